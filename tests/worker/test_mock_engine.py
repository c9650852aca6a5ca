"""``kvrouter mock-worker`` as a real process: its events, applied to a ``RadixIndex``, give exactly its ``/cache``.

Every test starts ``python -m kvrouter mock-worker`` with subprocess on ports the OS picks, talks HTTP
to it, subscribes to its KV events and decodes them with the vLLM decoder, as a router would. A high
``--speedup-ratio`` keeps simulated iterations to microseconds of wall time.
"""

from __future__ import annotations

import json
import signal
import socket
import struct
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
import zmq

from kvrouter import RadixIndex, StorageTier
from kvrouter.events.codecs import kvrouter as kvrouter_codec, vllm
from kvrouter.events.codecs.frames import ReplayEnd, parse_live, parse_replay_reply, replay_request
from kvrouter.events.codecs.query import QueryReply, QueryRequest, decode_reply, encode_request
from kvrouter.events.model import KvEvent, Removed, Stored
from tests.conftest import MOCK_TIMEOUT, MOCK_WORKER_ID, Worker, free_port, wait_for_stacks

BLOCK = 16
WORKER = MOCK_WORKER_ID
TIMEOUT = MOCK_TIMEOUT


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@dataclass
class Stream:
    """A router's view of one dp rank: live batches by seq, filled in from replay when asked."""

    context: zmq.Context[zmq.Socket[bytes]]
    events: str
    replay: str
    live: dict[int, bytes] = field(default_factory=dict)
    replayed: set[int] = field(default_factory=set)
    sub: zmq.Socket[bytes] | None = None

    def __post_init__(self) -> None:
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(self.events)

    def close(self) -> None:
        assert self.sub is not None
        self.sub.close()

    def pump(self, timeout_ms: int = 0) -> int:
        """Take every live message waiting (the first within ``timeout_ms``); returns how many."""
        assert self.sub is not None
        got = 0
        while self.sub.poll(timeout_ms if got == 0 else 0):
            frame = parse_live(self.sub.recv_multipart())
            self.live[frame.seq] = frame.payload
            got += 1
        return got

    def wait_live(self, seq: int) -> None:
        """Wait until live message ``seq`` arrives."""
        while seq not in self.live:
            assert self.pump(int(TIMEOUT * 1000)), f"live seq {seq} never arrived; have {sorted(self.live)}"

    def fetch(self, start: int) -> dict[int, bytes]:
        """One replay exchange from ``start``, as a DEALER."""
        dealer: zmq.Socket[bytes] = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay)
            dealer.send_multipart(replay_request(start))
            out: dict[int, bytes] = {}
            while True:
                assert dealer.poll(int(TIMEOUT * 1000)), "replay never ended"
                reply = parse_replay_reply(dealer.recv_multipart())
                if isinstance(reply, ReplayEnd):
                    return out
                out[reply.seq] = reply.payload
        finally:
            dealer.close()

    def complete(self, last_seq: int | None) -> list[bytes]:
        """Every batch 0 .. ``last_seq``: live ones as received, missing ones replayed."""
        if last_seq is None:
            return []
        self.pump()
        missing = [seq for seq in range(last_seq + 1) if seq not in self.live]
        if missing:
            replayed = self.fetch(missing[0])
            self.replayed.update(seq for seq in missing if seq in replayed)
            self.live.update({seq: replayed[seq] for seq in missing})
        return [self.live[seq] for seq in range(last_seq + 1)]


def _index(payloads: list[bytes], dp_rank: int = 0) -> tuple[RadixIndex, int, int]:
    """The payloads applied in order; also how many Stored and Removed events they held."""
    index = RadixIndex()
    decoder = vllm.Decoder(WORKER, BLOCK)
    stored = removed = 0
    for payload in payloads:
        batch = decoder.decode(payload)
        assert batch.dp_rank == dp_rank
        for event in batch.events:
            index.apply_event(WORKER, event)
            stored += isinstance(event, Stored)
            removed += isinstance(event, Removed)
    return index, stored, removed


