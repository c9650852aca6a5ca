"""What the applier's receive costs a message: its compiled drain against pyzmq's ``recv_multipart``.

A diagnostic of ``tools/bench_ingest.py``, beside its in-process rates: the reference's receive is Rust
inside its service, so there is no side to set against it here. The frames are queued on an inproc SUB
socket before the clock runs (inproc hands a message straight to the receiving socket's pipe, where a TCP
connection's I/O thread would put it), then drained by :class:`~kvrouter.plane.receive.Receiver` in drains
of the applier's ``DRAIN_LIMIT``: through the compiled loop, and through ``recv_multipart`` (with its shape
check and the payloads joined, what the applier did before). The two ways alternate, ``rounds`` each, and
the medians are reported in µs a message.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import zmq

from kvrouter.events.codecs.runs import RunBuffers
from kvrouter.plane.ingest import DRAIN_LIMIT
from kvrouter.plane.receive import Receiver, compiled

__all__ = ["receive_cost"]

SUBSCRIBE_TIMEOUT_S = 5.0


def receive_cost(frames: Sequence[list[bytes]], topic: bytes, max_bytes: int, rounds: int = 5) -> dict[str, float]:
    """Median µs a message of draining ``frames`` (each ``[topic, seq, payload]``), by each way."""
    ways = {"recv_multipart": Receiver(RunBuffers(), compiled_loop=False)}
    if compiled:
        ways["compiled"] = Receiver(RunBuffers())
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub, sub = context.socket(zmq.PUB), context.socket(zmq.SUB)
    try:
        for sock in (pub, sub):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        pub.bind("inproc://receive-cost")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect("inproc://receive-cost")
        _subscribed(pub, sub)
        samples: dict[str, list[float]] = {way: [] for way in ways}
        for r in range(rounds):
            for way in list(ways)[:: 1 if r % 2 else -1]:
                samples[way].append(_drain_all(pub, sub, ways[way], frames, topic, max_bytes))
    finally:
        pub.close()
        sub.close()
        context.term()
    return {way: statistics.median(values) for way, values in samples.items()}


def _subscribed(pub: zmq.Socket[bytes], sub: zmq.Socket[bytes]) -> None:
    """Until a probe comes through: the subscription has reached the PUB."""
    deadline = time.monotonic() + SUBSCRIBE_TIMEOUT_S
    while time.monotonic() < deadline:
        pub.send(b"probe")
        if sub.poll(10):
            while sub.poll(0):
                sub.recv()
            return
    raise SystemExit("receive_cost: the SUB socket never subscribed")


def _drain_all(
    pub: zmq.Socket[bytes],
    sub: zmq.Socket[bytes],
    receiver: Receiver,
    frames: Sequence[list[bytes]],
    topic: bytes,
    max_bytes: int,
) -> float:
    for message in frames:
        pub.send_multipart(message)
    got = 0
    started = time.perf_counter()
    while got < len(frames):  # hot path: every frame is queued already
        drain = receiver.drain(sub, DRAIN_LIMIT, topic, max_bytes)
        if not drain.count:
            raise SystemExit(f"receive_cost: {len(frames) - got} messages never arrived")
        got += drain.count
    return (time.perf_counter() - started) / len(frames) * 1e6
