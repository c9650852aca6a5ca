"""The recording format (version 1): one append-only file of length-prefixed msgpack frames.

A recording holds what a router saw and did, so that ``kvrouter replay --from FILE`` can run it again:
the worker registrations, every event batch as the appliers applied it (the raw payload, so decoding is
replayed too), and every decision with its inputs and outcome. ``docs/replay.md`` "Recording format" is
the operator's description; this module is the one place that writes and reads the bytes.

Layout: the 16-byte :data:`MAGIC`, then frames, each a little-endian u32 length and that many bytes of one
msgpack map. The first frame is the header (``kind == "header"``, ``version``, the kvrouter version, the
router config, the seed, ...); every later frame is a record with ``k`` (its kind), ``n`` (the writer's
sequence number: the order frames were written) and ``t`` (``time.monotonic_ns()`` of the moment it stands
for; ``CLOCK_MONOTONIC`` is one clock for every process of a host, the appliers' as the front's). The last
frame of a file closed cleanly is an ``end`` record with the drop counters.

Why ``t`` and not ``n`` gives the interleaving: the appliers' records reach the one writer a little after
the moment they stand for (an ipc hop), so the file is in arrival order, and the replay sorts by ``(t, n)``.
Rejected: one shared counter across processes (an atomic in shared memory would be a second write per
applied batch on the appliers' hot path, and gives no better order than the monotonic clock); per-shard
files merged at the end (an applier killed mid-frame leaves a torn frame in the middle of its file, and
the merge needs every file closed).

Why length-prefixed frames rather than a bare msgpack stream: a frame cut short (a writer killed, a copy
truncated) is told from the end of the file at its exact offset, where a streaming unpacker only reports
"out of data" for whatever follows.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgpack

from ..errors import RecordingError

__all__ = ["KINDS", "MAGIC", "VERSION", "Recording", "frame", "read_recording"]

MAGIC: Final = b"kvrouter-record\n"
"""The first 16 bytes of every recording (``file(1)`` shows them as text)."""
VERSION: Final = 1
"""The format version in the header; a reader refuses any other (``RecordingError``)."""
LENGTH: Final = struct.Struct("<I")
MAX_FRAME: Final = 256 << 20
"""A frame longer than this is a corrupt length, not a record (event payloads are at most 64 MiB)."""

KINDS: Final = frozenset({"reg", "unreg", "ev", "clr", "evict", "dec", "pc", "free", "busy", "sweep", "end"})
"""The record kinds (``docs/replay.md`` "Recording format" has their fields)."""


def frame(record: dict[str, Any]) -> bytes:
    """One record as its frame: length, then msgpack."""
    body: bytes = msgpack.packb(record, use_bin_type=True)
    return LENGTH.pack(len(body)) + body


@dataclass(slots=True)
class Recording:
    """A recording read back: its header, its records in interleaving order, and the end record (None when
    the writer never closed it)."""

    path: Path
    header: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)
    """Every record but the end, sorted by ``(t, n)``."""
    end: dict[str, Any] | None = None
    cut_at: int | None = None
    """With ``allow_cut``: the byte offset of the frame cut short, where reading stopped (None: whole)."""

    def count(self, kind: str) -> int:
        return sum(1 for record in self.records if record["k"] == kind)


class _Cut(RecordingError):
    """A frame cut short at the end of the data (``offset``): a writer killed mid-frame, a copy cut off."""

    def __init__(self, message: str, offset: int) -> None:
        super().__init__(message)
        self.offset = offset


def _frames(data: bytes, path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    offset = len(MAGIC)
    while offset < len(data):
        if offset + LENGTH.size > len(data):
            raise _Cut(f"{path}: truncated at byte {offset}: a frame length cut short", offset)
        (length,) = LENGTH.unpack_from(data, offset)
        if length > MAX_FRAME:
            raise RecordingError(f"{path}: corrupt at byte {offset}: a frame of {length} bytes")
        start = offset + LENGTH.size
        if start + length > len(data):
            raise _Cut(
                f"{path}: truncated at byte {offset}: a frame of {length} bytes, {len(data) - start} left", offset
            )
        try:
            record = msgpack.unpackb(data[start : start + length], raw=False, strict_map_key=False)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise RecordingError(f"{path}: corrupt frame at byte {offset}: {exc}") from exc
        if not isinstance(record, dict):
            raise RecordingError(f"{path}: corrupt frame at byte {offset}: a {type(record).__name__}, not a map")
        yield offset, record
        offset = start + length


def read_recording(path: str | Path, *, allow_open: bool = True, allow_cut: bool = False) -> Recording:
    """Read a whole recording.

    Args:
        path: the file ``kvrouter up --record`` wrote.
        allow_open: accept a file without its end record (a router still running, or killed); the frames
            it holds must still be whole.
        allow_cut: accept a last frame cut short (a router SIGKILLed mid-write): reading stops there and
            :attr:`Recording.cut_at` says where (``kvrouter replay --from FILE --allow-cut``).

    Raises:
        RecordingError: not a recording, another format version, a frame cut short (unless ``allow_cut``) or
            corrupt, a record without its kind, sequence number or time, or (``allow_open=False``) no end
            record.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RecordingError(f"{path}: cannot read: {exc}") from exc
    if not data.startswith(MAGIC):
        raise RecordingError(f"{path}: not a kvrouter recording (it does not start with {MAGIC!r})")
    frames = _frames(data, path)
    first = next(frames, None)
    if first is None or first[1].get("kind") != "header":
        raise RecordingError(f"{path}: no header frame after the magic")
    header = first[1]
    if header.get("version") != VERSION:
        raise RecordingError(
            f"{path}: recording format version {header.get('version')!r}; this kvrouter reads version {VERSION}"
        )
    recording = Recording(path, header)
    try:
        for offset, record in frames:
            kind, n, t = record.get("k"), record.get("n"), record.get("t")
            if kind not in KINDS or type(n) is not int or type(t) is not int:
                raise RecordingError(f"{path}: corrupt record at byte {offset}: kind {kind!r}, n {n!r}, t {t!r}")
            if kind == "end":
                recording.end = record
            else:
                recording.records.append(record)
    except _Cut as exc:
        if not allow_cut:
            raise RecordingError(f"{exc} (--allow-cut replays the frames before it)") from None
        recording.cut_at = exc.offset
    if recording.end is None and not allow_open:
        raise RecordingError(f"{path}: no end record: the router did not close it")
    recording.records.sort(key=lambda r: (r["t"], r["n"]))
    return recording