def _assert_index_is_cache(index: RadixIndex, rank: dict[str, Any]) -> None:
    """The index holds for the rank exactly the engine's blocks, each under its path of local hashes."""
    key = (WORKER, rank["dp_rank"])
    truth = {block["engine_hash"]: tuple(block["local_hashes"]) for block in rank["blocks"]}
    assert index.holdings().get((key, StorageTier.DEVICE), {}) == truth
    paths = {block["engine_hash"]: block["local_hashes"] for block in rank["blocks"]}
    for block in rank["blocks"]:
        path = block["local_hashes"]
        assert index.find_matches(path).get(key) == len(path)
        if block["parent"] is None:
            assert len(path) == 1
        elif block["parent"] in paths:
            assert paths[block["parent"]] == path[:-1]


def _joined(worker: Worker, stream: Stream) -> None:
    """Send small completions until one of their batches arrives live: the SUB has joined."""
    for attempt in range(200):
        worker.complete([90_000 + attempt] * BLOCK, 1)
        if stream.pump(50):
            return
    pytest.fail("the SUB never received a live batch")


def _prompts(count: int, shared: int, own: int) -> list[list[int]]:
    """``count`` prompts sharing a ``shared``-token prefix, each with ``own`` tokens of its own."""
    prefix = list(range(1, shared + 1))
    return [prefix + [10_000 * (i + 1) + t for t in range(own)] for i in range(count)]


def test_events_rebuild_the_engine_cache_exactly(start_worker, context):
    # 8 requests of 27 blocks at once in 48 blocks: evictions and preemptions (each request needs
    # 240 iterations, each at least a millisecond of wall time, so they overlap even on a loaded machine,
    # where 120 iterations once let the requests run one after another; any two overlapping overflow).
    worker = start_worker("--num-gpu-blocks", "48")
    stream = Stream(context, worker.events[0], worker.replay[0])
    try:
        _joined(worker, stream)
        joined_at = max(stream.live)
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda p: worker.complete(p, 240), _prompts(12, 80, 100)))
        assert all(a["usage"]["completion_tokens"] == 240 for a in answers)
        cache = worker.cache()
        (rank,) = cache["ranks"]
        assert (cache["worker_id"], cache["block_size"], cache["format"]) == (WORKER, BLOCK, "vllm")
        payloads = stream.complete(rank["last_seq"])
        assert not {seq for seq in stream.replayed if seq > joined_at}, "a live batch was lost after joining"
        index, stored, removed = _index(payloads)
        assert stored > 0, "the workload should store blocks"
        assert removed > 0, "the workload should evict blocks"
        assert rank["blocks"]
        assert rank["preemptions"] > 0
        _assert_index_is_cache(index, rank)
    finally:
        stream.close()


def test_repeated_prompt_reports_cached_tokens_and_simulated_times(start_worker):
    worker = start_worker()
    prompt = list(range(3 * BLOCK + 5))
    first = worker.complete(prompt, 4)
    second = worker.complete(prompt, 4)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK
    assert first["usage"]["prompt_tokens"] == len(prompt)
    for answer in (first, second):
        extra = answer["kvrouter"]
        assert extra["dp_rank"] == 0
        assert 0 < extra["ttft_ms"] < extra["finish_ms"]
    # A cached prefix means less to prefill (the worker is idle for both, so nothing else differs).
    assert second["kvrouter"]["ttft_ms"] < first["kvrouter"]["ttft_ms"]


def test_overlap_counts_each_prompts_leading_cached_blocks(start_worker):
    worker = start_worker()
    prompt = list(range(1, 3 * BLOCK + 5))
    worker.complete(prompt, 1)
    other = prompt[: 2 * BLOCK] + [70_000] * BLOCK
    status, answer = worker.call("POST", "/overlap", {"prompts": [prompt, other, [5] * BLOCK, [1]]})
    assert status == 200
    (rank,) = answer["ranks"]
    assert rank["overlaps"] == [3, 2, 0, 0]
    assert rank["last_seq"] == worker.cache()["ranks"][0]["last_seq"]
    assert worker.call("POST", "/overlap", {"prompts": [[-1]]})[0] == 400
    assert worker.call("POST", "/overlap", {})[0] == 400


