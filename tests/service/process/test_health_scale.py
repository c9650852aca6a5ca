"""The health tick and the stats publish at fleet scale: they read, check and judge every worker, and
must let requests in between (``health.py``'s ``HEALTH_SLICE``, ``stats.py``'s ``LOADS_SLICE``).

A file of its own: the service here is this process's one engine (``--dist loadfile`` keeps other
modules' services apart). Workers are registered without being followed (as another front mirrors
front 0's registrations) and their rows are made by applying one event each, so thousands of workers
cost no socket.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import msgpack

from kvrouter.engine import Engine
from kvrouter.events.codecs.kvrouter import Encoder
from kvrouter.events.model import EngineHash, EventBatch, LocalHash, Stored, StoredBlock
from kvrouter.service.core.config import ServiceConfig
from kvrouter.service.core.requests import Registration
from kvrouter.service.process.app import Service
from kvrouter.service.process.health import HEALTH_SLICE
from kvrouter.service.process.stats import LOADS_SLICE, PackedLoads, all_loads, sliced_loads
from tests.service.conftest import own_segments, serve, stop_served

T = TypeVar("T")

WORKERS = 3 * HEALTH_SLICE + 5
SLICES = -(-WORKERS // HEALTH_SLICE)


def on_loop(service: Service, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    loop = service._loop
    assert loop is not None
    return asyncio.run_coroutine_threadsafe(make(), loop).result(60)


def test_a_tick_over_many_workers_lets_the_loop_serve_between_slices_and_misses_none():
    service = Service(ServiceConfig(port=0, shards=1, drain_secs=0.5, health_interval_secs=3600.0))
    service.start()  # forks the applier: before the service thread
    engine = service.engine
    assert isinstance(engine, Engine)  # front 0's: it applies and flushes
    thread = None
    try:
        thread, _ = serve(service)

        async def register() -> None:
            encoder = Encoder()
            for wid in range(WORKERS):
                endpoint = f"tcp://127.0.0.1:{20_000 + wid}"
                service.core.registry.register(
                    Registration(instance_id=wid, endpoint=endpoint, model_name="m"), mirror=True
                )
                stored = Stored(wid, None, (StoredBlock(EngineHash(wid + 1), LocalHash(wid + 1)),))
                engine.apply_payload((wid, 0), encoder.encode(EventBatch((stored,), dp_rank=0)))

        on_loop(service, register)
        engine.flush(timeout=60)

        async def turns_during(work: Callable[[], Awaitable[Any]]) -> int:
            """How many turns the loop gave a callback while ``work`` ran."""
            turns = 0
            done = False

            def ping() -> None:
                nonlocal turns
                if not done:
                    turns += 1
                    asyncio.get_running_loop().call_soon(ping)

            asyncio.get_running_loop().call_soon(ping)
            await work()
            done = True
            return turns

        async def tick() -> int:
            """The stream step of one tick, and the loop's turns meanwhile."""
            return await turns_during(service.health._streams)

        turns = on_loop(service, tick)
        assert turns >= 2 * SLICES  # a turn a slice at least, of the rows and of the trust checks
        keys = {(wid, 0) for wid in range(WORKERS)}
        assert keys <= service.core.registry.streams.keys()
        assert all(service.core.trust.state(key) is not None for key in keys)

        # the next tick reads again only the row that changed: the others keep their stats objects
        first = dict(service.core.registry.streams)
        more = Stored(7, EngineHash(8), (StoredBlock(EngineHash(10_007), LocalHash(10_007)),))
        engine.apply_payload((7, 0), Encoder().encode(EventBatch((more,), dp_rank=0)))
        engine.flush(timeout=60)
        on_loop(service, tick)
        assert (first[7, 0].cached_blocks, service.core.registry.streams[7, 0].cached_blocks) == (1, 2)
        assert all(service.core.registry.streams[key] is first[key] for key in keys - {(7, 0)})

        # the stats publisher's loads for the dashboard: every worker, the loop let in between slices
        gathered: list[PackedLoads] = []

        async def publish() -> int:
            async def gather() -> None:
                gathered.append(await sliced_loads(service.core))

            return await turns_during(gather)

        assert on_loop(service, publish) >= -(-WORKERS // LOADS_SLICE)
        assert gathered == [all_loads(service.core)]
        unpacker = msgpack.Unpacker(raw=False)
        unpacker.feed(gathered[0].packed)
        loads = list(unpacker)
        assert len(loads) == gathered[0].entries
        assert {(load["worker_id"], load["dp_rank"]) for load in loads} == keys
    finally:
        stop_served(service, thread)
    assert own_segments() == []
