"""``FastPathRelay``: with ``--fronts N``, the one ZMQ fast-path endpoint, served by every front.

Front 0 binds the public ROUTER socket (``--zmq-port``) and a DEALER on an ``ipc://`` endpoint in the
fronts' private directory; every front, front 0's included, connects a DEALER of its own there
(``edges/fastpath.py`` with ``relay``). ``zmq.proxy`` moves each message from the ROUTER to the DEALER,
which deals them to the fronts in turn, and each reply back to the client it names: in libzmq's own
thread-free loop on one thread of front 0, so no Python runs per message on the way (about 20 µs of
latency, two local hops). A client sees one endpoint; ``"id"``s and REQ/DEALER envelopes pass through
untouched, since the ROUTER's identity frame travels with the message.

Rejected: front 0 reading and re-sending each message in Python (its loop would pay for every front's
traffic); a port per front (clients would need to know them); ``SO_REUSEPORT`` (libzmq does not bind with
it). The relay deals in turn rather than to the least busy front: a DEALER does not know which is free, and
a busy front's messages queue behind its current one (the tail, as for HTTP connections).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Final

import zmq

from ..edges.fastpath import FRAME_SLACK

__all__ = ["FastPathRelay"]

log = logging.getLogger(__name__)

TERMINATE: Final = b"TERMINATE"
"""``zmq.proxy_steerable``'s command that ends the proxy."""


class FastPathRelay:
    """Front 0's relay: :meth:`start` binds both sockets and runs the proxy on a thread, :meth:`close` ends
    it and closes everything (LINGER 0)."""

    def __init__(self, host: str, port: int, backend: str, max_body_bytes: int) -> None:
        self.host = host
        self.port = port
        self.backend = backend
        """Where the fronts' DEALERs connect (``ipc://``)."""
        self.max_body_bytes = max_body_bytes
        self.endpoint = ""
        """The public ``tcp://host:port`` once bound."""
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._control: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind and start relaying.

        Raises:
            zmq.ZMQError: the address is taken or not local.
        """
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        frontend = context.socket(zmq.ROUTER)
        backend = context.socket(zmq.DEALER)
        command = context.socket(zmq.PAIR)
        control = context.socket(zmq.PAIR)
        sockets = (frontend, backend, command, control)
        try:
            for sock in sockets:
                sock.setsockopt(zmq.LINGER, 0)
            frontend.setsockopt(zmq.MAXMSGSIZE, self.max_body_bytes + FRAME_SLACK)
            frontend.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a reply to a peer that left is dropped
            host = self.host
            if ":" in host.strip("[]"):
                frontend.setsockopt(zmq.IPV6, 1)
                host = f"[{host.strip('[]')}]"
            frontend.bind(f"tcp://{host}:{self.port or '*'}")
            self.endpoint = frontend.getsockopt_string(zmq.LAST_ENDPOINT)
            backend.bind(self.backend)
            address = f"inproc://kvrouter-fastpath-relay-{id(self)}"
            command.bind(address)
            control.connect(address)
        except BaseException:
            for sock in sockets:
                sock.close(linger=0)
            context.term()
            raise
        self._context, self._control = context, control

        def relay() -> None:
            try:
                zmq.proxy_steerable(frontend, backend, None, command)
            except zmq.ZMQError as exc:
                if exc.errno != zmq.ETERM:
                    log.error("fastpath relay stopped errno=%s", exc.errno)
            finally:
                for sock in (frontend, backend, command):
                    sock.close(linger=0)

        self._thread = threading.Thread(target=relay, name="kvrouter-fastpath-relay", daemon=True)
        self._thread.start()
        log.info("fastpath relay listening endpoint=%s backend=%s", self.endpoint, self.backend)

    def close(self) -> None:
        """Stop the proxy, close every socket, end the context. Idempotent."""
        control, self._control = self._control, None
        if control is not None:
            with contextlib.suppress(zmq.ZMQError):
                control.send(TERMINATE)
            control.close(linger=0)
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(5.0)
        context, self._context = self._context, None
        if context is not None:
            context.term()
