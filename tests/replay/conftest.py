"""One ``LocalStack`` (a ``kvrouter up`` and two ``kvrouter mock-worker`` processes) for the tests that need a
stack of their own rather than the command's: started once, stopped at the end, ``/dev/shm`` checked."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest

from kvrouter.replay import LocalStack, StackConfig


@pytest.fixture(scope="session")
def stack() -> Iterator[tuple[asyncio.AbstractEventLoop, LocalStack]]:
    """(the loop the stack's processes and sessions belong to, the started stack)."""
    loop = asyncio.new_event_loop()
    local = LocalStack(StackConfig(mock_workers=2, shards=1, speedup_ratio=8.0))
    try:
        loop.run_until_complete(local.start())
        yield loop, local
    finally:
        pid = local.up.pid if local.up is not None else None
        loop.run_until_complete(local.close())
        loop.close()
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"kvrouter-{pid}-")]
