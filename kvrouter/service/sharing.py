"""``--fronts N``: every front serves every connection, one request at a time.

Why: a connection dealt to one front for its life waits with that front. On a machine whose cores the
fronts share with their clients (and with each other), the kernel runs something else on a front's core
for a time slice now and then, and every request on that front's connections waits it out while another
front idles: one queue per front, where a shared queue lets whichever front is free take the next request.
Measured with ``tools/bench_service.py --sides kvrouter --concurrency 8 --rounds 3`` (2 fronts, 2 cores,
``wrk`` at 8 connections), this build against the one before it, alternated three times (15:09 UTC
2026-12-02, the VM slowing down over the run): p99 per round 1.00, 0.88, 0.82 / 1.01, 1.58, 1.31 / 4.26,
3.26, 2.39 ms shared against 2.45, 1.24, 1.92 / 6.43, 6.38, 6.53 / 9.47, 7.21, 5.92 ms dealt, at 18,899 /
17,006 / 13,716 requests/s against 19,529 / 13,296 / 13,978 (medians).

How:

- **Every front holds a copy.** Front 0 accepts each connection and sends its socket to every ready front
  (``SCM_RIGHTS``: one open socket, a descriptor per front). Each front's transport for it never reads
  by itself (paused); the front watches its copy edge-triggered in an epoll of its own, registered on its
  loop, so new bytes wake every front once, and bytes one front leaves to another wake nobody again.
- **One request at a time, by a lock on the socket.** A POSIX record lock on the socket's first byte
  (``fcntl``, non-blocking) is the request's: the front that gets it reads what the socket holds,
  answers it through the lane (:class:`~kvrouter.service.lane.LaneConnection`, the same code as for a
  connection of its own), and unlocks when nothing is left over. A front that does not get it does
  nothing: the holder reads those bytes too, or is woken by them after it unlocks (every front gets every
  edge). The kernel drops the locks of a front that dies.
- **Anything else makes the connection one front's own** for the rest of its life, as every connection
  was before: a request that has not all arrived, a pipelined one behind it, an answer the socket has not
  taken yet, a route the lane hands to aiohttp. That front keeps the lock and reads the connection
  through its transport again; the other fronts, finding it locked whenever its bytes wake them, leave
  them to it.
- **Closing.** A front that ends a connection (the peer's end of file, the keep-alive sweep, aiohttp or
  the lane closing one it owns) shuts the socket down before it closes its copy, so every other copy
  hears the end and is closed too. A front that only stops serving (its own restart, or the service's
  stop) drops its copies without a shutdown, and the other fronts go on serving them.

The cost, per request: the lock and unlock (about 1.4 µs together), and each other front's wake for
bytes it leaves (its epoll; a refused lock, 1.7 µs with its ``OSError``), against a request's
50-90 µs of CPU. In the runs above requests/s differed from dealt connections' by -3 %, +28 % and -2 %,
server CPU per request by +6, -7 and +5 µs; in two single 5 s rounds at 15:37 by -26 % and -10 %
(+27 and +8 µs). Not covered: a front that dies while it answers a request leaves that request unanswered
on a connection that stays open (the other fronts hold it), where a dealt connection was reset with its
front; the client's timeout ends it. Rejected: a lock word in shared memory taken by compare-and-swap (a
dead front's lock would stay taken); serving each request by whichever front reads it first, with no lock
(a request that arrives in two reads would be split between fronts); ``EPOLLEXCLUSIVE`` (it wakes one
waiter per event only when the waiters block on that epoll itself, and each front's epoll of copies is
watched through its loop's own).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import resource
import select
import socket
import time
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from .lane import Lane, LaneConnection

__all__ = ["Sharing"]

log = logging.getLogger(__name__)

_WATCH: Final = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLET
_ENDED: Final = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR


def _lock(fd: int) -> bool:
    """The request lock on ``fd``'s socket, if no other front holds it (this front may hold it already)."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):  # another front holds it
            return False
        raise
    return True


def _unlock(fd: int) -> None:
    fcntl.lockf(fd, fcntl.LOCK_UN, 1)


