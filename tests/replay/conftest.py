"""One ``LocalStack`` (a ``kvrouter up`` and two ``kvrouter mock-worker`` processes) for the tests that need a
stack of their own rather than the command's: started once, stopped at the end, ``/dev/shm`` checked."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvrouter.replay import LocalStack, StackConfig
from tests.conftest import ROOT

RUN_TIMEOUT_S = 300.0
"""A cold numba cache compiles the routers' and the mocks' kernels first: minutes on 2 shared cores."""


def run_replay(out: Path, drills: list[str], requests: int, *, drop_env: tuple[str, ...] = ()) -> dict[str, Any]:
    """``kvrouter replay --drill drills`` at x8 (``KVROUTER_*`` and ``drop_env`` left out of its environment),
    its ``--json`` document with ``exit_code``, ``output``, ``plot`` (the ``--plot`` file) and ``logs`` (the
    ``--keep-logs`` directory, beside ``out``) added."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_") and k not in drop_env}
    logs = out.with_suffix(".logs")
    command = [sys.executable, "-m", "kvrouter", "replay", "--drill", ",".join(drills), "--requests", str(requests),
               "--speed", "8", "--json", str(out), "--plot", str(out.with_suffix(".png")),
               "--keep-logs", str(logs)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert out.exists(), done.stdout + done.stderr
    document: dict[str, Any] = json.loads(out.read_text())
    document["exit_code"] = done.returncode
    document["output"] = done.stdout + done.stderr
    document["plot"] = out.with_suffix(".png")
    document["logs"] = logs
    return document


def drill_of(report: dict[str, Any], name: str) -> dict[str, Any]:
    """The one entry of ``report["drills"]`` for ``name``."""
    found: list[dict[str, Any]] = [d for d in report["drills"] if d["drill"] == name]
    assert len(found) == 1, report["drills"]
    return found[0]


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
