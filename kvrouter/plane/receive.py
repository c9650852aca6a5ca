"""The applier's receive: a drain of one SUB socket into the batch path's buffers, in one compiled call.

Rules:

- A message of three frames, ``[topic, seq (8 bytes, big-endian), payload]``, whose topic is the stream's
  and whose payload is at most ``max_message_bytes``, is *plain*: its payload is appended to
  ``RunBuffers.buf`` (its bounds in ``bounds``) and its sequence number goes to ``seqs``.
- Any other message is *odd*: its frames are kept as they came, for the stream's checks to name what is wrong
  (``Stream._live``), and its payload in ``buf`` is empty with the sequence number ``NO_ID``, as the batch
  path expects of a message it must leave to the stream.
- Nothing received is lost: an array that a frame does not fit grows before the copy.

Why: pyzmq's ``recv_multipart`` costs 4-5 µs for a three-frame message on this machine (three frame
objects, three ``getsockopt(RCVMORE)`` calls), and the shape check and ``b"".join`` after it 1-2 µs more;
in a burst from 16 publishers that was 15-20 % of the applier's time. The compiled loop calls libzmq's
``zmq_msg_recv`` and copies each payload once, straight into the buffer the decoder reads: 0.6-1.2 µs a
message in drains of 256, against 4.6-6.8 through pyzmq (``tools/receive_cost.py``).

How: the library is pyzmq's own copy, the one already mapped in this process (its sockets are that copy's
objects; another copy of libzmq would not know them). Its entry points, and libc's ``memcpy`` and ``memcmp``,
are given to LLVM by name (``llvmlite.binding.add_symbol``), so the loop is cached on disk like every other
kernel and needs no C compiler at install. Where pyzmq's libzmq is not a library of its own in the process (a
static build), :class:`Receiver` fills the same buffers through ``recv_multipart``; the tests hold the two
equal. Rejected: cffi (it compiles C at install); ``zmq_recv`` into a fixed buffer (it cuts a longer frame
short, and says so only after the bytes are gone); ctypes calls from Python (a call costs about 1 µs, what
pyzmq's own calls cost).
"""

from __future__ import annotations

import ctypes
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Final

import llvmlite.binding as llvm
import numpy as np
import numpy.typing as npt
import zmq
from numba import types
from numba.core.typing.templates import Signature

from .._jit import inlined, kernel
from ..events.codecs.runs import RunBuffers
from ..index.layout import NO_ID

__all__ = ["Drain", "Receiver", "compiled", "warm"]

log = logging.getLogger(__name__)

_DONTWAIT: Final = 1  # ZMQ_DONTWAIT
_MSG_WORDS: Final = 8  # zmq_msg_t: 64 bytes, pointer-aligned
_INITIAL_BYTES: Final = 1 << 20
_INITIAL_ODD_BYTES: Final = 1 << 12
_KEEP_BYTES: Final = 16 << 20
"""A buffer grown past this by one drain (an oversized frame) is given back before the next."""

# the counts the compiled drain writes
_N: Final = 0  # messages received
_ODD: Final = 1  # odd messages
_FRAMES: Final = 2  # frames kept for odd messages
_ODD_BYTES: Final = 3  # bytes of them
_LONGEST: Final = 4  # the longest plain payload
_COUNTS: Final = 5

_SYMBOLS: Final = ("zmq_msg_init", "zmq_msg_recv", "zmq_msg_data", "zmq_msg_size", "zmq_msg_more", "zmq_msg_close")


def _mapped_libzmq() -> str | None:
    """The path of the libzmq this process has mapped (pyzmq's), if it is a library of its own."""
    with open("/proc/self/maps") as fh:
        paths = set(re.findall(r"\S*/libzmq[^/\s]*\.so[^/\s]*", fh.read()))
    return paths.pop() if len(paths) == 1 else None


