"""``Recorder`` (``kvrouter/recording/writer.py``) and the appliers' ``Tap``: bounded, never blocking, drops counted."""

from __future__ import annotations

import zmq

from kvrouter.plane.tap import Tap
from kvrouter.recording import Recorder, read_recording
from tests.conftest import _wait_until


def test_records_the_front_cannot_queue_are_dropped_and_counted_in_the_end_record(tmp_path):
    path = tmp_path / "r.kvr"
    recorder = Recorder(path, {"kind": "header", "version": 1}, limit=3)
    for i in range(5):  # no thread yet: the queue fills, and add() never blocks
        recorder.add({"k": "free", "t": i, "id": str(i)})
    assert recorder.dropped == 2
    recorder.open()
    recorder.close()
    recording = read_recording(path, allow_open=False)
    assert [r["id"] for r in recording.records] == ["0", "1", "2"]
    assert recording.end is not None
    assert recording.end["dropped"] == 2
    assert recording.end["tap_dropped"] == 0


def test_a_taps_records_lost_before_the_recorder_listens_are_counted_from_its_numbering(tmp_path):
    endpoint = f"ipc://{tmp_path / 'tap.sock'}"
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    tap = Tap(context, endpoint, shard=0, hwm=2)
    recorder = Recorder(tmp_path / "r.kvr", {"kind": "header", "version": 1}, endpoint)
    try:
        for _ in range(20):  # nobody bound yet: the queue fills, then sends are refused at once, counted
            tap.cleared((7, 0), "join")
        assert 0 < tap.dropped < 20
        recorder.open()
        _wait_until(lambda: _delivered(tap), what="the tap's queue taken by the recorder")
        tap.applied((7, 0), "vllm", 16, b"payload", 0, 0)
        _wait_until(lambda: recorder.written >= tap.sent - tap.dropped, what="the tap's records written")
    finally:
        tap.close()
        recorder.close()
        context.term()
    recording = read_recording(tmp_path / "r.kvr", allow_open=False)
    # every refused send left a gap in the tap's numbering, which the recorder counted
    assert recording.end is not None
    assert recording.end["tap_dropped"] == tap.dropped
    assert len(recording.records) == tap.sent - tap.dropped
    assert recording.records[-1]["p"] == b"payload"
    assert recording.records[-1]["w"] == 7


def _delivered(tap: Tap) -> bool:
    """Send a probe record; True once one was taken (the connection to the recorder is up)."""
    before = tap.dropped
    tap.cleared((7, 0), "join")
    return tap.dropped == before
