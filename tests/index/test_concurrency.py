"""Readers against a writer running flat out in another process.

1. The seqlock itself: a writer process rewrites every mask word of 64 hot slots in each version window
   (W = 256 workers, 4 words a tier), each word encoding (key, generation); a reader attached read-only
   checks through the library's own seqlocked lookup that every read shows one generation in all its
   words. At least 10 million slot reads per run; one torn read fails the test.
2. The real writer: a ``ShardWriter`` process churns, grows the table and clears a worker while the test
   process queries through ``IndexReader``; every answer must be one the index could have held.
3. Worker rows reused under a reader: a writer process keeps giving one row to a worker that stores a
   chain and, once it is forgotten, to one that never stores anything; no answer ever names the latter,
   neither ``find_matches`` nor ``overlaps`` (through the reader's cached bit -> slot map).
4. A writer that died mid-write: the reader checks the shard's writer, gives up at once and reports the
   shard recovering; a live writer that sits mid-write is waited for.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import numpy.typing as npt
import pytest
from numba import njit

from kvrouter.engine import read_shards
from kvrouter.events.model import EngineHash, LocalHash, Removed, Stored, StoredBlock
from kvrouter.index import _kernels as kernels
from kvrouter.index.dense import WorkerSlots
from kvrouter.index.layout import (
    H_CAPACITY,
    H_NWORDS,
    H_TIERS,
    HEADER_WORDS,
    MIN_CAPACITY,
    SLOT_MASKS,
    SLOT_VERSION,
    STATUS_UP,
    TIERS,
    W_STATE,
    WORKER_EXACT,
    Control,
    Segment,
    control_name,
    row_words,
    shard_words,
)
from kvrouter.index.reader import IndexReader
from kvrouter.index.writer import ShardWriter
from kvrouter.routing import Router
from tests.index.shm import remove_left_shard

HOT_SLOTS = 64
NWORDS = 4
CAPACITY = 1024
SLOT_READS = 10_000_000
STOP_WORD = 7
"""The spare shard-header word the parent sets to stop the writer."""
FORK = multiprocessing.get_context("fork")
_names = itertools.count()


def _unique_name() -> str:
    return f"kvrouter-{os.getpid()}-test-{next(_names)}"


@njit(cache=True)
def _pattern(key: np.uint64, word: int) -> np.uint64:
    return (key * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(word * 0x1000193)


@njit(cache=True)
def _flip_until_stopped(table: npt.NDArray[np.uint64], keys: npt.NDArray[np.uint64]) -> int:
    """Rewrite every mask word of every hot slot with the next generation, seqlocked, until stopped."""
    width = SLOT_MASKS + TIERS * NWORDS
    generation = np.uint64(0)
    while kernels._load(table, STOP_WORD) == 0:
        generation += np.uint64(1)
        for i in range(keys.size):
            base = HEADER_WORDS + kernels._i64(keys[i] & np.uint64(CAPACITY - 1)) * width
            version = table[base + SLOT_VERSION]
            kernels._store(table, base + SLOT_VERSION, version + np.uint64(1))
            kernels._fence()
            for w in range(TIERS * NWORDS):
                kernels._store(table, base + SLOT_MASKS + w, _pattern(keys[i], w % NWORDS) ^ generation)
            kernels._fence()
            kernels._store(table, base + SLOT_VERSION, version + np.uint64(2))
    return kernels._i64(generation)


@njit(cache=True)
def _check_reads(table: npt.NDArray[np.uint64], keys: npt.NDArray[np.uint64], reads: int) -> tuple[int, int, int, int]:
    """(consistent reads, torn reads, failed lookups, reads that saw a new generation since the last)."""
    masks = np.empty(NWORDS, dtype=np.uint64)
    good = torn = failed = changed = 0
    last = np.zeros(keys.size, dtype=np.uint64)
    while good + torn + failed < reads:
        for i in range(keys.size):
            status = kernels.lookup(table, keys[i], 1, masks)
            while status < 0:  # the writer sat mid-write for STUCK_SPINS reads: it lives, read again
                status = kernels.lookup(table, keys[i], 1, masks)
            if status != 1:
                failed += 1
                continue
            generation = masks[0] ^ _pattern(keys[i], 0)
            consistent = True
            for w in range(1, NWORDS):
                if masks[w] ^ _pattern(keys[i], w) != generation:
                    consistent = False
            if consistent:
                good += 1
                if generation != last[i]:
                    changed += 1
                    last[i] = generation
            else:
                torn += 1
    return good, torn, failed, changed


@pytest.fixture
def hot_table() -> Iterator[tuple[Segment, npt.NDArray[np.uint64]]]:
    """A shard segment with 64 hot keys, one per home slot, all masks at generation 0."""
    segment = Segment.create(_unique_name(), shard_words(CAPACITY, NWORDS, TIERS))
    try:
        words = segment.words
        words[H_CAPACITY], words[H_NWORDS], words[H_TIERS] = CAPACITY, NWORDS, TIERS
        keys = np.arange(1, HOT_SLOTS + 1, dtype=np.uint64)
        width = SLOT_MASKS + TIERS * NWORDS
        for key in keys:
            base = HEADER_WORDS + int(key) * width
            words[base] = key
            for w in range(TIERS * NWORDS):
                words[base + SLOT_MASKS + w] = _pattern(key, w % NWORDS)
        yield segment, keys
    finally:
        segment.close()
        os.unlink(f"/dev/shm/{segment.name}")


@pytest.mark.timeout(120)
def test_no_torn_slot_in_ten_million_reads(
    hot_table: tuple[Segment, npt.NDArray[np.uint64]], wait_until: Callable[..., None]
):
    segment, keys = hot_table
    reader = Segment.attach(segment.name, writable=False)
    _check_reads(reader.words, keys[:1], 1)  # compile both sides here, so the fork starts writing at once
    segment.words[STOP_WORD] = 1
    _flip_until_stopped(segment.words, keys)
    segment.words[STOP_WORD] = 0
    version_word = HEADER_WORDS + int(keys[0]) * (SLOT_MASKS + TIERS * NWORDS) + SLOT_VERSION
    first = int(reader.words[version_word])
    writer = FORK.Process(target=_flip_until_stopped, args=(segment.words, keys))
    writer.start()
    try:
        wait_until(lambda: int(reader.words[version_word]) > first, what="the writer's first generation")
        good, torn, failed, changed = _check_reads(reader.words, keys, SLOT_READS)
    finally:
        segment.words[STOP_WORD] = 1
        writer.join(timeout=30)
        reader.close()
    assert writer.exitcode == 0
    assert (torn, failed) == (0, 0)
    assert good >= SLOT_READS
    assert changed > 1000, "the writer hardly ran: the reads proved nothing"


def _churn(control_name_: str, owner: int, rounds: int) -> None:
    """Writer process: worker 1 holds chain A throughout; worker 2 stores and removes chain A over and
    over; worker 3 adds new documents until the table has grown several times, then is cleared."""
    control = Control.attach(control_name_, writable=True)
    control.set_pid(0, os.getpid())  # as an applier does: a reader that meets a slot mid-write waits for a live writer
    writer = ShardWriter(control, 0, owner, capacity=MIN_CAPACITY)
    chain = tuple(StoredBlock(EngineHash(100 + i), LocalHash(i + 1)) for i in range(32))
    writer.apply(Stored(1, None, chain))
    control.set_flushed(0, 1)
    for round_ in range(rounds):
        writer.apply(Stored(2, None, chain))
        writer.apply(Removed(2, tuple(b.engine_hash for b in chain)))
        doc = tuple(
            StoredBlock(EngineHash(10_000 + round_ * 64 + i), LocalHash(5000 + round_ * 64 + i)) for i in range(64)
        )
        writer.apply(Stored(3, None, doc))
    writer.clear_all_blocks(3)
    control.set_flushed(0, 2)
    writer.close(unlink=False)  # the test unlinks what is left, as the supervisor does for a dead applier
    control.close()


@pytest.mark.timeout(120)
def test_queries_under_churn_growth_and_clear_see_only_states_the_index_held(wait_until: Callable[..., None]):
    owner = (os.getpid() << 20) + 900_000 + next(_names)
    control = Control.create(control_name(owner), 1)
    reader = IndexReader(control.name)
    query = list(range(1, 33))
    writer = FORK.Process(target=_churn, args=(control.name, owner, 150))
    seen_partial = queries = 0
    try:
        assert reader.find_matches(query) == {}  # loads the kernel first: 50-80 ms, longer than the writer's run
        writer.start()
        wait_until(lambda: control.flushed(0) >= 1, what="worker 1's chain")
        while control.flushed(0) < 2 or queries == 0:
            scores = reader.find_matches(query)
            queries += 1
            assert scores.get((1, 0)) == 32, scores  # worker 1 never lost a block
            assert set(scores) <= {(1, 0), (2, 0)}
            seen_partial += 0 < scores.get((2, 0), 0) < 32
        assert reader.find_matches([5000]) == {}  # worker 3 cleared
        assert control.epoch(0) > 2  # the table grew while being read
    finally:
        if writer.pid is not None:
            writer.join(timeout=60)
        reader.close()
        remove_left_shard(control)
    assert writer.exitcode == 0
    assert queries > 100


def _evict_under_cap(control_name_: str, owner: int, rounds: int) -> None:
    """Writer process with a budget of 300 entries: worker 1 (``exact``) holds chain A; worker 2 (not exact)
    stores chain Q, then a new 64-block document every round, so the cap evicts worker 2's blocks, Q's tip
    first, every few rounds."""
    control = Control.attach(control_name_, writable=True)
    control.set_pid(0, os.getpid())
    writer = ShardWriter(control, 0, owner, capacity=MIN_CAPACITY, budget=300)
    chain = tuple(StoredBlock(EngineHash(100 + i), LocalHash(i + 1)) for i in range(32))
    writer.apply(Stored(1, None, chain))
    row = writer.row((1, 0))
    assert row is not None
    row[W_STATE] = WORKER_EXACT
    query = tuple(StoredBlock(EngineHash(200 + i), LocalHash(3000 + i)) for i in range(64))
    writer.apply(Stored(2, None, query))
    control.set_flushed(0, 1)
    while control.flushed(0) != 2:  # the reader compiles its query first
        time.sleep(0.001)
    for round_ in range(rounds):
        doc = tuple(
            StoredBlock(EngineHash(10_000 + round_ * 64 + i), LocalHash(5000 + round_ * 64 + i)) for i in range(64)
        )
        writer.apply(Stored(2, None, doc))
    control.set_flushed(0, 3)
    writer.close(unlink=False)
    control.close()


@pytest.mark.timeout(120)
def test_queries_while_the_cap_evicts_see_chains_shrink_from_the_tip(wait_until: Callable[..., None]):
    """Every answer while the writer evicts is a state the index held: the exact worker's chain whole, the
    untrusted one's first chain a prefix that only ever shrinks (its tip goes first), never a torn slot."""
    owner = (os.getpid() << 20) + 950_000 + next(_names)
    control = Control.create(control_name(owner), 1)
    writer = FORK.Process(target=_evict_under_cap, args=(control.name, owner, 40))
    writer.start()
    reader = IndexReader(control.name)
    chain, query = list(range(1, 33)), list(range(3000, 3064))
    answers: list[int] = []
    try:
        wait_until(lambda: control.flushed(0) >= 1, what="the writer's first chains")
        answers.append(reader.find_matches(query).get((2, 0), 0))  # whole before the race (and compiled)
        assert answers == [64]
        control.set_flushed(0, 2)
        while control.flushed(0) < 3:
            scores = reader.find_matches(chain)
            assert scores.get((1, 0)) == 32, scores  # untrusted blocks go first: the exact worker keeps its own
            answers.append(reader.find_matches(query).get((2, 0), 0))
        answers.append(reader.find_matches(query).get((2, 0), 0))
        assert answers == sorted(answers, reverse=True)
        assert answers[-1] == 0
        (shard,) = read_shards(control)
        assert shard.entries <= 300
        assert shard.evicted["untrusted"] > 0
        assert shard.evicted["lru"] == 0
    finally:
        writer.join(timeout=60)
        reader.close()
        remove_left_shard(control)
    assert writer.exitcode == 0


