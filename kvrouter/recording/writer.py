"""``Recorder``: the one writer of a recording (``kvrouter up --record FILE``), off the routing path.

Two sources feed it: the front's own records (registrations, decisions, prefill completions, frees), handed
over by :meth:`Recorder.add` on the event loop (a deque append), and the appliers' (``plane/tap.py``), which
arrive on a ZMQ PULL socket. A thread drains both, numbers each record (``n``), packs and writes it. Routing
never waits for the disk: :meth:`add` puts on a bounded queue without blocking and counts a record it cannot
put (:attr:`Recorder.dropped`); the appliers' sends are bounded the same way, and their drops are counted here
from the gaps in each applier's numbering (:attr:`Recorder.tap_dropped`). Both counts are written in the end
record, and ``kvrouter replay --from`` warns when a recording lost records (its decisions may then differ for
a reason that is not the router's).

The cost on the event loop is building one small dict per operation and one append; packing runs
on the thread (the GIL is shared, so a very busy recording takes some of the front's CPU: it is a
diagnostic mode, not one to leave on at peak).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, BinaryIO, Final

import msgpack
import zmq

from .format import MAGIC, frame

__all__ = ["QUEUE_LIMIT", "Recorder"]

log = logging.getLogger(__name__)

QUEUE_LIMIT: Final = 100_000
"""The front's records waiting for the thread before :meth:`Recorder.add` drops: seconds of decisions."""
POLL_MS: Final = 20
FLUSH_S: Final = 0.2
"""The file is flushed this often (and at close), so a killed router loses at most this much."""


class Recorder:
    """Writes ``header`` then every record given to :meth:`add` or sent by the taps to ``path``.

    Args:
        path: the recording; created, or truncated if it exists.
        header: the header record (``kind``, ``version`` and the rest, ``format.py``).
        endpoint: the ``ipc://`` address the appliers' taps push to; None records the front's records only.
        limit: the queue bound of :meth:`add`.

    Raises:
        OSError: the file cannot be created (at :meth:`open`).
    """

    def __init__(
        self, path: str | Path, header: dict[str, Any], endpoint: str | None = None, *, limit: int = QUEUE_LIMIT
    ) -> None:
        self.path = Path(path)
        self.header = header
        self.endpoint = endpoint
        self._queue: deque[dict[str, Any]] = deque()
        """The front's records: appended on the event loop, taken on the thread (each end atomic under the GIL;
        a ``queue.Queue``'s lock and condition cost microseconds a record)."""
        self._limit = limit
        self._file: BinaryIO | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pull: zmq.Socket[bytes] | None = None
        self._next_i: dict[int, int] = {}
        """Per applier pid, the tap number expected next."""
        self.written = 0
        self.dropped = 0
        """The front's records :meth:`add` could not queue."""
        self.tap_dropped = 0
        """The appliers' records lost before they reached the recorder (gaps in their numbering)."""
        self.failed = 0
        """Records that could not be written (a disk error): the recording ends there."""

    def open(self) -> None:
        """Create the file, write the magic and the header, bind the taps' socket and start the thread."""
        self._file = self.path.open("wb")
        self._file.write(MAGIC + frame(self.header))
        if self.endpoint is not None:
            self._context = zmq.Context()
            self._pull = self._context.socket(zmq.PULL)
            self._pull.setsockopt(zmq.LINGER, 0)
            self._pull.bind(self.endpoint)
        self._thread = threading.Thread(target=self._run, name="kvrouter-recorder", daemon=True)
        self._thread.start()
        log.info("recording path=%s taps=%s", self.path, self.endpoint)

    def add(self, record: dict[str, Any]) -> None:
        """Queue one of the front's records (it has ``k`` and ``t``; ``n`` is given when written). Never blocks."""
        if len(self._queue) >= self._limit:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("recording dropped a record path=%s: the writer is behind", self.path)
            return
        self._queue.append(record)

    def _write(self, record: dict[str, Any]) -> None:
        file = self._file
        if file is None or self.failed:
            self.failed += file is not None
            return
        record["n"] = self.written
        try:
            file.write(frame(record))
        except (OSError, ValueError, TypeError) as exc:
            self.failed += 1
            log.error("recording write failed path=%s error=%s: the recording stops here", self.path, exc)
            return
        self.written += 1

    def _take_taps(self) -> None:
        pull = self._pull
        if pull is None:
            return
        while True:
            try:
                body = pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                record = msgpack.unpackb(body, raw=False)
                src, i = int(record["src"]), int(record["i"])
            except (ValueError, KeyError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
                log.warning("recording tap record unreadable: %s", exc)
                continue
            expected = self._next_i.get(src, 0)
            if i > expected:
                self.tap_dropped += i - expected
            self._next_i[src] = i + 1
            self._write(record)

    def _take_queue(self) -> None:
        pending = self._queue
        while pending:
            self._write(pending.popleft())

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._pull is not None:
            poller.register(self._pull, zmq.POLLIN)
        next_flush = time.monotonic() + FLUSH_S
        while not self._stop.is_set():
            if self._pull is not None:
                poller.poll(POLL_MS)
            else:
                self._stop.wait(POLL_MS / 1000)
            self._take_taps()
            self._take_queue()
            if time.monotonic() >= next_flush and self._file is not None:
                next_flush = time.monotonic() + FLUSH_S
                with contextlib.suppress(OSError, ValueError):
                    self._file.flush()

    def close(self, **end: Any) -> None:
        """Stop the thread, write what is left and the end record (with ``end``'s fields), close the file and
        the socket. Idempotent."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self._file is None:
            return
        self._take_taps()
        self._take_queue()
        self._write(
            {
                "k": "end",
                "t": time.monotonic_ns(),
                "dropped": self.dropped,
                "tap_dropped": self.tap_dropped,
                "records": self.written,
                **end,
            }
        )
        with contextlib.suppress(OSError):
            self._file.close()
        self._file = None
        if self._pull is not None:
            self._pull.close(linger=0)
            self._pull = None
        if self._context is not None:
            self._context.term()
            self._context = None
        if self.endpoint is not None and self.endpoint.startswith("ipc://"):
            with contextlib.suppress(OSError):
                os.unlink(self.endpoint.removeprefix("ipc://"))
        log.info(
            "recording closed path=%s records=%d dropped=%d tap_dropped=%d",
            self.path,
            self.written,
            self.dropped,
            self.tap_dropped,
        )
