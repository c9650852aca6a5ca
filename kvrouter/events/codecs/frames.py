"""ZMQ framing shared by every engine subscriber and replay client: live messages and replay envelopes.

vLLM and SGLang frame alike (``spec/wire-formats.md`` §1.5, §1.6, §2.1), so frames are checked here,
once, and a codec only ever sees a payload. The one difference between versions is whether a replay
reply repeats the topic (vLLM >= 0.26, SGLang >= 0.5.22) or not (older). The reader tells the two
envelopes apart by frame count, as Dynamo's bootstrap accepts both (§3), rather than by a per-engine
version setting: one replay client serves every engine version, at the cost of trusting the frame
count to name the envelope (a 3-frame reply is always read as ``[b"", seq, payload]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from ...errors import BadEvent
from ..model import U64_MAX

__all__ = [
    "END_SEQ",
    "LiveFrame",
    "ReplayEnd",
    "ReplayFrame",
    "encode_live",
    "parse_live",
    "parse_replay_reply",
    "replay_request",
]

SEQ_BYTES: Final = 8
"""Every seq frame is an 8-byte big-endian unsigned counter (``seq.to_bytes(8, "big")`` in the publishers)."""

END_SEQ: Final = U64_MAX
"""The seq of a replay reply's END marker: ``(-1).to_bytes(8, "big", signed=True)`` in the publishers."""


@dataclass(frozen=True, slots=True)
class LiveFrame:
    """One live message of an engine's PUB socket: ``[topic, seq, payload]``."""

    topic: bytes
    """The publisher's topic (vLLM's default is empty); SUB sockets prefix-filter on it."""
    seq: int
    """Per publisher incarnation, from 0; a gap is the only sign of a lost batch, a step back a restart."""
    payload: bytes
    """One msgpack batch, for the engine's codec."""


@dataclass(frozen=True, slots=True)
class ReplayFrame:
    """One buffered batch sent back by a publisher's replay ROUTER."""

    seq: int
    payload: bytes
    topic: bytes | None = None
    """``None`` when the envelope has no topic frame (vLLM <= 0.25, SGLang < 0.5.22)."""


@dataclass(frozen=True, slots=True)
class ReplayEnd:
    """The END marker: every buffered batch from the requested seq on has been sent.

    Recognised by its seq (:data:`END_SEQ`) alone; its payload, empty in every publisher, is not read.
    """


def _seq(frame: bytes, where: str) -> int:
    if len(frame) != SEQ_BYTES:
        raise BadEvent(f"{where}: seq frame is {len(frame)} bytes, expected {SEQ_BYTES}")
    return int.from_bytes(frame, "big")


def _seq_frame(seq: int, where: str) -> bytes:
    if not 0 <= seq <= U64_MAX:
        raise BadEvent(f"{where}: seq {seq} is outside [0, 2**64 - 1]")
    return seq.to_bytes(SEQ_BYTES, "big")


def parse_live(frames: Sequence[bytes]) -> LiveFrame:
    """Read one message received on a SUB socket.

    Raises:
        BadEvent: not exactly 3 frames, or a seq frame that is not 8 bytes.
    """
    if len(frames) != 3:
        raise BadEvent(f"live message: expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq, payload = frames
    return LiveFrame(topic, _seq(seq, "live message frame 1"), payload)


def encode_live(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The frames a publisher sends for one batch, as vLLM's and SGLang's ``ZmqEventPublisher`` do.

    Raises:
        BadEvent: ``seq`` does not fit in 8 unsigned bytes.
    """
    return [topic, _seq_frame(seq, "live message"), payload]


def replay_request(start_seq: int) -> list[bytes]:
    """The frames a DEALER sends to ask a replay ROUTER for every buffered batch from ``start_seq`` on.

    The leading empty frame is the delimiter the ROUTER expects after the identity it prepends; a
    request without it gets no reply at all (``spec/wire-formats.md`` §1.6).

    Raises:
        BadEvent: ``start_seq`` does not fit in 8 unsigned bytes.
    """
    return [b"", _seq_frame(start_seq, "replay request")]


def parse_replay_reply(frames: Sequence[bytes]) -> ReplayFrame | ReplayEnd:
    """Read one reply as a DEALER receives it: ``[b"", topic, seq, payload]`` or ``[b"", seq, payload]``.

    Raises:
        BadEvent: neither 3 nor 4 frames, a first frame that is not the empty delimiter, or a seq
            frame that is not 8 bytes.
    """
    if len(frames) == 4:
        delimiter, topic, seq_frame, payload = frames
        reply_topic: bytes | None = topic
    elif len(frames) == 3:
        delimiter, seq_frame, payload = frames
        reply_topic = None
    else:
        raise BadEvent(
            f"replay reply: expected 4 frames [b'', topic, seq, payload] or 3 [b'', seq, payload], got {len(frames)}"
        )
    if delimiter:
        raise BadEvent(f"replay reply frame 0: expected the empty delimiter, got {len(delimiter)} bytes")
    seq = _seq(seq_frame, f"replay reply frame {len(frames) - 2}")
    if seq == END_SEQ:
        return ReplayEnd()
    return ReplayFrame(seq, payload, reply_topic)
