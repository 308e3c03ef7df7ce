"""The continuous-batching policy: which requests run in the next step, with how many tokens.

One implementation, two hosts: the engine's `pagedkv.engine.scheduler.Scheduler` and the fleet
simulator's `pagedkv.sim.replica.Replica` both subclass `SchedulingPolicy` and call
`build_batch`, so the simulator cannot drift from the engine's decisions. The policy (vLLM's):

1. RUNNING requests first, in admission order, within the token budget
   (``max_num_batched_tokens``): a decode token, or the next prefill chunk (capped by the budget
   and ``max_model_len``; with a Mamba group caching checkpoints, cut to a block boundary).
   When the pool cannot hold a request's slots, the most recently admitted running request is
   preempted (FCFS; its tokens leave the batch, its budget comes back) until it fits; a request
   alone in the pool that still cannot grow is stopped (its sequence outgrew the whole cache).
2. WAITING requests next, only in a step without preemption (a freed pool is not refilled by
   the requests that caused the pressure), up to ``max_num_seqs`` running: prefix lookup, then
   the external tokens (a KV connector, a CPU tier) beyond it, capped so at least the last
   prompt token is computed, then one allocation for the rest of the prompt, chunked to the
   remaining budget, admitted only if its whole sequence fits (``full_sequence_must_fit``).
   Admission is strict FCFS: a new request that does not fit stops admission, except that
   requests already holding blocks (a connector's loaded KV) may still go on.

The hosts own everything else: what a preemption, a stop or an admission does to their
request objects (the engine tells its connector; the simulator offers blocks to its tier and
counts), where external tokens come from, and what the batch becomes (the engine's
`SchedulerOutput`; the simulator's modelled step). They do so by overriding the hooks below,
which never decide anything. Torch-free, like all of core/.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

from pagedkv.core.kv_cache_manager import KVCacheManager
from pagedkv.core.request import KVCacheRequest, RequestStatus

R = TypeVar("R")  # the host's request object (hashable by identity)

# An admission's answer: ``(computed, n)`` admitted, to compute ``n`` tokens after
# ``computed``; None: no room (strict FCFS stops here); False: not admitted this step, the next
# waiting request may go.
Admission = tuple[int, int] | Literal[False] | None


@dataclass(slots=True, eq=False)
class Chunk(Generic[R]):
    """One request's share of a step: ``n`` tokens after the ``start`` already computed."""

    request: R
    start: int
    n: int


@dataclass(slots=True)
class Batch(Generic[R]):
    """What `SchedulingPolicy.build_batch` decided for one step. ``chunks``: by request, in
    batch order (running requests first, then the admitted ones); ``preempted`` and
    ``stopped`` (outgrew the whole cache): in decision order, already handed to the hooks."""

    chunks: dict[R, Chunk[R]] = field(default_factory=dict)
    preempted: list[R] = field(default_factory=list)
    stopped: list[R] = field(default_factory=list)
    num_admitted: int = 0
    budget_left: int = 0


