"""Running a benchmark of ``tools/`` as its user does, for the smoke tests beside this module."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"
TRACES = ROOT.parent / "shared" / "traces"
"""The Mooncake traces beside the checkout, as CI has them."""


def run_tool(name: str, *args: str, timeout: float = 240) -> tuple[str, int]:
    """Run ``tools/<name>`` on this checkout's kvrouter (first on ``PYTHONPATH``, not an installed one) to its
    end (killed past ``timeout``) and require exit status 0; its stdout and its pid (the engines' segment
    names carry it)."""
    process = subprocess.Popen(
        [sys.executable, str(TOOLS / name), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stdout + stderr
    return stdout, process.pid


def left_behind(pid: int) -> list[str]:
    """Names of this pid's engines (``kvrouter-<pid>-``) and in-process writer (``kvrouter-<pid << 20 + 1>-``)."""
    prefixes = (f"kvrouter-{pid}-", f"kvrouter-{(pid << 20) + 1}-")
    return [n for folder in ("/dev/shm", tempfile.gettempdir()) for n in os.listdir(folder) if n.startswith(prefixes)]