def test_an_adapters_blocks_are_its_own_and_published_with_its_name_as_vllm_does(start_worker, context):
    """``model`` naming a served adapter runs with it: its blocks are hashed with the name (reused by the same
    adapter only), and its stores carry ``lora_name``, ``lora_id`` (numbered from 1 in the order served) and
    the name as each block's ``extra_keys``, as vLLM 0.33's; the router's decoder rebuilds the cache from them."""
    worker = start_worker("--lora-adapter", "sql", "--lora-adapter", "chat")
    stream = Stream(context, worker.events[0], worker.replay[0])
    prompt = list(range(1, 3 * BLOCK + 5))
    try:
        _joined(worker, stream)
        cached = [
            worker.complete(prompt, 2, model=model)["usage"]["prompt_tokens_details"]["cached_tokens"]
            for model in ("sql", "sql", "chat", "base", "unserved")  # any other name is the base model's
        ]
        assert cached == [0, 3 * BLOCK, 0, 0, 3 * BLOCK]
        (rank,) = worker.cache()["ranks"]
        payloads = stream.complete(rank["last_seq"])
        _assert_index_is_cache(_index(payloads)[0], rank)
        stores = [
            event
            for payload in payloads
            for event in msgpack.unpackb(payload, raw=False)[1]
            if event["type"] == "BlockStored"
        ]
        adapters = {(e["lora_name"], e["lora_id"]) for e in stores}
        assert adapters == {("sql", 1), ("chat", 2), (None, None)}
        for event in stores:
            named = event["lora_name"]
            assert event.get("extra_keys") == (None if named is None else [[named]] * len(event["block_hashes"]))
        _, answer = worker.call("POST", "/overlap", {"prompts": [prompt], "lora_name": "chat"})
        assert answer["ranks"][0]["overlaps"] == [3]
        _, answer = worker.call("POST", "/overlap", {"prompts": [prompt], "lora_name": "other"})
        assert answer["ranks"][0]["overlaps"] == [0]
    finally:
        stream.close()


def test_a_salted_requests_blocks_are_its_salts_alone_and_published_as_vllm_does(start_worker, context):
    """``cache_salt`` is hashed into every block of the request, so only a request of the same salt reuses
    them; the first block of a salted chain carries the salt in its extra keys (vLLM's one place for it) and
    the router's decoder, inheriting it down the chain, rebuilds the cache from the events."""
    worker = start_worker()
    stream = Stream(context, worker.events[0], worker.replay[0])
    prompt = list(range(1, 3 * BLOCK + 5))
    try:
        _joined(worker, stream)
        cached = [
            worker.complete(prompt[:length], 2, **salt)["usage"]["prompt_tokens_details"]["cached_tokens"]
            for length, salt in (
                (2 * BLOCK, {"cache_salt": "tenant-a"}),  # a first chunk, then the whole prompt under it
                (len(prompt), {"cache_salt": "tenant-a"}),
                (len(prompt), {"cache_salt": "tenant-a"}),
                (len(prompt), {"cache_salt": "tenant-b"}),
                (len(prompt), {}),
            )
        ]
        assert cached == [0, 2 * BLOCK, 3 * BLOCK, 0, 0]
        (rank,) = worker.cache()["ranks"]
        payloads = stream.complete(rank["last_seq"])
        _assert_index_is_cache(_index(payloads)[0], rank)
        roots = [
            event.get("extra_keys")
            for payload in payloads
            for event in msgpack.unpackb(payload, raw=False)[1]
            if event["type"] == "BlockStored" and event["parent_block_hash"] is None
        ]
        assert [["tenant-a"], *[None] * 1] in roots  # the first chunk's two blocks
        assert any(keys is not None and keys[0] == ["tenant-b"] for keys in roots)
        _, answer = worker.call("POST", "/overlap", {"prompts": [prompt], "cache_salt": "tenant-a"})
        assert answer["ranks"][0]["overlaps"] == [3]
    finally:
        stream.close()


