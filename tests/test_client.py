"""``kvrouter.client`` against a real service (two ``kvrouter mock-worker`` engines, a bearer token): every
typed method once, refusals as ``ApiError`` with the service's status and message, no answer as
``ServiceUnreachable``, ``SyncClient`` from a plain thread, and completions through the proxy, streamed or
not. One service for the module (``tests/service/conftest.py``'s ``serving``); each test keeps its own
prompts, models and selection ids, so the tests do not depend on one another's order."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest
from aiohttp import web

from kvrouter import ApiError, Client, RouterConfig, ServiceUnreachable, SyncClient
from kvrouter.client import KEEP
from kvrouter.service import ServiceConfig
from tests.conftest import free_port
from tests.service.conftest import BLOCK, MOCK_IDS, MODEL, TOKEN, Running, serving

pytestmark = pytest.mark.timeout(120)

T = TypeVar("T")


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    config = ServiceConfig(
        port=0, shards=1, auth_token=TOKEN, health_interval_secs=0.1, drain_secs=2.0, router=RouterConfig()
    )
    with serving(config, tmp_path_factory.mktemp("client")) as run:
        yield run


def prompt(seed: int, blocks: int = 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(blocks * BLOCK + 3)]


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coroutine)


def test_every_read_route_answers_in_its_documented_shape(running: Running):
    async def main() -> None:
        async with Client(running.url) as c:
            assert (await c.health()) == {"status": "ok", "stopping": False}
            ready = await c.ready()
            assert ready["ready"] is True
            assert ready["reasons"] == []
            assert ready["schedulable_workers"] == len(MOCK_IDS)
            workers = await c.workers(MODEL)
            assert sorted(w["instance_id"] for w in workers) == list(MOCK_IDS)
            assert all(w["block_size"] == BLOCK and "0" in w["listeners"] for w in workers)
            assert await c.workers("no-such-model") == []
            (partition,) = [p for p in await c.loads() if p["model_name"] == MODEL]
            assert sorted(load["worker_id"] for load in partition["loads"]) == list(MOCK_IDS)
            assert partition["pending_count"] == 0
            dump = await c.dump()
            assert dump[f"{MODEL}:default"]["block_size"] == BLOCK
            (thresholds,) = [t for t in (await c.busy_threshold())["thresholds"] if t["model_name"] == MODEL]
            assert set(thresholds) == {
                "model_name",
                "routing_group",
                "active_decode_blocks_threshold",
                "active_prefill_tokens_threshold",
            }
            events = await c.events()
            assert any(e["kind"] == "registered" for e in events["events"])
            assert (await c.events(since=events["last"]))["events"] == []
            metrics = await c.metrics()
            assert "kvrouter_start_time_seconds" in metrics

    run(main())


def test_a_prompt_is_queried_selected_reserved_completed_freed_and_its_decision_kept(running: Running):
    tokens = prompt(1)

    async def main() -> None:
        async with Client(running.url, token=TOKEN) as c:
            query = await c.query(MODEL, tokens)
            assert set(query) >= {"scores", "instances", "index"}
            assert isinstance(query["index"]["events_applied"], int)
            from kvrouter import block_hashes

            by_hash = await c.query_by_hash(MODEL, block_hashes(tokens, BLOCK))
            assert by_hash["scores"] == query["scores"]
            chosen = await c.select(MODEL, token_ids=tokens, explain=True, fallbacks=1)
            assert chosen["worker_id"] in MOCK_IDS
            assert chosen["isl_tokens"] == len(tokens)
            assert {w["worker_id"] for w in chosen["explain"]["workers"]} == set(MOCK_IDS)
            assert len(chosen["fallbacks"]) == 1
            assert "selection_id" not in chosen
            probe = await c.select(MODEL, token_ids=tokens, probe=True)
            assert len(probe["explain"]["workers"]) == len(MOCK_IDS)
            since = (await c.decisions())["last"]
            booked = await c.select_and_reserve(MODEL, token_ids=tokens, selection_id="client-test-1")
            assert booked["selection_id"] == "client-test-1"
            ring = await c.decisions(since=since)
            assert [d["selection_id"] for d in ring["decisions"]] == ["client-test-1"]
            assert ring["decisions"][0]["reserved"] is True
            detail = await c.decision("client-test-1")
            assert detail["worker_id"] == booked["worker_id"]
            assert len(detail["workers"]) == len(MOCK_IDS)
            assert (await c.prefill_complete("client-test-1", cached_tokens=0)) == {"status": "ok"}
            assert (await c.free("client-test-1")) == {"status": "ok"}
            with pytest.raises(ApiError) as freed:
                await c.free("client-test-1")
            assert freed.value.status == 404

    run(main())


def test_register_unregister_and_busy_thresholds_change_the_service(running: Running):
    async def main() -> None:
        async with Client(running.url, token=TOKEN) as c:
            added = await c.register(77, "tcp://127.0.0.1:1", model_name="client-extra", block_size=BLOCK)
            assert added == {"status": "ok"}
            assert [w["instance_id"] for w in await c.workers("client-extra")] == [77]
            changed = await c.set_busy_threshold("client-extra", active_prefill_tokens_threshold=4096)
            assert changed["active_prefill_tokens_threshold"] == 4096
            kept = await c.set_busy_threshold("client-extra", active_decode_blocks_threshold=KEEP)
            assert kept == changed
            cleared = await c.set_busy_threshold("client-extra", active_prefill_tokens_threshold=None)
            assert cleared["active_prefill_tokens_threshold"] is None
            assert (await c.unregister(77, "client-extra")) == {"status": "ok", "removed_ranks": 1}
            assert await c.workers("client-extra") == []

    run(main())


def test_refusals_are_api_errors_with_the_services_status_and_message(running: Running):
    async def main() -> None:
        async with Client(running.url, token=TOKEN) as c, Client(running.url) as anonymous:
            with pytest.raises(ApiError) as unknown:
                await c.select("no-such-model", token_ids=prompt(2))
            assert unknown.value.status == 404
            assert "no-such-model" in unknown.value.message
            assert unknown.value.request == "POST /select"
            assert unknown.value.retry_after is None
            with pytest.raises(ApiError) as unauthorised:
                await anonymous.register(78, "tcp://127.0.0.1:1", model_name="client-extra", block_size=BLOCK)
            assert unauthorised.value.status == 401
            assert unauthorised.value.message == "missing or wrong bearer token"
            worker = running.workers[0]
            with pytest.raises(ApiError) as duplicate:
                await c.register(MOCK_IDS[0], worker.events[0], model_name=MODEL, block_size=BLOCK)
            assert duplicate.value.status == 409
            assert f"instance {MOCK_IDS[0]} dp_rank 0 is already registered" in duplicate.value.message
            assert str(duplicate.value).startswith("POST /register answered 409: ")
            with pytest.raises(ApiError) as unrouted:
                await c.request("GET", "/no-such-route")
            assert unrouted.value.status == 404
            with pytest.raises(ApiError) as missing:
                await c.decision("never-made")
            assert missing.value.status == 404

    run(main())


def test_no_service_is_service_unreachable_naming_the_request():
    async def main() -> None:
        async with Client(f"http://127.0.0.1:{free_port()}") as c:
            await c.health()

    with pytest.raises(ServiceUnreachable, match=r"GET /health to http://127\.0\.0\.1:\d+") as gone:
        run(main())
    assert isinstance(gone.value, ConnectionError)


def test_a_503_with_retry_after_says_when_to_come_back():
    """A 503 with ``Retry-After`` (the service's answer while its index starts), from a stand-in server that
    stays in that state for the test."""

    async def starting(request: web.Request) -> web.Response:
        return web.json_response({"error": "engine starting"}, status=503, headers={"Retry-After": "2"})

    async def main() -> ApiError:
        app = web.Application()
        app.router.add_post("/select", starting)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with Client(f"http://127.0.0.1:{port}") as c:
                with pytest.raises(ApiError) as refused:
                    await c.select(MODEL, token_ids=[1, 2, 3])
                return refused.value
        finally:
            await runner.cleanup()

    error = run(main())
    assert (error.status, error.message, error.retry_after) == (503, "engine starting", 2.0)


def test_completions_go_through_the_proxy_streamed_or_not(running: Running):
    async def main() -> None:
        async with Client(running.url, token=TOKEN) as c:
            answer = await c.completions(prompt(3), model=MODEL, max_tokens=3)
            assert answer["choices"][0]["finish_reason"] is not None
            async with c.stream_completions(prompt(4), model=MODEL, max_tokens=3) as stream:
                assert stream.worker in {f"{wid}:0" for wid in MOCK_IDS}
                chunks = [chunk async for chunk in stream]
            assert chunks
            assert all("error" not in chunk for chunk in chunks)
            assert chunks[-1]["choices"][0]["finish_reason"] is not None
            with pytest.raises(ApiError) as unknown:
                async with c.stream_completions(prompt(5), model="no-such-model", max_tokens=1):
                    pass
            assert unknown.value.status == 404
            assert sum(p["loads"][0]["active_requests"] for p in await c.loads() if p["model_name"] == MODEL) == 0

    run(main())


def test_the_sync_client_works_from_a_plain_thread(running: Running):
    results: dict[str, Any] = {}

    def main() -> None:
        try:
            with SyncClient(running.url, token=TOKEN) as c:
                results["workers"] = sorted(w["instance_id"] for w in c.workers(MODEL))
                results["worker"] = c.select(MODEL, token_ids=prompt(6))["worker_id"]
                with c.stream_completions(prompt(7), model=MODEL, max_tokens=2) as stream:
                    results["chunks"] = list(stream)
                try:
                    c.select("no-such-model", token_ids=prompt(6))
                except ApiError as exc:
                    results["refused"] = exc.status
        except BaseException as exc:  # surfaced below, with the thread's traceback
            results["failed"] = exc

    thread = threading.Thread(target=main)
    thread.start()
    thread.join(60)
    assert "failed" not in results, results["failed"]
    assert results["workers"] == list(MOCK_IDS)
    assert results["worker"] in MOCK_IDS
    assert results["chunks"][-1]["choices"][0]["finish_reason"] is not None
    assert results["refused"] == 404


def test_a_closed_sync_client_refuses_calls_and_closing_twice_is_harmless(running: Running):
    client = SyncClient(running.url)
    assert client.health()["status"] == "ok"
    client.close()
    client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.health()
