"""``KvPublisher`` over real ZMQ sockets: a SUB reads its live batches, a DEALER asks its local indexer."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import msgpack
import pytest
import zmq
from hypothesis import given, settings, strategies as st

from kvrouter import KvPublisher
from kvrouter.errors import ConfigError, EncodeError, EngineError, InvalidHashInput
from kvrouter.events.codecs.frames import LiveFrame, parse_live
from kvrouter.events.codecs.kvrouter import Decoder
from kvrouter.events.codecs.query import QueryReply, QueryRequest, decode_reply, encode_request
from kvrouter.events.model import (
    Cleared,
    EngineHash,
    EventBatch,
    KvEvent,
    LocalHash,
    Removed,
    StorageTier,
    Stored,
    StoredBlock,
)
from kvrouter.hashing import block_hashes
from kvrouter.index.reference import RadixIndex
from kvrouter.worker.publisher import MAX_BATCH_BYTES, MAX_EVENT_BLOCKS

WaitUntil = Callable[..., None]
Context = zmq.Context[zmq.Socket[bytes]]
Socket = zmq.Socket[bytes]

WORKER = 7
BLOCK = 4
LOCAL = "tcp://127.0.0.1:*"
RECV_TIMEOUT_MS = 10_000


def tokens(*blocks: int) -> list[int]:
    """One full block of tokens per argument, distinct per argument value."""
    return [b * 1000 + i for b in blocks for i in range(BLOCK)]


def stored(event_id: int, parent: int | None, *blocks: int, tier: StorageTier = StorageTier.DEVICE) -> Stored:
    """The Stored event ``store(blocks, tokens(*blocks), parent=parent)`` publishes."""
    local = block_hashes(tokens(*blocks), BLOCK)
    parent_hash = None if parent is None else EngineHash(parent)
    items = tuple(StoredBlock(EngineHash(b), LocalHash(h)) for b, h in zip(blocks, local, strict=True))
    return Stored(WORKER, parent_hash, items, event_id=event_id, tier=tier)


@pytest.fixture
def ctx() -> Iterator[Context]:
    context: Context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def pub(ctx: Context) -> Iterator[KvPublisher]:
    with KvPublisher(
        WORKER, block_size=BLOCK, endpoint=LOCAL, query_endpoint=LOCAL, topic=b"kv", buffer_events=4, context=ctx
    ) as publisher:
        yield publisher


@pytest.fixture
def sub(ctx: Context, pub: KvPublisher) -> Iterator[Socket]:
    """A SUB that has joined: probes are published until one arrives, then the publisher is reset."""
    sock = ctx.socket(zmq.SUB)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(pub.endpoint)
        for _ in range(200):
            pub.clear()
            sent = pub.publish()
            received = None
            while sock.poll(50):
                received = parse_live(sock.recv_multipart()).seq
            if received == sent:  # in order, so every probe sent has arrived
                break
        else:
            pytest.fail("the SUB never joined the publisher")
        pub.reset()
        yield sock
    finally:
        sock.close(linger=0)


@pytest.fixture
def dealer(ctx: Context, pub: KvPublisher) -> Iterator[Socket]:
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        assert pub.query_endpoint is not None
        sock.connect(pub.query_endpoint)
        yield sock
    finally:
        sock.close(linger=0)


def receive(sock: Socket) -> tuple[LiveFrame, EventBatch]:
    assert sock.poll(RECV_TIMEOUT_MS), "no live message"
    frame = parse_live(sock.recv_multipart())
    return frame, Decoder().decode(frame.payload)


def query(
    pub: KvPublisher, dealer: Socket, wait_until: WaitUntil, start: int | None, end: int | None = None
) -> QueryReply:
    dealer.send_multipart(encode_request(QueryRequest(start, end)))
    wait_until(lambda: pub.serve(timeout_ms=50) == 1, what="the publisher to answer the query")
    assert dealer.poll(RECV_TIMEOUT_MS), "no query reply"
    return decode_reply(dealer.recv_multipart())


def reply_events(reply: QueryReply) -> list[KvEvent]:
    return [event for batch in reply.batches for event in Decoder().decode(batch).events]


def rebuilt(reply: QueryReply) -> RadixIndex:
    index = RadixIndex()
    for event in reply_events(reply):
        index.apply_event(WORKER, event)
    return index


def test_live_batches_carry_the_steps_events_with_consecutive_ids(pub: KvPublisher, sub: Socket):
    pub.store([101, 102], tokens(101, 102))
    assert pub.publish() == 0
    pub.store([103], tokens(103), tier=StorageTier.HOST)
    pub.remove([101])
    assert pub.publish() == 1
    pub.clear()
    assert pub.publish() == 2
    assert pub.publish() is None  # a step that changed nothing sends nothing
    assert pub.last_event_id == 3
    assert pub.index_errors == 0

    received = [receive(sub) for _ in range(3)]
    assert [(frame.topic, frame.seq) for frame, _ in received] == [(b"kv", 0), (b"kv", 1), (b"kv", 2)]
    assert [batch.events for _, batch in received] == [
        (stored(0, None, 101, 102),),
        (stored(1, None, 103, tier=StorageTier.HOST), Removed(WORKER, (EngineHash(101),), event_id=2)),
        (Cleared(WORKER, event_id=3),),
    ]


def test_lora_and_partial_tails_hash_as_the_router_would(pub: KvPublisher, sub: Socket):
    pub.store([5], [*tokens(5), 9, 9], lora_name="my-lora")  # the partial tail [9, 9] is not a block
    pub.publish()
    (_, batch) = receive(sub)
    (event,) = batch.events
    assert isinstance(event, Stored)
    assert event.blocks[0].local_hash == block_hashes(tokens(5), BLOCK, lora_name="my-lora")[0]


def test_a_range_in_the_ring_is_answered_with_its_events(pub: KvPublisher, dealer: Socket, wait_until: WaitUntil):
    pub.store([1, 2], tokens(1, 2))
    pub.publish()
    pub.store([3], tokens(3), parent=2)
    pub.publish()
    pub.remove([3])
    pub.store([4], tokens(4), parent=2)
    pub.publish()  # ids 0..3, all in the ring of 4

    reply = query(pub, dealer, wait_until, 1, 2)
    assert (reply.reply, reply.last_event_id) == ("events", 3)
    assert reply_events(reply) == [stored(1, 2, 3), Removed(WORKER, (EngineHash(3),), event_id=2)]
    reply = query(pub, dealer, wait_until, 2)
    assert [e.event_id for e in reply_events(reply)] == [2, 3]
    reply = query(pub, dealer, wait_until, 3, 99)  # end past the last id: up to the last
    assert reply_events(reply) == [stored(3, 2, 4)]
    reply = query(pub, dealer, wait_until, 4)  # exactly up to date
    assert (reply.reply, reply.last_event_id, reply.batches) == ("events", 3, ())


def test_a_start_past_the_last_id_is_too_new(pub: KvPublisher, dealer: Socket, wait_until: WaitUntil):
    assert query(pub, dealer, wait_until, 1) == QueryReply("too_new", None)
    assert query(pub, dealer, wait_until, 0) == QueryReply("events", None)
    pub.store([1], tokens(1))
    pub.publish()
    assert query(pub, dealer, wait_until, 2) == QueryReply("too_new", 0)


def _build_history_with_interior_evictions(pub: KvPublisher) -> None:
    """A prefix tree with an evicted interior block, a branch, a host tier and a moved hash; 9 events."""
    pub.store([1, 2, 3, 4], tokens(1, 2, 3, 4))
    pub.store([5, 6], tokens(5, 6), parent=2)  # a branch under block 2
    pub.publish()
    pub.remove([2])  # interior eviction: 3, 4, 5, 6 stay without their parent
    pub.publish()
    pub.store([7], tokens(7), parent=4)
    pub.remove([6])
    pub.store([10, 11], tokens(1, 8), tier=StorageTier.HOST)
    pub.publish()
    pub.remove([1])  # the root block too: everything left hangs under gaps
    pub.store([20], tokens(20), parent=7)
    pub.store([21], tokens(1))  # block 1's content again, under a new engine hash
    pub.publish()


def test_a_full_restore_is_a_tree_dump_that_rebuilds_the_same_index(
    pub: KvPublisher, dealer: Socket, wait_until: WaitUntil
):
    _build_history_with_interior_evictions(pub)
    reply = query(pub, dealer, wait_until, None)
    assert (reply.reply, reply.last_event_id) == ("tree_dump", 8)
    index = rebuilt(reply)
    assert index.holdings() == pub.index.holdings()
    paths = [tokens(1, 2, 3, 4, 7, 20), tokens(1, 2, 5), tokens(1, 8), tokens(1)]
    for path in paths:
        local = block_hashes(path, BLOCK)
        assert index.find_matches_by_tier(local) == pub.index.find_matches_by_tier(local)
    assert index.find_matches(block_hashes(tokens(1), BLOCK)) == {(WORKER, 0): 1}


def test_a_range_older_than_the_ring_is_answered_with_a_tree_dump(
    pub: KvPublisher, dealer: Socket, wait_until: WaitUntil
):
    _build_history_with_interior_evictions(pub)  # 9 events, the ring keeps ids 5..8
    assert query(pub, dealer, wait_until, 5, 5).reply == "events"
    reply = query(pub, dealer, wait_until, 4)
    assert (reply.reply, reply.last_event_id) == ("tree_dump", 8)
    assert rebuilt(reply).holdings() == pub.index.holdings()


def test_reset_starts_ids_and_seq_at_zero_with_an_empty_index(
    pub: KvPublisher, sub: Socket, dealer: Socket, wait_until: WaitUntil
):
    pub.store([1, 2], tokens(1, 2))
    pub.publish()
    pub.store([3], tokens(3), parent=2)
    pub.publish()
    receive(sub), receive(sub)
    pub.store([9], tokens(9))  # queued, then lost with the restart
    pub.reset()
    assert pub.last_event_id is None
    assert query(pub, dealer, wait_until, None) == QueryReply("tree_dump", None)

    pub.store([4], tokens(4))
    assert pub.publish() == 0
    frame, batch = receive(sub)
    assert (frame.seq, batch.events) == (0, (stored(0, None, 4),))
    reply = query(pub, dealer, wait_until, None)
    assert reply.last_event_id == 0
    assert rebuilt(reply).holdings() == pub.index.holdings()
    assert set(pub.index.holdings()[(WORKER, 0), StorageTier.DEVICE]) == {4}


def test_a_batch_not_sent_is_recoverable_by_query(pub: KvPublisher, sub: Socket, dealer: Socket, wait_until: WaitUntil):
    pub.store([1], tokens(1))
    pub.publish()
    pub.store([2], tokens(2), parent=1)
    assert pub.publish(send=False) == 1  # lost on the wire
    pub.store([3], tokens(3), parent=2)
    pub.publish()
    seen = [receive(sub) for _ in range(2)]
    assert [(frame.seq, batch.events[0].event_id) for frame, batch in seen] == [(0, 0), (2, 2)]
    reply = query(pub, dealer, wait_until, 1, 1)
    assert reply_events(reply) == [stored(1, 1, 2)]


def test_big_steps_split_into_batches_under_the_limit(ctx: Context, wait_until: WaitUntil):
    count = 2 * MAX_EVENT_BLOCKS + 100
    with KvPublisher(WORKER, block_size=1, endpoint=LOCAL, query_endpoint=LOCAL, context=ctx) as pub:
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            assert pub.query_endpoint is not None
            sock.connect(pub.query_endpoint)
            pub.store(range(1, count + 1), range(count))
            assert pub.publish(send=False) == 1  # three events of at most MAX_EVENT_BLOCKS, in two batches
            for start in (0, None):
                reply = query(pub, sock, wait_until, start)
                assert all(len(batch) <= MAX_BATCH_BYTES for batch in reply.batches)
                assert len(reply.batches) >= 2
            events = reply_events(query(pub, sock, wait_until, 0))
            assert [len(e.blocks) for e in events if isinstance(e, Stored)] == [MAX_EVENT_BLOCKS] * 2 + [100]
            assert [e.parent for e in events if isinstance(e, Stored)] == [None, MAX_EVENT_BLOCKS, 2 * MAX_EVENT_BLOCKS]
        finally:
            sock.close(linger=0)


def test_garbage_queries_are_counted_logged_once_and_ignored(
    ctx: Context, pub: KvPublisher, dealer: Socket, wait_until: WaitUntil, caplog: pytest.LogCaptureFixture
):
    assert pub.query_endpoint is not None
    garbage = ctx.socket(zmq.DEALER)
    flood = ctx.socket(zmq.DEALER)
    try:
        for sock in (garbage, flood):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(pub.query_endpoint)
        garbage.send_multipart([b"", b"\xc1"])
        garbage.send_multipart([b"no delimiter"])
        garbage.send_multipart([b"", msgpack.packb({"v": 2, "op": "events", "start": None})])
        flood.send_multipart([b"", b"\x00" * (4 << 20)])  # over MAX_QUERY_BYTES: ZMQ drops the peer
        with caplog.at_level(logging.WARNING, logger="kvrouter.worker.publisher"):
            wait_until(lambda: (pub.serve(timeout_ms=50), pub.bad_queries)[1] == 3, what="three bad queries read")
        assert pub.bad_queries == 3
        assert len(caplog.records) == 1
        assert "bad query ignored worker=7 dp=0" in caplog.records[0].message
        assert not garbage.poll(0)  # no reply to garbage
        assert query(pub, dealer, wait_until, None).reply == "tree_dump"  # still serving
    finally:
        garbage.close(linger=0)
        flood.close(linger=0)


def test_index_errors_are_counted_and_the_event_still_published(pub: KvPublisher, sub: Socket):
    pub.remove([42])  # never stored
    pub.store([2], tokens(2), parent=41)  # unknown parent
    pub.publish()
    _, batch = receive(sub)
    assert [e.event_id for e in batch.events] == [0, 1]
    assert pub.index_errors == 2
    assert pub.index.holdings() == {}


def test_bad_store_calls_raise_and_queue_nothing(pub: KvPublisher):
    with pytest.raises(EncodeError, match="2 engine hashes but 7 tokens make 1 full blocks of 4"):
        pub.store([1, 2], [*tokens(1), 0, 0, 0])
    with pytest.raises(InvalidHashInput, match=r"store engine_hashes\[1\]: engine hash 18446744073709551616"):
        pub.store([1, 1 << 64], tokens(1, 2))
    assert pub.publish() is None
    pub.store([-1], tokens(1))  # a signed engine id folds to u64, as the codecs fold SGLang's
    pub.remove([(1 << 64) - 1])
    pub.publish()
    assert pub.index_errors == 0


def test_close_leaves_no_sockets(ctx: Context):
    pub = KvPublisher(WORKER, block_size=BLOCK, endpoint=LOCAL, query_endpoint=LOCAL, context=ctx)
    pub.close()
    pub.close()  # idempotent
    with pytest.raises(EngineError, match="closed"):
        pub.publish()
    with pytest.raises(EngineError, match="closed"):
        pub.serve()
    # Terminating a context blocks while any of its sockets is open.
    term = threading.Thread(target=ctx.term, daemon=True)
    term.start()
    term.join(timeout=10)
    assert not term.is_alive()


def test_an_own_context_is_terminated_and_the_ports_freed():
    with KvPublisher(WORKER, block_size=BLOCK, endpoint=LOCAL, query_endpoint=LOCAL) as first:
        endpoints = first.endpoint, first.query_endpoint
    assert first._context.closed
    with KvPublisher(WORKER, block_size=BLOCK, endpoint=endpoints[0], query_endpoint=endpoints[1]) as again:
        assert (again.endpoint, again.query_endpoint) == endpoints


def test_an_endpoint_in_use_is_a_config_error(pub: KvPublisher, ctx: Context):
    with pytest.raises(ConfigError, match="cannot bind"):
        KvPublisher(WORKER, block_size=BLOCK, endpoint=LOCAL, query_endpoint=pub.endpoint, context=ctx)
    with pytest.raises(ConfigError, match="block_size"):
        KvPublisher(WORKER, block_size=0, endpoint=LOCAL, context=ctx)


Op = tuple[str, int, int]
OPS = st.tuples(st.sampled_from(["store", "store", "remove", "clear"]), st.integers(0, 30), st.integers(1, 3))


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(st.lists(OPS, min_size=1, max_size=3), min_size=1, max_size=8),
    starts=st.lists(st.none() | st.integers(0, 30), min_size=1, max_size=5),
)
def test_every_answer_agrees_with_the_published_history(steps: list[list[Op]], starts: list[int | None]):
    """Differential, without sockets: a dump rebuilds the publisher's index; the state a router held
    after event ``start - 1`` plus an events answer from ``start`` is the publisher's state too."""
    held: list[int] = []
    next_hash = 1
    with KvPublisher(WORKER, block_size=BLOCK, endpoint="inproc://events", buffer_events=3) as pub:
        dumps = {-1: pub.answer(QueryRequest(None))}  # what a router held after each event id
        for ops in steps:
            for kind, pick, length in ops:
                if kind == "store":
                    parent = held[pick % len(held)] if held and pick % 3 else None
                    blocks = list(range(next_hash, next_hash + length))
                    next_hash += length
                    pub.store(blocks, tokens(*(b % 5 for b in blocks)), parent=parent)
                    held.extend(blocks)
                elif kind == "remove" and held:
                    pub.remove([held.pop(pick % len(held))])
                elif kind == "clear":
                    pub.clear()
                    held.clear()
            if pub.publish(send=False) is not None:
                assert pub.last_event_id is not None
                dumps[pub.last_event_id] = pub.answer(QueryRequest(None))
        assert pub.index_errors == 0
        last = -1 if pub.last_event_id is None else pub.last_event_id
        for start in starts:
            reply = pub.answer(QueryRequest(start))
            assert reply.last_event_id == pub.last_event_id
            if start is None or start < last + 1 - 3:
                assert reply.reply == "tree_dump"
                assert rebuilt(reply).holdings() == pub.index.holdings()
            elif start > last + 1:
                assert reply == QueryReply("too_new", pub.last_event_id)
            else:
                assert reply.reply == "events"
                assert [e.event_id for e in reply_events(reply)] == list(range(start, last + 1))
                if start - 1 in dumps:
                    index = rebuilt(dumps[start - 1])
                    for event in reply_events(reply):
                        index.apply_event(WORKER, event)
                    assert index.holdings() == pub.index.holdings()
