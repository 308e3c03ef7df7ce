"""`OffloadingConnector`: the engine's bridge to the KV tiers (vLLM's KV connector split).

Scheduler side (bookkeeping, never blocks on I/O):

* `get_num_new_matched_tokens(request, num_computed_tokens)`: how many tokens after the local
  prefix hit can be loaded from the tiers (whole blocks, leaving at least the last token to
  compute); None while an answer is pending (a secondary-tier lookup or a promotion to the CPU
  tier) — the scheduler then leaves the request waiting and asks again next step.
* `update_state_after_alloc(request, block_ids, num_computed, num_external)`: pin the hit
  chunks and queue a load into the request's freshly allocated device blocks.
* `request_finished(request)` / `on_preempt(request)`: store what the offload policy still owes
  and wait for the request's stores to finish, so no block is reused while a store reads it.

Worker side (moves bytes, `OffloadingWorker`):

* `start_load_kv()`: before the forward pass, run the queued loads (synchronous on CPU);
* `save_kv(scheduler_output)`: after the forward pass, offer the newly full blocks of every
  scheduled request to the tiers (write-through: the CPU tier gets them, and cascades them to
  disk and Redis in the background).

Per-request ``kv_transfer_params`` (`SamplingParams.kv_transfer_params`): ``max_offload_tokens`` (store no
block past this many tokens), ``offload_policy`` (``"BLOCK_LEVEL"``: store blocks as they fill;
``"REQUEST_LEVEL"``: store once, when the request finishes) and ``skip_reading_prefix_cache``
(never load for this request). One chunk is one device block.
"""

from __future__ import annotations

import hashlib
import itertools
import time
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.core.request import KVCacheRequest as Request
from pagedkv.kv_transfer.base import KVConnectorBase
from pagedkv.offload.base import (
    GPULoadStoreSpec,
    LookupResult,
    OffloadingManager,
    TierStats,
    make_offload_key,
)
from pagedkv.offload.fingerprint import OffloadFingerprint
from pagedkv.offload.spec import parse_offload_spec
from pagedkv.offload.factory import build_offloading
from pagedkv.offload.worker import OffloadingWorker

logger = logging.getLogger(__name__)

BLOCK_LEVEL = "BLOCK_LEVEL"
REQUEST_LEVEL = "REQUEST_LEVEL"
# A request whose tier answer stays pending this long is admitted without external hits, so a
# slow or stuck tier can delay a request but never starve it (time, not steps: an idle engine
# steps thousands of times a second). Only time while the scheduler keeps considering the
# request counts: the intervals between blocked answers in consecutive scheduling steps. Time
# spent queued behind a full batch (the request is not considered) never counts, or a prefix
# on disk would be recomputed just because its request waited for a batch slot.
MAX_DEFERRAL_S = 5.0
# A request blocked again after a gap (it was passed over: the batch filled, or a request ahead
# blocked admission) starts a new deferral episode. Normally its prefix was promoted to the CPU
# tier meanwhile, so the next episode ends at once; this many episodes bound the rare case where
# its promoted chunks keep being evicted before it gets a slot.
MAX_DEFERRAL_EPISODES = 8


@dataclass(slots=True)
class _LoadJob:
    keys: list[bytes]
    dst_block_ids: list[int]
    spec: Any


@dataclass(slots=True)
class _ReqState:
    offered_blocks: int = 0  # blocks [0, offered) were offered to the tiers
    deferred_s: float = 0.0  # time blocked on a tier answer while being considered
    deferral_episodes: int = 0  # runs of consecutive blocked steps (see MAX_DEFERRAL_EPISODES)
    blocked_at: float = 0.0  # when the last blocked answer was given ...
    blocked_step: int = -2  # ... and in which scheduling step (-2: not blocked)
    pending_stores: set[int] = field(default_factory=set)

    def reset_deferral(self) -> None:
        self.deferred_s, self.deferral_episodes, self.blocked_step = 0.0, 0, -2


