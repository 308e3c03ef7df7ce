"""`OffloadingConnector`: the engine's bridge to the KV tiers (CPU, disk, Redis), a
`KVConnectorBase` built from ``--kv-offload SPEC`` (or ``--kv-transfer-config`` naming it).

Scheduler side (bookkeeping, never blocks on a tier):

* `get_num_new_matched_tokens(request, num_computed_tokens)`: how many tokens after the local
  prefix hit can be loaded from the tiers (whole blocks, leaving at least the last token to
  compute), always synchronous loads; ``(None, False)`` while an answer is pending (a
  secondary-tier lookup or a promotion to the CPU tier) — the scheduler then leaves the request
  waiting and asks again next step.
* `update_state_after_alloc(request, block_ids, num_external)`: pin the hit chunks and queue a
  load into the request's freshly allocated device blocks.
* `build_connector_meta(scheduler_output)`: this step's loads, and the stores of the blocks that
  become full in this step (``BLOCK_LEVEL``; CPU chunks are reserved now, filled after the pass).
* `request_finished(request)` / `on_preempt(request)`: store what the offload policy still owes
  and wait for the request's stores to finish, so no block is reused while a store reads it
  (never delays the free: ``(False, None)``).

Worker side (moves bytes, `OffloadingWorker`): `register_kv_caches` builds the host buffer and
tiers over the runner's KV buffer; `start_load_kv` runs the step's loads before the forward pass
(synchronous; a failed load's device blocks are reported by `get_block_ids_with_load_errors`,
and the scheduler recomputes them); `wait_for_save` submits the step's stores after it
(write-through: the CPU tier gets them and cascades them to disk and Redis in the background).
A step whose forward pass failed never submits its stores: `clear_connector_metadata` releases
their reserved chunks.

Per-request ``kv_transfer_params`` (`SamplingParams.kv_transfer_params`): ``max_offload_tokens`` (store no
block past this many tokens), ``offload_policy`` (``"BLOCK_LEVEL"``: store blocks as they fill;
``"REQUEST_LEVEL"``: store once, when the request finishes) and ``skip_reading_prefix_cache``
(never load for this request). One chunk is one device block.

Models with several KV cache groups (full + sliding window, chunked local, Mamba): each group's
blocks are stored under its own keys (block hash, group index); a load happens only when every
group has the blocks it needs for the hit (the hit is the minimum over groups, aligned to the
lcm of their block sizes); each request stores only the range it has not offered yet (its saved
offset); rules in `offload.kv_groups`. A stored chunk is one whole device block, every layer
slot of it: the layers of group ``g`` live in the slots of the block ids group ``g`` owns (see
`engine.model_runner.layer_placement`), so a block of group ``g`` holds exactly its layers
(plus unused slots when groups differ in size). Mamba checkpoint pages are blocks like the
others.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedkv.core.request import KVCacheRequest as Request
from pagedkv.kv_transfer.base import BlockIds, KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from pagedkv.kv_transfer.config import (
    KVTransferConfig,
    offloading_transfer_config,
    resolve_offload_config,
)
from pagedkv.kv_transfer.stats import KVConnectorStats
from pagedkv.offload.base import (
    GPULoadStoreSpec,
    OffloadingManager,
    TierStats,
)
from pagedkv.offload.factory import ShardedOffloading, build_offloading, build_sharded_offloading
from pagedkv.offload.fingerprint import OffloadFingerprint
from pagedkv.offload.kv_groups import OffloadGroupLayout
from pagedkv.offload.rank_worker import RankCopy, RankKVWork
from pagedkv.offload.sharded import HostAttachment, RankShardInfo, check_same_host
from pagedkv.offload.spec import CPUTierConfig, OffloadConfig
from pagedkv.offload.worker import OffloadingWorker, TransferResult

if TYPE_CHECKING:
    from pagedkv.core.specs import KVCacheConfig

logger = logging.getLogger(__name__)

NULL_BLOCK_ID = 0  # `BlockPool`'s null block: a position whose group holds no block
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
    dst_block_ids: list[int]  # one per key (groups concatenated in key order)
    spec: Any


@dataclass(slots=True)
class _StoreJob:
    request_id: str
    keys: list[bytes]
    src: GPULoadStoreSpec
    spec: Any


@dataclass(slots=True)
class OffloadingConnectorMetadata(KVConnectorMetadata):
    """One step's work: loads before the forward pass, stores after it (by job id)."""

    loads: dict[int, _LoadJob] = field(default_factory=dict)
    stores: dict[int, _StoreJob] = field(default_factory=dict)


