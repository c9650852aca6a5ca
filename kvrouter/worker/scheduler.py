"""``WorkerModel``: one simulated engine, Dynamo's vLLM-style mocker ("engine B", ``spec/routing-benchmark.md`` §2).

The model knows blocks, sequences and iterations, never a clock: :meth:`WorkerModel.step` runs one
engine iteration and says how many milliseconds it took; whoever drives it (the discrete-event
simulator, later the mock engine in real time) decides what those milliseconds mean. One iteration:

1. **Prefill phase.** Budget = ``max_num_batched_tokens`` (8192) minus the sequences decoding. Running
   sequences part-way through their prompt continue first (chunked prefill), then waiting ones are
   admitted first come first served while fewer than ``max_num_seqs`` (256) run and budget is left. At
   admission the longest prefix of the prompt's full blocks cached in either pool is reused for free
   (the hit rate counts those tokens); each chunk then takes ``min(uncached rest, budget)`` tokens and
   allocates its blocks. When a running sequence's chunk finds no blocks, running sequences are
   preempted, last admitted first (LIFO), their blocks freed and they requeued at the front for
   recompute; after a preemption no further sequence is admitted in that iteration. A waiting sequence
   whose first chunk finds no blocks stays waiting and admission stops (vLLM v1).
2. **Decode phase.** Each sequence that was decoding when the iteration began emits one token; crossing
   into a new block allocates it (and may preempt, LIFO).
3. **Duration** = ``prefill_ms(new tokens of the iteration) + decode_ms(p)`` (``timing.py``), p taken
   after the prefill phase's allocations. A sequence whose last chunk ran this iteration emits its first
   token at the end of it (after the decode phase of the others): that token is the prefill's output,
   not a decode step, so a lone request's TTFT is exactly the prefill polynomial (the §2.3 check).

Modelling decisions, with the reason for each:

- **Blocks.** A sequence holds ``ceil(tokens / 512)`` blocks; the tail is a private partial block. As in
  the mocker's ``ActiveSequence``, the partial block is promoted to a full, registered block (one
  ``Stored``) when the token *after* it arrives, at which point the next partial block is allocated.
  A generated full block's id is derived from the request (:func:`generated_block_id`), so it is
  never shared with another request and never matches a trace hash id.
- **Release order.** A finished or preempted sequence releases its blocks leaf first (partial, then its
  full blocks from the last to the first), so an LRU evicts a sequence's unshared tail before its
  prefix, as the mocker's reversed ``Deref`` does.
- **The final token** promotes a just-filled partial block but allocates no new one (the mocker
  allocates and at once frees it; only a pointless eviction differs).
- **Cached tokens take no budget.** The chunk is drawn from the uncached rest only (vLLM v1 and the
  current mocker skip the cached prefix; an older mocker charged it against the budget and counted
  ``min(chunk, uncached)`` as new, over-charging partly cached prompts). A prompt cached in full
  prefills nothing and emits its first token at the end of the iteration it was admitted in.
- **Preemption.** A preempted sequence keeps the tokens it generated; readmitted, it re-prefills prompt
  and output (reusing whatever of them is still cached) and then continues; its first token is not
  re-reported. The hit rate counts only a request's first admission (the router's decision).
- **Admission never preempts.** Tried first, as the spec's "on allocation failure, running decodes are
  preempted" reads and an older mocker did: under memory pressure two sequences then take turns
  preempting each other at every admission, each advancing one recomputed token per two iterations.
  vLLM v1 lets a new request wait instead, which is what is modelled. Round robin and the Dynamo-cost
  policies never preempt on the four workloads, so the gate cannot tell the two apart; overloaded runs
  (``greedy_overlap`` on C8: thousands of preemptions) can.
- **Budget.** The spec's ``8192 - decoding sequences``: decodes always get their token (vLLM schedules
  running requests first; the mocker's running loop could let a long chunk crowd out decodes listed
  after it).

Calibration (§7): with the choices above and p = active blocks / capacity (``timing.py``), round robin
lands within 0.001 of the anchors' hit rate and within 2% of their TTFT p50 and p90 on all four
workloads, with their uncached-prefill imbalance (1.02 / 1.05 / 1.01 / 1.08) and ITL p50 within 2%
(table in ``tests/sim/test_calibration.py``). Nothing had to be tuned; two variants were tried against
the anchors and dropped: released partial blocks kept in the inactive pool (hit 0.003 low everywhere,
see ``kv_cache.py``), and generated blocks freed instead of cached when released (hit 0.0836 on C4,
0.0016 high). Not tried, as the gate passed: stamping the first token at the end of the prefill phase
rather than of the iteration (it would be earlier by one decode step, 6-16 ms).

Received prompts (a disaggregated fleet's decode hop, ``add_request(received=True)``): the prompt's KV
came whole from the prefill worker, the partial last block included (vLLM's NixlConnector sends every block
of the prompt), so when all its full blocks are still cached at admission the decode worker prefills none
of it: no prefill time, and its first token comes out at the end of the iteration it is admitted in, which
runs a decode step for it even when nothing else is decoding. The reference's own disaggregated mocker does
the same (a decode worker's scheduled prompt tokens add nothing to the prefill time), and so do the engines:
vLLM computes only the last prompt token again, inside the decode batch; SGLang's decode server skips the
prefill forward. The reused tokens it reports are the cached full blocks', as for any admission. A full
block evicted between the landing and the admission is prefilled again from there, partial block included.

Fast-forwarding: a decoding sequence's token count is not stored but derived from a per-worker decode
step counter (``generated = decode_steps - offset``), and a heap holds the step at which each sequence
next crosses a block boundary or finishes. A decode phase therefore costs O(sequences with an event),
and a run of eventless decode-only iterations (:meth:`WorkerModel.fast_forward`) costs O(1): p cannot
change inside it, so every step lasts the same ``decode_ms(p)``.
"""

