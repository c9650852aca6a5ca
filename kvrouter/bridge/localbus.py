"""The local bus: NATS core's subject semantics over one ZMQ ROUTER, for fronts of one machine.

``kvrouter up --fronts N`` runs N front processes on one port; their load views must agree exactly as
replicas' do (``sync.py``). With a NATS server they use it; without one they use this bus, so the one
:class:`~kvrouter.bridge.sync.ReplicaSync` runs unchanged over either. :class:`LocalBus` offers the part
of nats-py's client that the sync uses — ``publish`` (with a reply subject), ``subscribe`` (callback or
``next_msg``), ``request``, ``new_inbox``, ``flush``, ``close``, messages with ``respond`` — and raises
nats-py's own errors (``NoRespondersError``, ``TimeoutError``, ``SlowConsumerError`` through
``error_cb``), so the sync's fault handling is the same code on both transports.

**Design: one broker, one socket per client.** The front that owns the engine runs :class:`LocalBroker`
on its loop: a ROUTER on an ``ipc://`` path in the service's private runtime directory. Each client
(every front, the broker's own included) talks to it through one DEALER. Everything a client sends —
subscribe, unsubscribe, publish, flush — travels that one pipe, so the broker sees it in order: after
``flush`` returns, every subscription made before it is live, which is what NATS's flush promises and
what a request/reply needs (the reply inbox must be subscribed before the request goes out). The broker
knows every subscription, so a request to a subject nobody subscribes gets NATS's "no responders" at
once instead of a timeout. Cost per message: one hop through the broker's loop (about 10 µs of Python
per delivery), which at the fronts' few thousand events a second is a few percent of a core.

Rejected: ZMQ XPUB/XSUB (a subscription and a publish travel different sockets, so "subscribed before
the reply comes" cannot be guaranteed, and a publisher never learns that nobody listens); a private
nats-server per ``kvrouter up`` (a Go binary as a run-time dependency and one more process to own for a
machine-local channel).

Subjects are matched exactly (the sync uses no wildcards). A client that dies leaves its subscriptions in
the broker; messages to them are dropped by the ROUTER (no ``ROUTER_MANDATORY``), and a request whose
only subscriber is dead times out as it would on NATS with a vanished peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import nats.errors
import zmq
import zmq.asyncio

__all__ = ["LocalBroker", "LocalBus", "LocalMessage", "LocalSubscription", "connect"]

log = logging.getLogger(__name__)

SUBSCRIBE: Final = b"S"
UNSUBSCRIBE: Final = b"U"
PUBLISH: Final = b"P"
FLUSH: Final = b"F"
MESSAGE: Final = b"M"
NO_RESPONDERS: Final = b"N"
DEFAULT_PENDING_MSGS: Final = 524_288
"""Messages a callback subscription holds before it drops (nats-py's default ``pending_msgs_limit``)."""
HWM: Final = 1_000_000
"""Frames queued per pipe before ZMQ drops: far above any burst the fronts make, so a drop means a dead peer."""

Callback = Callable[["LocalMessage"], Awaitable[None]]


class LocalBroker:
    """Routes the local bus's messages between its clients. One per ``kvrouter up``; runs on its loop.

    Args:
        endpoint: an ``ipc://`` path in a directory only this user can enter.
    """

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._context = zmq.asyncio.Context()
        self._sock = self._context.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, HWM)
        self._sock.setsockopt(zmq.RCVHWM, HWM)
        self._sock.bind(endpoint)
        self._subs: dict[bytes, dict[tuple[bytes, bytes], None]] = {}
        """subject -> {(client identity, sid)}: insertion-ordered, so deliveries keep subscription order."""
        self._by_sid: dict[tuple[bytes, bytes], bytes] = {}
        self.routed = 0
        self.malformed = 0
        self._logged: set[str] = set()

    def subscribers(self, subject: str) -> int:
        return len(self._subs.get(subject.encode(), ()))

    async def run(self) -> None:
        """Route until cancelled."""
        sock = self._sock
        while True:
            frames = await sock.recv_multipart()
            try:
                await self._route(frames)
            except (ValueError, IndexError) as exc:
                self.malformed += 1
                if "malformed" not in self._logged:
                    self._logged.add("malformed")
                    log.warning("local bus malformed frame error=%s frames=%d", exc, len(frames))

    async def _route(self, frames: list[bytes]) -> None:
        client, op = frames[0], frames[1]
        sock = self._sock
        if op == PUBLISH:
            _, _, subject, reply, data = frames
            targets = self._subs.get(subject)
            if not targets:
                if reply:
                    await sock.send_multipart((client, NO_RESPONDERS, reply))
                return
            for identity, sid in list(targets):
                await sock.send_multipart((identity, MESSAGE, sid, subject, reply, data))
            self.routed += 1
        elif op == SUBSCRIBE:
            _, _, subject, sid = frames
            self._subs.setdefault(subject, {})[client, sid] = None
            self._by_sid[client, sid] = subject
        elif op == UNSUBSCRIBE:
            _, _, sid = frames
            found = self._by_sid.pop((client, sid), None)
            if found is not None:
                targets = self._subs.get(found, {})
                targets.pop((client, sid), None)
                if not targets:
                    self._subs.pop(found, None)
        elif op == FLUSH:
            _, _, token = frames
            await sock.send_multipart((client, FLUSH, token))
        else:
            raise ValueError(f"unknown op {op!r}")

    def close(self) -> None:
        self._sock.close(linger=0)
        self._context.term()
        path = self.endpoint.removeprefix("ipc://")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@dataclass(slots=True)