def _bind() -> bool:
    """Give LLVM libzmq's and libc's entry points; False when pyzmq's libzmq cannot be found."""
    try:
        path = _mapped_libzmq()
    except OSError:
        return False
    if path is None:
        return False
    lib, libc = ctypes.CDLL(path), ctypes.CDLL(None)
    for name in _SYMBOLS:
        llvm.add_symbol(f"kvrouter_{name}", ctypes.cast(getattr(lib, name), ctypes.c_void_p).value)
    for name in ("memcpy", "memcmp"):
        llvm.add_symbol(f"kvrouter_{name}", ctypes.cast(getattr(libc, name), ctypes.c_void_p).value)
    return True


compiled: Final = _bind()
"""Whether drains go through the compiled loop (pyzmq's libzmq found), else through ``recv_multipart``."""

_P = types.uintp  # an address: the loop passes pointers as integers


def _external(name: str, signature: Signature) -> Any:
    """The entry point ``_bind`` gave LLVM as ``kvrouter_<name>``, callable from compiled code."""
    return types.ExternalFunction(f"kvrouter_{name}", signature)


_msg_init = _external("zmq_msg_init", types.intc(_P))
_msg_recv = _external("zmq_msg_recv", types.intc(_P, _P, types.intc))
_msg_data = _external("zmq_msg_data", _P(_P))
_msg_size = _external("zmq_msg_size", _P(_P))
_msg_more = _external("zmq_msg_more", types.intc(_P))
_msg_close = _external("zmq_msg_close", types.intc(_P))
_memcpy = _external("memcpy", _P(_P, _P, _P))
_memcmp = _external("memcmp", types.intc(_P, _P, _P))


@inlined
def _grown(buf: npt.NDArray[np.uint8], used: int, need: int) -> npt.NDArray[np.uint8]:
    """``buf`` with room for ``need`` bytes past ``used``: itself, or a copy twice as large or more."""
    if used + need <= buf.size:
        return buf
    bigger = np.empty(max(2 * buf.size, used + need), dtype=np.uint8)
    bigger[:used] = buf[:used]
    return bigger