from __future__ import annotations

import enum
import heapq
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from ..events.model import KvEvent
from .kv_cache import KvCache
from .timing import decode_ms, prefill_ms

__all__ = ["GENERATED_ID_BASE", "Iteration", "WorkerConfig", "WorkerModel", "generated_block_id"]

log = logging.getLogger(__name__)

GENERATED_ID_BASE: Final = 1 << 62
"""Generated (output) block ids live above this; trace hash ids must stay below it."""

_WORKER_SHIFT: Final = 50
_REQUEST_SHIFT: Final = 16


def generated_block_id(worker_id: int, request_serial: int, block_index: int) -> int:
    """The id of a request's ``block_index``-th block once generated tokens fill it.

    Derived from the worker, the request's serial on that worker and the block's position, so it is
    distinct from every other request's blocks and from every trace hash id (all below
    :data:`GENERATED_ID_BASE`), and stable across a preemption (a recompute can reuse it).
    """
    return GENERATED_ID_BASE | (worker_id << _WORKER_SHIFT) | (request_serial << _REQUEST_SHIFT) | block_index


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """The mocker's engine settings (``spec/routing-benchmark.md`` §6 engine config)."""

    block_size: int = 512
    """Tokens per KV block (one trace hash id)."""
    num_blocks: int = 2048
    """KV blocks per worker (``num_gpu_blocks``); do not change without re-running the anchors."""
    max_num_seqs: int = 256
    """Most sequences running (prefilling or decoding) at once."""
    max_num_batched_tokens: int = 8192
    """Tokens per iteration: prefill chunks plus one per decoding sequence."""
    prefix_sharing: Literal["scheduled", "computed"] = "scheduled"
    """What a sequence admitted while another prefills the same prefix reuses. ``"scheduled"`` (vLLM v1,
    Dynamo's mocker, the default and the routing grid's): every block a running prefill has been
    scheduled for, this iteration's chunk included, since vLLM caches a chunk's blocks when it schedules
    them (``KVCacheManager.allocate_slots``) and runs the step that computes them first. ``"computed"``
    (SGLang): only the chunks that have run, since the radix tree takes a chunk after it ran
    (``cache_unfinished_req``) and a prefill batch's prompts only once its result is processed."""

    def __post_init__(self) -> None:
        if self.prefix_sharing not in ("scheduled", "computed"):
            raise ValueError(f"prefix_sharing must be 'scheduled' or 'computed', got {self.prefix_sharing!r}")