class Sharing:
    """One front's share of every connection: its epoll of copies and the lock protocol above. Made on the
    front's running loop; :meth:`close` before the loop ends."""

    def __init__(self, lane: Lane) -> None:
        self._lane = lane
        _raise_descriptor_limit()
        self._epoll = select.epoll()
        self._watched: dict[int, LaneConnection] = {}
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._epoll.fileno(), self._poll)

    def watch(self, connection: LaneConnection, transport: asyncio.Transport) -> None:
        """Serve ``connection`` shared: its transport stops reading; this front reads it when it gets the
        request lock. Called from ``connection_made``, before the transport's first read."""
        transport.pause_reading()
        fd = transport.get_extra_info("socket").fileno()
        connection.fd = fd
        self._watched[fd] = connection
        self._epoll.register(fd, _WATCH)  # bytes already there are reported at once

    def owns(self, connection: LaneConnection) -> bool:
        """Whether ``connection`` is this front's own (or was never shared)."""
        return self._watched.get(connection.fd) is not connection

    def own(self, connection: LaneConnection, transport: asyncio.Transport) -> None:
        """Make the connection this front's own: called with the request lock held. Its transport reads
        it from now on (unless the lane paused it for a slow reader: its ``resume_writing`` does)."""
        if self.owns(connection):
            return
        self._forget(connection)
        if not connection.paused:
            transport.resume_reading()

    def hand_over(
        self, connection: LaneConnection, transport: asyncio.Transport, handler: asyncio.Protocol
    ) -> asyncio.Protocol:
        """The lane gives ``connection`` to aiohttp's ``handler``: it becomes this front's own, and the
        protocol returned (``handler``'s, which shuts the socket down at its end) takes the transport."""
        self.own(connection, transport)
        return _Owned(handler, transport)

    def drop(self, connection: LaneConnection) -> None:
        """Close this front's copy without a word to the peer: the other fronts go on serving it."""
        self._forget(connection)
        connection.dropped = True
        if connection.transport is not None:
            connection.transport.abort()

    def end(self, connection: LaneConnection) -> bool:
        """Before this front closes an idle connection (keep-alive sweep): False when another front is
        answering on it right now (then it is not idle)."""
        if self.owns(connection):
            return True
        if not _lock(connection.fd):
            return False
        self._forget(connection)
        return True

    def closing(self, connection: LaneConnection, transport: asyncio.BaseTransport) -> None:
        """``connection_lost``, before the transport closes its socket: unless only dropped, shut it down so
        every other front's copy hears the end."""
        self._forget(connection)
        if not connection.dropped:
            with contextlib.suppress(OSError):  # the peer may be gone already
                transport.get_extra_info("socket").shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Stop watching: every copy still shared is dropped (the other fronts keep serving them)."""
        for connection in list(self._watched.values()):
            self.drop(connection)
        self._loop.remove_reader(self._epoll.fileno())
        self._epoll.close()

    def _forget(self, connection: LaneConnection) -> None:
        if self._watched.get(connection.fd) is connection:
            del self._watched[connection.fd]
            self._epoll.unregister(connection.fd)

    def _poll(self) -> None:
        for fd, events in self._epoll.poll(0):
            connection = self._watched.get(fd)
            if connection is None:
                continue
            try:
                self._serve(connection, events)
            except Exception as exc:  # a failure here must not lose the other events of this poll
                self._lane.routes.service.counters.shared_failures += 1
                log.warning("shared connection closed fd=%d error=%r", fd, exc)
                self._forget(connection)
                connection.close()

    def _serve(self, connection: LaneConnection, events: int) -> None:
        """New bytes (or the end) on a shared connection: take the request if no other front has it."""
        fd = connection.fd
        connection.last_active = time.monotonic()
        if not _lock(fd):  # another front is reading it, or owns it
            if events & _ENDED:  # the holder sees the end too, and closes its copy
                self.drop(connection)
            return
        scratch = self._lane.scratch
        while connection.transport is not None and not self.owns(connection) and not connection.paused:
            try:
                n = os.readv(fd, [scratch])
            except BlockingIOError:
                break
            except OSError:
                n = 0  # reset by the peer: as its end
            if n == 0:
                self._forget(connection)
                connection.close()
                return
            connection.buffer_updated(n)  # answers every whole request; may hand the connection to aiohttp
            if n < len(scratch) and not events & _ENDED:  # all it held: later bytes wake every front again
                break  # (edge-triggered); after the peer's end, read on to it
        if self.owns(connection) or connection.transport is None:
            return  # handed over (own() was called) or closed
        if connection.buffer or connection.paused or connection.transport.get_write_buffer_size():
            self.own(connection, connection.transport)  # a request still arriving, an answer not taken yet
        else:
            _unlock(fd)


def _raise_descriptor_limit() -> None:
    """Every front holds a descriptor for every connection, so N fronts need N times the descriptors one
    did: the soft limit goes up to the hard one (often 1,024 and 524,288), as servers with many
    connections do at start."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        log.info("descriptor limit raised from %d to %d for shared connections", soft, hard)


class _Owned(asyncio.Protocol):
    """aiohttp's handler on a connection other fronts may still hold a copy of: at its end the socket is
    shut down (the transport calls ``connection_lost`` before it closes its socket), so the peer hears the
    end now, not when the last copy goes."""

    def __init__(self, handler: asyncio.Protocol, transport: asyncio.Transport) -> None:
        self._handler = handler
        self._transport = transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self._handler.eof_received()

    def pause_writing(self) -> None:
        self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        with contextlib.suppress(OSError):
            self._transport.get_extra_info("socket").shutdown(socket.SHUT_RDWR)
        self._handler.connection_lost(exc)
