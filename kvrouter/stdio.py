"""The process's stdout and stderr, made safe to write after their reader is gone.

A service run as ``kvrouter up | head`` or ``| tee log`` outlives the pipe's reader: once it exits, every
write to the pipe raises ``BrokenPipeError`` (Python ignores ``SIGPIPE``). A write in the wrong place (the
signal handler's "stopping" line, the demo's status line, a log record) then raised into the control path,
and SIGTERM left the service running. :func:`install` puts a writer under ``sys.stdout`` and
``sys.stderr`` that never raises: the first write that fails (``EPIPE``, ``EBADF``, ``EIO``) points the
file descriptor at ``/dev/null`` (``dup2``), so every later write, the interpreter's own flush at exit,
C-level writers (``faulthandler``'s stack dumps) and the children started afterwards all write nowhere
and succeed; each write that went nowhere is counted (:func:`dropped`, ``/metrics``
``kvrouter_output_dropped_writes_total``) and the loss is logged once (through stderr, so it is lost too
when stderr is the stream that closed: the counter says it).

Why below the text layer: ``sys.stdout`` stays a real ``io.TextIOWrapper`` (click and typer may wrap its
``buffer`` again), so every path to the descriptor goes through the safe writer. Rejected: restoring
``SIGPIPE``'s default (the process would die mid-stop, leaving its segments for the next start's sweep);
catching ``BrokenPipeError`` at each write site (one forgotten site is the bug this module fixes).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from typing import Final

__all__ = ["dropped", "install"]

log = logging.getLogger(__name__)

_STREAMS: Final = (("stdout", 1), ("stderr", 2))


class _SafeRaw(io.RawIOBase):
    """A file descriptor that swallows its failures: the first one sends it to ``/dev/null``."""

    def __init__(self, fd: int, name: str) -> None:
        super().__init__()
        self._fd = fd
        self.stream = name
        self.gone = False
        """The reader went away: the descriptor now points at ``/dev/null``."""
        self.dropped = 0

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return not self.gone and os.isatty(self._fd)

    def write(self, data: object) -> int:
        view = memoryview(data)  # type: ignore[arg-type]  # bytes-like, as RawIOBase.write takes
        size = view.nbytes
        if self.gone:
            self.dropped += 1
            return size
        try:
            return os.write(self._fd, view)
        except BlockingIOError:  # a non-blocking pipe, full: this write is lost, the stream is not
            self.dropped += 1
            return size
        except OSError as exc:
            self._went(exc)
            return size

    def _went(self, exc: OSError) -> None:
        self.gone = True
        self.dropped += 1
        with contextlib.suppress(OSError):
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, self._fd)
            finally:
                os.close(null)
        log.warning(
            "%s closed (%s): its writes are dropped and counted from now on (logged once)",
            self.stream,
            exc.strerror or exc,
        )


def install() -> None:
    """Put the safe writer under ``sys.stdout`` and ``sys.stderr`` (each only once, and only over the real
    descriptors: a stream something else put there, such as a test runner's capture, is left alone). Call
    it before any logging handler is made: a handler keeps the stream it was given."""
    for name, fd in _STREAMS:
        old = getattr(sys, name)
        try:
            if old is None or old.fileno() != fd or isinstance(getattr(old.buffer, "raw", None), _SafeRaw):
                continue
        except (AttributeError, OSError, ValueError):  # no descriptor of its own
            continue
        with contextlib.suppress(OSError, ValueError):
            old.flush()
        raw = _SafeRaw(fd, name)
        text = io.TextIOWrapper(
            io.BufferedWriter(raw),
            encoding=getattr(old, "encoding", None) or "utf-8",
            errors=getattr(old, "errors", None) or "strict",
            line_buffering=bool(getattr(old, "line_buffering", False)),
            write_through=name == "stderr",
        )
        setattr(sys, name, text)


def dropped() -> dict[str, int]:
    """Writes dropped per stream since :func:`install` (none for a stream it did not wrap)."""
    counts = {}
    for name, _ in _STREAMS:
        buffer = getattr(getattr(sys, name), "buffer", None)
        raw = getattr(buffer, "raw", None)
        if isinstance(raw, _SafeRaw):
            counts[name] = raw.dropped
    return counts