@dataclass(slots=True)
class Iteration:
    """What one engine iteration did; everything in it happens at the iteration's end."""

    duration_ms: float
    """Prefill time plus decode time."""
    events: list[KvEvent] = field(default_factory=list)
    """KV events, in order (``Stored`` for newly registered full blocks, ``Removed`` for evictions)."""
    first_tokens: list[str] = field(default_factory=list)
    """Requests whose first token came out (prefill completed)."""
    finished: list[str] = field(default_factory=list)
    """Requests that emitted their last token; their blocks are released."""
    admitted: list[tuple[str, int]] = field(default_factory=list)
    """First admissions: (request id, prompt tokens reused from cache)."""
    preempted: list[str] = field(default_factory=list)
    """Requests preempted and requeued for recompute."""
    prefill_tokens: int = 0
    """Uncached tokens prefilled (the prefill polynomial's T)."""
    decode_tokens: int = 0
    """Tokens emitted by the decode phase (one per sequence that was decoding)."""


class _State(enum.Enum):
    WAITING = 0
    PREFILLING = 1
    """Running, part-way through its prefill."""
    PREFILLED = 2
    """Its last chunk ran this iteration; the first token comes out at the end of it."""
    DECODING = 3
    DONE = 4


class _Seq:
    """One request inside the engine."""

    __slots__ = (
        "admitted",
        "computed",
        "first_token_out",
        "full_ids",
        "generated",
        "held",
        "offset",
        "output_tokens",
        "partial",
        "prompt_tokens",
        "received",
        "request_id",
        "serial",
        "state",
        "target",
        "version",
    )

    def __init__(self, request_id: str, serial: int, prompt_tokens: int, output_tokens: int, ids: list[int]) -> None:
        self.request_id = request_id
        self.serial = serial
        """Admission order on this worker; orders ``running`` and the heap."""
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.full_ids = ids
        """Ids of the sequence's full blocks: the prompt's, then each generated block once promoted."""
        self.held = 0
        """Leading ``full_ids`` this sequence holds in the cache."""
        self.partial: int | None = None
        """The private tail block it holds, if any."""
        self.computed = 0
        """Tokens of ``target`` whose KV exists (cached or prefilled)."""
        self.target = 0
        """Tokens to prefill: prompt plus anything generated before a preemption."""
        self.generated = 0
        """Output tokens so far; while decoding, derived from the worker's decode step counter."""
        self.offset = 0
        """While decoding: ``generated == decode_steps - offset``."""
        self.state = _State.WAITING
        self.version = 0
        """Bumped on preemption and completion, so stale heap entries are skipped."""
        self.first_token_out = False
        self.admitted = False
        self.received = False
        """Its prompt's KV was transferred to this worker (disaggregated serving), until its first admission."""


