"""The truth check tells a wrong index from a right one: an engine whose batches are held back (the mock's
``pause``) caches blocks the router cannot know, so the end check reports the difference and the probes
count wrong answers; once the batches are out, both say the index is right again. Real processes: a
``kvrouter up`` and two ``kvrouter mock-worker`` started by :class:`LocalStack`.
"""

from __future__ import annotations

import asyncio
import time

from kvrouter.replay import LocalStack
from kvrouter.replay.stack import Stack
from kvrouter.replay.truth import PROBE_INTERVAL_S, WINDOW_S, ProbeLog, index_equals_engines, probe

TIMEOUT_S = 30.0
PROMPT = list(range(1, 16 * 4 + 1))
"""Four full blocks of 16 tokens."""


async def _probe_until(local: LocalStack, log: ProbeLog, answers: int) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(probe(local, [PROMPT], log, stop))
    deadline = time.monotonic() + TIMEOUT_S
    while len(log.answers) < answers and time.monotonic() < deadline:
        await asyncio.sleep(PROBE_INTERVAL_S)
    stop.set()
    await task


def test_held_back_batches_make_the_index_wrong_until_they_are_published(stack):
    loop, local = stack
    victim = local.mocks[0]

    async def scenario() -> None:
        await local.reset()
        assert await index_equals_engines(local) == (True, "")
        assert (await local.call("POST", victim.http + "/faults", {"pause": True}))[0] == 200
        status, _ = await local.call("POST", victim.http + "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
        assert status == 200
        equal, mismatch = await index_equals_engines(local)
        assert not equal
        assert f"worker {victim.worker_id}" in mismatch
        held = ProbeLog()
        await _probe_until(local, held, 5)
        assert len(held.wrong()) == len(held.answers) >= 5  # the engine holds 4 blocks, the index none

        assert (await local.call("POST", victim.http + "/faults", {"pause": False}))[0] == 200
        deadline = time.monotonic() + TIMEOUT_S
        while not (await index_equals_engines(local))[0]:
            assert time.monotonic() < deadline, await index_equals_engines(local)
            await asyncio.sleep(0.1)
        published = ProbeLog()
        await _probe_until(local, published, 5)
        assert published.wrong() == []
        assert published.truth[victim.worker_id][-1][1] == [4]

    loop.run_until_complete(scenario())


def test_an_answer_is_right_when_it_matches_any_engine_state_of_its_window():
    log = ProbeLog(truth={1: [(10.0, [0]), (10.1, [3]), (10.2, [3]), (10.5, [5])]})
    log.answers = [
        (10.15, 0, {1: 0}),  # the state at 10.0 is within 250 ms
        (10.45, 0, {1: 5}),  # the sample right after the answer
        (10.45, 0, {1: 0}),  # 10.0 is older than the window: wrong
        (10.3, 0, {}),  # absent means 0: wrong (3, 3 and the 5 after it)
    ]
    assert WINDOW_S == 0.25
    assert log.wrong() == [10.45, 10.3]
    assert log.wrong(since=10.4) == [10.45]


def test_a_probe_whose_connection_is_closed_mid_request_is_counted_and_probing_goes_on():
    """A router draining for a restart closes a keep-alive connection with a probe on it: aiohttp raises
    ``ServerDisconnectedError``, which is no ``OSError``. The round is counted failed and the probes go
    on; until this was caught, it ended the whole ``kvrouter replay`` run ("stopped answering")."""

    async def main() -> ProbeLog:
        async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")  # the request's head, then no answer at all
            writer.close()

        server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        stack = Stack(f"http://127.0.0.1:{port}", "default", 16)
        log = ProbeLog()
        stop = asyncio.Event()
        task = asyncio.create_task(probe(stack, [PROMPT], log, stop))
        try:
            deadline = time.monotonic() + TIMEOUT_S
            while log.failed < 3 and time.monotonic() < deadline:
                await asyncio.sleep(PROBE_INTERVAL_S)
            stop.set()
            await task
        finally:
            await stack.close()
            server.close()
            await server.wait_closed()
        return log

    log = asyncio.run(main())
    assert log.failed >= 3
    assert log.answers == []