def test_stream_sends_first_token_then_done(start_worker):
    worker = start_worker()
    body = json.dumps({"prompt": list(range(40)), "max_tokens": 5, "stream": True}).encode()
    request = urllib.request.Request(worker.http + "/v1/completions", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
        assert response.headers["Content-Type"] == "text/event-stream"
        lines = [line for line in response.read().decode().split("\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    first, last = (json.loads(line[len("data: ") :]) for line in lines[:-1])
    assert first["choices"][0]["finish_reason"] is None
    assert first["kvrouter"]["ttft_ms"] > 0
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == 5


def test_dropped_batches_are_recovered_by_replay(start_worker, context):
    worker = start_worker()
    stream = Stream(context, worker.events[0], worker.replay[0])
    try:
        _joined(worker, stream)
        joined_at = max(stream.live)
        status, answer = worker.call("POST", "/faults", {"drop_batches": 2})
        assert (status, answer["ranks"][0]["drop_batches"]) == (200, 2)
        for prompt in _prompts(4, 0, 2 * BLOCK):  # one new-block batch each, one at a time
            worker.complete(prompt, 1)
        last = worker.cache()["ranks"][0]["last_seq"]
        stream.wait_live(last)
        assert sorted(seq for seq in range(joined_at + 1, last + 1) if seq not in stream.live) == [
            joined_at + 1,
            joined_at + 2,
        ]
        rank = worker.cache()["ranks"][0]
        index, _, _ = _index(stream.complete(rank["last_seq"]))
        assert {joined_at + 1, joined_at + 2} <= stream.replayed
        _assert_index_is_cache(index, rank)
    finally:
        stream.close()


def test_pause_holds_batches_until_resumed(start_worker, context):
    worker = start_worker()
    stream = Stream(context, worker.events[0], worker.replay[0])
    try:
        _joined(worker, stream)
        before = worker.cache()["ranks"][0]["last_seq"]
        assert worker.call("POST", "/faults", {"pause": True})[0] == 200
        worker.complete(list(range(1, 2 * BLOCK + 1)), 1)
        paused = worker.cache()["ranks"][0]
        assert (paused["last_seq"], paused["held_batches"]) == (before, 1)
        status, answer = worker.call("POST", "/faults", {"pause": False})
        assert (status, answer["ranks"][0]["held_batches"]) == (200, 0)
        stream.wait_live(before + 1)  # released in order, live: no gap
        rank = worker.cache()["ranks"][0]
        assert rank["last_seq"] == before + 1
        index, _, _ = _index(stream.complete(rank["last_seq"]))
        _assert_index_is_cache(index, rank)
    finally:
        stream.close()


def test_restart_empties_the_cache_and_starts_seq_at_zero(start_worker, context):
    worker = start_worker()
    stream = Stream(context, worker.events[0], worker.replay[0])
    try:
        _joined(worker, stream)
        worker.complete(list(range(1, 3 * BLOCK)), 2)
        assert worker.cache()["ranks"][0]["blocks"]
        status, answer = worker.call("POST", "/restart", {})
        assert (status, answer["ranks"]) == (200, [{"dp_rank": 0, "last_seq": None}])
        rank = worker.cache()["ranks"][0]
        assert (rank["last_seq"], rank["blocks"]) == (None, [])
        assert stream.fetch(0) == {}, "the replay buffer belongs to the old incarnation"
        stream.live.clear()
        worker.complete(list(range(1, 2 * BLOCK + 1)), 1)
        stream.wait_live(0)
        rank = worker.cache()["ranks"][0]
        index, _, _ = _index(stream.complete(rank["last_seq"]))
        _assert_index_is_cache(index, rank)
    finally:
        stream.close()


def test_dp_ranks_publish_on_consecutive_ports(start_worker, context):
    events_port, replay_port = free_port(2), free_port(2)
    worker = start_worker("--dp-size", "2", events_port=events_port, replay_port=replay_port)
    assert worker.events == [f"tcp://127.0.0.1:{events_port}", f"tcp://127.0.0.1:{events_port + 1}"]
    assert worker.replay == [f"tcp://127.0.0.1:{replay_port}", f"tcp://127.0.0.1:{replay_port + 1}"]
    answer = worker.complete(list(range(1, 2 * BLOCK + 1)), 1, dp_rank=1)
    assert answer["kvrouter"]["dp_rank"] == 1
    ranks = worker.cache()["ranks"]
    assert [(r["dp_rank"], r["last_seq"], r["blocks"]) for r in ranks[:1]] == [(0, None, [])]
    stream = Stream(context, worker.events[1], worker.replay[1])
    try:
        index, stored, _ = _index(stream.complete(ranks[1]["last_seq"]), dp_rank=1)  # all replayed
        assert stored == 1
        _assert_index_is_cache(index, ranks[1])
    finally:
        stream.close()


BAD_COMPLETIONS: list[tuple[object, str]] = [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "JSON object"),
    ({"prompt": "hello"}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, -2]}, "prompt[1]"),
    ({"prompt": [1, 2**32]}, "prompt[1]"),
    ({"prompt": [1, True]}, "prompt[1]"),
    ({"prompt": [1], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1], "max_tokens": "4"}, "max_tokens"),
    ({"prompt": [1], "stream": "yes"}, "stream"),
    ({"prompt": [1], "dp_rank": 1}, "dp_rank"),
    ({"prompt": [1], "max_tokens": 10**6}, "blocks"),
]


