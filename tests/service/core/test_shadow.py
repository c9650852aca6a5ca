"""Shadow policies (``service/shadow.py``) on a real service with two real mock engines.

Each decision's shadows are what the simulator's own policy classes choose on the service's state at
that moment (checked by asking fresh instances on the same engine and slot manager, with state that
leaves no tie), priced with the live decision's terms; nothing they choose is booked; ``/metrics`` counts
the comparison.
"""

from __future__ import annotations

import random
import urllib.request
from collections.abc import Iterator

import pytest

from kvrouter.errors import ConfigError
from kvrouter.hashing import block_hashes
from kvrouter.routing.config import RouterConfig
from kvrouter.service import ServiceConfig
from kvrouter.sim.policies import make_policy
from kvrouter.sim.policy import Request
from tests.service.conftest import BLOCK, MODEL, Running, serving
from tests.service.edges.test_proxy import complete

pytestmark = pytest.mark.timeout(180)

SHADOWS = ("greedy_overlap", "dynamo_t0", "round_robin")


@pytest.fixture(scope="module")
def shadowed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    config = ServiceConfig(
        port=0, shards=1, health_interval_secs=0.1, drain_secs=2.0, router=RouterConfig(), shadow_policies=SHADOWS
    )
    with serving(config, tmp_path_factory.mktemp("shadow")) as run:
        yield run


def prompt(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(blocks * BLOCK)]


def metric(run: Running, name: str, policy: str) -> float:
    with urllib.request.urlopen(run.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    line = next(line for line in text.splitlines() if line.startswith(f'{name}{{policy="{policy}"}} '))
    return float(line.split()[-1])


def test_shadows_choose_as_the_simulators_policies_and_book_nothing(shadowed: Running, wait_until) -> None:
    cached = prompt(1, 6)
    status, answer, headers = complete(shadowed, {"model": MODEL, "prompt": cached, "max_tokens": 1})
    assert status == 200, answer
    holder = int(headers["X-Kvrouter-Worker"].split(":")[0])
    wait_until(
        lambda: (
            shadowed.ok("POST", "/query", {"model_name": MODEL, "token_ids": cached})["scores"]
            .get(str(holder), {})
            .get("0", 0)
            == len(cached)
        ),
        timeout=20,
    )
    service = shadowed.service
    partition = service.core.registry.partitions[MODEL, "default"]
    before = metric(shadowed, "kvrouter_shadow_decisions_total", "greedy_overlap")
    for n, tokens in enumerate((cached, cached[: 4 * BLOCK] + prompt(2, 2))):
        # what fresh instances of the simulator's policies choose on the service's state now (idle: /select
        # books nothing, so the state is the one the service's shadows saw)
        assert service.core.shadows is not None
        cluster = service.core.shadows.cluster(partition, service.engine, partition.candidates)
        request = Request("x", 0.0, len(tokens), 0, tuple(block_hashes(tokens, BLOCK)))
        expected = {name: make_policy(name).choose(request, cluster) for name in ("greedy_overlap", "dynamo_t0")}
        answer = shadowed.ok(
            "POST", "/select", {"model_name": MODEL, "token_ids": tokens, "selection_id": f"shadow-{n}"}
        )
        ring = shadowed.ok("GET", "/decisions?since=0")["decisions"]
        (entry,) = [d for d in ring if d["selection_id"] == f"shadow-{n}"]
        shadows = entry["shadows"]
        assert set(shadows) == set(SHADOWS)
        for name, worker in expected.items():
            assert (shadows[name]["worker_id"], shadows[name]["dp_rank"]) == worker
        kept = shadowed.ok("GET", f"/decisions/shadow-{n}")
        by_worker = {(w["worker_id"], w["dp_rank"]): w for w in kept["workers"]}
        for name in SHADOWS:  # priced with the live decision's terms
            pick = by_worker[shadows[name]["worker_id"], shadows[name]["dp_rank"]]
            assert shadows[name]["cost"] == pick["cost"]
            assert shadows[name]["overlap_blocks"] == pick["overlap_blocks"]
        assert answer["worker_id"] == holder  # the live router's own pick, the prefix holder
    assert metric(shadowed, "kvrouter_shadow_decisions_total", "greedy_overlap") == before + 2
    assert metric(shadowed, "kvrouter_shadow_agreements_total", "greedy_overlap") >= 2  # both went to the holder
    loads = shadowed.ok("GET", "/loads")
    assert all(row["active_requests"] == 0 for group in loads for row in group["loads"])  # shadows booked nothing


def test_an_unknown_shadow_policy_is_refused() -> None:
    with pytest.raises(ConfigError, match="not one of"):
        ServiceConfig(shadow_policies=("nope",))
