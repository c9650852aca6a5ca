"""``bench_ingest.py --wire``'s reads during growth: a reader process timing ``find_matches`` against the
index of a running ``kvrouter up``, each read filed by whether a shard's table was growing around it.

The reader is spawned (a fresh interpreter: the benchmark's own process has threads by then) once the
service is up, attaches to its control segment by name (``kvrouter-<pid>-ctl``) and maps each shard's
current table read-only, as a front does. Every ``GAP_S`` it asks for ``probe`` (one sequence's local
hashes) and times the call; a read counts as **during growth** when some shard's table had its dirty word
set (``layout.H_DIRTY``: the writer marks its writes while the table's successor is built,
``index/growth.py``) just before or just after it, else as **steady**. Reads count once the probe shows whole
on its worker; one that shows less after that is counted wrong. The engine maps grow in the writer's own
memory, which no reader sees: a read during a map's growth alone counts as steady.

Issue 33's goal: the p99.9 during growth within 2x the steady p99, and no read over 1 ms on an otherwise
idle machine (the benchmark's sender and the service share its two cores here, so say what ran).
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.connection import Connection
from time import perf_counter_ns, sleep
from typing import Any, Final

from bench_index import percentiles

from kvrouter.events.model import WorkerKey
from kvrouter.index.layout import H_DIRTY, Control, Segment, control_name
from kvrouter.index.reader import IndexReader

GAP_S: Final = 0.0005
"""The pause between two reads: thousands of reads in a steady run, at a few µs of CPU each."""
START_TIMEOUT_S: Final = 60.0
"""How long the reader may take to start (a fresh interpreter loading the reader's kernels)."""


def _read(conn: Connection, control_name: str, probe: list[int], key: WorkerKey) -> None:
    """The reader process: reads until told to stop, then sends its samples."""
    reader = IndexReader(control_name)
    control = Control.attach(control_name)
    tables: list[Segment | None] = [None] * control.shards
    epochs = [-1] * control.shards
    samples: dict[str, list[float]] = {"growth": [], "steady": []}
    shown = False
    wrong = 0

    def growing() -> bool:
        for shard, table in enumerate(tables):
            if control.epoch(shard) != epochs[shard]:  # a successor was published: map it instead
                if table is not None:
                    table.close()
                tables[shard] = None
                with contextlib.suppress(FileNotFoundError):  # replaced again meanwhile: next read
                    tables[shard] = Segment.attach(control.segment_name(shard), writable=False)
                    epochs[shard] = control.epoch(shard)
            table = tables[shard]
            if table is not None and int(table.words[H_DIRTY]):
                return True
        return False

    try:
        reader.find_matches(probe)  # the kernels loaded before any clock
        conn.send("ready")
        while not conn.poll():
            before = growing()
            start = perf_counter_ns()
            depth = reader.find_matches(probe).get(key, 0)
            took = (perf_counter_ns() - start) / 1e3
            during = growing() or before
            if depth == len(probe):
                shown = True
            elif shown:
                wrong += 1
            if shown:
                samples["growth" if during else "steady"].append(took)
            sleep(GAP_S)
        conn.recv()
        conn.send({"samples": samples, "wrong": wrong})
    finally:
        for table in tables:
            if table is not None:
                table.close()
        control.close()
        reader.close()


@contextmanager
def growth_reads(owner_pid: int, probe: Sequence[int], key: WorkerKey) -> Iterator[dict[str, Any]]:
    """A reader process against ``kvrouter up`` ``owner_pid``'s index for the body of the ``with``; the dict
    it yields holds, afterwards, ``read_growth_us`` and ``read_steady_us`` (``bench_index.percentiles``) and
    ``read_wrong``."""
    figures: dict[str, Any] = {}
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    name = control_name(owner_pid)
    process = spawn.Process(target=_read, args=(theirs, name, list(probe), key), name="growth-reads")
    process.start()
    try:
        deadline = perf_counter_ns() + START_TIMEOUT_S * 1e9
        while not ours.poll(0.1) and process.is_alive() and perf_counter_ns() < deadline:
            pass
        if not ours.poll() or ours.recv() != "ready":
            raise SystemExit(f"bench_ingest --wire: the growth reader did not start against {name}")
        yield figures
        ours.send("stop")
        result = ours.recv()
        figures["read_growth_us"] = percentiles(result["samples"]["growth"])
        figures["read_steady_us"] = percentiles(result["samples"]["steady"])
        figures["read_wrong"] = result["wrong"]
    finally:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()
        ours.close()
        theirs.close()


def goals(run: dict[str, Any]) -> dict[str, bool]:
    """Issue 33's read goals for one run's figures."""
    growth, steady = run["read_growth_us"], run["read_steady_us"]
    return {
        "p999_growth_within_2x_steady_p99": growth["p99.9"] <= 2 * steady["p99"],
        "no_read_over_1ms": max(growth["max"], steady["max"]) <= 1000.0,
    }
