"""The drills: one fault each, injected the way it happens in a fleet, and how to tell the router saw it.

- ``gap``: the victim engine publishes its next :data:`GAP_BATCHES` batches with ``send=False``
  (``POST /faults``), a seq gap on the wire. Seen when the victim's ``gaps_detected`` moved.
- ``engine-restart``: the victim engine restarts (``POST /restart``): sequence back to 0, cache
  emptied, its requests in flight failed. Seen when the victim's ``restarts`` moved.
- ``worker-churn``: a new engine is started and registered, then the victim is unregistered (its
  process keeps running, unregistered), both while requests are routed. Seen when the new worker has a
  listener and the victim's row is gone. The end check then also requires that the router lists no
  worker that left and indexes nothing for it; probe answers for a worker that left may be 0 from
  its ``/unregister`` on. Gap counters are summed over the workers registered at the end.
- ``router-restart``: ``kvrouter up`` gets SIGTERM (it drains, then exits) and is started again on the
  same port; the engines are registered again (a new router knows no worker) and restored by replay from
  0. Requests and probes meanwhile fail (counted in ``errors``). Seen when another router pid answers
  ``/ready`` 200. The new router's counters start from 0, so its gaps are the run's.
- ``applier-kill``: SIGKILL to the applier writing the victim's shard (its pid from the control
  segment), under load, so most likely mid-write. Seen when the shard's applier pid changed.
- ``slow-consumer``: the applier following the victim stops reading (SIGSTOP, as a process starved of
  CPU or stalled on a table growth would) while :data:`BURST_REQUESTS` prompts go straight to the victim,
  until the victim has published :data:`STALL_BATCHES` batches; then it resumes (SIGCONT). The victim and
  the router are started with small queues on that connection (:data:`SLOW_HWM` messages at the publisher
  and at the SUB, :data:`SLOW_BUFFER_BYTES` of kernel buffer on each end: ``kvrouter mock-worker
  --kv-events-hwm/--kv-events-sndbuf``, ``kvrouter up --subscriber-hwm/--subscriber-rcvbuf``), so the
  victim's PUB overflows and drops silently, as ZMQ does. Seen when the victim's ``gaps_detected``
  moved: the router found the hole by sequence numbers and asks the victim's replay socket for it. The
  shard's other workers stall too; their publishers' default queues hold the stall, so they lose
  nothing. Rejected: a router endpoint pausing one socket (a backdoor into the applier, where a stopped
  process is a fault that happens) and the default queues (the overflow would take minutes of stall).

The NATS drills run on a :class:`~kvrouter.replay.replicas.ReplicaStack` (two ``kvrouter up
--router-replica-sync`` replicas, requests to each in turn, a NATS server):

- ``nats-outage``: the NATS server is SIGKILLed and, once every replica has seen its connection go (at
  least a second, at most ten), started again on the same port. Decisions taken meanwhile are missed by
  the peers, and KV events published meanwhile by the engines (on NATS in this stack) by the replicas'
  relays. Seen when every replica reported the connection lost; whole again when every replica has
  reconnected and re-synced (``/ready`` 200) and every event-id gap is settled. An engine's lost events
  show as a gap at its next event, or, when the workload ends inside the outage, at the quiet-tail check
  two seconds after its last relayed batch, which asks the engine's local indexer over ZMQ, not NATS
  (``plane/stream.py``'s ``TAIL_CHECK_S``).
- ``replica-kill``: the second replica and every process of it get SIGKILL (no drain, no goodbye), its
  leftovers in ``/dev/shm`` are swept, and it is started again on the same port, the engines registered
  on it; requests sent to it meanwhile fail (counted in ``errors``). It restores its index from the
  engines and learns the load from its peer's snapshot. Its requests in flight stay booked on the
  survivor until the replicas' expiry (:data:`~kvrouter.replay.replicas.EXPIRY_S`). Seen when another pid
  answers on its port.

For both, the end check adds, per replica, the index equal to every engine's cache and ``GET /loads``
equal across replicas, and that every message the sync lost was counted and re-synced.

The disaggregated drill runs on a stack of prefill and decode engines (half of ``--mock-workers`` each, the
router's proxy running both hops of every split request):

- ``prefill-kill``: SIGKILL to the victim, a prefill engine, while a decode engine is pulling KV from it
  (its ``/health`` shows a pull in progress; its link is slowed to :data:`VICTIM_GBPS` so that pulls last
  long enough to be caught). The decode hops pulling from it fail, and their clients get the error; prefill
  hops sent to it are refused, and the proxy decides them again. Seen when the router lists the victim
  ``unhealthy`` (the proxy's refused connection or its health probe); then the victim is started again, as
  its supervisor would, and registered in place of the dead one. The end check adds that every client was
  answered or refused (none left hanging) and that nothing stays booked (``GET /loads`` all zero).

The victim is chosen by the seed among the stack's engines. Each drill names what it needs: drills that
signal a process or read a segment need a :class:`~kvrouter.replay.stack.LocalStack`.

Drills of issue 14 not built would be listed in :data:`NOT_BUILT` (asking for one: a usage error naming
it, never a silent pass); there are none left.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

from .replicas import ReplicaStack
from .stack import Mock, ReplayError, Stack

__all__ = ["DRILLS", "GAP_BATCHES", "KILLED_REPLICA", "NOT_BUILT", "SLOW_HWM", "VICTIM_GBPS", "Drill", "Rows"]

log = logging.getLogger(__name__)

GAP_BATCHES: Final = 3
"""Batches the ``gap`` drill drops: one gap of three ids, recovered by one replay request."""

SLOW_HWM: Final = 8
"""Messages the slow-consumer drill's victim queues per subscriber, and the router's SUB unread: small,
so that a stall of seconds overflows them (the defaults, 100,000 and 1,048,576, absorb minutes)."""

SLOW_BUFFER_BYTES: Final = 4096
"""The kernel buffers of the victim's event connection on both ends (the kernel doubles it): without them
the OS's autotuned buffers (hundreds of KB on loopback) hold more than the victim publishes in a minute."""

