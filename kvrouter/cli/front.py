"""One of fronts 1..N-1 of ``kvrouter up --fronts N``, in the process the fronts' fork server forked.

``kvrouter up`` gives :func:`run` to its service, which hands it to the fork server (``service/process/
fronts.py``). The front maps front 0's engine, joins the local bus, takes the registry, serves the
connections front 0 deals it on its socketpair and tells front 0 there when it is ready. SIGINT, SIGTERM or
SIGHUP drain it and stop it; so does front 0's exit. SIGUSR1 writes its thread stacks to stderr.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import os
import signal
from typing import Final

from ..service.process.app import Service
from ..service.process.fronts import FrontSpec
from .signals import STOP_SIGNALS
from .stacks import stacks_on_sigusr1

__all__ = ["run"]

PR_SET_NAME: Final = 15
"""``prctl``'s option number (``<linux/prctl.h>``): the thread's name, what ``ps -o comm`` and ``top`` show."""


def run(spec: FrontSpec, connections: int) -> None:
    """The front's life, from the fork to its stop. ``connections``: its end of the socketpair with front 0.

    Forked from a server that ignores SIGINT and SIGTERM, so they are this front's own again first; a
    session of its own, so a terminal's Ctrl-C reaches front 0 only, and front 0 stops the others."""
    os.setsid()
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    _name(f"kvrouter-front{spec.index}")
    service = Service(spec.config, front=dataclasses.replace(spec, connections=connections))
    service.start()  # maps the engine: nothing to fork on a front that does not own it

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, service.stop)
        await service.run()

    with stacks_on_sigusr1():
        asyncio.run(serve())


def _name(name: str) -> None:
    """Name the process as ``ps`` and ``top`` show it (its command line stays front 0's: it was forked)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
