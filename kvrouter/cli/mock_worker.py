"""``kvrouter mock-worker``: a simulated engine that serves completions and publishes real KV events.

Options are named after Dynamo's mocker (``--num-gpu-blocks``, ``--speedup-ratio``,
``--zmq-kv-events-port``, ...) so a drill script reads the same against either. Once every socket is
bound the command prints one line to stdout and flushes it, for whoever started it to wait on::

    kvrouter-mock-worker ready http=http://127.0.0.1:PORT events=tcp://127.0.0.1:P replay=tcp://127.0.0.1:R

With ``--dp-size`` above 1, ``events`` and ``replay`` list one endpoint per rank, comma-separated
(rank r on port + r, vLLM's rule); ``replay=none`` when there is no replay / query socket. A worker whose
``--role`` is ``prefill`` or ``both`` adds ``transfer=HOST:PORT``, where decode engines pull its KV
(``worker/kv_transfer.py``). SIGINT and
SIGTERM stop the HTTP server and every engine thread and close their sockets; the exit status is 0.
SIGUSR1 writes every thread's stack to stderr and changes nothing else: what a worker that does not stop
is doing, for whoever is about to kill it (the tests do, before SIGKILL).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Annotated, Final

import typer

from ..chat import DEMO_MODEL, ChatModel
from ..errors import ConfigError
from ..worker.engine_publisher import DEFAULT_HWM
from ..worker.mock_engine import DEFAULT_BLOCK_SIZE, DEFAULT_NUM_GPU_BLOCKS, FORMATS, MockEngine, MockEngineConfig
from ..worker.mock_http import MockHttpServer
from .stacks import stacks_on_sigusr1

__all__ = ["mock_worker", "ready_line"]

log = logging.getLogger(__name__)

READY: Final = "kvrouter-mock-worker ready"
"""The start of the ready line; tests wait for it on the child's stdout."""

_POLL_S: Final = 0.1
"""How often the main thread and the HTTP server look for a stop: the shutdown latency."""

_ENGINE: Final = "Engine"
_WIRE: Final = "Events"
_DISAGG: Final = "Disaggregated serving"

EPILOG: Final = (
    "Examples:\n\n"
    "  kvrouter mock-worker --port 0 --zmq-kv-events-port 0 --zmq-replay-port 0 --speedup-ratio 100\n\n"
    "  kvrouter mock-worker --worker-id 3 --dp-size 2 --zmq-kv-events-port 5557 --zmq-replay-port 5567"
)


def ready_line(http: str, endpoints: list[tuple[str, str | None]], transfer: str | None = None) -> str:
    """The line printed once everything is bound (see the module docstring)."""
    events = ",".join(events for events, _ in endpoints)
    replays = [replay for _, replay in endpoints]
    replay = ",".join(r for r in replays if r is not None) if all(replays) else "none"
    line = f"{READY} http={http} events={events} replay={replay}"
    return line if transfer is None else f"{line} transfer={transfer}"


def _kv_events_subject(namespace: str, component: str) -> str:
    """The reference's ``kv-events`` subject (``bridge/subjects.py``).

    Raises:
        typer.BadParameter: a namespace or component NATS cannot carry.
    """
    from ..bridge.subjects import Subjects  # here: the bridge package loads nats-py

    try:
        return Subjects(namespace, component).kv_events
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="--namespace/--component") from exc