BURST_REQUESTS: Final = 32
"""Requests the slow-consumer drill sends straight to the victim during the stall: the burst that overflows."""

BURST_BLOCKS: Final = 16
"""Blocks per burst prompt: each prefill is one batch of ~1 KB (16 blocks' tokens and hashes), so the burst
is ~32 KB, several times what the small queues hold; 512 blocks in all, an eighth of a default mock."""

BURST_TOKEN_BASE: Final = (1 << 30) + (1 << 24)
"""Token ids of the burst prompts: above the workload's (hash-id tokens below 2**30, request tails from 2**30
up, a few tens of thousands), so the burst shares no block with the workload."""

STALL_BATCHES: Final = 32
"""The slow-consumer stall lasts until the victim has published this many batches since it began: the burst's
own, at least; far more than the 8-message queues and a few KB of kernel buffer hold."""

STALL_MAX_S: Final = 10.0
"""The longest stall, for a workload too light to publish :data:`STALL_BATCHES` (the drill then may not
overflow: its fault is then not seen, and the drill fails saying so)."""

STALL_POLL_S: Final = 0.1

VICTIM_GBPS: Final = 0.5
"""The prefill-kill victim's modelled link: a replay prompt (~860 tokens of 131,072 bytes) takes ~1.8
simulated seconds to pull (0.2 s wall at x8), so a poll every :data:`TRANSFER_POLL_S` catches one in
progress; at the default 25 Gbit/s a pull is over in a few wall milliseconds."""

DISAGG_LOCAL_TOKENS: Final = 128
"""The disaggregated stack's ``--disagg-max-local-prefill-tokens``: the default 2,048 scaled as the replay
workload is (1/16, ``workload.py``); at 2,048 nearly every scaled prompt is prefilled on its decode engine,
and nothing is pulled."""

