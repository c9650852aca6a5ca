"""The one client of the service's HTTP API (``docs/client.md``): ``Client`` (asyncio) and ``SyncClient``
(threads and scripts), one method per route of ``docs/http-api.md``, answers typed as the ``TypedDict`` s
below, every refusal an :class:`~kvrouter.errors.ApiError` and every missing answer a
:class:`~kvrouter.errors.ServiceUnreachable`.

Layout: ``_client.py`` the async client and the streamed completion, ``_sync.py`` the blocking wrapper,
``_answers.py`` the answers' shapes. This module only re-exports.
"""

from __future__ import annotations

from ..errors import ApiError as ApiError, ServiceUnreachable as ServiceUnreachable
from ._answers import (
    Accuracy as Accuracy,
    BusyThresholds as BusyThresholds,
    Candidate as Candidate,
    Decision as Decision,
    DecisionDetail as DecisionDetail,
    Decisions as Decisions,
    DumpPartition as DumpPartition,
    Events as Events,
    Explanation as Explanation,
    Fallback as Fallback,
    Health as Health,
    IndexFacts as IndexFacts,
    Listener as Listener,
    Overlap as Overlap,
    PartitionLoads as PartitionLoads,
    QueryAnswer as QueryAnswer,
    Ready as Ready,
    ReadyIndex as ReadyIndex,
    ReadyWorker as ReadyWorker,
    RunnerUp as RunnerUp,
    Selection as Selection,
    Status as Status,
    Thresholds as Thresholds,
    Unregistered as Unregistered,
    Worker as Worker,
    WorkerLoad as WorkerLoad,
)
from ._client import (
    DEFAULT_CONNECTIONS as DEFAULT_CONNECTIONS,
    DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT_S,
    DEFAULT_URL as DEFAULT_URL,
    KEEP as KEEP,
    Client as Client,
    CompletionStream as CompletionStream,
    Keep as Keep,
    Response as Response,
)
from ._sync import SyncClient as SyncClient, SyncCompletionStream as SyncCompletionStream

__all__ = [
    "DEFAULT_CONNECTIONS",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_URL",
    "KEEP",
    "Accuracy",
    "ApiError",
    "BusyThresholds",
    "Candidate",
    "Client",
    "CompletionStream",
    "Decision",
    "DecisionDetail",
    "Decisions",
    "DumpPartition",
    "Events",
    "Explanation",
    "Fallback",
    "Health",
    "IndexFacts",
    "Keep",
    "Listener",
    "Overlap",
    "PartitionLoads",
    "QueryAnswer",
    "Ready",
    "ReadyIndex",
    "ReadyWorker",
    "Response",
    "RunnerUp",
    "Selection",
    "ServiceUnreachable",
    "Status",
    "SyncClient",
    "SyncCompletionStream",
    "Thresholds",
    "Unregistered",
    "Worker",
    "WorkerLoad",
]