class WorkerModel:
    """One simulated engine: KV pools, a vLLM-v1-like scheduler and the mocker's timing.

    Usage: :meth:`add_request` whenever a request is routed here, :meth:`step` for each iteration
    while :meth:`has_work`; when :meth:`decode_only`, up to ``next_event_steps() - 1`` iterations may be
    skipped at once with :meth:`fast_forward`.

    Args:
        worker_id: the worker named in KV events and in generated block ids.
        config: engine settings.
        dp_rank: the dp rank named in KV events.
    """

    def __init__(self, worker_id: int, config: WorkerConfig | None = None, *, dp_rank: int = 0) -> None:
        self.worker_id = worker_id
        self.config = config or WorkerConfig()
        self.kv = KvCache(worker_id, self.config.num_blocks, dp_rank=dp_rank)
        self._block_size = self.config.block_size
        self._computed_only = self.config.prefix_sharing == "computed"
        self._waiting: deque[_Seq] = deque()
        self._running: dict[int, _Seq] = {}
        """Prefilling and decoding sequences by serial, in admission order (LIFO preemption takes the last)."""
        self._prefilling: list[_Seq] = []
        """Running sequences part-way through their prefill, in admission order."""
        self._decoding = 0
        self._events: list[tuple[int, int, int, _Seq]] = []
        """Heap of (decode step, serial, version, seq): when each decoding sequence next needs the scheduler."""
        self._steps = 0
        """Decode phases run so far."""
        self._serials = 0
        self._requests: dict[str, _Seq] = {}
        self._in_decode = False
        self._preempted_now = False
        self._iteration: Iteration | None = None
        self.prefill_tokens_total = 0
        """Uncached prompt tokens this worker prefilled (recomputes included)."""
        self.preemptions = 0

    # -- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_tokens: int,
        output_tokens: int,
        block_ids: Sequence[int],
        *,
        received: bool = False,
    ) -> None:
        """Queue a request (FCFS). ``block_ids`` name its full prompt blocks: ``prompt_tokens // block_size`` ids.
        ``received``: a decode hop whose prompt's KV was pulled from a prefill worker (:meth:`receive` stored the
        full blocks first): see "Received prompts" in the module docstring.

        Raises:
            ValueError: the ids do not match the prompt, an id is negative or in the generated range,
                the request cannot fit in the pool, it asks for no output, or the id is already here.
        """
        size = self._block_size
        if len(block_ids) != prompt_tokens // size:
            raise ValueError(
                f"request {request_id!r}: {len(block_ids)} block ids for {prompt_tokens} tokens "
                f"(expected {prompt_tokens // size} full {size}-token blocks)"
            )
        if output_tokens < 1:
            raise ValueError(f"request {request_id!r}: output_tokens must be >= 1, got {output_tokens}")
        if any(not 0 <= block < GENERATED_ID_BASE for block in block_ids):
            raise ValueError(f"request {request_id!r}: block ids must be in [0, 2**62)")
        if -(-(prompt_tokens + output_tokens) // size) > self.config.num_blocks:
            raise ValueError(f"request {request_id!r} needs more than the pool's {self.config.num_blocks} blocks")
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already on worker {self.worker_id}")
        seq = _Seq(request_id, self._serials, prompt_tokens, output_tokens, list(block_ids))
        seq.received = received
        self._serials += 1
        self._requests[request_id] = seq
        self._waiting.append(seq)

    def receive(self, block_ids: Sequence[int]) -> list[KvEvent]:
        """A KV transfer landed (disaggregated serving): the prompt's leading full blocks ``block_ids`` are stored
        and cached, as a decode engine stores the blocks it pulled, for the request added next to find. Call it
        between iterations. Returns the events an engine publishes for them (``Stored``, and ``Removed`` for what
        made room); blocks already cached are not stored again, and a full pool stores fewer."""
        held = self.kv.acquire_full(block_ids, None)
        self.kv.release(reversed(block_ids[:held]))
        self.kv.settle()
        return self.kv.drain_events()

    # -- state ----------------------------------------------------------------------------------

    def has_work(self) -> bool:
        """Anything waiting or running."""
        return bool(self._waiting or self._running)

    def decode_only(self) -> bool:
        """Nothing waiting or prefilling, and something decoding: iterations differ only in token counts."""
        return not self._waiting and not self._prefilling and self._decoding > 0

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_decoding(self) -> int:
        return self._decoding

    @property
    def kv_usage(self) -> float:
        """p of the decode polynomial: active blocks / capacity."""
        return self.kv.active_blocks / self.config.num_blocks

    def next_event_steps(self) -> int:
        """Decode steps until the next one in which some sequence crosses a block boundary or finishes.

        The iterations before it (``next_event_steps() - 1`` of them) are eventless while
        :meth:`decode_only`: safe to :meth:`fast_forward`. Large when nothing is decoding.
        """
        heap = self._events
        while heap:
            step, _, version, seq = heap[0]
            if seq.version == version:
                return step - self._steps
            heapq.heappop(heap)
        return 1 << 62

    def decode_step_ms(self) -> float:
        """Duration of a decode-only iteration now."""
        return decode_ms(self.kv_usage)

    def fast_forward(self, steps: int) -> float:
        """Run ``steps`` decode-only iterations at once; returns their total milliseconds.

        Raises:
            ValueError: not :meth:`decode_only`, or ``steps`` reaches the next event.
        """
        if not self.decode_only():
            raise ValueError(f"worker {self.worker_id}: fast_forward needs a decode-only worker")
        if not 0 <= steps < self.next_event_steps():
            raise ValueError(f"worker {self.worker_id}: {steps} steps reach the next event")
        self._steps += steps
        return steps * decode_ms(self.kv_usage)

    def generated_tokens(self, request_id: str) -> int:
        """Output tokens ``request_id`` has emitted so far (0 once it is gone)."""
        seq = self._requests.get(request_id)
        if seq is None:
            return 0
        return self._steps - seq.offset if seq.state is _State.DECODING else seq.generated

    def held_blocks(self, request_id: str) -> list[int]:
        """The block ids ``request_id`` holds, prefix first (partial block last, negative)."""
        seq = self._requests.get(request_id)
        if seq is None:
            return []
        held = seq.full_ids[: seq.held]
        return held if seq.partial is None else [*held, seq.partial]

    # -- one iteration --------------------------------------------------------------------------

    def step(self) -> Iteration:
        """Run one engine iteration (prefill phase, then decode phase) and report it."""
        it = self._iteration = Iteration(0.0)
        self._preempted_now = False
        size = self._block_size
        budget = self.config.max_num_batched_tokens - self._decoding
        done_prefill: list[_Seq] = []
        new_tokens = 0
        forward = False
        """A received prompt was admitted: its first token takes a forward pass even with nothing else decoding."""

        # 1a. Running sequences continue their prefill.
        for seq in list(self._prefilling):
            if budget <= 0:
                break
            if seq.state is not _State.PREFILLING:  # preempted by an earlier chunk's allocation
                continue
            chunk = min(seq.target - seq.computed, budget)
            if not self._grow(seq, seq.computed + chunk):
                continue  # preempted itself
            seq.computed += chunk
            budget -= chunk
            new_tokens += chunk
            if seq.computed >= seq.target:
                self._prefilling.remove(seq)
                seq.state = _State.PREFILLED
                done_prefill.append(seq)

        # 1b. Admit waiting sequences, first come first served.
        while self._waiting and budget > 0 and not self._preempted_now:
            if len(self._running) >= self.config.max_num_seqs:
                break
            seq = self._waiting.popleft()
            seq.target = seq.prompt_tokens + seq.generated
            hits = self.kv.prefix_hits(seq.full_ids, computed_only=self._computed_only)
            cached = min(hits * size, seq.target)
            reused = min(cached, seq.prompt_tokens)
            if seq.received and hits == len(seq.full_ids):  # the partial last block travelled with the rest
                cached = seq.target
                forward = True
            seq.received = False
            chunk = min(seq.target - cached, budget)
            seq.held = self.kv.acquire_full(seq.full_ids[:hits], None)
            seq.computed = cached
            if not self._grow(seq, cached + chunk, admitting=True):
                self._release(seq)
                seq.computed = 0
                self._waiting.appendleft(seq)
                break
            if not seq.admitted:
                seq.admitted = True
                it.admitted.append((seq.request_id, reused))
            self._running[seq.serial] = seq
            seq.computed += chunk
            budget -= chunk
            new_tokens += chunk
            if seq.computed >= seq.target:
                seq.state = _State.PREFILLED
                done_prefill.append(seq)
            else:
                seq.state = _State.PREFILLING
                self._prefilling.append(seq)

        # 2. Decode phase: p after the prefill phase's allocations.
        duration = prefill_ms(new_tokens)
        if self._decoding:  # (fewer than at the start if the prefill phase preempted some)
            duration += decode_ms(self.kv_usage)
            it.decode_tokens = self._decoding
            self._decode_phase()
        elif forward:
            duration += decode_ms(self.kv_usage)

        # 3. Sequences that finished prefilling emit their first token (the prefill's output).
        for seq in done_prefill:
            if seq.state is not _State.PREFILLED:  # preempted after its last chunk
                continue
            if not seq.first_token_out:
                seq.first_token_out = True
                it.first_tokens.append(seq.request_id)
            seq.generated += 1
            if self._on_token(seq):
                self._start_decoding(seq)

        it.duration_ms = duration
        it.prefill_tokens = new_tokens
        self.prefill_tokens_total += new_tokens
        it.events = self.kv.drain_events()
        self.kv.settle()
        self._iteration = None
        return it

    def _decode_phase(self) -> None:
        self._steps += 1
        step = self._steps
        heap = self._events
        due: list[_Seq] = []
        while heap and heap[0][0] <= step:
            _, _, version, seq = heapq.heappop(heap)
            if seq.version == version:
                due.append(seq)
        self._in_decode = True
        for seq in due:  # heap order is (step, serial): running order within a step
            if seq.state is not _State.DECODING:  # preempted by an earlier sequence's allocation
                continue
            seq.generated = step - seq.offset
            if self._on_token(seq):
                self._push_event(seq)
        self._in_decode = False

    def _start_decoding(self, seq: _Seq) -> None:
        seq.state = _State.DECODING
        seq.offset = self._steps - seq.generated
        self._decoding += 1
        self._push_event(seq)

    def _push_event(self, seq: _Seq) -> None:
        """Schedule the decode step at which ``seq`` next crosses a block boundary or finishes."""
        size = self._block_size
        length = seq.prompt_tokens + seq.generated
        boundary = ((length - 1) // size + 1) * size + 1  # next length with a fresh block
        steps = min(boundary - length, seq.output_tokens - seq.generated)
        heapq.heappush(self._events, (self._steps + steps, seq.serial, seq.version, seq))

    def _on_token(self, seq: _Seq) -> bool:
        """``seq`` just emitted its ``generated``-th token: promote / allocate / finish.

        Returns:
            Whether it is still running (False: finished, or preempted to make room for its block).
        """
        size = self._block_size
        length = seq.prompt_tokens + seq.generated
        crossing = length % size == 1 or size == 1
        if crossing and seq.partial is not None:  # the tail block just filled: register it
            index = len(seq.full_ids)
            full = generated_block_id(self.worker_id, seq.serial, index)
            self.kv.promote(seq.partial, full, seq.full_ids[index - 1] if index else None)
            seq.full_ids.append(full)
            seq.held += 1
            seq.partial = None
        if seq.generated >= seq.output_tokens:
            self._finish(seq)
            return False
        if crossing:
            while (block := self.kv.acquire_partial()) is None:
                if self._preempt_last() is seq:
                    return False
            seq.partial = block
        return True

    def _grow(self, seq: _Seq, computed: int, *, admitting: bool = False) -> bool:
        """Hold the blocks for ``seq``'s first ``computed`` tokens, preempting (LIFO) as needed.

        Returns:
            False when ``seq`` itself was preempted, or (``admitting``) the blocks are not there.
        """
        size = self._block_size
        needed = -(-computed // size)
        full = min(needed, len(seq.full_ids))
        while True:
            if seq.held < full:
                parent = seq.full_ids[seq.held - 1] if seq.held else None
                seq.held += self.kv.acquire_full(seq.full_ids[seq.held : full], parent)
            if seq.held >= full:
                if needed <= full or seq.partial is not None:
                    return True
                block = self.kv.acquire_partial()
                if block is not None:
                    seq.partial = block
                    return True
            if admitting:  # a new sequence waits for blocks; it never preempts (vLLM v1)
                return False
            if self._preempt_last() is seq:
                return False

    # -- freeing --------------------------------------------------------------------------------

    def _release(self, seq: _Seq) -> None:
        tail = [] if seq.partial is None else [seq.partial]
        self.kv.release([*tail, *reversed(seq.full_ids[: seq.held])])
        seq.partial = None
        seq.held = 0

    def _finish(self, seq: _Seq) -> None:
        if seq.state is _State.DECODING:
            self._decoding -= 1
        self._release(seq)
        seq.state = _State.DONE
        seq.version += 1
        del self._running[seq.serial]
        del self._requests[seq.request_id]
        assert self._iteration is not None
        self._iteration.finished.append(seq.request_id)

    def _preempt_last(self) -> _Seq:
        """Preempt the most recently admitted running sequence; returns it."""
        serial = next(reversed(self._running))
        seq = self._running.pop(serial)
        if seq.state is _State.DECODING:
            # Inside the decode phase the victim (later in running order) has not had this step's token.
            seq.generated = self._steps - seq.offset - (1 if self._in_decode else 0)
            self._decoding -= 1
        elif seq.state is _State.PREFILLING:
            self._prefilling.remove(seq)
        self._release(seq)
        seq.computed = 0
        seq.state = _State.WAITING
        seq.version += 1
        self._waiting.appendleft(seq)
        self._preempted_now = True
        self.preemptions += 1
        if self._iteration is not None:
            self._iteration.preempted.append(seq.request_id)
        log.debug("preempted worker=%d request=%s generated=%d", self.worker_id, seq.request_id, seq.generated)
        return seq