TRANSFER_WAIT_S: Final = 10.0
"""How long prefill-kill waits for a pull from its victim before killing it anyway (it then reports
``mid_transfer`` false, and the drill fails: the fault asked for did not happen)."""

TRANSFER_POLL_S: Final = 0.01

NOTICE_MAX_S: Final = 15.0
"""How long prefill-kill waits for the router to list its dead victim unhealthy: the health probe's period
(4 ticks of ``--health-interval-secs``) and its timeout, with room for a loaded machine."""

KILLED_REPLICA: Final = 1
"""The replica ``replica-kill`` kills: the second, so the first's control segment (which applier follows
which worker) stays readable for the other drills' bookkeeping."""

NOT_BUILT: Final[tuple[str, ...]] = ()
"""Issue 14's drills this version does not run yet: none."""

Rows = dict[int, dict[str, Any]]
"""Worker id -> its rank-0 listener from ``GET /workers`` (gap counters, restarts, state, cached blocks)."""


@dataclass(frozen=True, slots=True)
class Drill:
    """One fault: how to inject it, and how to tell from the router's rows that it was seen."""

    name: str
    needs_local: bool
    """Signals a process or reads a segment: skipped against ``--url``."""
    inject: Callable[[Stack, Mock], Awaitable[dict[str, Any]]]
    """Inject the fault on the victim; returns what was done (for the report)."""
    seen: Callable[[Stack, Mock, dict[str, Any], Rows, Rows], bool]
    """(stack, victim, what inject returned, rows before, rows now): the router has seen the fault."""
    router_args: tuple[str, ...] = ()
    """``kvrouter up`` flags the stack needs for this drill (added when the drill is asked for)."""
    victim_args: tuple[str, ...] = ()
    """``kvrouter mock-worker`` flags the victim engine needs for this drill."""
    replicas: bool = False
    """Runs on the replica stack (two ``kvrouter up --router-replica-sync`` and a NATS server)."""
    own_nats: bool = False
    """Takes the NATS server down: needs the one this run started (skipped with ``--nats-url``)."""
    disagg: bool = False
    """Runs on the disaggregated stack (prefill and decode engines); its victim is a prefill engine."""


def _moved(counter: str) -> Callable[[Stack, Mock, dict[str, Any], Rows, Rows], bool]:
    def seen(_stack: Stack, victim: Mock, _done: dict[str, Any], before: Rows, now: Rows) -> bool:
        was = before.get(victim.worker_id, {}).get(counter, 0)
        return int(now.get(victim.worker_id, {}).get(counter, 0)) > int(was)

    return seen


async def _gap(stack: Stack, victim: Mock) -> dict[str, Any]:
    status, answer = await stack.call("POST", victim.http + "/faults", {"drop_batches": GAP_BATCHES})
    if status != 200:
        raise ReplayError(f"POST {victim.http}/faults answered {status}: {answer}")
    return {"worker": victim.worker_id, "dropped_batches": GAP_BATCHES}


async def _engine_restart(stack: Stack, victim: Mock) -> dict[str, Any]:
    status, answer = await stack.call("POST", victim.http + "/restart", {})
    if status != 200:
        raise ReplayError(f"POST {victim.http}/restart answered {status}: {answer}")
    return {"worker": victim.worker_id}


def _victim_shard(stack: Stack, victim: Mock) -> int:
    """The shard whose applier follows the victim: the control segment's worker rows say."""
    shards = stack.shards_of()
    if victim.worker_id not in shards:
        raise ReplayError(f"no shard follows worker {victim.worker_id}: {shards}")
    return shards[victim.worker_id]


