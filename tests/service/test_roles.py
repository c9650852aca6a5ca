"""Worker roles (``routing/roles.py``): registered per instance, shown on every listing, and a ``prefill``
worker never given a whole request. A real service on its own thread; the workers are registered
endpoints that publish nothing, which is all a role needs (the routing here has no overlap to weigh)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest

from kvrouter.client import ApiError, SyncClient
from kvrouter.routing.config import RouterConfig
from kvrouter.service.core.config import WorkerRole
from tests.conftest import free_port
from tests.service.conftest import Served, served_alone

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with served_alone(RouterConfig(), [WorkerRole(71, "prefill", "rack-z")], [71, 72]) as served:
        yield served


def test_a_role_and_a_domain_are_registered_per_instance_and_listed_everywhere(served: Served):
    assert served.register(11, "listed", role="prefill", topology_domain="rack-a")[0] == 201
    assert served.register(11, "listed", role="prefill", topology_domain="rack-a", dp_rank=1)[0] == 201
    assert served.register(12, "listed", role="decode")[0] == 201
    assert served.register(13, "listed")[0] == 201  # no role: both, as before roles

    _, workers = served.call("GET", "/workers?model_name=listed")
    by_id = {w["instance_id"]: w for w in workers}
    assert {i: (w["role"], w["topology_domain"]) for i, w in by_id.items()} == {
        11: ("prefill", "rack-a"),
        12: ("decode", None),
        13: ("both", None),
    }
    _, loads = served.call("GET", "/loads")
    (partition,) = [p for p in loads if p["model_name"] == "listed"]
    assert sorted((w["worker_id"], w["dp_rank"], w["role"]) for w in partition["loads"]) == [
        (11, 0, "prefill"),
        (11, 1, "prefill"),
        (12, 0, "decode"),
        (13, 0, "both"),
    ]
    _, ready = served.call("GET", "/ready")
    listed = sorted((w["worker_id"], w["dp_rank"], w["role"]) for w in ready["workers"] if w["model_name"] == "listed")
    assert listed == [(11, 0, "prefill"), (11, 1, "prefill"), (12, 0, "decode"), (13, 0, "both")]

    with urllib.request.urlopen(served.url + "/metrics", timeout=30) as response:
        lines = set(response.read().decode().splitlines())
    for worker, role in ((11, "prefill"), (12, "decode"), (13, "both")):
        assert f'kvrouter_worker_role{{role="{role}",worker="{worker}"}} 1.0' in lines
    assert 'kvrouter_worker_active_requests{dp_rank="1",worker_id="11"} 0.0' in lines  # labels kept


def test_a_bad_role_or_domain_is_refused_and_registers_nothing(served: Served):
    status, answer = served.register(21, "refused", role="encode")
    assert status == 400
    assert answer["error"] == "role: expected one of prefill, decode, both, got 'encode'"
    status, answer = served.register(21, "refused", topology_domain=7)
    assert status == 400
    assert "topology_domain" in answer["error"]
    _, workers = served.call("GET", "/workers?model_name=refused")
    assert workers == []


def test_every_rank_of_an_instance_has_its_role_and_domain(served: Served):
    assert served.register(31, "ranks", role="prefill", topology_domain="rack-a")[0] == 201
    status, answer = served.register(31, "ranks", role="decode", topology_domain="rack-a", dp_rank=1)
    assert status == 409
    assert "registered with role prefill (one role per instance)" in answer["error"]
    status, answer = served.register(31, "ranks", role="prefill", topology_domain="rack-b", dp_rank=1)
    assert status == 409
    assert "topology_domain 'rack-a'" in answer["error"]
    _, workers = served.call("GET", "/workers?model_name=ranks")
    assert [sorted(w["endpoints"]) for w in workers] == [["0"]]


def test_a_prefill_worker_is_never_given_a_whole_request(served: Served):
    for instance_id, role in ((41, "prefill"), (42, "prefill"), (43, "decode"), (44, "both")):
        assert served.register(instance_id, "split", role=role)[0] == 201
    chosen = set()
    for _ in range(24):
        status, answer = served.select("split", explain=True, fallbacks=3)
        assert status == 200, answer
        chosen.add(answer["worker_id"])
        assert answer["split"] is False  # 69 tokens: its decode worker prefills it (tests/service/test_split.py)
        assert {c["worker_id"] for c in answer["explain"]["decode_costs"]} == {43, 44}
        assert {w["worker_id"] for w in answer["explain"]["workers"]} == {answer["worker_id"]}
        assert {f["worker_id"] for f in answer["fallbacks"]} <= {43, 44}
    assert chosen <= {43, 44}


def test_a_partition_of_prefill_workers_only_cannot_route_and_says_why(served: Served):
    assert served.register(51, "prefill-only", role="prefill")[0] == 201
    status, answer = served.select("prefill-only")
    assert status == 503
    assert answer["error"] == (
        "no decode-capable worker in prefill-only:default: its 1 schedulable workers all have role prefill; "
        "register a worker with role decode or both"
    )
    assert served.register(52, "prefill-only", role="both")[0] == 201
    status, answer = served.select("prefill-only")
    assert (status, answer["worker_id"]) == (200, 52)


def test_the_client_registers_a_role(served: Served):
    with SyncClient(served.url) as client:
        client.register(61, f"tcp://127.0.0.1:{free_port()}", model_name="client", role="decode", topology_domain="d1")
        (worker,) = client.workers("client")
        assert (worker["role"], worker["topology_domain"]) == ("decode", "d1")
        with pytest.raises(ApiError) as refused:
            client.register(62, f"tcp://127.0.0.1:{free_port()}", model_name="client", role="bogus")  # type: ignore[arg-type]
        assert refused.value.status == 400


def test_workers_of_the_config_file_register_with_their_role(served: Served):
    _, workers = served.call("GET", "/workers?model_name=configured")
    assert {w["instance_id"]: (w["role"], w["topology_domain"]) for w in workers} == {
        71: ("prefill", "rack-z"),
        72: ("both", None),
    }
