"""``--fronts N``: every front serves every connection, one request at a time, and a dead front leaves none hanging.

Why: a connection dealt to one front for its life waits with that front. On a machine whose cores the
fronts share with their clients (and with each other), the kernel runs something else on a front's core
for a time slice now and then, and every request on that front's connections waits it out while another
front idles: one queue per front, where a shared queue lets whichever front is free take the next request.
Measured with ``tools/bench_service.py`` (2 fronts, 2 cores, ``wrk`` at 8 connections, 5 rounds each,
2026-12-06; ``docs/http-api.md``, "Several fronts"): the p99 shared was 2.47 ms against the reference's
4.13 ms in the same run; dealt (each connection one front's, the design between), 3.63 and 2.67 ms
against the reference's 4.10 and 2.48.

How:

- **Two fronts hold a copy, and front 0.** Front 0 accepts each connection, numbers it, and sends its
  socket with its number to the two fronts that serve it, in turn over the ready fronts (``SCM_RIGHTS``:
  one open socket, a descriptor per front; with two fronts, front 0 and front 1). Each front's transport
  for it never reads by itself (paused); the front watches its copy edge-triggered in an epoll of its
  own, registered on its loop, so new bytes wake both fronts once, and bytes one front leaves to the other
  wake nobody again. Front 0 holds a copy of every connection it does not serve, watched for its end only:
  to end it, or read it, if a front dies. Why two and not all: every front that watches a connection
  wakes for each of its requests, and all but one find the lock taken; with four fronts on two cores,
  sharing with all of them cost 10-15 % more CPU per request than two (``tools/bench_service.py``
  ``--compare-fronts``), for no gain in the tail that the second front does not already give.
- **One request at a time, by a lock on the socket.** A POSIX record lock on the socket's first byte
  (``fcntl``, non-blocking) is the request's: the front that gets it reads what the socket holds,
  answers it through the lane (the same code as for a connection of its own), and unlocks when nothing is
  left over. A front that does not get it does nothing: the holder reads those bytes too, or is woken by
  them after it unlocks (every front gets every edge). The kernel drops the locks of a front that dies.
- **Anything else makes the connection one front's own** for the rest of its life: a request that has not
  all arrived, a pipelined one behind it, an answer the socket has not taken yet, a route the lane hands
  to aiohttp. That front keeps the lock, reads the connection through its transport again, and tells
  front 0 (its socketpair: ``o`` and the number).
- **A front that dies leaves nothing hanging.** While a front answers a request it writes the
  connection's number into its word of a small shared segment (``kvrouter-<pid>-fronts``; 0 between
  requests). Front 0 hears of a front's exit at once (it waits on the process), shuts down the connection
  in the dead front's word and every connection the dead front owned (a ``shutdown`` reaches every copy:
  its client gets its end of file, or a reset, and may retry), and reads every connection it shares again,
  so bytes the dead front locked but never read are answered. Front 0's own exit ends every front.
- **The lock is the process's, so each front holds one descriptor per socket.** A POSIX record lock is
  dropped by a ``close()`` of *any* descriptor of the same file in the process: a second descriptor of a
  shared socket, closed, would let another front read a request this one is answering. Only
  :meth:`Sharing.adopt` makes a front's descriptor of a shared connection (from front 0's message, never
  ``dup``, ``fromfd`` or ``makefile``); a second one for a socket already held (which front 0 never sends)
  is parked, not closed, until the first ends. ``tests/service/process/test_sharing.py`` checks every
  front's ``/proc/<pid>/fd`` for two descriptors of one socket.
- **Closing.** A front that ends a connection (the peer's end of file, the keep-alive sweep, aiohttp or
  the lane closing one it owns) shuts the socket down before it closes its copy, so every other copy
  hears the end and is closed too. A front that only stops serving (its own restart, or the service's
  stop) drops its copies without a shutdown, and the other fronts go on serving them.

The cost, per request: the lock and unlock (about 1.4 µs together), two writes of a shared word, and each
other front's wake for bytes it leaves (its epoll; a refused lock, 1.7 µs with its ``OSError``), against a
request's 50-90 µs of CPU. Four fronts on two cores spend about 8 % more CPU per ``/select`` than two, forked
from one server as they are; spawned, they spent 2-23 % more, as plain spawned processes that share no work
do in the same rounds (``tools/bench_service.py``'s fronts' floors; ``docs/http-api.md``, "Several
fronts"): four interpreters, each with its own copy of what it runs, take turns on two cores' caches. Not
possible on a shared connection: TLS or HTTP/2 (the fronts would need one session state; a TLS-terminating
proxy in front is the way). Rejected: a lock word in shared memory taken by compare-and-swap (Python has no
atomic instruction, and a dead front's word would stay taken); serving each request by whichever front reads
it first, with no lock (a request that arrives in two reads would be split between fronts);
``EPOLLEXCLUSIVE`` (it wakes one waiter per event only when the waiters block on that epoll itself, and each
front's epoll of copies is watched through its loop's own; tried with the shared sockets in each loop's own
epoll, through a selector of our own, and every front serving every connection: 82 against 99 µs, no
better, and one front alone lost the re-poll of its copies: 106 to 119 µs at one connection); dealing
each connection to one front (the tail above).
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
from collections.abc import Callable
from typing import Final

import numpy as np
import numpy.typing as npt

from ...index.layout import PREFIX, Segment, unlink_segment
from ..core.config import MAX_FRONTS
from ..edges.lane import Lane, LaneConnection

__all__ = ["Serving", "Sharing", "serving_name"]

log = logging.getLogger(__name__)

_WATCH: Final = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLET
_ENDED: Final = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR
POLL_AGAIN: Final = 4
"""How many times a wake asks the epoll again before it lets the loop run its other work."""
_HOLD: Final = select.EPOLLRDHUP | select.EPOLLET
"""A copy front 0 only holds (the connection's two fronts serve it): its end wakes it, its requests do not."""


def serving_name(owner_pid: int) -> str:
    """The fronts' shared segment of ``kvrouter up`` ``owner_pid``: one word per front."""
    return f"{PREFIX}{owner_pid}-fronts"


class Serving:
    """Each front's word: the number of the connection whose request it is answering, 0 between requests.
    Front 0 creates the segment (:meth:`create`) and unlinks it; the others attach to it."""

    def __init__(self, segment: Segment, name: str, owner: bool) -> None:
        self._segment = segment
        self.name = name
        self._owner = owner
        self.words: npt.NDArray[np.uint64] = segment.words

    @classmethod
    def create(cls, owner_pid: int) -> Serving:
        name = serving_name(owner_pid)
        return cls(Segment.create(name, MAX_FRONTS), name, True)

    @classmethod
    def attach(cls, name: str) -> Serving:
        return cls(Segment.attach(name, writable=True), name, False)

    def close(self) -> None:
        self._segment.close()
        if self._owner:
            unlink_segment(self.name)


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


def _inode(fd: int) -> int:
    return os.fstat(fd).st_ino


class Sharing:
    """One front's share of every connection: its epoll of copies and the lock protocol above. Made on the
    front's running loop; :meth:`close` before the loop ends.

    Args:
        lane: the front's lane, which answers the requests.
        serving: the fronts' shared words; ``index`` this front's.
        owned: tells front 0 that a connection became this front's own (its number).
    """

    def __init__(self, lane: Lane, serving: Serving, index: int, owned: Callable[[int], None]) -> None:
        self._lane = lane
        self._word = serving.words[index : index + 1]
        self._owned = owned
        _raise_descriptor_limit()
        self._epoll = select.epoll()
        self._watched: dict[int, LaneConnection] = {}
        self._inodes: dict[int, int] = {}
        """A held socket's inode -> its descriptor here: one descriptor per shared socket."""
        self._parked: dict[int, list[socket.socket]] = {}
        """A socket's inode -> descriptors of it that came again (never expected), kept until it ends."""
        self.by_id: dict[int, LaneConnection] = {}
        """The connections this front holds, by their number among the fronts."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._epoll.fileno(), self._poll)

    def adopt(self, sock: socket.socket) -> bool:
        """A descriptor of a shared connection front 0 sent: True to serve it; False when this front already
        holds that socket (then the descriptor is parked, never closed while the first is in use)."""
        inode = _inode(sock.fileno())
        if inode in self._inodes:
            log.error("a second descriptor of one shared socket fd=%d inode=%d: parked", sock.fileno(), inode)
            self._parked.setdefault(inode, []).append(sock)
            return False
        return True

    def watch(self, connection: LaneConnection, transport: asyncio.Transport, *, serve: bool = True) -> None:
        """Serve ``connection`` shared: its transport stops reading; this front reads it when it gets the
        request lock (``serve``), or when a front that serves it dies (front 0's copies of the connections
        two other fronts serve). Called from ``connection_made``, before the transport's first read."""
        transport.pause_reading()
        fd = transport.get_extra_info("socket").fileno()
        connection.fd = fd
        self._watched[fd] = connection
        self._inodes[_inode(fd)] = fd
        self.by_id[connection.id] = connection
        self._epoll.register(fd, _WATCH if serve else _HOLD)  # bytes already there are reported at once

    def owns(self, connection: LaneConnection) -> bool:
        """Whether ``connection`` is this front's own (or was never shared)."""
        return self._watched.get(connection.fd) is not connection

    def own(self, connection: LaneConnection, transport: asyncio.Transport) -> None:
        """Make the connection this front's own: called with the request lock held. Its transport reads
        it from now on (unless the lane paused it for a slow reader: its ``resume_writing`` does)."""
        if self.owns(connection):
            return
        self._unwatch(connection)
        self._owned(connection.id)
        if not connection.paused:
            transport.resume_reading()

    def hand_over(
        self, connection: LaneConnection, transport: asyncio.Transport, handler: asyncio.Protocol
    ) -> asyncio.Protocol:
        """The lane gives ``connection`` to aiohttp's ``handler``: it becomes this front's own, and the
        protocol returned (``handler``'s, which shuts the socket down at its end) takes the transport."""
        self.own(connection, transport)
        return _Owned(handler, transport, self, connection)

    def drop(self, connection: LaneConnection) -> None:
        """Close this front's copy without a word to the peer: the other fronts go on serving it."""
        self.forget(connection)
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
        self._unwatch(connection)
        return True

    def closing(self, connection: LaneConnection, transport: asyncio.BaseTransport) -> None:
        """``connection_lost``, before the transport closes its socket: unless only dropped, shut it down so
        every other front's copy hears the end."""
        self.forget(connection)
        if not connection.dropped:
            with contextlib.suppress(OSError):  # the peer may be gone already
                transport.get_extra_info("socket").shutdown(socket.SHUT_RDWR)

    def shut(self, connection_id: int) -> bool:
        """Front 0, for a front that died answering or owning connection ``connection_id``: end it for every
        copy (its client gets its end of file or a reset at once). Whether this front held it."""
        connection = self.by_id.get(connection_id)
        if connection is None or connection.transport is None:
            return False
        with contextlib.suppress(OSError):
            connection.transport.get_extra_info("socket").shutdown(socket.SHUT_RDWR)
        connection.close()
        return True

    def reread(self) -> None:
        """Read every shared connection again, those only held included, as if each had new bytes: what a
        front that died had locked but not read is answered (its lock went with it, and no new edge will
        come for those bytes)."""
        for connection in list(self._watched.values()):
            self._serve_safely(connection.fd, connection, select.EPOLLIN)

    def close(self) -> None:
        """Stop watching: every copy still shared is dropped (the other fronts keep serving them)."""
        for connection in list(self._watched.values()):
            self.drop(connection)
        self._loop.remove_reader(self._epoll.fileno())
        self._epoll.close()
        for parked in self._parked.values():
            for sock in parked:
                sock.close()
        self._parked.clear()

    def _unwatch(self, connection: LaneConnection) -> None:
        """Stop sharing ``connection`` (it is this front's own now, or ending): its epoll watch goes."""
        if self._watched.get(connection.fd) is connection:
            del self._watched[connection.fd]
            self._epoll.unregister(connection.fd)

    def forget(self, connection: LaneConnection) -> None:
        """The connection ends here: nothing of it is kept (its parked descriptors close with it)."""
        self._unwatch(connection)
        if self.by_id.get(connection.id) is connection:
            del self.by_id[connection.id]
        if connection.fd >= 0:
            with contextlib.suppress(OSError):
                inode = _inode(connection.fd)
                if self._inodes.get(inode) == connection.fd:
                    del self._inodes[inode]
                    for sock in self._parked.pop(inode, []):
                        sock.close()

    def _poll(self) -> None:
        """Serve what the epoll reports, then ask it again (up to ``POLL_AGAIN`` times) before the loop runs
        anything else: a request that arrived while this front answered is taken now, without the loop's own
        round (its select, its handles), which is most of what a front spends per wake."""
        for _ in range(POLL_AGAIN):
            ready = self._epoll.poll(0)
            if not ready:
                return
            for fd, events in ready:
                connection = self._watched.get(fd)
                if connection is not None:
                    self._serve_safely(fd, connection, events)

    def _serve_safely(self, fd: int, connection: LaneConnection, events: int) -> None:
        try:
            self._serve(connection, events)
        except Exception as exc:  # a failure here must not lose the other events of this poll
            self._word[0] = 0
            self._lane.core.counters.shared_failures += 1
            log.warning("shared connection closed fd=%d error=%r", fd, exc)
            self.forget(connection)
            connection.close()

    def _serve(self, connection: LaneConnection, events: int) -> None:
        """New bytes (or the end) on a shared connection: take the request if no other front has it."""
        fd = connection.fd
        connection.last_active = time.monotonic()
        if not _lock(fd):  # another front is reading it, or owns it
            if events & _ENDED:  # the holder sees the end too, and closes its copy
                self.drop(connection)
            return
        word, scratch = self._word, self._lane.scratch
        try:
            while connection.transport is not None and not self.owns(connection) and not connection.paused:
                word[0] = connection.id  # what front 0 ends if this front dies with bytes read and not answered
                try:
                    n = os.readv(fd, [scratch])
                except BlockingIOError:
                    break
                except OSError:
                    n = 0  # reset by the peer: as its end
                if n == 0:
                    self.forget(connection)
                    connection.close()
                    return
                connection.buffer_updated(n)  # answers every whole request; may hand the connection to aiohttp
                if not connection.buffer:
                    word[0] = 0  # every byte read is answered
                if n < len(scratch) and not events & _ENDED:  # all it held: later bytes wake every front again
                    break  # (edge-triggered); after the peer's end, read on to it
            if self.owns(connection) or connection.transport is None:
                return  # handed over (own() was called, front 0 told) or closed
            if connection.buffer or connection.paused or connection.transport.get_write_buffer_size():
                self.own(connection, connection.transport)  # a request still arriving, an answer not taken yet
            else:
                _unlock(fd)
        finally:
            word[0] = 0


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

    def __init__(
        self, handler: asyncio.Protocol, transport: asyncio.Transport, sharing: Sharing, connection: LaneConnection
    ) -> None:
        self._handler = handler
        self._transport = transport
        self._sharing = sharing
        self._connection = connection

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
        self._sharing.forget(self._connection)
        with contextlib.suppress(OSError):
            self._transport.get_extra_info("socket").shutdown(socket.SHUT_RDWR)
        self._handler.connection_lost(exc)