async def _applier_kill(stack: Stack, victim: Mock) -> dict[str, Any]:
    shard = _victim_shard(stack, victim)
    pid = stack.applier_pids().get(shard, 0)
    if pid <= 0:
        raise ReplayError(f"shard {shard} has no applier to kill")
    os.kill(pid, signal.SIGKILL)
    log.info("applier killed shard=%d pid=%d worker=%d", shard, pid, victim.worker_id)
    return {"worker": victim.worker_id, "shard": shard, "pid": pid}


def _applier_replaced(stack: Stack, _victim: Mock, done: dict[str, Any], _before: Rows, _now: Rows) -> bool:
    pid = stack.applier_pids().get(int(done["shard"]), 0)
    return pid not in (0, int(done["pid"]))


async def _slow_consumer(stack: Stack, victim: Mock) -> dict[str, Any]:
    shard = _victim_shard(stack, victim)
    pid = stack.applier_pids().get(shard, 0)
    if pid <= 0:
        raise ReplayError(f"shard {shard} has no applier to stall")
    start = await _published(stack, victim)
    started = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    log.info("applier stalled shard=%d pid=%d worker=%d last_seq=%d", shard, pid, victim.worker_id, start)
    published = start
    try:
        await _burst(stack, victim)
        published = await _published(stack, victim)
        while published - start < STALL_BATCHES and time.monotonic() - started < STALL_MAX_S:
            await asyncio.sleep(STALL_POLL_S)
            published = await _published(stack, victim)
    finally:
        os.kill(pid, signal.SIGCONT)
    stalled = round(time.monotonic() - started, 2)
    log.info("applier resumed shard=%d pid=%d stalled_s=%.2f published=%d", shard, pid, stalled, published - start)
    return {
        "worker": victim.worker_id,
        "shard": shard,
        "pid": pid,
        "stalled_s": stalled,
        "published": published - start,
    }


async def _burst(stack: Stack, victim: Mock) -> None:
    """:data:`BURST_REQUESTS` prompts sent straight to the victim one after another (each a prefill, so a
    batch of stored blocks at least), as a client warming an engine up would."""
    tokens = BURST_BLOCKS * stack.block_size
    for i in range(BURST_REQUESTS):
        base = BURST_TOKEN_BASE + i * tokens
        body = {"model": stack.model_name, "prompt": list(range(base, base + tokens)), "max_tokens": 1}
        status, answer = await stack.call("POST", victim.http + "/v1/completions", body)
        if status != 200:
            raise ReplayError(f"POST {victim.http}/v1/completions answered {status}: {str(answer)[:200]}")


async def _published(stack: Stack, victim: Mock) -> int:
    """The victim's last published sequence number (its ``/health``)."""
    status, health = await stack.call("GET", victim.http + "/health")
    if status != 200 or not isinstance(health, dict):
        raise ReplayError(f"GET {victim.http}/health answered {status}: {health}")
    return int(health["published"][0].get("last_seq") or 0)


async def _prefill_kill(stack: Stack, victim: Mock) -> dict[str, Any]:
    serving = 0
    deadline = time.monotonic() + TRANSFER_WAIT_S
    while not serving and time.monotonic() < deadline:
        status, health = await stack.call("GET", victim.http + "/health")
        transfers = health.get("transfers") if status == 200 and isinstance(health, dict) else None
        serving = int(transfers.get("serving", 0)) if isinstance(transfers, dict) else 0
        if not serving:
            await asyncio.sleep(TRANSFER_POLL_S)
    pid = await stack.kill_mock(victim)
    killed = time.monotonic()
    log.info("prefill engine killed worker=%d pid=%d pulls_in_progress=%d", victim.worker_id, pid, serving)
    noticed_s = None
    while time.monotonic() - killed < NOTICE_MAX_S:
        rows = await stack.workers()
        if any(int(row["instance_id"]) == victim.worker_id and row["status"] == "unhealthy" for row in rows):
            noticed_s = round(time.monotonic() - killed, 3)
            break
        await asyncio.sleep(STALL_POLL_S)
    fresh = await stack.restart_mock(victim)
    return {
        "worker": victim.worker_id,
        "pid": pid,
        "mid_transfer": serving > 0,
        "pulls_in_progress": serving,
        "noticed_s": noticed_s,
        "restarted_http": fresh.http,
    }


