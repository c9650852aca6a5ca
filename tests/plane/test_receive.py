"""The applier's compiled receive (``plane/receive.py``) against ``recv_multipart``, over real sockets.

The oracle is the same drain through pyzmq (``Receiver(compiled_loop=False)``): both get the same generated
messages on sockets of their own, and every message must come out of both alike, plain or odd, with its
frames exactly as sent; a plain one's payload and sequence number where the batch path reads them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from kvrouter.events.codecs.runs import RunBuffers
from kvrouter.index.layout import NO_ID
from kvrouter.plane import receive
from kvrouter.plane.receive import Drain, Receiver

TOPIC = b"kv@1"
MAX_BYTES = 6000

pytestmark = pytest.mark.skipif(not receive.compiled, reason="pyzmq's libzmq is not a library of its own here")


@pytest.fixture
def pairs(context: zmq.Context[zmq.Socket[bytes]]) -> Iterator[list[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]]:
    """Two PUSH -> PULL pairs over TCP: one for the compiled receive, one for the oracle."""
    made: list[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]] = []
    try:
        for _ in range(2):
            pull = context.socket(zmq.PULL)
            push = context.socket(zmq.PUSH)
            made.append((push, pull))
            for sock in (push, pull):
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.setsockopt(zmq.RCVHWM, 0)
            port = pull.bind_to_random_port("tcp://127.0.0.1")
            push.connect(f"tcp://127.0.0.1:{port}")
        yield made
    finally:
        for push, pull in made:
            push.close()
            pull.close()


def received(receiver: Receiver, pull: zmq.Socket[bytes], count: int, limit: int) -> list[tuple[object, ...]]:
    """Drain ``pull`` until ``count`` messages came: each as (frames, odd, its payload and seq as the
    buffers hold them)."""
    out: list[tuple[object, ...]] = []
    deadline = time.monotonic() + 10
    while len(out) < count:
        assert time.monotonic() < deadline, f"{len(out)} of {count} messages received"
        drain = receiver.drain(pull, limit, TOPIC, MAX_BYTES)
        assert drain.count <= limit
        out.extend(described(drain))
        if not drain.count:
            time.sleep(0.002)
    return out


def described(drain: Drain) -> Iterator[tuple[object, ...]]:
    b = drain.buffers
    assert b.bounds.size == drain.count + 1  # what the decoders count messages by
    assert b.seqs.size == drain.count
    assert b.stamps.size >= drain.count
    for m in range(drain.count):
        payload = b.buf[int(b.bounds[m]) : int(b.bounds[m + 1])].tobytes()
        if b.tokens.size < len(payload):
            pytest.fail("the token buffer is shorter than a payload")
        yield drain.frames(m), m in drain.odd, payload, int(b.seqs[m])


@st.composite
def message(draw: st.DrawFn) -> list[bytes]:
    seq = draw(st.integers(0, (1 << 64) - 1)).to_bytes(8, "big")
    size = draw(st.one_of(st.integers(0, 64), st.integers(0, 3 * MAX_BYTES)))
    payload = draw(st.binary(min_size=size, max_size=size)) if size < 64 else bytes([size % 251]) * size
    topic = draw(st.sampled_from([TOPIC, TOPIC + b"x", b"kv@2", b"", TOPIC[:-1]]))
    shape = draw(st.sampled_from(["plain", "plain", "plain", "short seq", "long seq", "1", "2", "4", "5"]))
    if shape == "short seq":
        return [topic, seq[1:], payload]
    if shape == "long seq":
        return [topic, seq + b"\0", payload]
    if shape in ("1", "2"):
        return [topic, seq][: int(shape)]
    if shape in ("4", "5"):
        return [topic, seq, payload, *[b"extra" * i for i in range(int(shape) - 3)]]
    return [topic, seq, payload]


def oracle_view(sent: list[list[bytes]]) -> list[tuple[object, ...]]:
    """What the rules say of each message sent."""
    out: list[tuple[object, ...]] = []
    for frames in sent:
        plain = len(frames) == 3 and frames[0] == TOPIC and len(frames[1]) == 8 and len(frames[2]) <= MAX_BYTES
        seq = int.from_bytes(frames[1], "big") if plain else NO_ID
        out.append((frames, not plain, frames[2] if plain else b"", seq))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sent=st.lists(message(), min_size=1, max_size=80), limit=st.integers(1, 300))
def test_the_compiled_drain_receives_as_recv_multipart(
    pairs: list[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]], sent: list[list[bytes]], limit: int
) -> None:
    """Plain, odd (topics, frame counts, sequence frames, oversized payloads) and empty messages, in drains cut
    by the limit: both receives agree with each other and with the rules, message by message."""
    (push, pull), (oracle_push, oracle_pull) = pairs
    for frames in sent:
        push.send_multipart(frames)
        oracle_push.send_multipart(frames)
    compiled = received(Receiver(RunBuffers()), pull, len(sent), limit)
    oracle = received(Receiver(RunBuffers(), compiled_loop=False), oracle_pull, len(sent), limit)
    assert compiled == oracle == oracle_view(sent)


def test_every_buffer_grows_to_what_one_drain_brings(
    pairs: list[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]],
) -> None:
    """A fresh receiver's buffers are small: payloads of megabytes, a hundred odd messages of many frames and
    an odd frame of 20 MiB all arrive whole, and a later drain starts from small buffers again."""
    (push, pull), _ = pairs
    big_max = 32 << 20
    sent = [[TOPIC, i.to_bytes(8, "big"), bytes([i]) * (300_000 + i)] for i in range(8)]
    sent += [[b"other", i.to_bytes(8, "big"), b"p" * 5000, b"q" * i] for i in range(100)]
    sent += [[TOPIC, (1).to_bytes(8, "big"), b"z" * (20 << 20)]]  # odd here: over MAX_BYTES below
    for frames in sent:
        push.send_multipart(frames)
    receiver = Receiver(RunBuffers())
    got: list[list[bytes]] = []
    odd: list[bool] = []
    deadline = time.monotonic() + 20
    while len(got) < len(sent):
        assert time.monotonic() < deadline
        drain = receiver.drain(pull, 256, TOPIC, big_max if len(got) < 8 else MAX_BYTES)
        got += [drain.frames(m) for m in range(drain.count)]
        odd += [m in drain.odd for m in range(drain.count)]
    assert got == sent
    assert odd == [False] * 8 + [True] * 101
    push.send_multipart([TOPIC, (2).to_bytes(8, "big"), b"after"])
    while not (drain := receiver.drain(pull, 256, TOPIC, MAX_BYTES)).count:
        time.sleep(0.002)
    assert drain.frames(0) == [TOPIC, (2).to_bytes(8, "big"), b"after"]
    assert receiver.buffers.buf.size < 20 << 20  # the 20 MiB grown for the odd frame was given back


def test_a_drain_stops_at_its_limit_and_leaves_the_rest_queued(
    pairs: list[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]],
) -> None:
    (push, pull), _ = pairs
    for i in range(10):
        push.send_multipart([TOPIC, i.to_bytes(8, "big"), b"x" * i])
    receiver = Receiver(RunBuffers())
    seen: list[int] = []
    deadline = time.monotonic() + 10
    while len(seen) < 10:
        assert time.monotonic() < deadline
        drain = receiver.drain(pull, 3, TOPIC, MAX_BYTES)
        assert drain.count <= 3
        seen += [int(s) for s in drain.buffers.seqs]
    assert seen == list(range(10))
    assert receiver.drain(pull, 3, TOPIC, MAX_BYTES).count == 0


def test_a_closed_socket_drains_nothing(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    """No socket at the address (as the fork server's warm-up calls it): libzmq refuses, and the drain is empty."""
    sock = context.socket(zmq.PULL)
    sock.close()
    drain = Receiver(RunBuffers()).drain(sock, 4, TOPIC, MAX_BYTES)
    assert drain.count == 0
    assert np.array_equal(drain.buffers.bounds, [0])
