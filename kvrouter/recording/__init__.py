"""Recordings of a router's run (``kvrouter up --record FILE``), replayed by ``kvrouter replay --from FILE``.

- ``format.py``: the file (magic, length-prefixed msgpack frames, the header and record kinds) and its reader.
- ``clock.py``: ``HeldClock``, the routers' clock while recording, held at each recorded operation's time.
- ``writer.py``: ``Recorder``, the one writer thread of a running router, bounded, never blocking routing.

The appliers' side is ``kvrouter/plane/tap.py``; the replay in logical time is ``kvrouter/replay/logical.py``.
"""

from __future__ import annotations

from .clock import HeldClock
from .format import KINDS, MAGIC, VERSION, Recording, frame, read_recording
from .writer import Recorder

__all__ = ["KINDS", "MAGIC", "VERSION", "HeldClock", "Recorder", "Recording", "frame", "read_recording"]
