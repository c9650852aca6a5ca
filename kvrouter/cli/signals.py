"""The signals that stop a kvrouter process cleanly: ``kvrouter up`` and each of its other fronts."""

from __future__ import annotations

import signal
from typing import Final

__all__ = ["STOP_SIGNALS"]

STOP_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Each stops the service cleanly; SIGHUP too, so closing the terminal (or its tmux) does not kill it
mid-flight with its segments and demo engines left behind."""
