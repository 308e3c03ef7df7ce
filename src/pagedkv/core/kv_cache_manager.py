"""`KVCacheManager`: the scheduler's only interface to KV memory (vLLM's API).

The scheduler thinks in tokens; the manager turns tokens into blocks:

* `get_computed_blocks(request)`: the longest cached prefix (a hit is never the whole request:
  at least the last token is recomputed to produce logits, so hits are capped at
  ``num_tokens - 1`` and rounded down to whole blocks);
* `allocate_slots(request, num_new_tokens, ...)`: reserve slots for the next tokens, adopting
  hit blocks on a request's first allocation; returns None — with no side effect other than
  releasing out-of-window blocks — when the pool cannot fit them;
* `free(request)`: release every block, tail first.

Token layout of a request during `allocate_slots`::

    | computed | new computed (hit) | external computed | new | lookahead |
    '------------ total_computed -------------------'
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.core.block_pool import BlockPool, KVCacheBlock
from pagedkv.core.events import MEDIUM_GPU, KVCacheEvent
from pagedkv.core.kv_cache_coordinator import get_kv_cache_coordinator
from pagedkv.core.request import KVCacheRequest, RequestStatus
from pagedkv.core.specs import KVCacheConfig, get_kv_cache_spec_sliding_window
from pagedkv.core.units import cdiv

_EMPTY: tuple = ()


@dataclass(slots=True)
class KVCacheBlocks:
    """Blocks of one request per KV cache group: ``blocks[g]`` is group ``g``'s list."""

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(list(a) + list(b) for a, b in zip(self.blocks, other.blocks)))

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        assert len(self.blocks) == 1, "only one group is supported"
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.blocks)


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache counters, in tokens, one record per admission. ``queries`` counts the tokens
    of admitted requests, ``hits`` those found in the local (device) prefix cache and
    ``external_hits`` those loaded from a KV connector (offload tiers); preempted requests
    (re-admitted after losing their blocks) are counted apart so that recompute does not
    inflate the hit rate."""

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    external_hits: int = 0

    def record(
        self, num_tokens: int, num_hits: int, preempted: bool, num_external: int = 0
    ) -> None:
        self.external_hits += num_external
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    def merge(self, other: PrefixCacheStats) -> None:
        for name in (
            "requests",
            "queries",
            "hits",
            "preempted_requests",
            "preempted_queries",
            "preempted_hits",
            "external_hits",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Block allocation and prefix caching for the scheduler.

    ``watermark`` (a fraction of the pool) is kept free when admitting new or preempted
    requests, so running requests can still grow a little before someone must be preempted.
    ``medium`` is the location KV events report for these blocks: ``"GPU"`` (vLLM's default)
    for an accelerator's cache; an engine whose KV cache is host memory passes ``"CPU"``.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        hash_block_size: int | None = None,
        watermark: float = 0.0,
        log_stats: bool = True,
        medium: str = MEDIUM_GPU,
    ) -> None:
        groups = list(kv_cache_config.kv_cache_groups)
        if not groups:
            raise ValueError("a KV cache manager needs at least one KV cache group")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        sizes = [g.kv_cache_spec.block_size for g in groups]
        if hash_block_size is None:
            hash_block_size = sizes[0] if len(set(sizes)) == 1 else math.gcd(*sizes)
        self.hash_block_size = hash_block_size
        self.coordinator = get_kv_cache_coordinator(
            groups,
            kv_cache_config.num_blocks,
            enable_caching,
            enable_kv_cache_events,
            hash_block_size,
            medium,
            kv_cache_config.prefix_cache_retention_interval,
        )
        self.block_pool: BlockPool = self.coordinator.block_pool
        self.kv_cache_groups = groups
        self.num_kv_cache_groups = len(groups)
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.log_stats = log_stats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.total_prefix_cache_stats = PrefixCacheStats()
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(_EMPTY for _ in groups))
        # Blocks a compaction replaced, held until the step that reads them is done.
        self._deferred_free: list[KVCacheBlock] = []

    # ---- queries ------------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def get_computed_blocks(self, request: KVCacheRequest) -> tuple[KVCacheBlocks, int]:
        """``(hit blocks, number of computed tokens)`` for a new request. Does not touch the
        blocks: `allocate_slots` takes the references, so a failed allocation leaves no trace
        (and the lookup is counted in the prefix-cache stats only when the request is admitted,
        so a request that waits several steps is counted once)."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        # The last token is always recomputed: its logits are needed to sample.
        max_cache_hit_length = request.num_tokens - 1
        ev = request.kv_eviction
        if ev is not None:  # no more than the cache keeps at admission (token_eviction)
            bs = self.kv_cache_groups[0].kv_cache_spec.block_size
            cap = ev.max_prefix_hit(bs, request.num_prompt_tokens)
            max_cache_hit_length = min(max_cache_hit_length, cap)
        hits, num_computed = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length
        )
        return KVCacheBlocks(hits), num_computed

    # ---- allocation -----------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        full_sequence_must_fit: bool = False,
    ) -> KVCacheBlocks | None:
        """Reserve slots for ``num_new_tokens`` (+ lookahead) tokens after the computed ones.

        Returns the newly allocated blocks (possibly none), or None when they do not fit; then
        nothing was touched or allocated (blocks that fell out of a sliding window may have
        been released, which only makes room). With ``full_sequence_must_fit`` a new request is
        admitted only if its whole current sequence fits, so a long prompt that is chunked
        cannot be admitted and then preempted for lack of room a few steps later.
        Newly full blocks are registered in the prefix cache at once unless
        ``delay_cache_blocks`` (their KV is still arriving from an external source).
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        hits = (
            new_computed_blocks.blocks
            if new_computed_blocks is not None
            else self.empty_kv_cache_blocks.blocks
        )
        rid = request.request_id
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(num_local_computed + num_external_computed_tokens, self.max_model_len)
        num_tokens_need_slot = min(
            total_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        admitting = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        watermark = self.watermark_blocks if admitting else 0
        coordinator = self.coordinator
        # Release out-of-window blocks first: fewer cached blocks need to be evicted below.
        coordinator.remove_skipped_blocks(rid, total_computed)
        full_len = min(max(request.num_tokens, num_tokens_need_slot), self.max_model_len)
        if request.kv_eviction is not None:
            # From here on, token counts are cache indices (position - evicted tokens).
            self._evict_streaming_blocks(request, total_computed)
            ev = request.num_evicted_tokens
            total_computed -= ev
            num_tokens_need_slot -= ev
            bs = self.kv_cache_groups[0].kv_cache_spec.block_size
            full_len = min(
                full_len - ev,
                request.kv_eviction.max_blocks_per_request(bs, request.num_prompt_tokens, 0) * bs,
            )
        num_free = self.block_pool.get_num_free_blocks()
        if full_sequence_must_fit and admitting:
            if (
                coordinator.get_num_blocks_for_whole_sequence(
                    rid, full_len, num_tokens_need_slot, hits, total_computed
                )
                + watermark
                > num_free
            ):
                return None
        num_needed = coordinator.get_num_blocks_to_allocate(
            rid, num_tokens_need_slot, hits, total_computed
        )
        if num_needed + watermark > num_free:
            return None
        if admitting and request.num_computed_tokens == 0:
            self._record_admission(request, num_new_computed_tokens, num_external_computed_tokens)
        coordinator.allocate_new_computed_blocks(rid, hits, total_computed)
        new_blocks = coordinator.allocate_new_blocks(rid, num_tokens_need_slot)
        if self.enable_caching and not delay_cache_blocks and request.num_evicted_tokens == 0:
            # After an eviction the table's block i no longer holds token block i, and what it
            # holds depends on the schedule: nothing more of this request is registered.
            # Capped at num_tokens: lookahead slots hold no verified token yet.
            coordinator.cache_blocks(
                request, min(total_computed + num_new_tokens, request.num_tokens)
            )
        return KVCacheBlocks(new_blocks)

    # ---- token eviction (`core.token_eviction`) -------------------------------------------------

    def _evict_streaming_blocks(self, request: KVCacheRequest, total_computed: int) -> None:
        """StreamingLLM: release the oldest non-sink blocks of a running request that the
        window no longer needs (``KVEvictionConfig.num_blocks_to_evict``), oldest first, and
        count their tokens as evicted. Freed blocks keep any hash they have (they were
        registered before the first eviction, so they hold exact KV)."""
        ev = request.kv_eviction
        mgr = self.coordinator.single_type_managers[0]
        rid = request.request_id
        if ev is None or ev.policy != "streaming" or rid not in mgr.num_cached_block:
            return
        bs = mgr.block_size
        n = ev.num_blocks_to_evict(total_computed - request.num_evicted_tokens, bs)
        if n <= 0:
            return
        blocks = mgr.req_to_blocks[rid]
        first = ev.sink_blocks(bs)
        removed = blocks[first : first + n]
        del blocks[first : first + n]
        mgr.num_cached_block[rid] = min(mgr.num_cached_block[rid], first)
        self.block_pool.free_blocks(reversed(removed))
        request.num_evicted_tokens += n * bs

    def compact_blocks(self, request: KVCacheRequest, num_kept: int) -> list[int]:
        """SnapKV: give ``request`` a block table of ``cdiv(num_kept, bs)`` blocks to hold the
        tokens its compression keeps (the worker copies them there after this step's forward
        pass, which still reads and writes the old table) and return their ids. The old blocks
        are released at the next `release_deferred` (so nothing else reuses them within this
        step); they keep their hashes: the uncompressed prefix stays a prefix-cache hit for
        later requests. When the pool cannot spare the new blocks, the first old blocks are
        reused in place (their hashes dropped first, since they will be overwritten) and the
        rest released. The request's later tokens go after the kept ones:
        ``num_evicted_tokens`` becomes the number of computed tokens minus ``num_kept``."""
        mgr = self.coordinator.single_type_managers[0]
        rid = request.request_id
        old = mgr.req_to_blocks[rid]
        n = cdiv(num_kept, mgr.block_size)
        if self.block_pool.get_num_free_blocks() >= n:
            new = self.block_pool.get_new_blocks(n)
            self._deferred_free.extend(reversed(old))
        else:
            new = old[:n]
            self.block_pool.evict_blocks([b.block_id for b in new])
            self._deferred_free.extend(reversed(old[n:]))
        mgr.req_to_blocks[rid] = new
        mgr.num_cached_block[rid] = 0
        request.num_evicted_tokens = request.num_computed_tokens - num_kept
        return [b.block_id for b in new]

    def release_deferred(self) -> None:
        """Free the blocks `compact_blocks` set aside (call once the step that read them is
        done: at the start of the next schedule)."""
        if self._deferred_free:
            blocks, self._deferred_free = self._deferred_free, []
            self.block_pool.free_blocks(blocks)

    def fork_request(
        self, parent: KVCacheRequest, child: KVCacheRequest
    ) -> list[tuple[int, int]] | None:
        """Give ``child`` the KV of ``parent``'s first ``parent.num_computed_tokens`` tokens
        (parallel sampling, ``n > 1``).

        Full blocks are shared by reference (``ref_cnt + 1``); each group's partially filled
        last block is copied into a fresh block for the child, since both sequences will write
        their next tokens into it (copy-on-write, done at fork time). Returns the ``(src, dst)``
        block-id pairs the worker must copy before the next forward pass, or None — with nothing
        changed — when the pool lacks blocks for the copies.
        """
        num_tokens = parent.num_computed_tokens
        copies = self.coordinator.fork(parent.request_id, child.request_id, num_tokens)
        if copies is not None:
            child.num_computed_tokens = num_tokens
        return copies

    def _record_admission(self, request: KVCacheRequest, num_hits: int, num_external: int) -> None:
        preempted = request.num_preemptions > 0
        for stats in (self.prefix_cache_stats, self.total_prefix_cache_stats):
            if stats is not None:
                stats.record(request.num_tokens, num_hits, preempted, num_external)

    def cache_blocks(self, request: KVCacheRequest, num_computed_tokens: int) -> None:
        """Register blocks whose KV has arrived (after a delayed, asynchronous load)."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def free(self, request: KVCacheRequest) -> None:
        """Release all blocks of the request, tail first (see `BlockPool.free_blocks`). A
        request recomputed later (preemption) starts again with no token evicted."""
        self.coordinator.free(request.request_id)
        request.num_evicted_tokens = 0

    def invalidate(self, request: KVCacheRequest, num_valid_tokens: int) -> None:
        """Only the first ``num_valid_tokens`` tokens of ``request``'s KV are valid (a connector
        reported a failed load): later blocks lose their prefix-cache hashes (in every group)
        and are registered again when recomputed. The caller rewinds ``num_computed_tokens``."""
        self.coordinator.invalidate(request.request_id, num_valid_tokens)

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the KV events, annotated with each group's spec kind and window."""
        events = self.block_pool.take_events()
        for event in events:
            gid = getattr(event, "group_idx", None)
            if (
                gid is not None
                and hasattr(event, "kv_cache_spec_kind")
                and 0 <= gid < self.num_kv_cache_groups
            ):
                spec = self.kv_cache_groups[gid].kv_cache_spec
                event.kv_cache_spec_kind = spec.kind
                event.kv_cache_spec_sliding_window = get_kv_cache_spec_sliding_window(spec)
        return events

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The counters since the last call (and start a new window)."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    # ---- invariants -------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the README's invariants ("core/"): every block is null, in use or free (exactly one);
        ``ref_cnt`` equals the number of live block tables holding the block; hashes and the
        prefix-cache index agree; the free count plus the used count plus the null block is the
        pool size. Raises AssertionError with the first violation."""
        pool = self.block_pool
        pool.check_invariants()
        holders: Counter[int] = Counter()
        for manager in self.coordinator.single_type_managers:
            for rid, blocks in manager.req_to_blocks.items():
                ids = [b.block_id for b in blocks if not b.is_null]
                assert len(ids) == len(set(ids)), f"request {rid} holds a block twice"
                holders.update(ids)
                assert manager.num_cached_block.get(rid, 0) <= len(blocks)
        holders.update(b.block_id for b in self._deferred_free if not b.is_null)
        used = 0
        for block in pool.blocks[1:]:
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != "
                f"{holders.get(block.block_id, 0)} block tables"
            )
            used += block.ref_cnt > 0
        assert used + pool.get_num_free_blocks() + 1 == pool.num_gpu_blocks, "blocks leaked"
