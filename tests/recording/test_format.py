"""The recording file (``kvrouter/recording/format.py``): what a reader accepts and how it refuses the rest."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from kvrouter.errors import RecordingError
from kvrouter.recording import MAGIC, VERSION, frame, read_recording


def _write(path: Path, header: dict[str, object], records: list[dict[str, object]]) -> Path:
    path.write_bytes(MAGIC + frame(header) + b"".join(frame(r) for r in records))
    return path


def _records() -> list[dict[str, object]]:
    return [
        {"k": "reg", "n": 0, "t": 30, "m": "m", "g": "default", "w": 1, "r": 0, "bs": 16, "fmt": "vllm"},
        {"k": "clr", "n": 2, "t": 10, "w": 1, "r": 0, "why": "join"},
        {"k": "free", "n": 1, "t": 30, "id": "a"},
        {"k": "end", "n": 3, "t": 40, "dropped": 0, "tap_dropped": 0, "records": 3},
    ]


def test_records_come_back_in_interleaving_order_with_the_end_apart(tmp_path):
    recording = read_recording(_write(tmp_path / "r.kvr", {"kind": "header", "version": VERSION}, _records()))
    assert [(r["t"], r["n"]) for r in recording.records] == [(10, 2), (30, 0), (30, 1)]
    assert recording.end is not None
    assert recording.end["records"] == 3


def test_another_format_version_is_refused_naming_both(tmp_path):
    path = _write(tmp_path / "r.kvr", {"kind": "header", "version": VERSION + 1}, _records())
    with pytest.raises(RecordingError, match=f"version {VERSION + 1}.*reads version {VERSION}"):
        read_recording(path)


def test_a_file_cut_inside_a_frame_is_refused_at_its_offset(tmp_path):
    path = _write(tmp_path / "r.kvr", {"kind": "header", "version": VERSION}, _records())
    whole = path.read_bytes()
    path.write_bytes(whole[:-5])
    last = len(whole) - len(frame(_records()[-1]))
    with pytest.raises(RecordingError, match=f"truncated at byte {last}"):
        read_recording(path)
    path.write_bytes(whole[: last + 2])  # inside the length prefix itself
    with pytest.raises(RecordingError, match="frame length cut short"):
        read_recording(path)
    salvaged = read_recording(path, allow_cut=True)  # a router killed mid-write: the whole frames before it
    assert salvaged.cut_at == last
    assert [r["n"] for r in salvaged.records] == [2, 0, 1]
    assert salvaged.end is None


def test_not_a_recording_a_corrupt_frame_and_a_missing_end(tmp_path):
    path = tmp_path / "r.kvr"
    path.write_bytes(b"{}\n")
    with pytest.raises(RecordingError, match="not a kvrouter recording"):
        read_recording(path)
    body = msgpack.packb([1, 2])
    path.write_bytes(MAGIC + frame({"kind": "header", "version": VERSION}) + len(body).to_bytes(4, "little") + body)
    with pytest.raises(RecordingError, match="not a map"):
        read_recording(path)
    _write(path, {"kind": "header", "version": VERSION}, _records()[:-1])
    assert read_recording(path).end is None
    with pytest.raises(RecordingError, match="no end record"):
        read_recording(path, allow_open=False)