def _prefill_kill_seen(_stack: Stack, _victim: Mock, done: dict[str, Any], _before: Rows, _now: Rows) -> bool:
    return bool(done["mid_transfer"]) and done["noticed_s"] is not None


def _replica_stack(stack: Stack) -> ReplicaStack:
    if not isinstance(stack, ReplicaStack):
        raise ReplayError("this drill needs the replica stack")
    return stack


async def _nats_outage(stack: Stack, _victim: Mock) -> dict[str, Any]:
    return await _replica_stack(stack).nats_outage()


def _outage_noticed(stack: Stack, _victim: Mock, done: dict[str, Any], _before: Rows, _now: Rows) -> bool:
    return int(done["noticed_by"]) == len(stack.urls)


async def _replica_kill(stack: Stack, _victim: Mock) -> dict[str, Any]:
    return await _replica_stack(stack).kill_replica(KILLED_REPLICA)


def _replica_replaced(_stack: Stack, _victim: Mock, done: dict[str, Any], _before: Rows, _now: Rows) -> bool:
    return int(done["pid"]) != int(done["old_pid"])


async def _worker_churn(stack: Stack, victim: Mock) -> dict[str, Any]:
    added = await stack.add_mock()
    await stack.remove(victim)
    log.info("workers churned added=%d removed=%d", added.worker_id, victim.worker_id)
    return {"added": added.worker_id, "removed": victim.worker_id}


def _churned(_stack: Stack, _victim: Mock, done: dict[str, Any], _before: Rows, now: Rows) -> bool:
    return int(done["added"]) in now and int(done["removed"]) not in now


async def _router_restart(stack: Stack, _victim: Mock) -> dict[str, Any]:
    old = await stack.restart_router()
    return {"old_pid": old, "pid": stack.router_pid()}


def _router_replaced(stack: Stack, _victim: Mock, done: dict[str, Any], _before: Rows, now: Rows) -> bool:
    return stack.router_pid() not in (0, int(done["old_pid"])) and bool(now)


DRILLS: Final[dict[str, Drill]] = {
    drill.name: drill
    for drill in (
        Drill("gap", needs_local=False, inject=_gap, seen=_moved("gaps_detected")),
        Drill("engine-restart", needs_local=False, inject=_engine_restart, seen=_moved("restarts")),
        Drill("applier-kill", needs_local=True, inject=_applier_kill, seen=_applier_replaced),
        Drill("worker-churn", needs_local=True, inject=_worker_churn, seen=_churned),
        Drill("router-restart", needs_local=True, inject=_router_restart, seen=_router_replaced),
        Drill(
            "slow-consumer",
            needs_local=True,
            inject=_slow_consumer,
            seen=_moved("gaps_detected"),
            router_args=("--subscriber-hwm", str(SLOW_HWM), "--subscriber-rcvbuf", str(SLOW_BUFFER_BYTES)),
            victim_args=("--kv-events-hwm", str(SLOW_HWM), "--kv-events-sndbuf", str(SLOW_BUFFER_BYTES)),
        ),
        Drill("nats-outage", needs_local=True, inject=_nats_outage, seen=_outage_noticed, replicas=True, own_nats=True),
        Drill("replica-kill", needs_local=True, inject=_replica_kill, seen=_replica_replaced, replicas=True),
        Drill(
            "prefill-kill",
            needs_local=True,
            inject=_prefill_kill,
            seen=_prefill_kill_seen,
            router_args=("--disagg-max-local-prefill-tokens", str(DISAGG_LOCAL_TOKENS)),
            victim_args=("--kv-transfer-gbps", str(VICTIM_GBPS)),
            disagg=True,
        ),
    )
}
"""The drills this version runs, in the issue's order."""
