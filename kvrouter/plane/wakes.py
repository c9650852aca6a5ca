"""``Wakes``: which of an applier's ZMQ sockets to read next, at a cost that does not grow with the sockets.

Rules:

- Every watched socket's ``ZMQ_FD`` sits in one epoll, level-triggered. A socket whose descriptor is
  readable is handed out; reading it (a receive, even one that finds nothing) lets libzmq take the
  notice, and the descriptor goes quiet.
- That descriptor tells of a change, not of messages: libzmq notices the socket once when its queue
  stops being empty, and not again until a read has found it empty. So a reader that stops before a
  socket is empty (its drain bound) says so with :meth:`again`, and the socket is handed out next round
  without a wake.
- A socket is handed out once when it is watched, and what it holds is read then: libzmq gives no
  notice for messages on a connection no read has yet found empty (a recovery DEALER's reply to the
  request it sent before it was watched, tested in ``tests/plane/test_wakes.py``).

Why: ``zmq.Poller.poll`` asks every registered socket for its events on each call, twice, through
libzmq's ``zmq_poll``: 16 µs a call with 17 sockets and 170 µs with 257 (an applier following 256 workers),
measured idle on the 2-core VM, 2026-12-07, against 0.4-0.6 µs for the epoll here. An applier wakes for a
message or two at a time under a steady load, so that poll was most of its cost per message. Rejected:
edge-triggered registration, which saves nothing (reading the socket clears the descriptor anyway) and
would lose a socket whose notice came while it was out of the epoll.
"""

from __future__ import annotations

import select

import zmq

__all__ = ["Wakes"]


class Wakes:
    """The sockets of one applier; made and used by its one thread."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._by_fd: dict[int, zmq.Socket[bytes]] = {}
        self._fds: dict[zmq.Socket[bytes], int] = {}
        self._again: dict[zmq.Socket[bytes], None] = {}
        """Sockets to hand out next round whatever the epoll says, in the order they came (a set keeps none)."""

    def watch(self, socket: zmq.Socket[bytes]) -> None:
        fd = int(socket.getsockopt(zmq.FD))
        self._epoll.register(fd, select.EPOLLIN)
        self._by_fd[fd] = socket
        self._fds[socket] = fd
        self._again[socket] = None

    def unwatch(self, socket: zmq.Socket[bytes]) -> None:
        """Stop watching ``socket``: before it is closed (its descriptor goes with it)."""
        fd = self._fds.pop(socket, None)
        if fd is None:
            return
        self._epoll.unregister(fd)
        del self._by_fd[fd]
        self._again.pop(socket, None)

    def again(self, socket: zmq.Socket[bytes]) -> None:
        """``socket`` was left with messages in it: hand it out next round without a wake."""
        if socket in self._fds:
            self._again[socket] = None

    def poll(self, timeout_ms: float) -> list[zmq.Socket[bytes]]:
        """The sockets to read now: those left over and those whose descriptor is readable, waiting up to
        ``timeout_ms`` for one when none is left over. A socket unwatched while the caller goes through the
        list is still in it: the caller skips what it no longer knows."""
        ready = self._again
        self._again = {}
        by_fd = self._by_fd
        for fd, _ in self._epoll.poll(0 if ready else timeout_ms / 1000):  # hot path
            socket = by_fd.get(fd)
            if socket is not None:
                ready[socket] = None
        return list(ready)

    def close(self) -> None:
        """Close the epoll; the sockets are their owners' to close."""
        self._epoll.close()
        self._by_fd.clear()
        self._fds.clear()
        self._again.clear()