@dataclass(slots=True)
class _ReqState:
    offered_tokens: int = 0  # the saved offset: blocks of tokens [0, offered) were offered
    deferred_s: float = 0.0  # time blocked on a tier answer while being considered
    deferral_episodes: int = 0  # runs of consecutive blocked steps (see MAX_DEFERRAL_EPISODES)
    blocked_at: float = 0.0  # when the last blocked answer was given ...
    blocked_step: int = -2  # ... and in which scheduling step (-2: not blocked)
    pending_stores: set[int] = field(default_factory=set)

    def reset_deferral(self) -> None:
        self.deferred_s, self.deferral_episodes, self.blocked_step = 0.0, 0, -2


class OffloadingConnector(KVConnectorBase):
    """``kv_connector_extra_config``: ``offload_config`` (the parsed tiers, see
    `kv_transfer.config.resolve_offload_config`), ``cache_policy`` (CPU tier eviction, "lru" or
    "arc"), ``store_threshold`` (admit a block after this many offers), ``preemption_mode``
    ("recompute", or "swap": a preempted request's KV goes to the CPU tier)."""

    def __init__(
        self,
        config: KVTransferConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
        *,
        model_identity: str = "",
        hash_seed: str = "",
    ) -> None:
        super().__init__(
            config, role, kv_cache_config, model_identity=model_identity, hash_seed=hash_seed
        )
        if kv_cache_config is None:
            raise ValueError("the OffloadingConnector needs the KV cache config")
        self.check_kv_cache_groups(kv_cache_config.kv_cache_groups)
        self.layout = OffloadGroupLayout.from_kv_cache_groups(
            kv_cache_config.kv_cache_groups, kv_cache_config.prefix_cache_retention_interval
        )
        self.offload_config = resolve_offload_config(config)
        self.cache_policy = config.get_from_extra_config("cache_policy", "lru")
        self.store_threshold = int(config.get_from_extra_config("store_threshold", 0))
        preemption_mode = config.get_from_extra_config("preemption_mode", "recompute")
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"invalid preemption_mode {preemption_mode!r}: use 'recompute' or 'swap'"
            )
        self.preemption_mode = preemption_mode
        self.block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.manager: OffloadingManager | None = None  # built by register_kv_caches
        self.worker: OffloadingWorker | None = None
        self._jobs = itertools.count()
        self._pending_loads: dict[int, _LoadJob] = {}  # queued until build_connector_meta
        self._loads: dict[int, _LoadJob] = {}  # submitted, not collected
        self._stores: dict[int, tuple[str, list[bytes]]] = {}  # submitted, not collected
        self._reqs: dict[str, _ReqState] = {}
        self._load_errors: set[int] = set()
        self.num_loaded_tokens = 0
        self.num_stored_blocks = 0
        self.max_deferral_s = MAX_DEFERRAL_S
        self.max_deferral_episodes = MAX_DEFERRAL_EPISODES
        self._step = 0  # scheduling steps so far (`on_schedule_start`)
        # Tensor / decode context parallelism (`set_rank_shards`): every rank copies its part.
        self._rank_infos: list[RankShardInfo] | None = None
        self._sharded: ShardedOffloading | None = None
        self._rank_pending: set[int] = set()  # jobs the other ranks have not reported yet
        self._rank_failed: set[int] = set()  # jobs some other rank failed
        self._held: list[TransferResult] = []  # rank 0's results of pending jobs
        self._deferred_rank: list[RankCopy] = []  # stores made between steps, for the others

    @classmethod
    def check_kv_cache_groups(cls, kv_cache_groups: list[Any]) -> None:
        """Full, MLA, sliding-window, chunked-local and Mamba groups, in any mix; ValueError
        naming the spec for anything else (cross attention)."""
        OffloadGroupLayout.from_kv_cache_groups(kv_cache_groups)

    @classmethod
    def from_parts(
        cls,
        manager: OffloadingManager,
        worker: OffloadingWorker,
        block_size: int,
        preemption_mode: str = "recompute",
    ) -> OffloadingConnector:
        """A connector over a ready manager and worker (tests that build their own tiers)."""
        from pagedkv.core.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32"
        )
        kv_config = KVCacheConfig(
            num_blocks=1, kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)], bytes_per_block=1
        )
        config = offloading_transfer_config(
            OffloadConfig(CPUTierConfig(1)), preemption_mode=preemption_mode
        )
        self = cls(config, KVConnectorRole.SCHEDULER, kv_config)
        self.manager, self.worker = manager, worker
        return self

    # ---- worker side: setup ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any], kv_buffer: Any = None) -> None:
        """Build the host chunk buffer, the tiers and the copy worker over ``kv_buffer``."""
        super().register_kv_caches(kv_caches, kv_buffer)
        if kv_buffer is None:
            raise ValueError("the OffloadingConnector needs the contiguous KV buffer")
        fingerprint = self.fingerprint(kv_buffer)
        if self._rank_infos is not None:
            self._sharded = build_sharded_offloading(
                self.offload_config,
                fingerprint,
                kv_buffer,
                self.kv_cache_config.layout,
                self._rank_infos,
                cache_policy=self.cache_policy,
                store_threshold=self.store_threshold,
            )
            self.manager, self.worker = self._sharded.manager, self._sharded.worker
            self.worker.fence_stores = any(g.kind != "full" for g in self.layout.groups)
            return
        self.manager, self.worker = build_offloading(
            self.offload_config,
            fingerprint,
            kv_buffer,
            self.kv_cache_config.layout,
            cache_policy=self.cache_policy,
            store_threshold=self.store_threshold,
            hash_seed=self.hash_seed,
            p2p_backend=self.config.get_from_extra_config("p2p_backend"),
        )
        # Blocks of windowed groups are freed while their requests run: a CUDA store must be
        # done before the next forward pass may reuse them (`OffloadingWorker.fence_stores`).
        self.worker.fence_stores = any(g.kind != "full" for g in self.layout.groups)

    def fingerprint(self, kv_buffer: Any) -> OffloadFingerprint:
        """Everything that changes a stored chunk's bytes, the group layout included (a tier
        written by a single-group model is a miss for a hybrid one, and vice versa)."""
        kvc = self.kv_cache_config
        groups = kvc.kv_cache_groups
        # The attention spec fixes the page geometry (Mamba states live inside its pages).
        spec = next(
            (g.kv_cache_spec for g in groups if hasattr(g.kv_cache_spec, "num_kv_heads")),
            groups[0].kv_cache_spec,
        )
        spec = getattr(spec, "representative", spec)
        return OffloadFingerprint.create(
            self.model_identity,
            kv_buffer.dtype,
            self.block_size,
            kvc.layout,
            max(len(g.layer_names) for g in groups),
            spec.num_kv_heads,
            spec.head_size,
            kv_quant=getattr(spec, "kv_format", "none"),  # quantized pages never meet other formats
            kv_cache_groups=self.layout.describe(),
        )

    # ---- tensor / decode context parallelism --------------------------------------------------------

    def set_rank_shards(self, infos: list[RankShardInfo]) -> None:
        """Before `register_kv_caches`, on a TP/DCP engine's driver: every rank's shard (rank 0
        first). The tiers then hold one part per distinct shard (`offload.sharded`); each step
        the executor ships `take_rank_work` to ranks 1..N-1 and reports their failures to
        `finish_rank_step`, and no job counts as done before every rank did it. ValueError if
        a rank is on another host."""
        check_same_host(infos)
        self._rank_infos = list(infos)

    def host_attachment(self, rank: int) -> HostAttachment:
        """What rank ``rank`` maps of the shared host buffer (after `register_kv_caches`)."""
        assert self._sharded is not None and self._rank_infos is not None
        info = self._rank_infos[rank]
        shard = next(s for s in self._sharded.shards if s.rank == info.writer)
        sh = self._sharded
        return HostAttachment(
            sh.memory.path, sh.num_chunks, sh.chunk_bytes, shard.offset, info.writer == rank
        )

    def take_rank_work(self, metadata: KVConnectorMetadata | None) -> RankKVWork | None:
        """This step's copies for the other ranks (None if none): stores made since the last
        step, then ``metadata``'s loads (before the forward pass), then its stores (after)."""
        if self._sharded is None:
            return None
        work = RankKVWork(before=self._deferred_rank)
        self._deferred_rank = []
        if isinstance(metadata, OffloadingConnectorMetadata):
            for job_id, load in metadata.loads.items():
                work.before.append(
                    RankCopy(job_id, False, tuple(load.dst_block_ids), tuple(load.spec.ids))
                )
            for job_id, store in metadata.stores.items():
                work.after.append(RankCopy(job_id, True, store.src.ids, tuple(store.spec.ids)))
        if not work.before and not work.after:
            return None
        self._rank_pending |= work.job_ids
        return work

    def finish_rank_step(self, work: RankKVWork | None, failed: set[int]) -> None:
        """The other ranks ran ``work``; ``failed``: the jobs any of them failed. Their loads
        and stores now complete (a job fails if any rank failed it)."""
        if work is None:
            return
        self._rank_pending -= work.job_ids
        self._rank_failed |= failed & work.job_ids
        self._collect()

    def has_pending_work(self) -> bool:
        """Stores made between steps that the other ranks have not copied yet."""
        return bool(self._deferred_rank)

    # ---- scheduler side ---------------------------------------------------------------------------

    def _state(self, req: Request) -> _ReqState:
        st = self._reqs.get(req.request_id)
        if st is None:
            st = self._reqs[req.request_id] = _ReqState()
        return st

    def _keys(self, req: Request, group_idx: int, blocks: Sequence[int]) -> list[bytes]:
        return self.layout.keys(req.block_hashes, group_idx, blocks)

    @staticmethod
    def _params(req: Request) -> dict[str, Any]:
        return req.kv_transfer_params or {}

    def on_schedule_start(self) -> None:
        """The scheduler starts a step: the deferral clocks tell consecutive steps apart."""
        self._step += 1

    def get_num_new_matched_tokens(
        self, req: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """External hit tokens after ``num_computed_tokens`` (block aligned), loaded
        synchronously; ``(None, False)`` to retry.

        None (the request stays waiting) while a tier answer or a promotion is pending, until
        the request has been blocked for ``max_deferral_s`` of consideration time (see
        `MAX_DEFERRAL_S`) or ``max_deferral_episodes`` episodes; then the hits known so far."""
        if req.skip_reading_prefix_cache:
            return 0, False
        # Always compute at least the last token; a hit ends where every group hits.
        max_tokens = min(req.num_tokens - 1, len(req.block_hashes) * self.layout.hash_block_size)
        n, blocked = self.layout.find_hit(
            num_computed_tokens,
            max_tokens,
            lambda gid, blocks: self.manager.lookup_many(self._keys(req, gid, blocks)),
        )
        if blocked and self._defer(self._state(req)):
            return None, False
        st = self._reqs.get(req.request_id)
        if st is not None:
            st.reset_deferral()
        return n, False

    def _defer(self, st: _ReqState) -> bool:
        """Charge one blocked answer to the request's deferral clock; True: keep waiting."""
        now = time.monotonic()
        if st.blocked_step >= self._step - 1:  # blocked in the previous step too: count the gap
            st.deferred_s += now - st.blocked_at
        else:  # first blocked answer, or after a pass-over: a new episode, nothing to charge
            st.deferral_episodes += 1
        st.blocked_at, st.blocked_step = now, self._step
        return (
            st.deferred_s < self.max_deferral_s
            and st.deferral_episodes <= self.max_deferral_episodes
        )

    def update_state_after_alloc(
        self, req: Request, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        """Pin every group's hit chunks and queue one load into the blocks just allocated."""
        if num_external_tokens <= 0:
            return
        num_computed = req.num_computed_tokens
        keys: list[bytes] = []
        dst: list[int] = []
        for gid in range(len(self.layout.groups)):
            blocks = self.layout.required_blocks(
                gid, num_computed, num_computed + num_external_tokens
            )
            ids = [block_ids[gid][i] for i in blocks]
            if (
                NULL_BLOCK_ID in ids
            ):  # the scheduler allocates every required block: a broken contract
                raise RuntimeError(f"group {gid} has no device block for a loaded position")
            keys += self._keys(req, gid, blocks)
            dst += ids
        spec = self.manager.prepare_load(keys)
        self._pending_loads[next(self._jobs)] = _LoadJob(keys, dst, spec)
        self.num_loaded_tokens += num_external_tokens

    def build_connector_meta(self, scheduler_output: Any) -> OffloadingConnectorMetadata:
        """The loads queued since the last step, and a store job (CPU chunks reserved) for the
        blocks of each scheduled request that this step fills (``BLOCK_LEVEL`` requests)."""
        meta = OffloadingConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = {}
        for s in scheduler_output.scheduled:
            req = s.request
            if self._params(req).get("offload_policy", BLOCK_LEVEL) == BLOCK_LEVEL:
                job = self._prepare_store(req, s.block_ids, s.start + s.num_tokens)
                if job is not None:
                    meta.stores[next(self._jobs)] = job
        return meta

    def request_finished(
        self, req: Request, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        """Before the request's blocks are freed: settle what it owes the tiers (synchronously,
        so the free is never delayed)."""
        if self._params(req).get("offload_policy", BLOCK_LEVEL) == REQUEST_LEVEL:
            self._store_now(req, block_ids)
        self._wait_stores(req)
        self._reqs.pop(req.request_id, None)
        return False, None

    def on_preempt(self, req: Request, block_ids: BlockIds) -> None:
        """Swap mode: make sure the victim's full blocks are in the CPU tier, so re-admission
        loads them instead of recomputing."""
        if self.preemption_mode == "swap":
            self._store_now(req, block_ids)
        self._wait_stores(req)

    # ---- worker side --------------------------------------------------------------------------------

    def start_load_kv(self) -> None:
        """Run the step's loads (before the forward pass reads the blocks); the device blocks
        of a failed load are reported by `get_block_ids_with_load_errors`."""
        loads = self._get_connector_metadata().loads
        if not loads:
            return
        for job_id, job in loads.items():
            self._loads[job_id] = job
            self.worker.submit_load(job_id, job.spec, GPULoadStoreSpec(tuple(job.dst_block_ids)))
        self.worker.wait(list(loads))
        self._collect()

    def wait_for_save(self) -> None:
        """Submit the step's stores (after the forward pass wrote the blocks they read)."""
        meta = self._get_connector_metadata()
        stores, meta.stores = meta.stores, {}
        for job_id, job in stores.items():
            self._submit_store(job_id, job, in_step=True)
        self._collect()
        self.manager.on_schedule_end()

    def clear_connector_metadata(self) -> None:
        """Stores still in the metadata were never submitted (the forward pass failed): their
        reserved chunks are released."""
        meta = self._metadata
        if isinstance(meta, OffloadingConnectorMetadata) and meta.stores:
            for job in meta.stores.values():
                self.manager.complete_store(job.keys, False)
            meta.stores = {}
        super().clear_connector_metadata()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- stores -------------------------------------------------------------------------------------

    def _prepare_store(
        self, req: Request, block_ids: BlockIds, num_computed: int, force: bool = False
    ) -> _StoreJob | None:
        """Reserve CPU chunks for every group's blocks of ``req`` full after ``num_computed``
        tokens (aligned down to the lcm of the block sizes) that were not offered yet (all of
        them with ``force``); positions a group holds no block for (released, or a Mamba
        position without a checkpoint) store nothing. None if nothing is to store."""
        st = self._state(req)
        limit = self._params(req).get("max_offload_tokens")
        num_tokens = min(num_computed, req.num_tokens)
        if limit is not None:
            num_tokens = min(num_tokens, int(limit))
        layout = self.layout
        end = min(
            layout.store_range(num_tokens),
            layout.store_range(len(req.block_hashes) * layout.hash_block_size),
        )
        start = 0 if force else st.offered_tokens
        if end <= start:
            return None
        st.offered_tokens = max(st.offered_tokens, end)
        keys: list[bytes] = []
        src: dict[bytes, int] = {}
        for gid, ids in enumerate(block_ids):
            blocks = [
                i
                for i in layout.store_blocks(gid, start, end)
                if i < len(ids) and ids[i] != NULL_BLOCK_ID
            ]
            for key, i in zip(self._keys(req, gid, blocks), blocks):
                keys.append(key)
                src[key] = ids[i]
        if not keys:
            return None
        out = self.manager.prepare_store(keys)
        if out is None or not out.keys_to_store:
            return None
        dev = tuple(src[k] for k in out.keys_to_store)
        return _StoreJob(
            req.request_id, list(out.keys_to_store), GPULoadStoreSpec(dev), out.store_spec
        )

    def _submit_store(self, job_id: int, job: _StoreJob, in_step: bool = False) -> None:
        """Copy rank 0's part now; a store made between steps (``in_step`` False) is also
        queued for the other ranks' next step, before anything can reuse its blocks."""
        self._stores[job_id] = (job.request_id, job.keys)
        st = self._reqs.get(job.request_id)
        if st is not None:
            st.pending_stores.add(job_id)
        if self._sharded is not None and not in_step:
            self._deferred_rank.append(RankCopy(job_id, True, job.src.ids, tuple(job.spec.ids)))
            self._rank_pending.add(job_id)
        self.worker.submit_store(job_id, job.src, job.spec)

    def _store_now(self, req: Request, block_ids: BlockIds) -> None:
        """Store every full block of ``req`` at once (outside a step: finish, swap-out)."""
        job = self._prepare_store(req, block_ids, req.num_computed_tokens, force=True)
        if job is not None:
            self._submit_store(next(self._jobs), job)

    def _wait_stores(self, req: Request) -> None:
        st = self._reqs.get(req.request_id)
        if st is not None and st.pending_stores:
            self.worker.wait(list(st.pending_stores))
        self._collect()

    def _collect(self) -> None:
        """Complete the jobs every rank has finished (rank 0's results of jobs the other ranks
        have not reported are held until `finish_rank_step`)."""
        results, self._held = self._held + self.worker.get_finished(), []
        for result in results:
            if result.job_id in self._rank_pending:
                self._held.append(result)
                continue
            if result.job_id in self._rank_failed:
                self._rank_failed.discard(result.job_id)
                result.success = False
            if result.job_id in self._loads:
                job = self._loads.pop(result.job_id)
                self.manager.complete_load(job.keys)
                if not result.success:
                    logger.error(
                        "offload load job %d failed: its %d blocks are recomputed",
                        result.job_id,
                        len(job.dst_block_ids),
                    )
                    self._load_errors.update(job.dst_block_ids)
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
        sizes = [g.block_size for g in self.layout.groups]
        for ev in self.manager.take_events():
            out.extend(ev.to_kv_events(sizes))
        if self._sharded is not None:  # a chunk is the writer ranks' parts
            writers = [s.rank for s in self._sharded.shards]
            for e in out:
                e.tp_ranks = writers
        return out

    def get_stats(self) -> dict[str, TierStats]:
        return self.manager.get_stats()

    def get_kv_connector_stats(self) -> KVConnectorStats:
        return KVConnectorStats.from_tiers(
            self.manager.get_stats(), self.num_loaded_tokens, self.num_stored_blocks
        )

    def shutdown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown()
        if self._sharded is not None:
            self._sharded.memory.close()
