"""Continuous batching and the request lifecycle: which tokens of which requests run in the next
forward pass, and what the sampled tokens do to each request.

``schedule() -> SchedulerOutput`` builds one flat batch inside a token budget
(``max_num_batched_tokens``). Steps 1 and 2 are `pagedkv.core.scheduling.SchedulingPolicy`,
the one policy the engine and the fleet simulator (`pagedkv.sim.replica`) share; this class
supplies what they do to a `Request` (its connector, its metrics) and step 3:

1. RUNNING requests first, in admission order: a decode token, or the next prefill chunk.
   When the pool cannot hold their slots, the most recently admitted running request is
   preempted (FCFS): its blocks are freed, it restarts from scratch later (recompute), and its
   prefix blocks usually come back as prefix-cache hits.
2. WAITING requests next (only in a step without preemption, so a freed pool is not refilled
   by the requests that caused the pressure), up to ``max_num_seqs`` running: prefix lookup
   (`get_computed_blocks`), then `allocate_slots` for the rest of the prompt, chunked to the
   remaining budget. A new request is admitted only if its whole prompt fits in the pool
   (vLLM's ``scheduler_reserve_full_isl``), so a chunked prompt is not admitted only to be
   preempted a few steps later. Admission is strict FCFS (head-of-line).
3. A request of ``n > 1`` whose prompt ends this step names its ``n - 1`` children
   (``SchedulerOutput.forks``): they are sampled from its logits in the same step.

``update_from_output(scheduler_output, model_runner_output) -> EngineCoreOutputs`` then owns
the rest of the step: it forks the children (sharing the parent's prompt blocks), appends each
sampled token (which hashes newly full blocks), applies the token-level stops (EOS, stop token
ids, ``max_tokens``, ``max_model_len``) and finishes and frees the requests that stopped.
Stop strings need text: the output processor finds them and finishes the request through
`finish_requests`.

With a KV connector (`kv_transfer.base.KVConnectorBase`, the only connector type known here):
a waiting request's external tokens (``get_num_new_matched_tokens``) are loaded into its
freshly allocated blocks; asynchronous ones park it in ``WAITING_FOR_REMOTE_KVS`` (blocks
allocated, not scheduled) until the worker reports it in ``finished_recving``, then it is
scheduled from its loaded prefix. Blocks the worker reports invalid are recomputed (their
prefix-cache hashes dropped, ``num_computed_tokens`` rewound) or fail the request with
``finish_reason "error"``, per ``kv_load_failure_policy``. A finished request's blocks stay
allocated while the connector sends them (``request_finished`` returned ``delay_free``) until
it appears in ``finished_sending``.

``num_computed_tokens`` advances when a request is scheduled (the KV of scheduled tokens is
"written or being written"); a request is sampled in the step its scheduled tokens reach
``num_tokens``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable

from pagedkv.core.kv_cache_manager import KVCacheManager
from pagedkv.core.request import RequestStatus
from pagedkv.core.scheduling import Admission, SchedulingPolicy
from pagedkv.core.specs import KVCacheConfig, MambaSpec
from pagedkv.engine.request import FINISHED_REASONS, Request
from pagedkv.engine.scheduler_output import (
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from pagedkv.kv_transfer.base import KVConnectorBase, KVConnectorOutput

__all__ = ["Scheduler", "SchedulerOutput", "ScheduledRequest"]  # re-exported for compatibility

logger = logging.getLogger(__name__)


class Scheduler(SchedulingPolicy[Request]):
    """Builds its own `KVCacheManager` from ``kv_cache_config`` (``enable_caching``: prefix
    caching; ``enable_kv_cache_events``; ``kv_cache_medium``: where the blocks live, for KV
    events). ``connector``: the engine's KV connector, if any. The batch decisions are the
    shared `SchedulingPolicy`'s (the simulator's replicas run the same code)."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        connector: KVConnectorBase | None = None,
        *,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        kv_cache_medium: str = "GPU",
    ) -> None:
        kv_cache_manager = KVCacheManager(
            kv_cache_config,
            max_model_len,
            enable_caching=enable_caching,
            enable_kv_cache_events=enable_kv_cache_events,
            medium=kv_cache_medium,
        )
        # Block size of a Mamba group that caches checkpoints (see `SchedulingPolicy`).
        mamba_block_size = None
        if enable_caching:
            mamba_block_size = next(
                (
                    g.kv_cache_spec.block_size
                    for g in kv_cache_config.kv_cache_groups
                    if isinstance(g.kv_cache_spec, MambaSpec)
                ),
                None,
            )
        super().__init__(
            kv_cache_manager, max_num_seqs, max_num_batched_tokens, max_model_len, mamba_block_size
        )
        self.connector = connector
        self.kv_load_failure_policy = (
            connector.config.kv_load_failure_policy if connector else "recompute"
        )
        # Requests whose asynchronous load the worker reported done, not yet promoted.
        self.finished_recving_kv_req_ids: set[str] = set()
        # Promoted from WAITING_FOR_REMOTE_KVS, holding their blocks, not yet running.
        self.promoted_req_ids: set[str] = set()
        # Finished requests whose blocks a transfer still uses, with what is pending: "send"
        # (``delay_free``: until ``finished_sending``) and/or "recv" (aborted while its KV was
        # arriving: until ``finished_recving``). Freed when nothing is pending.
        self.delayed_free: dict[str, tuple[Request, set[str]]] = {}
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.pending_copies: list[tuple[int, int]] = []
        # Finished since the last schedule(): handed to the workers in the next SchedulerOutput.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0

    # ---- queues -----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests wherever they are (abort, or a stop string the output processor
        found) and free their blocks. Unknown (already finished) ids are ignored."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            self._free_request(req, status)
            done.append(req)
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_pending_kv_transfers(self) -> bool:
        """Blocks held for a connector's transfer (or its own pending work): the engine keeps
        stepping until they are settled."""
        return bool(self.delayed_free) or (
            self.connector is not None and self.connector.has_pending_work()
        )

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- scheduling ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The next step's batch: the shared policy (`SchedulingPolicy.build_batch`) decides,
        this turns its decision into the workers' `SchedulerOutput`."""
        out = SchedulerOutput(blocks_to_copy=self.pending_copies)
        self.pending_copies = []
        if self.finished_req_ids:
            out.finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()
        if self.connector is not None:
            self.connector.on_schedule_start()
        kv = self.kv_cache_manager
        kv.release_deferred()  # blocks a compaction replaced: the step that read them is done
        batch = self.build_batch()
        out.preempted = batch.preempted
        out.finished = batch.stopped
        for c in batch.chunks.values():
            req, start, n = c.request, c.start, c.n
            req.num_computed_tokens = end = start + n
            sr = ScheduledRequest(req, start, n, kv.get_block_ids(req.request_id))
            if req.kv_eviction is not None:
                self._eviction_step(req, sr)
            out.scheduled.append(sr)
            out.num_batched_tokens += n
            if req.fork_pending and end >= req.num_tokens and not req.output_token_ids:
                # Its prompt ends this step: its siblings are sampled from the same logits.
                out.forks.extend((req, req.make_child(k)) for k in range(1, req.fork_pending + 1))
                req.fork_pending = 0
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def _eviction_step(self, req: Request, sr: ScheduledRequest) -> None:
        """Token eviction's part of a scheduled request (`core.token_eviction`): its cache
        offset; for streaming with cache positions, the shift its window's keys take for the
        blocks released this step; for snapkv, the compacted table when this step reaches the
        compression point (the step itself still runs on the old table)."""
        ev = req.kv_eviction
        assert ev is not None
        sr.kv_offset = req.num_evicted_tokens
        if ev.positions == "cache":
            sr.cache_positions = True
            sr.rerotate = req.num_evicted_tokens - req.kv_rotated_offset
            bs = self.kv_cache_manager.kv_cache_groups[0].kv_cache_spec.block_size
            sr.rerotate_from = ev.sink_blocks(bs) * bs
            req.kv_rotated_offset = req.num_evicted_tokens
        sr.layer_shift = req.kv_layer_shift
        end = sr.start + sr.num_tokens
        point = ev.compression_point(req.num_prompt_tokens)
        if (
            ev.compacts
            and sr.kv_offset == 0
            and end == point
            and ev.compresses(req.num_prompt_tokens)
        ):
            kept = ev.kept_tokens(point)
            sr.compaction = self.kv_cache_manager.compact_blocks(req, max(kept))
            sr.layer_kept = kept
            if min(kept) < max(kept):  # pyramidkv: deeper layers write earlier from now on
                req.kv_layer_shift = [max(kept) - k for k in kept]

    # ---- the policy's hooks (`SchedulingPolicy`): what its decisions do to a `Request` -----------

    def _kv_request(self, item: Request) -> Request:
        return item

    def _resume_holding(self, req: Request, budget: int) -> Admission:
        """A request whose KV a connector loaded goes on from its valid prefix (it already
        holds its blocks); one whose load is still in flight waits."""
        rid = req.request_id
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            if rid not in self.finished_recving_kv_req_ids:
                return False  # its KV is still arriving
            self._promote_remote_kv(req)
        if rid not in self.promoted_req_ids:
            return None
        computed = req.num_computed_tokens
        n = min(req.num_tokens - computed, budget)
        if self.kv_cache_manager.allocate_slots(req, n) is None:
            return False
        self.promoted_req_ids.discard(rid)
        return computed, n

    def _any_holding_waiting(self) -> bool:
        return bool(self.promoted_req_ids or self.finished_recving_kv_req_ids)

    def _external_tokens(self, req: Request, num_hit: int) -> tuple[int, bool] | None:
        """The connector's answer (None: a tier is still answering: leave it waiting, try the
        next one, vLLM's skip; its deferral clock runs only while it is considered, so waiting
        for a batch slot later never costs it its tier hits)."""
        if self.connector is None:
            return 0, False
        ext, load_async = self.connector.get_num_new_matched_tokens(req, num_hit)
        return None if ext is None else (ext, load_async)

    def _allocated(self, req: Request, num_hit: int, num_ext: int, load_async: bool) -> bool:
        """Tell the connector its blocks; an asynchronous load parks the request in
        ``WAITING_FOR_REMOTE_KVS`` (blocks allocated, not scheduled) until it arrives."""
        if self.connector is not None:
            req.num_computed_tokens = num_hit
            block_ids = self.kv_cache_manager.get_block_ids(req.request_id)
            self.connector.update_state_after_alloc(req, block_ids, num_ext)
        if load_async:
            req.num_computed_tokens = num_hit + num_ext  # provisional, until the KV arrives
            req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            return False
        return True

    def _admitted(self, req: Request, computed: int) -> None:
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = computed
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = computed
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = time.monotonic()

    def _promote_remote_kv(self, req: Request) -> None:
        """``req``'s asynchronous load ended (failed blocks were already cut off by
        `_handle_invalid_blocks`): register its loaded blocks in the prefix cache; if the whole
        prompt arrived, recompute its last token, whose logits give the first output token. It
        goes on from its valid prefix, even an empty one (the connector is not asked again)."""
        self.finished_recving_kv_req_ids.discard(req.request_id)
        self.promoted_req_ids.add(req.request_id)
        req.status = RequestStatus.WAITING
        self.kv_cache_manager.cache_blocks(req, req.num_computed_tokens)
        if req.num_computed_tokens >= req.num_tokens:
            req.num_computed_tokens = req.num_tokens - 1

    def _stop_cache_exhausted(self, req: Request) -> None:
        kv = self.kv_cache_manager
        pool = kv.block_pool
        logger.warning(
            "request %s stopped at %d tokens: the whole KV cache (%d tokens) cannot hold more",
            req.request_id,
            req.num_tokens,
            (pool.num_gpu_blocks - 1) * kv.kv_cache_groups[0].kv_cache_spec.block_size,
        )
        self._free_request(req, RequestStatus.FINISHED_LENGTH_CAPPED)

    def _release(self, req: Request, was_loading: bool = False) -> dict | None:
        """Free the request's blocks once no transfer uses them: at once, or when the connector
        reports the send it asked to delay (``delay_free``) and/or the load still in flight
        (which may write into them: vLLM's rule). Returns the connector's
        ``kv_transfer_params`` for the client."""
        rid = req.request_id
        self.promoted_req_ids.discard(rid)
        params = None
        if self.connector is not None:
            delay, params = self.connector.request_finished(
                req, self.kv_cache_manager.get_block_ids(rid)
            )
            pending = {"send"} if delay else set()
            if was_loading and rid not in self.finished_recving_kv_req_ids:
                pending.add("recv")
            self.finished_recving_kv_req_ids.discard(rid)
            if pending:
                self.delayed_free[rid] = (req, pending)
                return params
        self.kv_cache_manager.free(req)
        return params

    def _preempt(self, req: Request) -> None:
        if self.connector is not None:
            self.connector.on_preempt(req, self.kv_cache_manager.get_block_ids(req.request_id))
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.kv_rotated_offset = 0  # recomputed from scratch: keys rotated afresh
        req.kv_layer_shift = None
        req.num_preemptions += 1
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _free_request(self, req: Request, status: RequestStatus) -> dict | None:
        """The one way a request ends: out of its queue, forgotten, blocks freed (or held for
        the connector, see `_release`), ``status`` set, and its id handed to the workers in the
        next `SchedulerOutput`. Returns the connector's ``kv_transfer_params``."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        del self.requests[req.request_id]
        was_loading = req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        req.status = status
        params = self._release(req, was_loading)
        self.finished_req_ids.add(req.request_id)
        return params

    # ---- after the forward pass -------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Apply one step's sampled tokens: fork the step's children, append one token per
        row, stop and free the requests that hit EOS, a stop token id, ``max_tokens`` or
        ``max_model_len``. Returns one `EngineCoreOutput` per request that got a token, after
        one per request `schedule()` stopped (finish reason "length").

        Rows of requests no longer known (finished meanwhile) are skipped, and so are forks of
        a parent that finished (a failed step). Forks are consumed on the first call and the
        ``finished`` list on success, so calling again after a failure (with an empty runner
        output) reports what the failed call did not.
        """
        so = scheduler_output
        outputs = (
            [
                EngineCoreOutput(r.request_id, [], finish_reason=FINISHED_REASONS[r.status])
                for r in so.finished
            ]
            if so.finished
            else []
        )
        mro = model_runner_output
        kco = mro.kv_connector_output
        dropped: set[str] = set()
        if kco is not None and self.connector is not None:
            self.connector.update_connector_output(kco)
            if kco.invalid_block_ids:
                dropped = self._handle_invalid_blocks(kco.invalid_block_ids, outputs)
        forked: list[Request] = []
        if so.forks:
            forks, so.forks = so.forks, []
            # Before any parent may finish (and free its blocks) below.
            forked = [
                child
                for parent, child in forks
                if self._fork_unless_dropped(parent, child, dropped)
            ]
        if mro.req_ids:
            self._append_tokens(mro, outputs, dropped)
        if so.finished:
            so.finished = []
        if kco is not None:
            self._update_from_kv_xfer_finished(kco)
        return EngineCoreOutputs(outputs, forked)

    def _fork_unless_dropped(self, parent: Request, child: Request, dropped: set[str]) -> bool:
        if parent.request_id in dropped:  # its prompt KV is being recomputed: fork later
            parent.fork_pending += 1
            return False
        return self._fork(parent, child)

    # ---- KV connector reports ---------------------------------------------------------------------

    def _handle_invalid_blocks(
        self, invalid: set[int], outputs: list[EngineCoreOutput]
    ) -> set[str]:
        """Blocks whose load failed: each request holding one keeps only the KV before its
        first invalid block. Policy "recompute": its prefix-cache hashes from there are dropped
        and ``num_computed_tokens`` rewinds to there (a running request's token sampled this
        step is discarded). Policy "fail": it finishes with reason "error". Returns the ids
        whose sampled token must be dropped."""
        kv = self.kv_cache_manager
        dropped: set[str] = set()
        for req in list(self.requests.values()):
            valid = self._num_valid_tokens(req, invalid)
            if valid is None:
                continue
            kv.invalidate(req, valid)
            dropped.add(req.request_id)
            if self.kv_load_failure_policy == "fail":
                logger.error(
                    "request %s: its KV failed to load (kv_load_failure_policy=fail)",
                    req.request_id,
                )
                self._free_request(req, RequestStatus.FINISHED_ERROR)
                outputs.append(EngineCoreOutput(req.request_id, [], finish_reason="error"))
            else:
                logger.warning(
                    "request %s: KV load failed after %d tokens; recomputing the rest",
                    req.request_id,
                    valid,
                )
                req.num_computed_tokens = min(req.num_computed_tokens, valid)
        return dropped

    def _num_valid_tokens(self, req: Request, invalid: set[int]) -> int | None:
        """Tokens before the first block of ``req`` in ``invalid`` (over all groups); None if it
        holds none."""
        valid = None
        groups = self.kv_cache_manager.kv_cache_groups
        for g, ids in enumerate(self.kv_cache_manager.get_block_ids(req.request_id)):
            for i, b in enumerate(ids):
                if b in invalid:
                    tokens = i * groups[g].kv_cache_spec.block_size
                    valid = tokens if valid is None else min(valid, tokens)
                    break
        return valid

    def _update_from_kv_xfer_finished(self, kco: KVConnectorOutput) -> None:
        """Loads that ended ready their requests (promoted in the next `schedule`); sends and
        loads that ended free the blocks held for them."""
        for rid in kco.finished_recving:
            req = self.requests.get(rid)
            if req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv_req_ids.add(rid)
            else:
                self._settle_delayed_free(rid, "recv")
        for rid in kco.finished_sending:
            self._settle_delayed_free(rid, "send")

    def _settle_delayed_free(self, rid: str, what: str) -> None:
        entry = self.delayed_free.get(rid)
        if entry is None:
            return
        req, pending = entry
        pending.discard(what)
        if not pending:
            del self.delayed_free[rid]
            self.kv_cache_manager.free(req)

    def _append_tokens(
        self,
        mro: ModelRunnerOutput,
        outputs: list[EngineCoreOutput],
        dropped: set[str] = frozenset(),
    ) -> None:  # type: ignore[assignment]
        """Append each row's token to its request and apply the token-level stops (rows of
        ``dropped`` requests are skipped: their KV is being recomputed)."""
        requests = self.requests
        lps = itertools.repeat(None) if mro.logprobs is None else mro.logprobs
        slps = itertools.repeat(None) if mro.sampled_logprobs is None else mro.sampled_logprobs
        for rid, token, lp, slp in zip(mro.req_ids, mro.sampled_token_ids, lps, slps):
            req = requests.get(rid)
            if req is None or rid in dropped:
                continue
            req.append_output_token_ids(token)
            if req.grammar is not None and not req.grammar.accept_token(token):
                # Cannot happen while the sampler applies the grammar's mask; if it does, the
                # output no longer parses: end it here rather than generate more of it.
                logger.error("request %s: token %d is outside its grammar", rid, token)
                req.grammar = None
                status = RequestStatus.FINISHED_STOPPED
            else:
                status = self._check_stop(req, token)
            if status is None:
                outputs.append(EngineCoreOutput(rid, [token], lp, slp))
            else:
                params = self._free_request(req, status)
                outputs.append(
                    EngineCoreOutput(
                        rid, [token], lp, slp, FINISHED_REASONS[status], req.stop_reason, params
                    )
                )

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        """The token-level stop ``token`` (just appended) triggers, if any. EOS and stop token
        ids count only from ``min_tokens`` on; a stop token id becomes ``stop_reason``. A
        structured request also stops when its grammar accepted its stop token."""
        p = req.sampling_params
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token == req.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.grammar is not None and req.grammar.is_terminated():
            return RequestStatus.FINISHED_STOPPED  # its stop token accepted (e.g. ignore_eos)
        if n_out >= req.max_tokens or len(req.all_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _fork(self, parent: Request, child: Request) -> bool:
        """Start ``child`` from ``parent``'s prompt KV (n > 1); False when the parent is gone.
        Falls back to queueing the child as a new request (it will then hit the prefix cache)
        when the pool is short or ``max_num_seqs`` are running."""
        if parent.request_id not in self.requests:
            return False
        self.requests[child.request_id] = child
        copies = None
        if len(self.running) < self.max_num_seqs:
            copies = self.kv_cache_manager.fork_request(parent, child)
        if copies is None:
            self.waiting.appendleft(child)
            return True
        child.status = RequestStatus.RUNNING
        child.num_cached_tokens = parent.num_cached_tokens
        child.metrics.first_scheduled_time = parent.metrics.first_scheduled_time
        self.pending_copies.extend(copies)
        self.running.append(child)
        return True

    def fail_requests(
        self, scheduler_output: SchedulerOutput, parent_ids: Iterable[str]
    ) -> list[Request]:
        """The step of ``scheduler_output`` failed: finish (aborted) every unfinished request of
        the user requests ``parent_ids`` and free their blocks; returns them.

        Their blocks' prefix-cache hashes are dropped first: allocation registered the hashes
        of blocks this batch was to write (or load from a tier), so their KV may be missing or
        half written and must never be served as a cache hit. Dropping a hash only costs a
        future hit; blocks shared with surviving requests keep their references. Pending
        copy-on-write copies into the failed requests' blocks are dropped too (those blocks
        go back to the pool).
        """
        for s in scheduler_output.scheduled:  # this batch's tokens were not computed
            s.request.num_computed_tokens = min(s.request.num_computed_tokens, s.start)
        by_parent: dict[str | None, list[Request]] = {}
        for r in self.requests.values():
            by_parent.setdefault(r.parent_id, []).append(r)
        kv = self.kv_cache_manager
        failed: list[Request] = []
        for pid in parent_ids:
            live = by_parent.pop(pid, [])
            block_ids = {b for r in live for group in kv.get_block_ids(r.request_id) for b in group}
            kv.evict_blocks(sorted(block_ids))
            self.pending_copies = [
                (src, dst) for src, dst in self.pending_copies if dst not in block_ids
            ]
            for r in live:
                self._free_request(r, RequestStatus.FINISHED_ABORTED)
            failed.extend(live)
        return failed
