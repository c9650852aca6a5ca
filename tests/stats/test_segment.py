"""The stats segment (``kvrouter/stats/segment.py``): a blob copied out whole or not at all.

No service here: a :class:`StatsWriter` in this process (or a writer process, for the race) and a
:class:`StatsReader`. The reader must never hand back a torn blob: it retries while the writer is
mid-write, raises a clear :class:`StatsError` for a writer that stays mid-write, a blob that fails its
checksum or does not decode, and a segment of another layout. Every segment is unlinked, also on failure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

from kvrouter.errors import StatsError
from kvrouter.index.layout import SHM_DIR, Control, unlink_segment
from kvrouter.service.process.stats import pack_blob, pack_loads
from kvrouter.stats.segment import (
    DATA_OFFSET,
    M_CRC,
    M_LENGTH,
    M_SEQ,
    STATS_VERSION,
    StatsReader,
    StatsWriter,
    percentiles,
)
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(60)


def segment_name() -> str:
    """Unique, under this process's ``kvrouter-<pid>-`` prefix (the leftover checks see it), and outside the
    sweep's patterns (no engine removes it under the test)."""
    return f"kvrouter-{os.getpid()}-t{uuid.uuid4().hex[:8]}-stats"


def blob(**fields: object) -> bytes:
    packed: bytes = msgpack.packb({"version": STATS_VERSION, **fields}, use_bin_type=True)
    return packed


@pytest.fixture
def writer() -> Iterator[StatsWriter]:
    w = StatsWriter(segment_name(), capacity=4096)
    try:
        yield w
    finally:
        w.close()
    assert not os.path.exists(f"{SHM_DIR}/{w.name}")


@pytest.fixture
def reader(writer: StatsWriter) -> Iterator[StatsReader]:
    r = StatsReader(writer.name)
    try:
        yield r
    finally:
        r.close()


def test_a_blob_written_is_read_back(writer: StatsWriter, reader: StatsReader):
    writer.write(blob(n=1, name="first"))
    assert reader.read() == {"version": STATS_VERSION, "n": 1, "name": "first"}
    writer.write(blob(n=2))  # shorter: the length, not the old bytes, bounds the copy
    assert reader.read() == {"version": STATS_VERSION, "n": 2}
    assert reader.published_ns() > 0
    with pytest.raises(StatsError, match="exceeds 4096"):
        writer.write(b"x" * 5000)


def test_nothing_published_yet_is_an_error(writer: StatsWriter, reader: StatsReader):
    with pytest.raises(StatsError, match="nothing published yet"):
        reader.read()


def test_a_writer_mid_write_is_waited_for_then_reported(writer: StatsWriter, reader: StatsReader):
    writer.write(blob(n=1))
    words = writer._segment.words
    words[M_SEQ] += 1  # odd: as a writer stopped mid-write
    with pytest.raises(StatsError, match="mid-write"):
        reader.read(timeout=0.05)
    assert reader.retries > 0
    words[M_SEQ] += 1  # the write completes
    assert reader.read()["n"] == 1


def test_a_corrupt_or_truncated_blob_is_an_error(writer: StatsWriter, reader: StatsReader):
    writer.write(blob(n=1, pad="x" * 100))
    segment = writer._segment
    segment.mapping[DATA_OFFSET + 20] ^= 0xFF  # flipped under a stable, even seq
    with pytest.raises(StatsError, match="checksum"):
        reader.read()
    writer.write(blob(n=1, pad="x" * 100))
    segment.words[M_LENGTH] = int(segment.words[M_LENGTH]) - 10  # truncated
    with pytest.raises(StatsError, match="checksum"):
        reader.read()
    segment.words[M_LENGTH] = 1 << 40
    with pytest.raises(StatsError, match="exceeds capacity"):
        reader.read()
    writer.write(b"\xc1 not msgpack")  # checksummed, but not a blob
    with pytest.raises(StatsError, match="does not decode"):
        reader.read()
    writer.write(msgpack.packb({"version": 99}))
    with pytest.raises(StatsError, match="not a version 1"):
        reader.read()
    assert int(segment.words[M_CRC]) != 0