def test_bad_completion_requests_get_400_naming_the_field(start_worker):
    worker = start_worker("--num-gpu-blocks", "32")
    for body, names in BAD_COMPLETIONS:
        status, answer = worker.call("POST", "/v1/completions", body)
        assert status == 400, body
        assert names in answer["error"]["message"], body
    assert worker.complete([1, 2, 3], 1)["usage"]["completion_tokens"] == 1  # still serving


def test_a_client_resetting_its_connection_is_not_a_traceback_and_the_worker_keeps_serving(start_worker, tmp_path):
    worker = start_worker()
    host, port = worker.http.removeprefix("http://").rsplit(":", 1)
    for _ in range(3):  # reset mid request line: the server's read fails with ECONNRESET
        with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
            sock.sendall(b"GET /hea")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    assert worker.complete([1, 2, 3], 1)["usage"]["completion_tokens"] == 1  # still serving
    logged = (tmp_path / "worker0.err").read_text()
    assert "Traceback" not in logged
    assert logged.count("mock http connection failed") <= 1


def test_sigusr1_writes_every_threads_stack_and_the_worker_keeps_serving(start_worker, tmp_path):
    """What the tests ask a worker that does not stop on SIGTERM before they kill it; the fixture then
    checks that SIGTERM still ends it with 0."""
    worker = start_worker()
    err = tmp_path / "worker0.err"
    worker.proc.send_signal(signal.SIGUSR1)
    wait_for_stacks(err, ("cli/mock_worker.py", "serve_forever", "mock_engine.py"), TIMEOUT)  # main, http, engine
    assert worker.complete([1, 2, 3], 1)["usage"]["completion_tokens"] == 1  # still serving


def test_bad_control_requests_get_400_and_unknown_routes_404(start_worker):
    worker = start_worker()
    assert worker.call("POST", "/faults", {})[0] == 400
    assert worker.call("POST", "/faults", {"drop_batches": -1})[0] == 400
    assert worker.call("POST", "/faults", {"pause": "no"})[0] == 400
    assert worker.call("POST", "/restart", {"dp_rank": 3})[0] == 400
    assert worker.call("GET", "/nowhere")[0] == 404
    status, health = worker.call("GET", "/health")
    assert (status, health["status"], health["worker_id"]) == (200, "ok", WORKER)


def _query(context: zmq.Context[zmq.Socket[bytes]], endpoint: str, request: QueryRequest) -> QueryReply:
    """One local-indexer query, as a router's DEALER sends it."""
    dealer: zmq.Socket[bytes] = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart(encode_request(request))
        assert dealer.poll(int(TIMEOUT * 1000)), "no query reply"
        return decode_reply(dealer.recv_multipart())
    finally:
        dealer.close()