def mock_worker(
    worker_id: Annotated[
        int, typer.Option("--worker-id", min=0, help="The worker id in /cache and kvrouter-format events.")
    ] = 0,
    host: Annotated[str, typer.Option("--host", help="Address every socket binds to.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="HTTP port; 0 picks a free one.")] = 8000,
    zmq_kv_events_port: Annotated[
        int,
        typer.Option(
            "--zmq-kv-events-port",
            min=0,
            max=65535,
            help="Port of the KV-event PUB socket (rank r: port + r); 0 = a free port per rank.",
            rich_help_panel=_WIRE,
        ),
    ] = 5557,
    zmq_replay_port: Annotated[
        int | None,
        typer.Option(
            "--zmq-replay-port",
            min=0,
            max=65535,
            help="Port of the replay ROUTER (vllm) or local-indexer query socket (kvrouter), rank r on port + r; "
            "0 = a free port per rank.",
            show_default="none",
            rich_help_panel=_WIRE,
        ),
    ] = None,
    event_format: Annotated[
        str,
        typer.Option("--format", help=f"Event wire format: {' or '.join(FORMATS)}.", rich_help_panel=_WIRE),
    ] = "vllm",
    topic: Annotated[
        str,
        typer.Option(
            "--topic", help="Topic frame of every event message (vLLM's default is empty).", rich_help_panel=_WIRE
        ),
    ] = "",
    kv_events_hwm: Annotated[
        int,
        typer.Option(
            "--kv-events-hwm",
            min=1,
            help="Messages the KV-event PUB queues per subscriber before it drops (vLLM's KVEventsConfig.hwm; "
            "vllm format).",
            rich_help_panel=_WIRE,
        ),
    ] = DEFAULT_HWM,
    kv_events_sndbuf: Annotated[
        int,
        typer.Option(
            "--kv-events-sndbuf",
            min=0,
            help="\\[bytes] Kernel send buffer of each subscriber's connection (SO_SNDBUF; vllm format); "
            "0 = the OS's default. Small, with a small --kv-events-hwm, a stalled subscriber overflows in seconds.",
            rich_help_panel=_WIRE,
        ),
    ] = 0,
    nats_url: Annotated[
        str | None,
        typer.Option(
            "--nats-url",
            metavar="URL",
            help="Also publish every KV event on NATS core, as the reference's workers do (kvrouter format; "
            "register the worker with transport nats).",
            show_default="ZMQ only",
            rich_help_panel=_WIRE,
        ),
    ] = None,
    namespace: Annotated[
        str,
        typer.Option("--namespace", help="The kv-events subject's namespace (with --nats-url).", rich_help_panel=_WIRE),
    ] = "dynamo",  # bridge/subjects.py's defaults, as kvrouter up's: importing it here would load nats-py
    component: Annotated[
        str,
        typer.Option("--component", help="The kv-events subject's component (with --nats-url).", rich_help_panel=_WIRE),
    ] = "backend",
    block_size: Annotated[
        int, typer.Option("--block-size", min=1, help="Tokens per KV block.", rich_help_panel=_ENGINE)
    ] = DEFAULT_BLOCK_SIZE,
    num_gpu_blocks: Annotated[
        int, typer.Option("--num-gpu-blocks", min=1, help="KV blocks per dp rank.", rich_help_panel=_ENGINE)
    ] = DEFAULT_NUM_GPU_BLOCKS,
    speedup_ratio: Annotated[
        float,
        typer.Option("--speedup-ratio", help="Simulated ms per wall ms (> 0).", rich_help_panel=_ENGINE),
    ] = 1.0,
    dp_size: Annotated[
        int, typer.Option("--dp-size", min=1, help="Data-parallel ranks, one model each.", rich_help_panel=_ENGINE)
    ] = 1,
    role: Annotated[
        str,
        typer.Option(
            "--role",
            help="prefill: answers a prefill hop (kv_transfer_params.do_remote_decode) and offers the prompt's KV; "
            "decode: pulls it for a decode hop (do_remote_prefill); both: either. Every role serves whole requests.",
            rich_help_panel=_DISAGG,
        ),
    ] = "both",
    kv_bytes_per_token: Annotated[
        int,
        typer.Option(
            "--kv-bytes-per-token",
            min=1,
            help="Modelled KV bytes of one token (paces transfers).",
            rich_help_panel=_DISAGG,
        ),
    ] = 131_072,
    kv_transfer_gbps: Annotated[
        float,
        typer.Option(
            "--kv-transfer-gbps", min=0.001, help="Modelled link for KV pulls, Gbit/s.", rich_help_panel=_DISAGG
        ),
    ] = 25.0,
    kv_transfer_port: Annotated[
        int,
        typer.Option(
            "--kv-transfer-port",
            min=0,
            max=65535,
            help="Where pulls are served; 0 picks a free one.",
            rich_help_panel=_DISAGG,
        ),
    ] = 0,
    kv_hold_secs: Annotated[
        float,
        typer.Option(
            "--kv-hold-secs",
            min=0.001,
            help="How long an offered prompt's KV waits for its pull.",
            rich_help_panel=_DISAGG,
        ),
    ] = 30.0,
    lora_adapter: Annotated[
        list[str] | None,
        typer.Option(
            "--lora-adapter",
            help="A LoRA adapter it serves (repeat for more): a request whose model names it is computed with "
            "it, its blocks hashed with the name and published with lora_name, as vLLM's --lora-modules.",
            rich_help_panel=_ENGINE,
        ),
    ] = None,
    model_path: Annotated[
        Path,
        typer.Option(
            "--model-path",
            help="A local model directory (tokenizer.json, tokenizer_config.json's chat template): "
            "/v1/chat/completions renders and tokenizes with it. Default: the demo model shipped in the package.",
        ),
    ] = DEMO_MODEL,
    exit_with_parent: Annotated[
        bool,
        typer.Option(
            "--exit-with-parent",
            help="Stop when the process that started this one is gone (kvrouter up's demo engines: a killed "
            "router leaves no engine behind).",
        ),
    ] = False,
) -> None:
    """Run a mock engine: the simulator's worker model in real time, with HTTP completions and KV events."""
    if event_format not in FORMATS:
        raise typer.BadParameter(f"{event_format!r}; choose from {', '.join(FORMATS)}", param_hint="--format")
    config = MockEngineConfig(
        worker_id=worker_id,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        speedup_ratio=speedup_ratio,
        dp_size=dp_size,
        format="vllm" if event_format == "vllm" else "kvrouter",
        host=host,
        zmq_kv_events_port=zmq_kv_events_port,
        zmq_replay_port=zmq_replay_port,
        topic=topic.encode(),
        kv_events_hwm=kv_events_hwm,
        kv_events_sndbuf=kv_events_sndbuf,
        nats_url=nats_url,
        nats_subject=_kv_events_subject(namespace, component) if nats_url is not None else "",
        role=role,  # type: ignore[arg-type]  # MockEngineConfig.validate names a bad one
        kv_bytes_per_token=kv_bytes_per_token,
        kv_transfer_gbps=kv_transfer_gbps,
        kv_transfer_port=kv_transfer_port,
        kv_hold_secs=kv_hold_secs,
        lora_adapters=tuple(lora_adapter or ()),
    )
    # The handler runs in the main thread between two bytecodes, possibly inside the wait below. A
    # threading.Event there deadlocked: Event.wait holds its condition's lock while it wakes up, and the
    # handler's Event.set waited for that same lock (a CI run's stacks showed exactly this). A list append
    # takes no lock; the main thread sleeps and looks.
    signals: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        signals.append(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with stacks_on_sigusr1():
            try:
                chat = ChatModel.from_directory("mock", model_path)
                engine = MockEngine(config)
            except ConfigError as exc:
                typer.echo(f"kvrouter mock-worker: {exc}", err=True)
                raise typer.Exit(2) from exc
            with engine:
                try:
                    server = MockHttpServer(engine, host, port, chat=chat)
                except OSError as exc:
                    typer.echo(f"kvrouter mock-worker: cannot listen on {host}:{port}: {exc}", err=True)
                    raise typer.Exit(2) from exc
                engine.start()
                http_thread = threading.Thread(
                    target=server.serve_forever, args=(_POLL_S,), name="mock-http", daemon=True
                )
                http_thread.start()
                try:
                    transfers = engine.transfers
                    transfer = None if transfers is None else f"{transfers.host}:{transfers.port}"
                    print(ready_line(server.url, engine.endpoints, transfer), flush=True)
                    log.info("mock worker ready worker=%d url=%s dp_size=%d", worker_id, server.url, dp_size)
                    parent = os.getppid()
                    while not signals:
                        time.sleep(_POLL_S)
                        if exit_with_parent and os.getppid() != parent:  # reparented: whoever started us died
                            log.warning("mock worker's parent is gone worker=%d parent=%d: stopping", worker_id, parent)
                            break
                    log.info("mock worker stopping worker=%d", worker_id)
                finally:
                    server.shutdown()
                    server.server_close()
                    http_thread.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
