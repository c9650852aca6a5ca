"""The mock engines' KV transfer: a prefill engine offers a finished prompt's KV, a decode engine pulls it.

vLLM's disaggregated serving (the NixlConnector) has the prefill engine keep a finished prompt's KV blocks
for the decode engine to read, and answer the prefill hop with ``kv_transfer_params``: where to read them
(``remote_host``, ``remote_port``, ``remote_engine_id``, ``remote_block_ids``). The mock does the same over a
plain TCP socket, so that everything a router's proxy does with the exchange is real: a decode engine
really connects to the address the prefill engine gave, and a prefill engine killed mid-transfer really
breaks the pull.

What travels is a stand-in for the KV: the prompt's block ids, 8 bytes each, paced to the time the real
bytes would take (tokens x ``kv_bytes_per_token`` x 8 / ``gbps``, divided by the mock's speed-up). The
modelled volume itself would exhaust a small machine's memory. The protocol, one pull per connection:

- the decode engine sends one JSON line, ``{"transfer": id}`` (``remote_request_id`` of the parameters);
- the prefill engine answers one JSON line, ``{"ok": true, "blocks": n}`` or ``{"ok": false, "error": ...}``,
  then ``n`` ids as little-endian u64, in chunks spread over the paced time, and closes.

An offer is kept ``hold_secs`` (then it is gone, as vLLM frees blocks no decode engine read in time) and is
served once.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import secrets
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

__all__ = ["TransferFailed", "TransferServer", "pull"]

log = logging.getLogger(__name__)

CHUNKS: Final = 8
"""The stand-in is sent in this many paced chunks: a pull in progress is a pull a kill can break."""
MAX_LINE: Final = 4096


class TransferFailed(Exception):
    """A pull that did not complete: refused, cut, unknown or expired; the message says which."""


@dataclass(slots=True)
class _Offer:
    ids: tuple[int, ...]
    tokens: int
    expires: float


class TransferServer:
    """A prefill engine's KV offers and the socket decode engines pull them from. Owns its socket and thread.

    Args:
        host: the address to bind and to give decode engines.
        port: 0 picks a free one.
        kv_bytes_per_token: the modelled KV size of one token.
        gbps: the modelled link, Gbit/s.
        speedup: the mock's simulated ms per wall ms: a transfer takes its modelled time divided by it.
        hold_secs: how long an offer waits for its pull (wall seconds).
    """

    def __init__(
        self, host: str, port: int, *, kv_bytes_per_token: int, gbps: float, speedup: float, hold_secs: float
    ) -> None:
        self.kv_bytes_per_token = kv_bytes_per_token
        self.gbps = gbps
        self.speedup = speedup
        self.hold_secs = hold_secs
        self._offers: dict[str, _Offer] = {}
        self._lock = threading.Lock()
        self._serving = 0
        self._served = 0
        self._cut = 0
        owner = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                owner._serve(self.rfile, self.connection)

        self._server = socketserver.ThreadingTCPServer((host, port), Handler, bind_and_activate=False)
        self._server.daemon_threads = True
        self._server.allow_reuse_address = True
        try:
            self._server.server_bind()
            self._server.server_activate()
        except BaseException:
            self._server.server_close()
            raise
        self.host = host
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kv-transfer", daemon=True)
        self._thread.start()

    def offer(self, ids: Sequence[int], tokens: int) -> str:
        """Keep a finished prompt's KV (its block ids, ``tokens`` tokens) for one pull; returns its id."""
        transfer = secrets.token_hex(8)
        now = time.monotonic()
        with self._lock:
            for gone in [key for key, offer in self._offers.items() if offer.expires <= now]:
                del self._offers[gone]
            self._offers[transfer] = _Offer(tuple(ids), tokens, now + self.hold_secs)
        return transfer

    def seconds(self, tokens: int) -> float:
        """Wall seconds a transfer of ``tokens`` tokens' KV takes."""
        return tokens * self.kv_bytes_per_token * 8 / (self.gbps * 1e9) / self.speedup

    def status(self) -> dict[str, int]:
        """What ``GET /health`` shows: offers waiting, pulls in progress, pulls served whole and cut. A drill
        kills a prefill engine while ``serving`` is above 0, so that it is killed mid-transfer."""
        with self._lock:
            return {"offered": len(self._offers), "serving": self._serving, "served": self._served, "cut": self._cut}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def _take(self, transfer: str) -> _Offer | None:
        with self._lock:
            offer = self._offers.pop(transfer, None)
        if offer is None or offer.expires <= time.monotonic():
            return None
        return offer

    def _serve(self, rfile: io.BufferedIOBase, sock: socket.socket) -> None:
        try:
            transfer = str(json.loads(rfile.readline(MAX_LINE))["transfer"])
        except (ValueError, KeyError, TypeError, OSError) as exc:
            with contextlib.suppress(OSError):
                sock.sendall(json.dumps({"ok": False, "error": f"bad pull request: {exc}"}).encode() + b"\n")
            return
        offer = self._take(transfer)
        if offer is None:
            refusal = {"ok": False, "error": f"no KV offered as {transfer!r} (expired, or pulled already)"}
            with contextlib.suppress(OSError):
                sock.sendall(json.dumps(refusal).encode() + b"\n")
            return
        payload = struct.pack(f"<{len(offer.ids)}Q", *offer.ids)
        pause = self.seconds(offer.tokens) / CHUNKS
        with self._lock:
            self._serving += 1
        whole = False
        try:
            sock.sendall(json.dumps({"ok": True, "blocks": len(offer.ids)}).encode() + b"\n")
            size = -(-len(payload) // CHUNKS) or 1
            for start in range(0, max(len(payload), 1), size):
                time.sleep(pause)
                sock.sendall(payload[start : start + size])
            whole = True
        except OSError as exc:  # the decode engine went away: its pull fails on its side
            log.info("kv transfer cut transfer=%s error=%r", transfer, exc)
        finally:
            with self._lock:
                self._serving -= 1
                if whole:
                    self._served += 1
                else:
                    self._cut += 1


def pull(host: str, port: int, transfer: str, *, timeout: float) -> list[int]:
    """Read an offered prompt's block ids from a prefill engine.

    Raises:
        TransferFailed: the connection was refused or cut, the offer is unknown or expired, or the
            answer was malformed.
    """
    where = f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(json.dumps({"transfer": transfer}).encode() + b"\n")
            stream = sock.makefile("rb")
            header = json.loads(stream.readline(MAX_LINE) or b"null")
            if not isinstance(header, dict):
                raise TransferFailed(f"KV pull from {where}: the prefill engine closed the connection")
            if not header.get("ok"):
                raise TransferFailed(f"KV pull from {where}: {header.get('error', 'refused')}")
            count = int(header["blocks"])
            data = stream.read(count * 8)
            if len(data) != count * 8:
                raise TransferFailed(f"KV pull from {where}: cut after {len(data)} of {count * 8} bytes")
            return list(struct.unpack(f"<{count}Q", data))
    except TransferFailed:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TransferFailed(f"KV pull from {where} failed: {exc}") from exc
