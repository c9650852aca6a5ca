"""``kvrouter top``: the live dashboard (``tui/``) on a local or remote router.

With no option it follows the ``kvrouter up`` running on this host, found through the discovery file
each service writes in the user's runtime directory (``kvrouter/stats/discovery.py``), and reads it
through shared memory: no request to the router but the pinned probe's. ``--shm`` names one by its
segment or pid, ``--url`` attaches to a remote one over HTTP. A router that is not there yet, or goes
away, is shown as such and retried; the dashboard never exits on it.

``tui`` is imported inside the command: ``kvrouter up`` and the other commands never load Textual.
"""

from __future__ import annotations

from typing import Annotated, Final

import typer

__all__ = ["EPILOG", "top"]

EPILOG: Final = (
    "Examples:\n\n"
    "  kvrouter top                                  # the kvrouter up on this host (shared memory)\n\n"
    "  kvrouter top --shm kvrouter-4242-stats        # one of several, by segment or pid\n\n"
    "  kvrouter top --url http://10.0.0.7:8490       # a remote router over HTTP\n\n"
    "Keys: q quit, p pause, s/S sort, / filter, enter detail, e/d panes, i probe prompt, ? help."
)


def top(
    shm: Annotated[
        str | None,
        typer.Option(
            help="Follow this local router: its stats segment (kvrouter-<pid>-stats), control segment or pid."
        ),
    ] = None,
    url: Annotated[
        str | None,
        typer.Option(help="Follow a router over HTTP (GET /loads, /workers, /metrics, /decisions, /events)."),
    ] = None,
    interval: Annotated[
        float, typer.Option(min=0.125, max=4.0, help="Seconds between refreshes (+/- change it live).")
    ] = 0.25,
) -> None:
    """Show the router's mind at work: per-worker cache and load, each decision's costs, gaps and events."""
    from tui.app import TopApp
    from tui.feed import HttpFeed, LocalFeed, ShmFeed, shm_names
    from tui.model import Feed, RouterGone

    if shm is not None and url is not None:
        raise typer.BadParameter("give --shm or --url, not both", param_hint="--shm")
    feed: Feed
    if url is not None:
        feed = HttpFeed(url.rstrip("/"))
    elif shm is not None:
        try:
            feed = ShmFeed(shm_names(shm)[1])
        except RouterGone as exc:
            raise typer.BadParameter(str(exc), param_hint="--shm") from exc
    else:
        feed = LocalFeed()
    TopApp(feed, interval=interval).run()
