"""``EnginePublisher`` over real sockets: live frames, dropped batches, and replay as a DEALER sees it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from kvrouter.errors import ConfigError
from kvrouter.events.codecs import sglang, vllm
from kvrouter.events.codecs.frames import ReplayEnd, ReplayFrame, parse_live, parse_replay_reply, replay_request
from kvrouter.events.model import EngineHash, EventBatch, LocalHash, Removed, Stored, StoredBlock
from kvrouter.hashing import block_hashes
from kvrouter.worker.engine_publisher import EnginePublisher

BLOCK = 4
TIMEOUT_MS = 10_000


def _batch(n: int, dp_rank: int = 0) -> EventBatch:
    """Batch ``n``: one stored block (engine hash n + 1) whose tokens also say n."""
    tokens = tuple(range(n * BLOCK, (n + 1) * BLOCK))
    block = StoredBlock(EngineHash(n + 1), LocalHash(block_hashes(tokens, BLOCK)[0]), tokens)
    return EventBatch((Stored(7, None, (block,), dp_rank=dp_rank),), timestamp=float(n), dp_rank=dp_rank)


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _publisher(context: zmq.Context[zmq.Socket[bytes]], **kwargs: object) -> EnginePublisher:
    return EnginePublisher(
        "tcp://127.0.0.1:0",
        replay_endpoint="tcp://127.0.0.1:0",
        context=context,
        **kwargs,  # type: ignore[arg-type]
    )


def _subscribe(context: zmq.Context[zmq.Socket[bytes]], pub: EnginePublisher, topic: bytes = b"") -> zmq.Socket[bytes]:
    """A SUB that has joined: batches are published until one arrives, then the publisher is reset."""
    sub: zmq.Socket[bytes] = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(pub.endpoint)
    for _ in range(TIMEOUT_MS // 10):
        pub.publish(EventBatch(()))
        if sub.poll(10):
            break
    else:
        pytest.fail("the SUB never received a batch")
    while sub.poll(50):
        sub.recv_multipart()
    pub.reset()
    return sub


def _recv_live(sub: zmq.Socket[bytes]) -> tuple[bytes, int, bytes]:
    assert sub.poll(TIMEOUT_MS), "no live message"
    frame = parse_live(sub.recv_multipart())
    return frame.topic, frame.seq, frame.payload


def _replay(context: zmq.Context[zmq.Socket[bytes]], pub: EnginePublisher, start: int) -> list[ReplayFrame | ReplayEnd]:
    """One DEALER exchange: the request, the publisher serving it, every reply up to END."""
    dealer: zmq.Socket[bytes] = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        assert pub.replay_endpoint is not None
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart(replay_request(start))
        assert pub.serve(timeout_ms=TIMEOUT_MS) == 1
        replies: list[ReplayFrame | ReplayEnd] = []
        while not replies or not isinstance(replies[-1], ReplayEnd):
            assert dealer.poll(TIMEOUT_MS), "replay reply missing"
            replies.append(parse_replay_reply(dealer.recv_multipart()))
        return replies
    finally:
        dealer.close()


def test_live_frames_are_vllm_batches_with_seq_from_zero(context):
    with _publisher(context, topic=b"kv") as pub:
        sub = _subscribe(context, pub, b"kv")
        try:
            assert pub.last_seq is None
            assert [pub.publish(_batch(n, dp_rank=1)) for n in range(3)] == [0, 1, 2]
            decoder = vllm.Decoder(7, BLOCK)
            for n in range(3):
                topic, seq, payload = _recv_live(sub)
                assert (topic, seq) == (b"kv", n)
                decoded = decoder.decode(payload)
                assert decoded.dp_rank == 1
                assert decoded.events == (
                    Stored(7, None, _batch(n).events[0].blocks, dp_rank=1),  # type: ignore[union-attr]
                )
            assert pub.last_seq == 2
        finally:
            sub.close()


def test_a_dropped_batch_shows_as_a_seq_gap_and_stays_replayable(context):
    with _publisher(context) as pub:
        sub = _subscribe(context, pub)
        try:
            pub.publish(_batch(0))
            pub.publish(_batch(1), send=False)
            pub.publish(_batch(2))
            assert [_recv_live(sub)[1] for _ in range(2)] == [0, 2]
            replies = _replay(context, pub, 1)
            assert [type(r) for r in replies] == [ReplayFrame, ReplayFrame, ReplayEnd]
            frames = [r for r in replies if isinstance(r, ReplayFrame)]
            assert [(f.topic, f.seq) for f in frames] == [(b"", 1), (b"", 2)]
            assert frames[0].payload == vllm.Encoder().encode(_batch(1))
        finally:
            sub.close()


def test_replay_without_topic_uses_the_old_envelope(context):
    with _publisher(context, topic=b"t", replay_topic=False) as pub:
        for n in range(2):
            pub.publish(_batch(n), send=False)
        replies = _replay(context, pub, 0)
        assert [(r.topic, r.seq) for r in replies if isinstance(r, ReplayFrame)] == [(None, 0), (None, 1)]
        assert isinstance(replies[-1], ReplayEnd)


def test_replay_keeps_only_the_last_buffer_steps_batches(context):
    with _publisher(context, buffer_steps=2) as pub:
        for n in range(5):
            pub.publish(_batch(n), send=False)
        replies = _replay(context, pub, 0)
        # Missing history: the first batch replayed is newer than the one asked for.
        assert [r.seq for r in replies if isinstance(r, ReplayFrame)] == [3, 4]


def test_reset_starts_a_new_incarnation(context):
    with _publisher(context) as pub:
        for n in range(3):
            pub.publish(_batch(n), send=False)
        pub.reset()
        assert pub.last_seq is None
        assert _replay(context, pub, 0) == [ReplayEnd()]
        assert pub.publish(_batch(9), send=False) == 0


def test_bad_replay_requests_are_ignored_and_counted(context):
    with _publisher(context) as pub:
        pub.publish(_batch(0), send=False)
        assert pub.replay_endpoint is not None
        dealer: zmq.Socket[bytes] = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(pub.replay_endpoint)
            dealer.send_multipart([(0).to_bytes(8, "big")])  # no empty delimiter
            dealer.send_multipart([b"", b"\x00\x01"])  # seq frame too short
            pub.serve(timeout_ms=TIMEOUT_MS)
            while pub.bad_requests < 2:
                pub.serve(timeout_ms=TIMEOUT_MS)
            assert pub.bad_requests == 2
            assert not dealer.poll(0), "a bad request was answered"
        finally:
            dealer.close()
        assert [type(r) for r in _replay(context, pub, 0)] == [ReplayFrame, ReplayEnd]


def test_sglang_engine_and_array_encoding(context):
    batch = EventBatch((Removed(7, (EngineHash(2**64 - 1),)),), timestamp=1.0)
    with _publisher(context, engine="sglang", encoding="array") as pub:
        pub.publish(batch, send=False)
        (frame, _end) = _replay(context, pub, 0)
        assert isinstance(frame, ReplayFrame)
        assert sglang.Decoder(7, BLOCK).decode(frame.payload).events == batch.events
        assert frame.payload == sglang.Encoder("array").encode(batch)


def test_without_replay_endpoint_serve_returns_at_once(context):
    with EnginePublisher("tcp://127.0.0.1:0", context=context) as pub:
        assert pub.replay_endpoint is None
        assert pub.serve(timeout_ms=TIMEOUT_MS) == 0


def test_bad_settings_and_busy_endpoints_raise_config_error(context):
    with pytest.raises(ConfigError, match="encoding"):
        EnginePublisher("tcp://127.0.0.1:0", encoding="json", context=context)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="buffer_steps"):
        EnginePublisher("tcp://127.0.0.1:0", buffer_steps=0, context=context)
    with (
        EnginePublisher("tcp://127.0.0.1:0", context=context) as pub,
        pytest.raises(ConfigError, match="cannot bind"),
    ):
        EnginePublisher(pub.endpoint, context=context)
