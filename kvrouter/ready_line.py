"""Waiting for a child process's ready line: the demo's mock engines, the other fronts, a replayed router.

Each prints one line on stdout once it serves; its parent reads lines until one matches, within a
deadline. The callers differ only in what they call a failure, so the loop lives here and each caller
turns the two outcomes into its own error: a ``TimeoutError`` (no match in time) and ``None`` (stdout
closed first: the child exited).
"""

from __future__ import annotations

import asyncio
import re
import time

__all__ = ["ready_line"]


async def ready_line(stdout: asyncio.StreamReader, pattern: re.Pattern[str], timeout: float) -> re.Match[str] | None:
    """The first line from ``stdout`` that ``pattern`` matches (``search``); None when ``stdout`` ends first.

    Raises:
        TimeoutError: no matching line within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        line = await asyncio.wait_for(stdout.readline(), timeout=max(deadline - time.monotonic(), 0.001))
        if not line:
            return None
        match = pattern.search(line.decode(errors="replace"))
        if match:
            return match