class LocalMessage:
    """One delivered message: nats-py's ``Msg`` fields the sync reads."""

    subject: str
    reply: str
    data: bytes
    _bus: LocalBus

    async def respond(self, data: bytes) -> None:
        if self.reply:
            await self._bus.publish(self.reply, data)


class LocalSubscription:
    """A subscription: with a callback, messages go to it one at a time on a task of its own (as nats-py's
    do); without one, :meth:`next_msg` takes them."""

    def __init__(self, bus: LocalBus, sid: bytes, subject: str, cb: Callback | None, pending: int) -> None:
        self._bus = bus
        self.sid = sid
        self.subject = subject
        self._queue: asyncio.Queue[LocalMessage] = asyncio.Queue(maxsize=pending)
        self._task = asyncio.create_task(self._deliver(cb), name=f"localbus-{subject}") if cb else None
        self.dropped = 0

    def _put(self, msg: LocalMessage) -> bool:
        try:
            self._queue.put_nowait(msg)
        except asyncio.QueueFull:
            self.dropped += 1
            return False
        return True

    async def _deliver(self, cb: Callback) -> None:
        while True:
            msg = await self._queue.get()
            try:
                await cb(msg)
            except Exception as exc:  # a callback's bug must not end the subscription
                await self._bus._error(exc)

    async def next_msg(self, timeout: float = 1.0) -> LocalMessage:
        """Raises: nats.errors.TimeoutError: nothing within ``timeout`` seconds."""
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            raise nats.errors.TimeoutError from None

    async def unsubscribe(self) -> None:
        await self._bus._unsubscribe(self)

    def _stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