def test_kvrouter_format_live_events_and_queries_rebuild_the_cache(start_worker, context):
    worker = start_worker("--format", "kvrouter", "--num-gpu-blocks", "64")
    stream = Stream(context, worker.events[0], worker.replay[0])
    decoder = kvrouter_codec.Decoder()
    events: dict[int, KvEvent] = {}
    try:
        _joined(worker, stream)
        assert worker.call("POST", "/faults", {"drop_batches": 2})[0] == 200
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda p: worker.complete(p, 40), _prompts(12, 80, 100)))
        cache = worker.cache()
        (rank,) = cache["ranks"]
        assert cache["format"] == "kvrouter"
        last = rank["last_event_id"]
        while last not in events:  # the drops hit the first batches: the last one comes live
            assert stream.pump(int(TIMEOUT * 1000)), f"event {last} never arrived live"
            for payload in stream.live.values():
                events.update((event.event_id, event) for event in decoder.decode(payload).events)
        missing = [event_id for event_id in range(last + 1) if event_id not in events]
        assert missing, "two batches were dropped on the wire"
        reply = _query(context, worker.replay[0], QueryRequest(missing[0], last))
        assert (reply.reply, reply.last_event_id) == ("events", last)
        for payload in reply.batches:
            events.update((event.event_id, event) for event in decoder.decode(payload).events)
        assert sorted(events) == list(range(last + 1))
        index = RadixIndex()
        for event_id in range(last + 1):
            index.apply_event(WORKER, events[event_id])
        assert any(isinstance(event, Removed) for event in events.values())
        _assert_index_is_cache(index, rank)
        assert worker.call("POST", "/restart", {})[1]["ranks"] == [{"dp_rank": 0, "last_event_id": None}]
        assert _query(context, worker.replay[0], QueryRequest(None)).reply == "tree_dump"
    finally:
        stream.close()


def test_a_subscriber_that_stops_reading_loses_what_the_small_queues_cannot_hold(start_worker):
    """``--kv-events-hwm`` / ``--kv-events-sndbuf`` (the slow-consumer drill's victim): a SUB that reads
    nothing while the engine publishes 40 prefills gets the first few, then a jump in seq (the PUB
    dropped the rest), and ``/health`` says how far the engine published."""
    worker = start_worker("--kv-events-hwm", "4", "--kv-events-sndbuf", "4096")
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 4)
        sub.setsockopt(zmq.RCVBUF, 4096)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(worker.events[0])
        worker.complete(list(range(1, 33)), 1)  # until the subscription is in, batches may go nowhere: one first
        first = worker.call("GET", "/health")[1]["published"][0]["last_seq"]
        for i in range(40):  # each one prefill: one batch of 16 blocks (~1 KB), nobody reading
            worker.complete(list(range(10_000 + i * 256, 10_256 + i * 256)), 1)
        status, health = worker.call("GET", "/health")
        assert status == 200
        published = health["published"][0]["last_seq"]
        assert published >= first + 40
        seqs = []
        while sub.poll(int(1000 * 0.5)):  # drain what the queues held: the subscriber catches up
            seqs.append(parse_live(sub.recv_multipart()).seq)
        assert seqs, "the subscriber got nothing at all"
        assert len(seqs) < published - seqs[0] + 1  # some were dropped: a gap the router would see
    finally:
        sub.close(linger=0)
        context.term()


def test_nats_events_need_the_kvrouter_format():
    from typer.testing import CliRunner

    from kvrouter.cli import app

    result = CliRunner().invoke(app, ["mock-worker", "--nats-url", "nats://127.0.0.1:1", "--format", "vllm"])
    assert result.exit_code == 2
    assert "'kvrouter' to publish on NATS" in result.output


def test_chat_completions_render_with_the_demo_model_and_report_cached_tokens(start_worker):
    """``/v1/chat/completions``: the messages rendered and tokenized with the shipped demo model (the router
    renders with the same files), answered as ``chat.completion``; a second turn reuses the first's blocks."""
    from kvrouter.chat import DEMO_MODEL, ChatModel, checked_messages

    worker = start_worker()
    messages = [{"role": "system", "content": "You route requests. " * 20}, {"role": "user", "content": "hi"}]
    ids = ChatModel.from_directory("demo", DEMO_MODEL).encode(
        ChatModel.from_directory("demo", DEMO_MODEL).render(checked_messages(messages))
    )
    first = worker.call("POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 2})[1]
    assert first["object"] == "chat.completion"
    assert first["choices"][0]["message"] == {"role": "assistant", "content": ""}
    assert first["usage"]["prompt_tokens"] == len(ids)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    status, bad = worker.call("POST", "/v1/chat/completions", {"messages": [{"role": "bot"}]})
    assert status == 400
    assert "messages[0].role" in bad["error"]["message"]
    again = worker.call("POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 2})[1]
    block = worker.cache()["block_size"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) // block * block