class SchedulingPolicy(Generic[R]):
    """The decisions (see the module docstring) over the host's queues ``waiting`` (preempted
    requests go back to its head) and ``running`` (admission order). A host subclasses it and
    overrides the hooks; `build_batch` never sets ``num_computed_tokens`` past what is already
    computed: the host does it for the chunks it runs."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        mamba_block_size: int | None = None,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # Block size of a Mamba group that caches checkpoints: prefill chunks end on its
        # boundaries (vLLM's align mode), so a step's last state is a checkpoint.
        self.mamba_block_size = mamba_block_size
        self.waiting: deque[R] = deque()
        self.running: list[R] = []

    # ---- hooks (the host's side effects; no decisions) ---------------------------------------

    def _kv_request(self, item: R) -> KVCacheRequest:
        """The KV-cache side of the host's request object."""
        raise NotImplementedError

    def _preempt(self, item: R) -> None:
        """``item`` (already popped from ``running``) is preempted: free its blocks, reset it to
        recompute from scratch and put it back at the head of ``waiting``."""
        raise NotImplementedError

    def _stop_cache_exhausted(self, item: R) -> None:
        """``item``, alone in ``running``, cannot grow: finish it (length capped), out of
        ``running``, its blocks freed."""
        raise NotImplementedError

    def _resume_holding(self, item: R, budget: int) -> Admission:
        """A waiting request that already holds blocks (the engine: KV loaded by a connector)
        goes on from them: ``(computed, n)``, or False (not this step). None: it holds no
        blocks, admit it as a new request (the default)."""
        return None

    def _any_holding_waiting(self) -> bool:
        """Whether some waiting request holds blocks (may pass a new request that did not fit)."""
        return False

    def _external_tokens(self, item: R, num_hit: int) -> tuple[int, bool] | None:
        """Tokens after the ``num_hit`` prefix hit whose KV comes from outside (a connector, a
        tier, a prefill replica) and whether they load asynchronously; None: undecided, skip
        it this step. Default: none."""
        return 0, False

    def _allocated(self, item: R, num_hit: int, num_ext: int, load_async: bool) -> bool:
        """``item``'s admission allocation succeeded. False: not admitted this step (the engine
        parks an asynchronous load); True: admitted (the default)."""
        return True

    def _admitted(self, item: R, computed: int) -> None:
        """``item`` moved from ``waiting`` to ``running`` with ``computed`` tokens computed."""
        req = self._kv_request(item)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = computed

    # ---- the decisions ---------------------------------------------------------------------------

    def build_batch(self) -> Batch[R]:
        """Decide the next step (module docstring): running requests, preemptions and stops,
        then admissions in a step without preemption."""
        batch: Batch[R] = Batch()
        budget = self._schedule_running(batch, self.max_num_batched_tokens)
        if not batch.preempted:
            budget = self._schedule_waiting(batch, budget)
        batch.budget_left = budget
        return batch

    def _schedule_running(self, batch: Batch[R], budget: int) -> int:
        kv, running, chunks = self.kv_cache_manager, self.running, batch.chunks
        max_len, mamba_bs, kv_request = self.max_model_len, self.mamba_block_size, self._kv_request
        i = 0
        while i < len(running) and budget > 0:
            item = running[i]
            req = kv_request(item)
            start = req.num_computed_tokens
            n = min(req.num_tokens - start, budget, max_len - start)
            if mamba_bs is not None:
                n = self._mamba_block_aligned_split(req, start, n)
            if req.kv_eviction is not None:
                n = self._eviction_chunk(req, start, n)
            if n <= 0:
                i += 1
                continue
            while kv.allocate_slots(req, n) is None:
                if len(running) == 1 and running[0] is item:
                    # Alone and still no room: its sequence outgrew the whole KV cache.
                    # Preempting it would loop forever (re-admission needs the same room).
                    self._stop_cache_exhausted(item)
                    batch.stopped.append(item)
                    break
                victim = running.pop()  # FCFS: the latest admitted goes first
                dropped = chunks.pop(victim, None)
                if dropped is not None:
                    budget += dropped.n
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is item:
                    break
            else:
                chunks[item] = Chunk(item, start, n)
                budget -= n
                i += 1
        return budget

    def _schedule_waiting(self, batch: Batch[R], budget: int) -> int:
        waiting, running, chunks = self.waiting, self.running, batch.chunks
        idx = 0
        no_room = False  # a new request did not fit: only requests holding blocks may still go
        while idx < len(waiting) and budget > 0 and len(running) < self.max_num_seqs:
            item = waiting[idx]
            got = self._resume_holding(item, budget)
            if got is None:
                if no_room:
                    idx += 1
                    continue
                got = self._admit(item, budget)
                if got is None:
                    # Strict FCFS: no new request behind it overtakes it for memory; but
                    # requests holding blocks may go on (else they would hold them for ever).
                    if not self._any_holding_waiting():
                        break
                    no_room = True
                    idx += 1
                    continue
            if got is False:
                idx += 1  # undecided, or parked: the next one may go
                continue
            computed, n = got
            del waiting[idx]
            running.append(item)
            self._admitted(item, computed)
            chunks[item] = Chunk(item, computed, n)
            batch.num_admitted += 1
            budget -= n
        return budget

    def _admit(self, item: R, budget: int) -> Admission:
        """Prefix lookup, external tokens and allocation for a new (or preempted) request."""
        kv = self.kv_cache_manager
        req = self._kv_request(item)
        hits, num_hit = kv.get_computed_blocks(req)
        ext = self._external_tokens(item, num_hit)
        if ext is None:
            return False
        num_ext, load_async = ext
        load_async = load_async and num_ext > 0
        if not load_async:  # compute at least the last token: its logits give the next one
            num_ext = max(min(num_ext, req.num_tokens - 1 - num_hit), 0)
        n = 0
        if not load_async:
            n = min(req.num_tokens - num_hit - num_ext, budget)
            if self.mamba_block_size is not None:
                n = self._mamba_block_aligned_split(req, num_hit + num_ext, n)
            if req.kv_eviction is not None:
                n = self._eviction_chunk(req, num_hit + num_ext, n)
                if n <= 0:
                    return None  # not one whole block of budget left: next step
        if (
            kv.allocate_slots(
                req,
                n,
                num_hit,
                hits,
                num_external_computed_tokens=num_ext,
                delay_cache_blocks=load_async,
                full_sequence_must_fit=True,
            )
            is None
        ):
            return None
        if not self._allocated(item, num_hit, num_ext, load_async):
            return False
        return num_hit + num_ext, n

    def _eviction_chunk(self, req: KVCacheRequest, num_computed: int, n: int) -> int:
        """Token eviction (`core.token_eviction`): a streaming prefill runs in chunks of at
        most ``chunk_tokens`` that end on block boundaries, but the last (so no token reads
        far more than the window, and the request never holds more than its ceiling); a
        snapkv/pyramidkv chunk ends at the compression point (its step compresses)."""
        ev = req.kv_eviction
        assert ev is not None
        bs = self.kv_cache_manager.kv_cache_groups[0].kv_cache_spec.block_size
        cap = ev.chunk_tokens(bs)
        if cap is not None:
            end = num_computed + min(n, cap)
            if end < req.num_tokens:  # end on a block boundary (the ceiling counts on it)
                end = end // bs * bs
            return end - num_computed  # <= 0: no whole block fits in this step's budget
        point = ev.compression_point(req.num_prompt_tokens)
        if num_computed < point < num_computed + n:
            return point - num_computed
        return n

    def _mamba_block_aligned_split(self, req: KVCacheRequest, num_computed: int, n: int) -> int:
        """vLLM's ``_mamba_block_aligned_split``: with a Mamba group caching checkpoints, a
        prefill chunk is cut to end on a block boundary, or on the last boundary before the
        prompt end (``last_cache_position``) when it would cross it. A chunk that would become
        empty (a budget below one block) is left as it is: that costs at most the checkpoint
        of this step's end under ``prefix_cache_retention_interval=0`` (with the dense default
        the mixer checkpoints every boundary a step crosses), never correctness."""
        bs = self.mamba_block_size
        if bs is None or n <= 0 or req.output_token_ids:
            return n
        last = req.num_tokens // bs * bs
        end = num_computed + n
        if end < last:
            aligned = end // bs * bs
        elif num_computed < last < end:
            aligned = last
        else:
            return n
        return aligned - num_computed if aligned > num_computed else n
