"""The ``kvrouter`` command: one typer app, one module per subcommand (``spec/interfaces.md`` §5).

Only this package configures logging handlers; library modules just log.
"""

from __future__ import annotations

import logging

import typer

from .. import stdio
from . import decision_log, mock_worker, replay, simulate, top, up, version

__all__ = ["app", "configure_logging", "main"]

app = typer.Typer(
    name="kvrouter",
    help="KV-cache-aware request router for LLM inference fleets.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    add_completion=False,
)
app.command("version")(version.version)
app.command("simulate", epilog=simulate.EPILOG)(simulate.simulate)
app.command("up", epilog=up.EPILOG)(up.up)
app.command("top", epilog=top.EPILOG)(top.top)
app.command("mock-worker", epilog=mock_worker.EPILOG)(mock_worker.mock_worker)
app.command("decision-log", epilog=decision_log.EPILOG)(decision_log.decision_log)
app.command("replay", epilog=replay.EPILOG)(replay.replay)


def configure_logging(spec: str) -> None:
    """Apply a ``DYN_LOG``-style spec: ``"info,kvrouter.index=debug"`` sets the root level, then per logger.

    Raises:
        typer.BadParameter: a level name logging does not know.
    """
    stdio.install()  # first: the handler keeps the stream it is given, and a closed pipe must not raise
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(handlers=[handler], force=True)
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, level = part.rpartition("=")
        value = logging.getLevelName(level.upper())
        if not isinstance(value, int):
            raise typer.BadParameter(f"unknown log level {level!r} in {spec!r}")
        logging.getLogger(name or None).setLevel(value)


@app.callback()
def _root(
    log: str = typer.Option(
        "warning", "--log", envvar="KVROUTER_LOG", help="Log levels, e.g. 'info,kvrouter.index=debug'."
    ),
) -> None:
    configure_logging(log)


def main() -> None:
    """Console-script entry point."""
    app()