ID_ROUNDS = 10_000
"""Worker ids repeat after this many rounds (the reader's numbering covers them)."""
ENOUGH = 4
"""The flush word the reader sets once it met holders often enough: the writer stops its rounds."""
WANTED_HITS = 1_000


def _reuse_rows(control_name_: str, owner: int, rounds: int) -> None:
    """Writer process: round r gives the lowest free row to worker 2r + 2, which stores chain A, forgets it
    (bits cleared, row freed) and gives the same row to worker 2r + 3, which never stores a thing; until
    the reader has seen enough, or ``rounds`` rounds."""
    control = Control.attach(control_name_, writable=True)
    control.set_pid(0, os.getpid())  # as an applier does: a reader that meets the rows mid-change waits for it
    writer = ShardWriter(control, 0, owner, capacity=MIN_CAPACITY)
    chain = tuple(StoredBlock(EngineHash(100 + i), LocalHash(i + 1)) for i in range(64))
    writer.apply(Stored(1, None, chain[:1]))  # keeps the table live between rounds
    warm = (1_000_000, 0)  # one round before the race, so no kernel compiles inside it (a cold numba cache)
    writer.apply(Stored(warm[0], None, chain))
    writer.forget(warm)
    writer.register(warm)
    writer.forget(warm)
    control.set_flushed(0, 1)
    while control.flushed(0) != 2:  # the reader compiles its query first
        time.sleep(0.001)
    for round_ in range(rounds):
        if control.flushed(0) == ENOUGH:  # the reader has seen enough of the race
            break
        holder, empty = (2 * (round_ % ID_ROUNDS) + 2, 0), (2 * (round_ % ID_ROUNDS) + 3, 0)
        writer.apply(Stored(holder[0], None, chain))
        writer.forget(holder)
        assert writer.register(empty) == writer.register(empty) == 1  # the row the holder had
        writer.forget(empty)
    control.set_flushed(0, 3)
    writer.close(unlink=False)
    control.close()