def test_a_segment_of_another_layout_is_refused():
    control = Control.create(segment_name(), shards=1)  # a real kvrouter segment, the wrong one
    short = segment_name()
    try:
        with pytest.raises(StatsError, match="not a kvrouter stats segment"):
            StatsReader(control.name)
        with open(f"{SHM_DIR}/{short}", "wb") as fh:
            fh.write(b"kvrstats")
        with pytest.raises(StatsError, match="shorter than its 64-byte header"):
            StatsReader(short)
        with pytest.raises(FileNotFoundError):
            StatsReader(segment_name())
    finally:
        control.close()
        control.unlink()
        unlink_segment(short)


WRITER = """
import signal, sys, msgpack
from kvrouter.stats.segment import StatsWriter
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
writer = StatsWriter(sys.argv[1], capacity=1 << 16)
try:
    i = 0
    writer.write(msgpack.packb({"version": 1, "n": 0, "pad": bytes(1000)}))
    print("ready", flush=True)
    while True:  # blobs of changing length, each all one byte value: a torn copy would mix two
        i += 1
        writer.write(msgpack.packb({"version": 1, "n": i, "pad": bytes([i % 251]) * (1000 + (i % 7) * 3000)}))
finally:
    writer.close()
"""


def test_torn_reads_never_escape_a_racing_writer():
    """A writer process rewrites the blob as fast as it can; every read is one whole blob, in order."""
    name = segment_name()
    proc = subprocess.Popen([sys.executable, "-c", WRITER, name], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    reader: StatsReader | None = None
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        reader = StatsReader(name)
        last, reads = -1, 0
        deadline = time.monotonic() + 30.0
        # 3,000 reads at least, and on until the writer has written a few hundred blobs: on a loaded machine
        # the reads can all run before the writer gets a core (a full run caught it)
        while reads < 3000 or (last < 300 and time.monotonic() < deadline):
            value = reader.read()
            n, pad = value["n"], value["pad"]
            assert pad == bytes([n % 251]) * len(pad)  # never a mix of two blobs
            assert len(pad) == (1000 if n == 0 else 1000 + (n % 7) * 3000)
            assert n >= last  # never an older blob after a newer one
            last, reads = n, reads + 1
        assert last >= 300, "the writer never got to write"
        print(f"reads retried: {reader.retries}")  # a race: how many is the scheduler's business
    finally:
        if reader is not None:
            reader.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{SHM_DIR}/{name}")
    assert not os.path.exists(f"{SHM_DIR}/{name}")


def test_percentiles_are_nearest_rank():
    assert percentiles([], 0.5, 0.99) == [None, None]
    assert percentiles([3.0, 1.0, 2.0], 0.5, 0.99) == [2.0, 3.0]
    assert percentiles([float(i) for i in range(101)], 0.5, 0.99) == [50.0, 99.0]


def test_a_blob_with_its_loads_packed_apart_is_the_blob_packed_whole():
    """The publisher packs ``loads`` a slice at a time and splices them in: the bytes must be msgpack's own
    for the whole map, whatever the entries and wherever ``loads`` sits."""
    loads: list[dict[str, Any]] = [
        {"worker_id": w, "dp_rank": 0, "accuracy": None if w % 2 else 0.5, "problems": {}} for w in range(300)
    ]
    for body in (
        {"version": 1, "loads": None, "events": [{"kind": "gaps_detected"}], "trimmed": False},
        {"loads": None},
        {"version": 1, "url": "http://127.0.0.1:8490", "loads": None},
    ):
        for entries in (loads, loads[:1], []):
            expected = msgpack.packb({**body, "loads": entries}, use_bin_type=True)
            assert pack_blob(body, pack_loads(entries)) == expected
