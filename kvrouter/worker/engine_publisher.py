"""``EnginePublisher``: what vLLM's and SGLang's ``ZmqEventPublisher`` put on the wire, for the mock engine and tests.

A router's vLLM path can only be trusted end to end if something speaks vLLM's protocol byte for
byte without a GPU. This class does, from the spec rather than from vLLM's code
(``spec/wire-formats.md`` §1.5-1.7, §2.1): a PUB socket sending ``[topic, seq8, payload]`` per batch,
seq from 0 per incarnation, payloads from the engine encoders of :mod:`kvrouter.events.codecs`, and a
ROUTER answering replay requests from a ring of the last ``buffer_steps`` batches, vLLM >= 0.26's
envelope (with topic) by default, the older one (without) on request.

Where it parts from vLLM, on purpose:

- **No publisher thread or queue.** vLLM feeds a background thread through a bounded queue and answers
  replays from that thread. Here the caller's thread does both: :meth:`EnginePublisher.publish` sends at
  once and :meth:`EnginePublisher.serve` answers replays when the owner calls it (the mock engine
  polls :attr:`EnginePublisher.replay_socket` in its own loop). One thread owns an instance; it is not
  thread-safe. The cost: a replay is answered only as often as the owner serves, the same as vLLM's
  ``poll(0)`` once per loop.
- **Always binds.** vLLM connects when the endpoint has no ``*``/``::``; a mock is always the side that
  binds, so ``tcp://127.0.0.1:0`` binds an ephemeral port (read it back from :attr:`endpoint`).
- **Fault injection.** ``publish(send=False)`` consumes a seq and keeps the batch for replay but sends
  nothing: exactly what a router sees when PUB/SUB drops a message at a high-water mark.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Final, Literal

import zmq

from ..errors import ConfigError
from ..events.codecs import sglang, vllm
from ..events.codecs.frames import END_SEQ, SEQ_BYTES, encode_live
from ..events.model import EventBatch

__all__ = ["DEFAULT_BUFFER_STEPS", "DEFAULT_HWM", "EnginePublisher"]

log = logging.getLogger(__name__)

DEFAULT_BUFFER_STEPS: Final = 10_000
"""Batches kept for replay: vLLM's ``KVEventsConfig.buffer_steps`` default (``spec/wire-formats.md`` §1.7)."""

DEFAULT_HWM: Final = 100_000
"""PUB send high-water mark: vLLM's ``KVEventsConfig.hwm`` default (§1.7)."""

_END_SEQ_FRAME: Final = END_SEQ.to_bytes(SEQ_BYTES, "big")