@pytest.mark.timeout(120)
def test_a_reused_worker_row_never_names_a_worker_that_did_not_hold_the_blocks(wait_until: Callable[..., None]):
    owner = (os.getpid() << 20) + 920_000 + next(_names)
    control = Control.create(control_name(owner), 1)
    writer = FORK.Process(target=_reuse_rows, args=(control.name, owner, 2_000_000))
    writer.start()
    reader = IndexReader(control.name)
    query = list(range(1, 65))
    local = np.array(query, dtype=np.uint64)
    slots = WorkerSlots((worker_id, 0) for worker_id in range(1, 2 * ID_ROUNDS + 4))
    hits = queries = 0
    try:
        wait_until(lambda: control.flushed(0) >= 1, what="the writer's first store")
        assert reader.find_matches(query) == {(1, 0): 1}
        assert reader.overlaps(local, slots, 1)[0].tolist()[:2] == [1, 0]  # both queries compiled before the race
        control.set_flushed(0, 2)
        while control.flushed(0) < 3 or queries == 0:
            if queries % 2:  # the dense answer, through the reader's bit -> slot map
                dense = reader.overlaps(local, slots, 1)[0]
                scores = {slots.key(int(slot)): int(dense[slot]) for slot in np.flatnonzero(dense)}
            else:
                scores = reader.find_matches(query)
            queries += 1
            holders = {worker for worker in scores if worker != (1, 0)}
            assert all(worker_id % 2 == 0 for worker_id, _ in holders), scores  # never a worker 2r + 3
            hits += bool(holders)
            if hits == WANTED_HITS:
                control.set_flushed(0, ENOUGH)
    finally:
        writer.join(timeout=60)
        reader.close()
        remove_left_shard(control)
    assert writer.exitcode == 0
    assert hits >= WANTED_HITS, "the reader hardly ever met a holder: the race was not exercised"


