"""``python -m kvrouter.cli.front``: one of fronts 1..N-1 of ``kvrouter up --fronts N``, not a command.

Front 0 starts it (``service/process/fronts.py``) and writes a pickled
:class:`~kvrouter.service.process.fronts.FrontSpec` on its stdin; it maps front 0's engine, joins the local
bus, takes the registry, takes the connections front 0 deals it and prints one ready line. SIGINT, SIGTERM
or SIGHUP drain it and stop it; so does front 0's exit.
SIGUSR1 writes its thread stacks to stderr.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import sys

from ..service.process.app import Service
from ..service.process.fronts import READY_LINE, FrontSpec
from . import configure_logging
from .stacks import stacks_on_sigusr1
from .up import STOP_SIGNALS


def main() -> int:
    spec = pickle.loads(sys.stdin.buffer.read())
    if not isinstance(spec, FrontSpec):
        print(f"kvrouter front: expected a FrontSpec on stdin, got {type(spec).__name__}", file=sys.stderr)
        return 2
    configure_logging(logging.getLevelName(spec.log_level))
    service = Service(spec.config, front=spec)
    service.start()  # maps the engine: nothing to fork on a front that does not own it

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, service.stop)

        def on_ready(url: str) -> None:
            print(f"{READY_LINE} front={spec.index} url={url}", flush=True)

        await service.run(on_ready=on_ready)

    with stacks_on_sigusr1():
        asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
