"""The two ways a worker answers for its history: an engine's replay socket, or a kvrouter worker's local indexer.

Both are a DEALER the router connects for one recovery and closes after it, never kept open: a late reply
to a recovery that timed out would otherwise be read as the answer to the next one, and an open socket
per worker would cost a file descriptor per rank of the fleet for a path used after drops and restarts
only. A client never blocks: it sends its request at once (ZMQ queues it while the peer is away) and the
applier's wakes tell the stream when replies are readable, so a peer that never answers costs a timer,
not a hang (``plane/stream.py`` owns the timeout).

- :class:`ReplayClient` speaks vLLM's and SGLang's replay protocol (``spec/wire-formats.md`` §1.6): one
  request ``[b"", start_seq]``, then every buffered batch from it on and an END marker, in either envelope.
- :class:`QueryClient` speaks the local-indexer protocol of ``docs/wire-format.md``: one request (a range
  of event ids, or none for a full dump), one reply (Events, TreeDump or TooNew).
"""

from __future__ import annotations

from typing import Final

import zmq

from ..errors import BadEvent
from ..events.codecs.frames import ReplayEnd, ReplayFrame, parse_replay_reply, replay_request
from ..events.codecs.query import QueryReply, QueryRequest, decode_reply, encode_request

__all__ = ["QueryClient", "RecoveryClient", "ReplayClient"]

RECONNECT_MS: Final = 100
"""How soon a recovery socket retries a peer that is not there yet."""


class RecoveryClient:
    """A DEALER to one peer for one recovery. The caller polls :attr:`socket` and closes the client."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], endpoint: str, max_message_bytes: int) -> None:
        self.endpoint = endpoint
        self.socket: zmq.Socket[bytes] = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # a reply is one message: a dump can be big
        self.socket.connect(endpoint)

    def _drain(self) -> list[list[bytes]]:
        messages = []
        while True:
            try:
                messages.append(self.socket.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return messages

    def close(self) -> None:
        self.socket.close(linger=0)


class ReplayClient(RecoveryClient):
    """vLLM / SGLang replay: ask for every batch from ``start_seq`` on; read batches until the END marker."""

    def request(self, start_seq: int) -> None:
        self.socket.send_multipart(replay_request(start_seq), zmq.NOBLOCK)

    def read(self) -> list[ReplayFrame | ReplayEnd | BadEvent]:
        """Every reply readable now, in order; a malformed one comes back as its ``BadEvent``."""
        replies: list[ReplayFrame | ReplayEnd | BadEvent] = []
        for frames in self._drain():
            try:
                replies.append(parse_replay_reply(frames))
            except BadEvent as exc:
                replies.append(exc)
        return replies


class QueryClient(RecoveryClient):
    """A kvrouter worker's local indexer: one request, one reply."""

    def request(self, start: int | None, end: int | None = None) -> None:
        self.socket.send_multipart(encode_request(QueryRequest(start, end)), zmq.NOBLOCK)

    def read(self) -> list[QueryReply | BadEvent]:
        """Every reply readable now; a malformed one comes back as its ``BadEvent``."""
        replies: list[QueryReply | BadEvent] = []
        for frames in self._drain():
            try:
                replies.append(decode_reply(frames))
            except BadEvent as exc:
                replies.append(exc)
        return replies
