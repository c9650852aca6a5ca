"""Mock engines that transfer KV (``worker/kv_transfer.py``): real ``kvrouter mock-worker`` processes, one
prefill and one decode, doing vLLM's NixlConnector exchange by hand as a router's proxy would."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Worker, free_port

pytestmark = pytest.mark.timeout(120)

BLOCK = 16
PROMPT = list(range(1000, 1000 + 4 * BLOCK + 5))
PREFILL_HOP = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def cached_prompt_blocks(worker: Worker) -> int:
    return sum(len(rank["blocks"]) for rank in worker.cache()["ranks"])


def test_a_prefill_hop_then_a_decode_hop_moves_the_prompts_kv(start_worker: Callable[..., Worker]):
    prefill = start_worker("--role", "prefill", worker_id=1)
    decode = start_worker("--role", "decode", worker_id=2)
    first = prefill.complete(PROMPT, 1, kv_transfer_params=PREFILL_HOP)
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "kvrouter-mock-1"
    assert len(params["remote_block_ids"]) == 4  # the prompt's full blocks
    assert params["remote_host"] == "127.0.0.1"
    assert isinstance(params["remote_port"], int)
    assert cached_prompt_blocks(decode) == 0
    assert prefill.call("GET", "/health")[1]["transfers"] == {"offered": 1, "serving": 0, "served": 0, "cut": 0}
    assert "transfers" not in decode.call("GET", "/health")[1]  # a decode engine offers nothing

    answer = decode.complete(PROMPT, 8, kv_transfer_params=params)
    assert answer["usage"]["completion_tokens"] == 8
    assert prefill.call("GET", "/health")[1]["transfers"] == {"offered": 0, "serving": 0, "served": 1, "cut": 0}
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BLOCK  # the pulled blocks, reused
    assert cached_prompt_blocks(decode) >= 4  # stored, as an engine stores what it pulled (and published)

    status, again = decode.call(
        "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": params}
    )
    assert status == 502
    assert "pulled already" in again["error"]["message"]


@pytest.mark.parametrize(
    ("role", "params", "message"),
    [
        ("decode", PREFILL_HOP, "role is decode: it does not take a prefill hop"),
        ("prefill", {"do_remote_prefill": True}, "role is prefill: it does not take a decode hop"),
        ("both", {"do_remote_prefill": True, "do_remote_decode": True}, "both true"),
        ("both", "yes", "kv_transfer_params must be an object"),
    ],
)
def test_a_hop_the_role_does_not_take_is_refused(
    start_worker: Callable[..., Worker], role: str, params: Any, message: str
):
    worker = start_worker("--role", role)
    status, answer = worker.call(
        "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": params}
    )
    assert status == 400
    assert message in answer["error"]["message"]
    assert worker.complete(PROMPT, 2)["usage"]["completion_tokens"] == 2  # a whole request: every role


def test_a_streamed_prefill_hop_is_refused(start_worker: Callable[..., Worker]):
    worker = start_worker("--role", "prefill")
    body = {"prompt": PROMPT, "max_tokens": 1, "stream": True, "kv_transfer_params": PREFILL_HOP}
    status, answer = worker.call("POST", "/v1/completions", body)
    assert (status, "stream false" in answer["error"]["message"]) == (400, True)


def test_an_offer_not_pulled_in_time_is_gone(start_worker: Callable[..., Worker]):
    prefill = start_worker("--role", "prefill", "--kv-hold-secs", "0.2", worker_id=1)
    decode = start_worker("--role", "decode", worker_id=2)
    params = prefill.complete(PROMPT, 1, kv_transfer_params=PREFILL_HOP)["kv_transfer_params"]
    time.sleep(0.5)
    body = {"prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": params}
    status, answer = decode.call("POST", "/v1/completions", body)
    assert status == 502
    assert "expired" in answer["error"]["message"]


def test_a_pull_from_nowhere_is_an_error_and_stores_nothing(start_worker: Callable[..., Worker]):
    decode = start_worker("--role", "decode")
    params: dict[str, Any] = {**PREFILL_HOP, "do_remote_decode": False, "do_remote_prefill": True}
    params |= {"remote_host": "127.0.0.1", "remote_port": free_port(), "remote_request_id": "x"}
    status, answer = decode.call(
        "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": params}
    )
    assert status == 502
    assert "KV pull from 127.0.0.1" in answer["error"]["message"]
    assert cached_prompt_blocks(decode) == 0


def own_worker(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    """A mock worker this test kills itself (``start_worker`` wants every worker to exit 0): its process and URL."""
    command = [sys.executable, "-m", "kvrouter", "mock-worker", "--port", "0", "--zmq-kv-events-port", "0", *args]
    with (tmp_path / "killed.err").open("w") as stderr:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("kvrouter-mock-worker ready "), (tmp_path / "killed.err").read_text()
    return proc, dict(part.split("=", 1) for part in line.split()[2:])["http"]


def test_a_prefill_engine_killed_mid_transfer_breaks_the_pull(start_worker: Callable[..., Worker], tmp_path: Path):
    """At real speed over a 0.01 Gbit/s link, the pull of 69 tokens' KV takes 7 s: the prefill process is
    killed while it sends, and the decode hop answers an error at once, storing nothing."""
    proc, url = own_worker(tmp_path, "--role", "prefill", "--kv-transfer-gbps", "0.01", "--worker-id", "1")
    try:
        prefill = Worker(proc, url, [], [])
        decode = start_worker("--role", "decode", worker_id=2)
        params = prefill.complete(PROMPT, 1, kv_transfer_params=PREFILL_HOP)["kv_transfer_params"]
        outcome: list[tuple[int, Any]] = []
        body = {"prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": params}
        pulling = threading.Thread(target=lambda: outcome.append(decode.call("POST", "/v1/completions", body)))
        pulling.start()
        time.sleep(1.0)
        assert pulling.is_alive(), "the pull ended before the kill: the link is not slow enough to test this"
        assert prefill.call("GET", "/health")[1]["transfers"]["serving"] == 1  # what the prefill-kill drill waits for
        killed = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        pulling.join(30)
        ((status, answer),) = outcome
        assert status == 502
        assert "KV pull from 127.0.0.1" in answer["error"]["message"]
        assert time.monotonic() - killed < 5  # at once, not at the end of the modelled transfer
        assert cached_prompt_blocks(decode) == 0
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
