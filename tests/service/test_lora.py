"""LoRA adapters: registered with their base model, listed, and routed only to the workers serving them.

A real service on its own thread; the workers are registered endpoints that publish nothing, which is all
the candidate filter and the registry's checks need. That an adapter's blocks are hashed as the engine
hashes them is ``tests/service/edges/test_chat.py``'s, against mock engines that serve one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvrouter.client import SyncClient
from kvrouter.routing.config import RouterConfig
from kvrouter.service.core.config import WorkerRole
from tests.conftest import free_port
from tests.service.conftest import Served, served_alone

pytestmark = pytest.mark.timeout(120)


def chosen(served: Served, model: str, times: int = 60, **fields: Any) -> set[int]:
    """The workers ``times`` selections of one prompt went to. At temperature 1 over equal costs each of three
    workers is drawn a third of the time: 60 draws miss one with a chance of 3 x (2/3)^60, about 1e-10 (24
    draws, 2e-4, missed one once in CI)."""
    workers = set()
    for _ in range(times):
        status, answer = served.select(model, **fields)
        assert status == 200, answer
        workers.add(answer["worker_id"])
    return workers


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    spread = RouterConfig(router_temperature=1.0)  # a filter that let one worker through would show
    with served_alone(spread, [WorkerRole(71, lora_adapters=("configured-sql",))], [71]) as served:
        yield served


def test_an_adapters_requests_go_only_to_the_workers_serving_it(served: Served):
    assert served.register(11, "base", lora_adapters=["sql", "chat"])[0] == 201
    assert served.register(12, "base", lora_adapters=["sql"])[0] == 201
    assert served.register(13, "base")[0] == 201

    assert chosen(served, "base", lora_name="chat") == {11}
    assert chosen(served, "base", lora_name="sql") == {11, 12}
    assert chosen(served, "base") == {11, 12, 13}  # the base model: every worker
    assert chosen(served, "base", lora_name="unregistered") == {11, 12, 13}  # as the reference: a salt only

    _, workers = served.call("GET", "/workers?model_name=base")
    assert {w["instance_id"]: w["lora_adapters"] for w in workers} == {11: ["chat", "sql"], 12: ["sql"], 13: []}


def test_v1_models_lists_adapters_with_their_base_model_as_parent(served: Served):
    assert served.register(16, "listed-base", lora_adapters=["listed-a", "listed-b"])[0] == 201
    status, answer = served.call("GET", "/v1/models")
    assert status == 200
    models = {entry["id"]: entry for entry in answer["data"]}
    assert models["listed-base"] == {"id": "listed-base", "object": "model", "owned_by": "kvrouter"}
    for adapter in ("listed-a", "listed-b"):
        assert models[adapter] == {"id": adapter, "object": "model", "owned_by": "kvrouter", "parent": "listed-base"}


def test_no_schedulable_worker_for_an_adapter_is_a_503_naming_it(served: Served):
    assert served.register(21, "lonely", lora_adapters=["rare"], role="prefill")[0] == 201
    assert served.register(22, "lonely")[0] == 201
    status, answer = served.select("lonely", lora_name="rare")
    assert status == 503
    assert "serves LoRA adapter 'rare'" in answer["error"]
    assert chosen(served, "lonely", times=3) == {22}


def test_both_hops_of_an_adapters_split_request_go_to_workers_serving_it(served: Served):
    for instance_id, role, adapters in ((81, "prefill", ["pd-x"]), (82, "prefill", []), (83, "decode", ["pd-x"])):
        assert served.register(instance_id, "pd", role=role, lora_adapters=adapters)[0] == 201
    assert served.register(84, "pd", role="decode")[0] == 201
    hops = set()
    for i in range(12):
        body = {"model_name": "pd", "token_ids": [i + 1, *range(1, 4096)], "lora_name": "pd-x"}
        status, answer = served.call("POST", "/select", body)
        assert status == 200, answer
        assert answer["split"] is True
        hops.add((answer["prefill"]["worker_id"], answer["decode"]["worker_id"]))
    assert hops == {(81, 83)}


@pytest.mark.parametrize(
    ("first", "second", "message"),
    [
        (("a1", "m1", ["x1"]), ("a2", "m2", ["x1"]), "'x1' is registered as an adapter of 'm1'"),
        (("a3", "m3", []), ("a4", "m4", ["m3"]), "'m3' is a model's name"),
        (("a5", "m5", ["x5"]), ("a6", "x5", []), "model_name 'x5' is registered as a LoRA adapter of 'm5'"),
        (("a7", "m7", []), ("a8", "m8", ["m8"]), "'m8' is a model's name"),
    ],
)
def test_a_name_is_a_model_or_an_adapter_never_both(served: Served, first, second, message):
    """A request's ``model`` names either; two meanings would make its routing depend on registration order."""
    (name1, model1, adapters1), (_, model2, adapters2) = first, second
    iid = 100 + int(name1[1:])
    assert served.register(iid, model1, lora_adapters=adapters1)[0] == 201
    status, answer = served.register(iid + 1, model2, lora_adapters=adapters2)
    assert status == 409
    assert message in answer["error"]
    assert served.call("GET", f"/workers?model_name={model2}")[1] == []


def test_every_rank_of_an_instance_serves_the_same_adapters(served: Served):
    assert served.register(31, "ranked", lora_adapters=["r1"])[0] == 201
    status, answer = served.register(31, "ranked", lora_adapters=["r2"], dp_rank=1)
    assert status == 409
    assert "one set per instance" in answer["error"]
    assert served.register(31, "ranked", lora_adapters=["r1"], dp_rank=1)[0] == 201


@pytest.mark.parametrize(
    ("value", "message"),
    [("sql", "expected a list of adapter names"), ([""], "1..256 characters"), ([7], "1..256 characters")],
)
def test_bad_adapter_names_are_refused(served: Served, value, message):
    status, answer = served.register(41, "bad-names", lora_adapters=value)
    assert status == 400
    assert answer["error"].startswith("lora_adapters: ")
    assert message in answer["error"]


def test_an_unregistered_workers_adapters_go_with_it(served: Served):
    assert served.register(51, "leaving", lora_adapters=["gone"])[0] == 201
    assert served.register(52, "leaving")[0] == 201
    assert served.call("POST", "/unregister", {"instance_id": 51, "model_name": "leaving"})[0] == 200
    assert "gone" not in {entry["id"] for entry in served.call("GET", "/v1/models")[1]["data"]}
    assert chosen(served, "leaving", times=3, lora_name="gone") == {52}  # no longer registered: a salt only
    assert served.register(53, "other", lora_adapters=["gone"])[0] == 201  # the name is free again


def test_the_client_and_the_config_file_register_adapters(served: Served):
    with SyncClient(served.url) as client:
        client.register(61, f"tcp://127.0.0.1:{free_port()}", model_name="client", lora_adapters=["c2", "c1"])
        (worker,) = client.workers("client")
        assert worker["lora_adapters"] == ["c1", "c2"]
    _, workers = served.call("GET", "/workers?model_name=configured")
    assert [w["lora_adapters"] for w in workers] == [["configured-sql"]]