@contextlib.contextmanager
def _one_block_shard(offset: int) -> Iterator[tuple[Control, IndexReader, npt.NDArray[np.uint64], int]]:
    """A one-shard index no applier ever took up (pid word 0), written from this process, holding block 42
    on worker 1: the control block, a reader, the shard's table and where block 42's slot version sits (a
    test leaves it odd, as a writer killed between its two version stores would). Everything is closed
    and unlinked on the way out."""
    owner = (os.getpid() << 20) + offset + next(_names)
    control = Control.create(control_name(owner), 1)
    writer = ShardWriter(control, 0, owner)
    reader = IndexReader(control.name)
    try:
        writer.apply(Stored(1, None, (StoredBlock(EngineHash(7), LocalHash(42)),)))
        table = writer.table
        slot = int(np.uint64(42) & np.uint64(int(table[H_CAPACITY]) - 1))
        width = row_words(int(table[H_NWORDS]), int(table[H_TIERS]))
        yield control, reader, table, HEADER_WORDS + slot * width + SLOT_VERSION
    finally:
        reader.close()
        writer.close(unlink=True)
        control.close()
        control.unlink()


def test_a_writer_dead_mid_write_makes_the_shard_recovering_at_once_and_a_live_one_is_waited_for(
    wait_until: Callable[..., None],
):
    with _one_block_shard(950_000) as (control, reader, table, version):
        assert reader.find_matches([42]) == {(1, 0): 1}
        assert reader.writer_checks == 0
        # no applier ever took the shard up (pid word 0): the writer is gone, the slot stays odd
        table[version] += 1  # left odd, as by a writer killed between its two version stores
        assert reader.find_matches([42]) == {}
        assert reader.recovering() == {0}
        assert reader.writer_checks == 1  # one short spin, one look at the writer, given up
        slots = WorkerSlots([(9, 0), (1, 0)])
        assert reader.overlaps(np.array([42], dtype=np.uint64), slots, 2).tolist() == [[0, 0], [0, 0]]
        assert reader.recovering() == {0}
        assert reader.writer_checks == 2
        table[version] += 1
        assert reader.overlaps(np.array([42], dtype=np.uint64), slots, 2).tolist() == [[0, 1], [0, 1]]
        assert reader.recovering() == set()
        assert reader.find_matches([42]) == {(1, 0): 1}

        # a live writer (this process) preempted mid-write: the reader keeps asking until it finishes
        control.set_pid(0, os.getpid())
        control.set_status(0, STATUS_UP)
        table[version] += 1
        checks = reader.writer_checks

        def finish_the_write() -> None:
            wait_until(lambda: reader.writer_checks >= checks + 3, what="the reader to wait for the writer")
            table[version] += 1

        finisher = threading.Thread(target=finish_the_write)
        finisher.start()
        try:
            assert reader.find_matches([42]) == {(1, 0): 1}
        finally:
            finisher.join()
        assert reader.writer_checks >= checks + 3
        assert reader.recovering() == set()


def test_a_router_deciding_while_a_shard_is_given_up_asks_it_again_and_clears_it():
    """The router walks the reader's context by itself only while no shard is given up: a decision after the
    writer finished goes through the reader, which sees the shard answer and reports it recovered (walking
    by the context alone, the shard would stay reported recovering however long it answered)."""
    with _one_block_shard(960_000) as (_, reader, table, version):
        router = Router(block_size=16, seed=3)
        fleet = ((9, 0), (1, 0))
        local = np.array([42, 43], dtype=np.uint64)
        assert router.select(reader, fleet, local_hashes=local).overlap_blocks == 1
        table[version] += 1  # left odd by a writer that is gone (no applier's pid): given up
        assert router.select(reader, fleet, local_hashes=local).overlap_blocks == 0
        assert reader.recovering() == {0}
        table[version] += 1
        chosen = router.select(reader, fleet, local_hashes=local)
        assert (chosen.worker, chosen.overlap_blocks) == ((1, 0), 1)
        assert reader.recovering() == set()