class LocalBus:
    """A client of :class:`LocalBroker`; make it with :func:`connect`. Not thread-safe: one loop uses it."""

    def __init__(
        self, endpoint: str, *, name: str = "", error_cb: Callable[[Exception], Awaitable[None]] | None = None
    ):
        self.endpoint = endpoint
        self.name = name
        self._error_cb = error_cb
        self._context = zmq.asyncio.Context()
        self._sock = self._context.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, HWM)
        self._sock.setsockopt(zmq.RCVHWM, HWM)
        self._sock.connect(endpoint)
        self._subs: dict[bytes, LocalSubscription] = {}
        self._sids = itertools.count(1)
        self._prefix = f"_INBOX.{secrets.token_hex(8)}"
        self._flushes: dict[bytes, asyncio.Future[None]] = {}
        self._no_responders: dict[str, asyncio.Future[None]] = {}
        self._reader = asyncio.create_task(self._read(), name="localbus-reader")
        self._closed = False

    @property
    def is_connected(self) -> bool:
        return not self._closed

    def new_inbox(self) -> str:
        return f"{self._prefix}.{next(self._sids)}"

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "") -> None:
        await self._sock.send_multipart((PUBLISH, subject.encode(), reply.encode(), payload))

    async def subscribe(
        self, subject: str, cb: Callback | None = None, pending_msgs_limit: int = DEFAULT_PENDING_MSGS
    ) -> LocalSubscription:
        """Subscribed once the broker has it: the call waits for a flush, so a reply to a request sent after
        it cannot overtake it."""
        sid = str(next(self._sids)).encode()
        sub = LocalSubscription(self, sid, subject, cb, pending_msgs_limit)
        self._subs[sid] = sub
        await self._sock.send_multipart((SUBSCRIBE, subject.encode(), sid))
        await self.flush()
        return sub

    async def _unsubscribe(self, sub: LocalSubscription) -> None:
        sub._stop()
        if self._subs.pop(sub.sid, None) is not None and not self._closed:
            await self._sock.send_multipart((UNSUBSCRIBE, sub.sid))

    async def request(self, subject: str, payload: bytes = b"", timeout: float = 1.0) -> LocalMessage:
        """The first answer to ``payload`` on ``subject``.

        Raises:
            nats.errors.NoRespondersError: nobody subscribes to ``subject``.
            nats.errors.TimeoutError: nobody answered within ``timeout`` seconds.
        """
        inbox = self.new_inbox()
        sub = await self.subscribe(inbox)
        none: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._no_responders[inbox] = none
        try:
            await self.publish(subject, payload, reply=inbox)
            answer = asyncio.ensure_future(sub.next_msg(timeout))
            await asyncio.wait((answer, none), return_when=asyncio.FIRST_COMPLETED)
            if none.done():
                answer.cancel()
                with contextlib.suppress(asyncio.CancelledError, nats.errors.TimeoutError):
                    await answer
                raise nats.errors.NoRespondersError
            return answer.result()
        finally:
            self._no_responders.pop(inbox, None)
            none.cancel()
            await sub.unsubscribe()

    async def flush(self, timeout: float = 2.0) -> None:
        """Returns when the broker has handled everything sent before.

        Raises:
            nats.errors.TimeoutError: the broker did not answer within ``timeout`` seconds.
        """
        token = secrets.token_bytes(8)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._flushes[token] = done
        try:
            await self._sock.send_multipart((FLUSH, token))
            await asyncio.wait_for(done, timeout)
        except TimeoutError:
            raise nats.errors.TimeoutError from None
        finally:
            self._flushes.pop(token, None)

    async def _read(self) -> None:
        sock = self._sock
        while True:
            frames = await sock.recv_multipart()
            op = frames[0]
            if op == MESSAGE and len(frames) == 5:
                sub = self._subs.get(frames[1])
                if sub is None:
                    continue
                msg = LocalMessage(frames[2].decode(), frames[3].decode(), frames[4], self)
                if not sub._put(msg):
                    await self._error(nats.errors.SlowConsumerError(msg.subject, msg.reply, int(sub.sid), sub))  # type: ignore[arg-type]
            elif op == FLUSH and len(frames) == 2:
                done = self._flushes.get(frames[1])
                if done is not None and not done.done():
                    done.set_result(None)
            elif op == NO_RESPONDERS and len(frames) == 2:
                waiting = self._no_responders.get(frames[1].decode())
                if waiting is not None and not waiting.done():
                    waiting.set_result(None)

    async def _error(self, exc: Exception) -> None:
        if self._error_cb is not None:
            await self._error_cb(exc)
        else:
            log.warning("local bus error name=%s error=%r", self.name, exc)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        for sub in list(self._subs.values()):
            sub._stop()
        self._subs.clear()
        self._sock.close(linger=0)
        self._context.term()


async def connect(
    servers: list[str], *, name: str = "", error_cb: Callable[[Exception], Awaitable[None]] | None = None, **_: Any
) -> LocalBus:
    """nats.connect's shape for the local bus: ``servers[0]`` is the broker's ``ipc://`` endpoint; the
    reconnect and ping options have no meaning on a local pipe and are ignored.

    Raises:
        nats.errors.TimeoutError: no broker answers there within 2 s.
    """
    bus = LocalBus(servers[0], name=name, error_cb=error_cb)
    try:
        await bus.flush()
    except BaseException:
        await bus.close()
        raise
    return bus