class EnginePublisher:
    """A vLLM/SGLang-compatible KV-event publisher: live PUB plus optional replay ROUTER.

    Args:
        endpoint: where the PUB socket binds, e.g. ``tcp://127.0.0.1:5557`` or ``tcp://127.0.0.1:0``.
        replay_endpoint: where the replay ROUTER binds; None = no replay (vLLM's default).
        topic: the first frame of every live message (vLLM's default is empty).
        engine: whose encoder writes payloads: ``"vllm"`` (0.33 / 0.23 layouts) or ``"sglang"``.
        encoding: ``"map"`` (vLLM >= 0.24, SGLang >= 0.5.20) or ``"array"`` (older).
        buffer_steps: batches kept for replay (vLLM's ``buffer_steps``).
        replay_topic: answer replays with vLLM >= 0.26's ``[topic, seq, payload]`` envelope; False
            gives the older ``[seq, payload]``.
        hwm: the PUB socket's send high-water mark.
        sndbuf: the kernel send buffer of each subscriber's TCP connection in bytes (``SO_SNDBUF``);
            0 keeps the OS's autotuned default. With a small ``hwm`` it bounds what a stalled subscriber
            may hold back before the PUB drops (``kvrouter replay --drill slow-consumer``).
        context: the ZMQ context to use; None creates one, terminated by :meth:`close`.

    Raises:
        ConfigError: a bad ``engine``, ``encoding`` or ``buffer_steps``, or an endpoint that cannot be
            bound (in use, malformed).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: bytes = b"",
        engine: Literal["vllm", "sglang"] = "vllm",
        encoding: Literal["map", "array"] = "map",
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        replay_topic: bool = True,
        hwm: int = DEFAULT_HWM,
        sndbuf: int = 0,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        if engine not in ("vllm", "sglang"):
            raise ConfigError(f"engine publisher: engine must be 'vllm' or 'sglang', got {engine!r}")
        if buffer_steps < 1:
            raise ConfigError(f"engine publisher: buffer_steps must be >= 1, got {buffer_steps}")
        try:
            self._encoder = (vllm.Encoder if engine == "vllm" else sglang.Encoder)(encoding)
        except ValueError as exc:
            raise ConfigError(f"engine publisher: {exc}") from exc
        self.topic = topic
        """The live topic frame, repeated in replies when :attr:`replay_topic`."""
        self.replay_topic = replay_topic
        """Replies carry the topic frame (vLLM >= 0.26, SGLang >= 0.5.22)."""
        self._owns_context = context is None
        self._context: zmq.Context[zmq.Socket[bytes]] = context if context is not None else zmq.Context()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self.bad_requests = 0
        """Replay requests of the wrong shape, ignored with no reply as vLLM does."""
        self.replays = 0
        """Replay requests answered."""
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.Socket[bytes] | None = None
        try:
            self._pub = self._bind(zmq.PUB, endpoint, hwm, sndbuf)
            if replay_endpoint is not None:
                # vLLM 0.33 sizes the ROUTER's SNDHWM for a whole buffer plus the END marker (§1.2).
                self._router = self._bind(zmq.ROUTER, replay_endpoint, 2 * (buffer_steps + 1))
        except BaseException:
            self.close()
            raise

    def _bind(self, kind: int, endpoint: str, hwm: int, sndbuf: int = 0) -> zmq.Socket[bytes]:
        socket: zmq.Socket[bytes] = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, hwm)
        if sndbuf > 0:  # before bind, like the HWM: each connection's TCP socket takes it
            socket.setsockopt(zmq.SNDBUF, sndbuf)
        try:
            socket.bind(endpoint)
        except zmq.ZMQError as exc:
            socket.close()
            raise ConfigError(f"engine publisher: cannot bind {endpoint!r}: {exc}") from exc
        return socket

    # -- state ----------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The PUB socket's bound endpoint, with the real port when bound to port 0."""
        return _last_endpoint(self._pub)

    @property
    def replay_endpoint(self) -> str | None:
        """The replay ROUTER's bound endpoint; None without replay."""
        return None if self._router is None else _last_endpoint(self._router)

    @property
    def replay_socket(self) -> zmq.Socket[bytes] | None:
        """The replay ROUTER, for the owner's ``zmq.Poller``; call :meth:`serve` when it is readable."""
        return self._router

    @property
    def next_seq(self) -> int:
        """The seq the next :meth:`publish` will use."""
        return self._seq

    @property
    def last_seq(self) -> int | None:
        """The seq of the last batch published (sent or dropped) in this incarnation; None before any."""
        return self._seq - 1 if self._seq else None

    # -- publishing -----------------------------------------------------------------------------

    def publish(self, batch: EventBatch, *, send: bool = True) -> int:
        """Encode ``batch``, buffer it for replay and send it as ``[topic, seq, payload]``.

        Args:
            batch: one engine step's events; its ``dp_rank`` is written into the payload.
            send: False drops the message on the wire (fault injection): the seq is used and the batch
                stays replayable, so the next sent batch shows the router a gap.

        Returns:
            The batch's seq.

        Raises:
            EncodeError: the batch cannot be written in this engine's format.
        """
        payload = self._encoder.encode(batch)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if send:
            assert self._pub is not None, "publish after close"
            self._pub.send_multipart(encode_live(self.topic, seq, payload), copy=False)
        return seq

    def serve(self, timeout_ms: int = 0) -> int:
        """Answer every pending replay request, waiting up to ``timeout_ms`` for the first one.

        A request ``[identity, b"", seq8]`` gets every buffered batch with seq >= the requested one,
        oldest first, then the END marker. Anything else is counted in :attr:`bad_requests` and
        ignored with no reply, as vLLM does. Without a replay socket this returns 0 at once.

        Returns:
            The number of requests answered.
        """
        router = self._router
        if router is None or (timeout_ms and not router.poll(timeout_ms)):
            return 0
        answered = 0
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return answered
            if len(frames) != 3 or frames[1] or len(frames[2]) != SEQ_BYTES:
                self._bad_request(frames)
                continue
            self._answer(router, frames[0], int.from_bytes(frames[2], "big"))
            answered += 1

    def _answer(self, router: zmq.Socket[bytes], identity: bytes, start: int) -> None:
        for seq, payload in self._buffer:
            if seq >= start:
                if self.replay_topic:
                    router.send_multipart([identity, b"", *encode_live(self.topic, seq, payload)], copy=False)
                else:
                    router.send_multipart([identity, b"", seq.to_bytes(SEQ_BYTES, "big"), payload], copy=False)
        topic = [b""] if self.replay_topic else []  # the END marker's topic frame is empty
        router.send_multipart([identity, b"", *topic, _END_SEQ_FRAME, b""])
        self.replays += 1
        log.debug("replay answered start=%d buffered=%d", start, len(self._buffer))

    def _bad_request(self, frames: list[bytes]) -> None:
        self.bad_requests += 1
        if self.bad_requests == 1:
            sizes = [len(frame) for frame in frames]
            log.warning(
                "replay request ignored frames=%d sizes=%s endpoint=%s (expected [identity, b'', seq8]; "
                "further ones are only counted)",
                len(frames),
                sizes,
                self.replay_endpoint,
            )

    # -- lifecycle ------------------------------------------------------------------------------

    def reset(self) -> None:
        """Start a new incarnation, as a restarted engine does: seq back to 0, replay buffer emptied."""
        self._seq = 0
        self._buffer.clear()

    def close(self) -> None:
        """Close both sockets (unsent messages are dropped) and the context if this instance made it."""
        for socket in (self._pub, self._router):
            if socket is not None:
                socket.close(linger=0)
        self._pub = self._router = None
        if self._owns_context:
            self._context.term()
            self._owns_context = False

    def __enter__(self) -> EnginePublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _last_endpoint(socket: zmq.Socket[bytes] | None) -> str:
    if socket is None:
        raise ConfigError("engine publisher: closed")
    endpoint = socket.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return endpoint.decode()
