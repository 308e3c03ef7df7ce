"""Continuous batching: which tokens of which requests run in the next forward pass.

Each `schedule()` builds one flat batch inside a token budget (``max_num_batched_tokens``):

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

``num_computed_tokens`` advances when a request is scheduled (the KV of scheduled tokens is
"written or being written"); a request is sampled in the step its scheduled tokens reach
``num_tokens``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedkv.core.kv_cache_manager import KVCacheManager
from pagedkv.core.request import RequestStatus
from pagedkv.engine.request import Request
from pagedkv.kv_transfer.offloading_connector import OffloadingConnector


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    start: int  # first position computed this step (== num_computed_tokens before the step)
    num_tokens: int
    block_ids: tuple[list[int], ...]  # the request's block table in each KV cache group

    @property
    def samples(self) -> bool:
        return self.start + self.num_tokens >= self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the pass
    # Running requests stopped because their sequence no longer fits even the empty cache.
    finished: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 connector: OffloadingConnector | None = None) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.connector = connector
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.pending_copies: list[tuple[int, int]] = []
        self.num_preemptions = 0

    # ---- queues -----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (abort) requests wherever they are; frees their blocks. Unknown ids are ignored."""
        done = []
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._release(req)
            done.append(req)
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- scheduling ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(blocks_to_copy=self.pending_copies)
        self.pending_copies = []
        budget = self.max_num_batched_tokens
        kv = self.kv_cache_manager
        scheduled: dict[str, tuple[Request, int, int]] = {}  # rid -> (req, start, n)
        if self.connector is not None:
            self.connector.on_schedule_start()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            start = req.num_computed_tokens
            n = min(req.num_tokens - start, budget, self.max_model_len - start)
            if n <= 0:
                i += 1
                continue
            while kv.allocate_slots(req, n) is None:
                if len(self.running) == 1 and self.running[0] is req:
                    # Alone and still no room: its sequence outgrew the whole KV cache.
                    # Preempting it would loop forever (re-admission needs the same room):
                    # it ends as if max_model_len were reached.
                    self.finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
                    out.finished.append(req)
                    break
                victim = self.running.pop()  # FCFS: the latest admitted goes first
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id)[2]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = (req, start, n)
                budget -= n
                i += 1

        if not out.preempted:
            self._schedule_waiting(scheduled, budget)

        for req, start, n in scheduled.values():
            req.num_computed_tokens = start + n
            out.scheduled.append(ScheduledRequest(req, start, n, kv.get_block_ids(req.request_id)))
            out.num_batched_tokens += n
        return out

    def _schedule_waiting(self, scheduled: dict[str, tuple[Request, int, int]], budget: int) -> None:
        kv = self.kv_cache_manager
        idx = 0
        while idx < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[idx]
            hits, num_hit = kv.get_computed_blocks(req)
            num_ext = 0
            if self.connector is not None:
                ext = self.connector.get_num_new_matched_tokens(req, num_hit)
                if ext is None:  # a tier is still answering: leave it waiting, try the next one
                    # (vLLM's skip). Its deferral clock runs only while it is considered, so
                    # waiting for a batch slot later never costs it its tier hits.
                    idx += 1
                    continue
                num_ext = ext
            n = min(req.num_tokens - num_hit - num_ext, budget)
            if kv.allocate_slots(req, n, num_hit, hits, num_external_computed_tokens=num_ext,
                                 full_sequence_must_fit=True) is None:
                break  # strict FCFS: no one behind it overtakes it for memory
            del self.waiting[idx]
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            if num_ext:
                self.connector.update_state_after_alloc(req, kv.get_block_ids(req.request_id)[0],
                                                        num_hit, num_ext)
            computed = num_hit + num_ext
            req.num_computed_tokens = computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = computed
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.monotonic()
            scheduled[req.request_id] = (req, computed, n)
            budget -= n

    def _release(self, req: Request, preempted: bool = False) -> None:
        """Free the request's blocks, after the connector settled its stores."""
        if self.connector is not None:
            block_ids = self.kv_cache_manager.get_block_ids(req.request_id)[0]
            if preempted:
                self.connector.on_preempt(req, block_ids)
            else:
                self.connector.request_finished(req, block_ids)
        self.kv_cache_manager.free(req)

    def _preempt(self, req: Request) -> None:
        self._release(req, preempted=True)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the forward pass -------------------------------------------------------------------

    def fork(self, parent: Request, child: Request) -> bool:
        """Start ``child`` from ``parent``'s prompt KV (n > 1). Falls back to queueing the child
        as a new request (it will then hit the prefix cache) when the pool is short."""
        self.requests[child.request_id] = child
        copies = None
        if len(self.running) < self.max_num_seqs:
            copies = self.kv_cache_manager.fork_request(parent, child)
        if copies is None:
            self.waiting.appendleft(child)
            return False
        child.status = RequestStatus.RUNNING
        child.num_cached_tokens = parent.num_cached_tokens
        child.metrics.first_scheduled_time = parent.metrics.first_scheduled_time
        self.pending_copies.extend(copies)
        self.running.append(child)
        return True

    def finish(self, req: Request, status: RequestStatus) -> None:
        """A running request stopped (EOS, stop string, length): free its blocks."""
        self.running.remove(req)
        self.requests.pop(req.request_id, None)
        req.status = status
        self._release(req)
