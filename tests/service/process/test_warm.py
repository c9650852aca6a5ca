"""A service's first requests after ``/ready`` load no compiled kernel: the start loaded every one they use.

numba loads a kernel from its on-disk cache on the first call of each signature, 10-30 ms each (on a cold
cache it compiles, seconds). ``/query`` walked with a kernel the start had not called, so the first
``/query`` after ``/ready`` took 17-35 ms against 0.5 after it. The check runs in a fresh interpreter, where
no other test has loaded anything: it counts every kvrouter dispatcher's signatures once the index is up,
sends each hot route a first request, and counts again.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(300)

SCRIPT = r"""
import asyncio, json, sys, threading, time, urllib.error, urllib.request
from numba.core.dispatcher import Dispatcher
from kvrouter.service import Service, ServiceConfig

def loaded():
    return {
        f"{module.__name__}.{name}": len(value.signatures)
        for module in list(sys.modules.values()) if module is not None and module.__name__.startswith("kvrouter")
        for name, value in list(vars(module).items()) if isinstance(value, Dispatcher)
    }

def call(url, method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status, json.loads(response.read())

service = Service(ServiceConfig(port=0, shards=1))
service.start()
ready = []
threading.Thread(target=lambda: asyncio.run(service.run(on_ready=ready.append)), daemon=True).start()
while not ready:
    time.sleep(0.05)
url = ready[0]
try:
    while True:  # /ready answers 503 until a worker is up: the body says whether the index is
        try:
            body = urllib.request.urlopen(url + "/ready", timeout=60).read()
        except urllib.error.HTTPError as exc:
            body = exc.read()
        if b"engine starting" not in body:
            break
        time.sleep(0.05)
    worker = {"instance_id": 1, "endpoint": "tcp://127.0.0.1:1", "model_name": "m", "block_size": 16}
    call(url, "POST", "/register", worker)
    before = loaded()
    tokens = list(range(1, 70))
    call(url, "POST", "/query", {"model_name": "m", "token_ids": tokens})
    call(url, "POST", "/query_by_hash", {"model_name": "m", "block_hashes": [1, 2, 3]})
    call(url, "POST", "/select", {"model_name": "m", "token_ids": tokens})
    after = loaded()
    loads = {name: (before.get(name, 0), count) for name, count in after.items() if count != before.get(name, 0)}
    print(json.dumps(loads))
finally:
    service.stop()
"""


def test_first_requests_after_ready_load_no_kernel() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "{}", done.stdout
