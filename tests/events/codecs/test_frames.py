from __future__ import annotations

from typing import Any

import msgpack
import pytest

from kvrouter.errors import BadEvent
from kvrouter.events.codecs.frames import (
    END_SEQ,
    LiveFrame,
    ReplayEnd,
    ReplayFrame,
    encode_live,
    parse_live,
    parse_replay_reply,
    replay_request,
)

EngineFrames = tuple[str, dict[str, Any], dict[str, Any]]


def test_live_messages_match_the_twin(engine_frames: EngineFrames):
    _, captured, twin = engine_frames
    for group, twin_group in zip(captured["live"], twin["live"], strict=True):
        for frames, expected in zip(group["messages"], twin_group["messages"], strict=True):
            assert [f.hex() for f in frames] == expected["frames_hex"]
            live = parse_live(frames)
            assert live.topic == expected["topic"].encode()
            assert live.seq == expected["seq"]
            assert not expected["end_marker"]
            assert msgpack.unpackb(live.payload, raw=False) == expected["payload"]
            assert encode_live(live.topic, live.seq, live.payload) == frames


def test_replay_replies_match_the_twin_and_the_live_batches(engine_frames: EngineFrames):
    _, captured, twin = engine_frames
    live = {
        (group["dp_rank"], frame.seq): frame
        for group in captured["live"]
        for frame in map(parse_live, group["messages"])
    }
    for replay, twin_replay in zip(captured["replay"], twin["replay"], strict=True):
        assert replay_request(twin_replay["start_seq"]) == replay["request"]
        replies = [parse_replay_reply(frames) for frames in replay["replies"]]
        for reply, expected in zip(replies, twin_replay["replies"], strict=True):
            if expected["end_marker"]:
                assert reply == ReplayEnd()
                assert expected["seq"] == END_SEQ
                continue
            assert isinstance(reply, ReplayFrame)
            assert reply.seq == expected["seq"]
            # Publishers before vLLM 0.26 / SGLang 0.5.22 send no topic frame; the twin then has no topic.
            assert reply.topic == (expected["topic"].encode() if "topic" in expected else None)
            assert msgpack.unpackb(reply.payload, raw=False) == expected["payload"]
            assert reply.payload == live[replay["dp_rank"], reply.seq].payload
        first, last = replies[0], replies[-1]
        assert isinstance(first, ReplayFrame)
        assert first.seq == twin_replay["start_seq"]
        assert last == ReplayEnd()


def test_encode_live_frames_read_back():
    assert parse_live(encode_live(b"kv", 2**64 - 2, b"\x90")) == LiveFrame(b"kv", 2**64 - 2, b"\x90")


def test_both_replay_envelopes_and_their_end_markers():
    seq8 = (5).to_bytes(8, "big")
    end8 = END_SEQ.to_bytes(8, "big")
    assert parse_replay_reply([b"", b"t", seq8, b"p"]) == ReplayFrame(5, b"p", b"t")
    assert parse_replay_reply([b"", seq8, b"p"]) == ReplayFrame(5, b"p", None)
    assert parse_replay_reply([b"", b"", end8, b""]) == ReplayEnd()
    assert parse_replay_reply([b"", end8, b""]) == ReplayEnd()


def test_replay_request_is_delimiter_then_big_endian_seq():
    assert replay_request(258) == [b"", b"\x00\x00\x00\x00\x00\x00\x01\x02"]


@pytest.mark.parametrize("count", [0, 2, 4])
def test_live_message_with_wrong_frame_count(count: int):
    with pytest.raises(BadEvent, match=rf"^live message: expected 3 frames \[topic, seq, payload\], got {count}$"):
        parse_live([b""] * count)


def test_live_message_with_7_byte_seq():
    with pytest.raises(BadEvent, match=r"^live message frame 1: seq frame is 7 bytes, expected 8$"):
        parse_live([b"kv", b"\x00" * 7, b"\x90"])


@pytest.mark.parametrize("count", [2, 5])
def test_replay_reply_with_wrong_frame_count(count: int):
    with pytest.raises(BadEvent, match=rf"^replay reply: expected 4 frames .* got {count}$"):
        parse_replay_reply([b""] * count)


@pytest.mark.parametrize(
    ("frames", "frame_index"),
    [([b"", b"kv", b"\x00" * 7, b""], 2), ([b"", b"\x00" * 7, b""], 1)],
    ids=["with-topic", "without-topic"],
)
def test_replay_reply_with_7_byte_seq(frames: list[bytes], frame_index: int):
    with pytest.raises(BadEvent, match=rf"^replay reply frame {frame_index}: seq frame is 7 bytes, expected 8$"):
        parse_replay_reply(frames)


def test_replay_reply_without_the_empty_delimiter():
    """What a REQ socket or a ROUTER-side caller would pass: the delimiter is not where a DEALER sees it."""
    with pytest.raises(BadEvent, match=r"^replay reply frame 0: expected the empty delimiter, got 2 bytes$"):
        parse_replay_reply([b"kv", (1).to_bytes(8, "big"), b"\x90"])


@pytest.mark.parametrize("seq", [-1, 2**64])
def test_seq_outside_8_unsigned_bytes_is_refused(seq: int):
    with pytest.raises(BadEvent, match=rf"^replay request: seq {seq} is outside"):
        replay_request(seq)
    with pytest.raises(BadEvent, match=rf"^live message: seq {seq} is outside"):
        encode_live(b"", seq, b"")