def model_identity(path: str | Path) -> str:
    """Names the weights, not just the architecture: file name, size and a digest of the first
    4 MiB (cheap, and different for every real checkpoint)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        parts = [f"{f.name}:{f.stat().st_size}" for f in files]
        return f"{p.name}|" + ",".join(parts)
    with open(p, "rb") as f:
        head = hashlib.sha256(f.read(4 << 20)).hexdigest()[:16]
    return f"{p.name}|{p.stat().st_size}|{head}"


class OffloadingConnector(KVConnectorBase):
    def __init__(self, manager: OffloadingManager, worker: OffloadingWorker, block_size: int,
                 preemption_mode: str = "recompute") -> None:
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"invalid preemption_mode {preemption_mode!r}: use 'recompute' or 'swap'")
        self.manager = manager
        self.worker = worker
        self.block_size = block_size
        self.preemption_mode = preemption_mode
        self._jobs = itertools.count()
        self._loads: dict[int, _LoadJob] = {}
        self._stores: dict[int, tuple[str, list[bytes]]] = {}
        self._reqs: dict[str, _ReqState] = {}
        self.num_loaded_tokens = 0
        self.num_stored_blocks = 0
        self.max_deferral_s = MAX_DEFERRAL_S
        self.max_deferral_episodes = MAX_DEFERRAL_EPISODES
        self._step = 0  # scheduling steps so far (`on_schedule_start`)

    @classmethod
    def from_spec(cls, spec: str, *, model_path: str | Path, dtype: Any, block_size: int,
                  layout: Any, num_layers: int, num_kv_heads: int, head_size: int, kv_buffer: Any,
                  cache_policy: str = "lru", store_threshold: int = 0,
                  preemption_mode: str = "recompute") -> OffloadingConnector:
        fingerprint = OffloadFingerprint.create(model_identity(model_path), dtype, block_size, layout,
                                                num_layers, num_kv_heads, head_size)
        manager, worker = build_offloading(parse_offload_spec(spec), fingerprint, kv_buffer, layout,
                                           cache_policy=cache_policy, store_threshold=store_threshold)
        return cls(manager, worker, block_size, preemption_mode)

    # ---- scheduler side ---------------------------------------------------------------------------

    def _state(self, req: Request) -> _ReqState:
        st = self._reqs.get(req.request_id)
        if st is None:
            st = self._reqs[req.request_id] = _ReqState()
        return st

    def _keys(self, req: Request, start_block: int, end_block: int) -> list[bytes]:
        return [make_offload_key(h) for h in req.block_hashes[start_block:end_block]]

    @staticmethod
    def _params(req: Request) -> dict[str, Any]:
        return req.kv_transfer_params or {}

    def on_schedule_start(self) -> None:
        """The scheduler starts a step: the deferral clocks tell consecutive steps apart."""
        self._step += 1

    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int) -> int | None:
        """External hit tokens after ``num_computed_tokens`` (block aligned), or None to retry.

        None (the request stays waiting) while a tier answer or a promotion is pending, until
        the request has been blocked for ``max_deferral_s`` of consideration time (see
        `MAX_DEFERRAL_S`) or ``max_deferral_episodes`` episodes; then the hits known so far."""
        if req.skip_reading_prefix_cache:
            return 0
        bs = self.block_size
        start = num_computed_tokens // bs
        end = (req.num_tokens - 1) // bs  # always compute at least the last token
        if end <= start:
            return 0
        results = self.manager.lookup_many(self._keys(req, start, end))
        n = 0
        for r in results:
            if r is not LookupResult.HIT:
                break
            n += 1
        blocked = n < len(results) and results[n] in (LookupResult.RETRY, LookupResult.HIT_PENDING)
        if blocked and self._defer(self._state(req)):
            return None
        st = self._reqs.get(req.request_id)
        if st is not None:
            st.reset_deferral()
        return n * bs

    def _defer(self, st: _ReqState) -> bool:
        """Charge one blocked answer to the request's deferral clock; True: keep waiting."""
        now = time.monotonic()
        if st.blocked_step >= self._step - 1:  # blocked in the previous step too: count the gap
            st.deferred_s += now - st.blocked_at
        else:  # first blocked answer, or after a pass-over: a new episode, nothing to charge
            st.deferral_episodes += 1
        st.blocked_at, st.blocked_step = now, self._step
        return (st.deferred_s < self.max_deferral_s
                and st.deferral_episodes <= self.max_deferral_episodes)

    def update_state_after_alloc(self, req: Request, block_ids: Sequence[int], num_computed_tokens: int,
                                 num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        bs = self.block_size
        start, end = num_computed_tokens // bs, (num_computed_tokens + num_external_tokens) // bs
        keys = self._keys(req, start, end)
        spec = self.manager.prepare_load(keys)
        self._loads[next(self._jobs)] = _LoadJob(keys, list(block_ids[start:end]), spec)
        self.num_loaded_tokens += num_external_tokens

    def request_finished(self, req: Request, block_ids: Sequence[int]) -> None:
        """Before the request's blocks are freed: settle what it owes the tiers."""
        if self._params(req).get("offload_policy", BLOCK_LEVEL) == REQUEST_LEVEL:
            self._offer(req, block_ids, req.num_computed_tokens, force=True)
        self._wait_stores(req)
        self._reqs.pop(req.request_id, None)

    def on_preempt(self, req: Request, block_ids: Sequence[int]) -> None:
        """Swap mode: make sure the victim's full blocks are in the CPU tier, so re-admission
        loads them instead of recomputing."""
        if self.preemption_mode == "swap":
            self._offer(req, block_ids, req.num_computed_tokens, force=True)
        self._wait_stores(req)

    # ---- worker side --------------------------------------------------------------------------------

    def start_load_kv(self) -> None:
        """Run every queued load (before the forward pass reads the blocks)."""
        if not self._loads:
            return
        for job_id, job in self._loads.items():
            self.worker.submit_load(job_id, job.spec, GPULoadStoreSpec(tuple(job.dst_block_ids)))
        self.worker.wait(list(self._loads))
        self._collect()

    def save_kv(self, scheduled: Iterable[tuple[Request, Sequence[int], int]]) -> None:
        """Offer the blocks that became full in this step: ``(request, block ids, tokens
        computed after the step)`` for every scheduled request."""
        for req, block_ids, num_computed in scheduled:
            if self._params(req).get("offload_policy", BLOCK_LEVEL) == BLOCK_LEVEL:
                self._offer(req, block_ids, num_computed)
        self._collect()
        self.manager.on_schedule_end()

    def _offer(self, req: Request, block_ids: Sequence[int], num_computed: int, force: bool = False) -> None:
        st = self._state(req)
        limit = self._params(req).get("max_offload_tokens")
        num_tokens = min(num_computed, req.num_tokens)
        if limit is not None:
            num_tokens = min(num_tokens, int(limit))
        end = min(num_tokens // self.block_size, len(req.block_hashes), len(block_ids))
        start = 0 if force else st.offered_blocks
        if end <= start:
            return
        keys = self._keys(req, start, end)
        st.offered_blocks = max(st.offered_blocks, end)
        out = self.manager.prepare_store(keys)
        if out is None or not out.keys_to_store:
            return
        index = {k: i for i, k in enumerate(keys)}
        dev = tuple(block_ids[start + index[k]] for k in out.keys_to_store)
        job_id = next(self._jobs)
        self._stores[job_id] = (req.request_id, list(out.keys_to_store))
        st.pending_stores.add(job_id)
        self.worker.submit_store(job_id, GPULoadStoreSpec(dev), out.store_spec)

    def _wait_stores(self, req: Request) -> None:
        st = self._reqs.get(req.request_id)
        if st is not None and st.pending_stores:
            self.worker.wait(list(st.pending_stores))
        self._collect()

    def _collect(self) -> None:
        for result in self.worker.get_finished():
            if result.job_id in self._loads:
                job = self._loads.pop(result.job_id)
                self.manager.complete_load(job.keys)
                if not result.success:
                    logger.error("offload load job %d failed", result.job_id)
            elif result.job_id in self._stores:
                rid, keys = self._stores.pop(result.job_id)
                self.manager.complete_store(keys, result.success)
                if result.success:
                    self.num_stored_blocks += len(keys)
                st = self._reqs.get(rid)
                if st is not None:
                    st.pending_stores.discard(result.job_id)

    # ---- introspection ------------------------------------------------------------------------------

    def take_events(self) -> list:
        out = []
        for ev in self.manager.take_events():
            out.extend(ev.to_kv_events(self.block_size))
        return out

    def get_stats(self) -> dict[str, TierStats]:
        return self.manager.get_stats()

    def shutdown(self) -> None:
        self.manager.shutdown()
