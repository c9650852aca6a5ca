"""The captured engine frames over real sockets: every live message sent on a real ZMQ PUB ends in the
shared-memory index as ``router_view.json`` says, and a replay peer speaking the recorded protocol fills
a gap with exactly the recorded exchange."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import zmq

from kvrouter import Engine
from kvrouter.events.codecs.frames import parse_live
from kvrouter.plane import PlaneConfig, WorkerSpec
from tests.conftest import ENGINES, load_engine_frames

WORKER_ID = 1
"""router_view.json converts every engine's events as worker 1."""


class Publisher:
    """An XPUB per dp rank standing in for the engine's PUB: it learns when the router's subscription has
    arrived, so nothing is sent into the slow-joiner window."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], ranks: int) -> None:
        self.sockets = []
        for _ in range(ranks):
            socket = context.socket(zmq.XPUB)
            socket.setsockopt(zmq.LINGER, 0)
            socket.bind("tcp://127.0.0.1:*")
            self.sockets.append(socket)

    def endpoints(self) -> dict[int, str]:
        return {rank: s.getsockopt_string(zmq.LAST_ENDPOINT) for rank, s in enumerate(self.sockets)}

    def wait_subscribed(self) -> None:
        for socket in self.sockets:
            assert socket.poll(30_000), "the router never subscribed"
            assert socket.recv()[:1] == b"\x01"

    def send(self, rank: int, frames: list[bytes]) -> None:
        self.sockets[rank].send_multipart(frames)

    def close(self) -> None:
        for socket in self.sockets:
            socket.close(linger=0)


def scores(engine: Engine, query: list[int]) -> list[list[int]]:
    return sorted([worker, rank, score] for (worker, rank), score in engine.find_matches(query).items())


def applied(engine: Engine, rank: int, seq: int) -> Callable[[], bool]:
    """The rank's row is at ``seq``, and every gap it detected has an outcome (a gap's count is written
    after the batches that close it, so the last id can show first)."""

    def done() -> bool:
        row = engine.workers().get((WORKER_ID, rank))
        return (
            row is not None
            and row.last_id == seq
            and row.state != "restoring"
            and row.gaps_detected == row.gaps_recovered + row.gaps_lost
        )

    return done


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("engine_name", ENGINES)
def test_live_frames_over_a_real_pub_end_as_router_view_says(
    engine_name: str, shards: int, router_view: dict[str, Any], context: zmq.Context[zmq.Socket[bytes]], wait_until
):
    captured, twin = load_engine_frames(engine_name)
    view = router_view[engine_name]
    messages = {(group["dp_rank"], parse_live(m).seq): m for group in captured["live"] for m in group["messages"]}
    publisher = Publisher(context, ranks=2)
    try:
        with Engine(shards=shards) as engine:
            endpoints = publisher.endpoints()
            spec = WorkerSpec(
                WORKER_ID,
                endpoints[0],
                format=twin["engine"],
                topic=twin["scenario"]["topic"].encode(),
                dp_ranks=(0, 1),
                block_size=twin["scenario"]["block_size"],
                rank_endpoints=endpoints,
            )
            engine.add_worker(spec)
            publisher.wait_subscribed()
            for entry in view["batches"]:
                rank, seq = entry["dp_rank"], entry["seq"]
                publisher.send(rank, messages[rank, seq])
                wait_until(applied(engine, rank, seq), timeout=60, what=f"rank {rank} seq {seq} applied")
                for prompt, query in view["query_tokens_hashes"].items():
                    assert scores(engine, query) == entry["scores_after"][prompt], (rank, seq, prompt)
            workers = engine.workers()
            assert {key: (w.state, w.gaps_detected, w.bad_frames) for key, w in workers.items()} == {
                (WORKER_ID, 0): ("exact", 0, 0),
                (WORKER_ID, 1): ("exact", 0, 0),
            }
            if engine_name.startswith("sglang"):  # its partial 5-token page is dropped, as Dynamo does
                assert workers[WORKER_ID, 0].dropped_blocks > 0
    finally:
        publisher.close()


class RecordedReplayPeer:
    """A replay ROUTER that answers exactly as the captured engine did: an empty buffer for the router's
    join request (nothing was published yet), then the recorded replies to the recorded request."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], replay: dict[str, Any]) -> None:
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind("tcp://127.0.0.1:*")
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay = replay
        self.requests: list[list[bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.socket.poll(50):
                continue
            identity, *request = self.socket.recv_multipart()
            self.requests.append(request)
            if request == self.replay["request"]:
                for reply in self.replay["replies"]:
                    self.socket.send_multipart([identity, *reply])
            else:  # the join: nothing buffered yet, so only the END marker
                self.socket.send_multipart([identity, *self.replay["replies"][-1]])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.socket.close(linger=0)


@pytest.mark.parametrize("engine_name", ENGINES)
def test_a_gap_is_filled_by_the_recorded_replay_exchange(
    engine_name: str, router_view: dict[str, Any], context: zmq.Context[zmq.Socket[bytes]], wait_until
):
    """Rank 0's seq 2 and 3 are lost on the wire; seq 4 shows the gap, the applier asks the replay socket
    from 2 with the recorded request, and the recorded replies (2..4, END) restore the index exactly."""
    captured, twin = load_engine_frames(engine_name)
    view = router_view[engine_name]
    (replay,) = captured["replay"]
    live = {parse_live(m).seq: m for m in captured["live"][0]["messages"]}
    publisher = Publisher(context, ranks=1)
    peer = RecordedReplayPeer(context, replay)
    try:
        with Engine(shards=1, plane=PlaneConfig(recovery_timeout=30)) as engine:
            spec = WorkerSpec(
                WORKER_ID,
                publisher.endpoints()[0],
                format=twin["engine"],
                replay_endpoint=peer.endpoint,
                topic=twin["scenario"]["topic"].encode(),
                block_size=twin["scenario"]["block_size"],
            )
            engine.add_worker(spec)
            publisher.wait_subscribed()
            wait_until(lambda: engine.workers()[WORKER_ID, 0].state == "exact", timeout=60, what="join restore")
            for seq in (0, 1, 4):
                publisher.send(0, live[seq])
            wait_until(applied(engine, 0, 4), timeout=60, what="the gap recovered")
            worker = engine.workers()[WORKER_ID, 0]
            assert (worker.gaps_detected, worker.gaps_recovered, worker.gaps_lost, worker.state) == (1, 1, 0, "exact")
            assert peer.requests[-1] == replay["request"]
            last_rank0 = [e for e in view["batches"] if e["dp_rank"] == 0][-1]
            for prompt, query in view["query_tokens_hashes"].items():
                expected = [s for s in last_rank0["scores_after"][prompt] if s[1] == 0]
                assert scores(engine, query) == expected, prompt
    finally:
        peer.close()
        publisher.close()