@kernel
def _keep_odd(
    odd: npt.NDArray[np.uint8],
    frames: npt.NDArray[np.int64],
    counts: npt.NDArray[np.int64],
    address: int,
    size: int,
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    """Append ``size`` bytes at ``address`` to the odd messages' frames."""
    used, k = counts[_ODD_BYTES], counts[_FRAMES]
    odd = _grown(odd, used, size)
    if k == frames.shape[0]:
        more = np.empty((2 * k, 2), dtype=np.int64)
        more[:k] = frames[:k]
        frames = more
    if size:
        _memcpy(odd.ctypes.data + used, address, size)
    frames[k, 0] = used
    frames[k, 1] = size
    counts[_FRAMES] = k + 1
    counts[_ODD_BYTES] = used + size
    return odd, frames


@inlined
def _keep_first(
    odd: npt.NDArray[np.uint8],
    frames: npt.NDArray[np.int64],
    counts: npt.NDArray[np.int64],
    n: int,
    topic: npt.NDArray[np.uint8],
    seq: np.uint64,
    scratch: npt.NDArray[np.uint8],
    buf: npt.NDArray[np.uint8],
    start: int,
    used: int,
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    """The first ``n`` frames of a message found odd after them, kept as they came: the topic they matched,
    the sequence number's 8 bytes, the payload copied to ``buf[start:used]``."""
    if n >= 1:
        odd, frames = _keep_odd(odd, frames, counts, topic.ctypes.data, topic.size)
    if n >= 2:
        for i in range(8):
            scratch[i] = np.uint8((seq >> np.uint64(8 * (7 - i))) & np.uint64(0xFF))
        odd, frames = _keep_odd(odd, frames, counts, scratch.ctypes.data, 8)
    if n >= 3:
        odd, frames = _keep_odd(odd, frames, counts, buf.ctypes.data + start, used - start)
    return odd, frames


@kernel
def _drain(
    sock: int,
    msg: npt.NDArray[np.uint64],
    limit: int,
    topic: npt.NDArray[np.uint8],
    max_bytes: int,
    buf: npt.NDArray[np.uint8],
    bounds: npt.NDArray[np.int64],
    seqs: npt.NDArray[np.uint64],
    odd: npt.NDArray[np.uint8],
    frames: npt.NDArray[np.int64],
    odd_messages: npt.NDArray[np.int64],
    counts: npt.NDArray[np.int64],
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    """Receive up to ``limit`` messages from ``sock`` without waiting (the module's rules). Returns the
    payload buffer, the odd frames' bytes and their (start, size) rows, each grown or as given;
    ``odd_messages`` rows are (message, its first row in ``frames``)."""
    address = msg.ctypes.data
    scratch = np.zeros(8, dtype=np.uint8)
    for c in range(_COUNTS):
        counts[c] = 0
    bounds[0] = 0
    _msg_init(address)
    m = 0
    while m < limit:
        start = bounds[m]
        used = start
        seq = np.uint64(0)
        n = 0  # frames of this message so far
        plain = True
        first_frame = counts[_FRAMES]
        while True:
            if _msg_recv(address, sock, _DONTWAIT) < 0:  # nothing waiting (a message comes whole, or not)
                _msg_close(address)
                counts[_N] = m
                return buf, odd, frames
            size = int(_msg_size(address))
            data = _msg_data(address)
            if plain:
                if n == 0:
                    plain = size == topic.size and (size == 0 or _memcmp(data, topic.ctypes.data, size) == 0)
                elif n == 1:
                    plain = size == 8
                    if plain:
                        _memcpy(scratch.ctypes.data, data, 8)
                        for i in range(8):
                            seq = (seq << np.uint64(8)) | np.uint64(scratch[i])
                elif n == 2:
                    plain = size <= max_bytes
                    if plain:
                        buf = _grown(buf, used, size)
                        if size:
                            _memcpy(buf.ctypes.data + used, data, size)
                        used += size
                else:
                    plain = False
                if not plain:  # the frames before this one, as they came
                    odd, frames = _keep_first(odd, frames, counts, n, topic, seq, scratch, buf, start, used)
                    used = start
            if not plain:
                odd, frames = _keep_odd(odd, frames, counts, data, size)
            n += 1
            if not _msg_more(address):
                break
        if plain and n != 3:  # too few frames: kept as they came
            plain = False
            odd, frames = _keep_first(odd, frames, counts, n, topic, seq, scratch, buf, start, used)
        if plain:
            seqs[m] = seq
            counts[_LONGEST] = max(counts[_LONGEST], used - start)
        else:
            seqs[m] = np.uint64(NO_ID)
            j = counts[_ODD]
            odd_messages[j, 0] = m
            odd_messages[j, 1] = first_frame
            counts[_ODD] = j + 1
        bounds[m + 1] = used
        m += 1
    _msg_close(address)
    counts[_N] = m
    return buf, odd, frames


@dataclass
class Drain:
    """What one drain of a stream's socket received: ``count`` messages, in order. The plain ones are in
    ``buffers`` (payloads joined in ``buf`` with their ``bounds``, and ``seqs``), ready for the batch path;
    ``odd`` holds the frames of every other message, by its place in the drain."""

    count: int
    topic: bytes
    buffers: RunBuffers
    odd: dict[int, list[bytes]] = field(default_factory=dict)

    @classmethod
    def of(cls, messages: list[list[bytes]], topic: bytes, buffers: RunBuffers, max_bytes: int) -> Drain:
        """The drain of ``messages`` received by other means, by the same rules."""
        drain = cls(len(messages), topic, buffers)
        payloads: list[bytes] = []
        seqs: list[int] = []
        for m, frames in enumerate(messages):
            if len(frames) == 3 and frames[0] == topic and len(frames[1]) == 8 and len(frames[2]) <= max_bytes:
                payloads.append(frames[2])
                seqs.append(int.from_bytes(frames[1], "big"))
            else:
                drain.odd[m] = frames
                payloads.append(b"")
                seqs.append(NO_ID)
        buffers.load(payloads, seqs, tokens=True)
        return drain

    def frames(self, m: int) -> list[bytes]:
        """Message ``m`` as it came: its frames."""
        frames = self.odd.get(m)
        if frames is not None:
            return frames
        b = self.buffers
        payload = b.buf[int(b.bounds[m]) : int(b.bounds[m + 1])].tobytes()
        return [self.topic, int(b.seqs[m]).to_bytes(8, "big"), payload]


class Receiver:
    """One applier's receive, into its :class:`RunBuffers` (one drain at a time, each read before the next).

    Args:
        buffers: the applier's.
        compiled_loop: drain through the compiled loop; False: through ``recv_multipart`` (where libzmq
            was not found, and in the tests that hold the two equal).
    """

    def __init__(self, buffers: RunBuffers, *, compiled_loop: bool = compiled) -> None:
        self.buffers = buffers
        self._compiled = compiled_loop
        self._msg = np.zeros(_MSG_WORDS, dtype=np.uint64)
        self._odd = np.empty(_INITIAL_ODD_BYTES, dtype=np.uint8)
        self._frames = np.empty((64, 2), dtype=np.int64)
        self._odd_messages = np.empty((0, 2), dtype=np.int64)
        self._counts = np.zeros(_COUNTS, dtype=np.int64)
        self._bounds = np.zeros(1, dtype=np.int64)
        self._seqs = np.empty(0, dtype=np.uint64)
        """The drain's full arrays; ``buffers`` gets views of the messages received (the decoders count
        messages by ``bounds``)."""
        self._topics: dict[bytes, npt.NDArray[np.uint8]] = {}

    def drain(self, socket: zmq.Socket[bytes], limit: int, topic: bytes, max_bytes: int) -> Drain:
        """Take up to ``limit`` messages waiting on ``socket``, without blocking."""
        if not self._compiled:
            return self._drain_in_python(socket, limit, topic, max_bytes)
        return self._drain_at(socket.underlying, limit, topic, max_bytes)

    def _drain_at(self, address: int, limit: int, topic: bytes, max_bytes: int) -> Drain:
        """The compiled drain of the libzmq socket at ``address`` (0, a closed socket: nothing)."""
        b = self.buffers
        if b.buf.size > _KEEP_BYTES:
            b.buf = np.empty(_INITIAL_BYTES, dtype=np.uint8)
        if self._odd.size > _KEEP_BYTES:
            self._odd = np.empty(_INITIAL_ODD_BYTES, dtype=np.uint8)
        if self._seqs.size < limit:
            self._seqs = np.empty(limit, dtype=np.uint64)
            self._bounds = np.zeros(limit + 1, dtype=np.int64)
            self._odd_messages = np.empty((limit, 2), dtype=np.int64)
        if b.stamps.size < limit:
            b.stamps = np.empty(limit, dtype=np.float64)
        wanted = self._topics.get(topic)
        if wanted is None:
            wanted = self._topics[topic] = np.frombuffer(topic, dtype=np.uint8).copy()
        counts = self._counts
        b.buf, self._odd, self._frames = _drain(
            address,
            self._msg,
            limit,
            wanted,
            max_bytes,
            b.buf,
            self._bounds,
            self._seqs,
            self._odd,
            self._frames,
            self._odd_messages,
            counts,
        )
        n = int(counts[_N])
        b.bounds, b.seqs = self._bounds[: n + 1], self._seqs[:n]
        drain = Drain(n, topic, b)
        if counts[_LONGEST] > b.tokens.size:  # a token takes a byte or more of its message
            b.tokens = np.empty(2 * int(counts[_LONGEST]), dtype=np.uint32)
        odd_count = int(counts[_ODD])
        if odd_count:
            rows, odd = self._frames[: counts[_FRAMES]], self._odd
            for j in range(odd_count):
                m, first = (int(x) for x in self._odd_messages[j])
                end = int(self._odd_messages[j + 1, 1]) if j + 1 < odd_count else len(rows)
                drain.odd[m] = [odd[s : s + n].tobytes() for s, n in rows[first:end]]
        return drain

    def _drain_in_python(self, socket: zmq.Socket[bytes], limit: int, topic: bytes, max_bytes: int) -> Drain:
        messages: list[list[bytes]] = []
        for _ in range(limit):
            try:
                messages.append(socket.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        return Drain.of(messages, topic, self.buffers, max_bytes)


def warm() -> None:
    """Compile (or load from the cache) the drain loop with the types an applier calls it with, on no
    socket, which libzmq refuses at once: for the fork server, which makes no socket."""
    if compiled:
        Receiver(RunBuffers())._drain_at(0, 1, b"kv", 1)
