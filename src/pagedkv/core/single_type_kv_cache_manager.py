"""Per-attention-type block managers: one per KV cache group, all sharing one `BlockPool`.

Each manager owns the block tables of its group (``req_to_blocks``) and knows two rules of its
attention type:

* `get_num_skipped_tokens(n)`: how many leading tokens can no longer be read once ``n`` tokens
  are computed (their blocks are released and replaced by the null block);
* `find_longest_cache_hit`: which cached blocks make a usable prefix hit.

======================  =============================  ===========================================
manager                 skipped tokens                 longest hit
======================  =============================  ===========================================
FullAttentionManager    0                              left→right until the first miss
SlidingWindowManager    max(0, n - window + 1)         right→left: the last run of
                                                       cdiv(window - 1, bs) cached blocks (or the
                                                       run that starts at block 0)
ChunkedLocal...Manager  (n // chunk) * chunk           blocks before the current chunk are null;
                                                       then left→right inside the chunk
MambaManager            ((n - 1) // bs) * bs (only     right→left: the last cached block at an
                        the block of the last token)   aligned boundary: ``[null]*i + [block]``
======================  =============================  ===========================================

Invariant: a request's block table only grows, except that blocks that fell out of the window
are replaced by the null block (their ids never change otherwise).

What gets cached (vLLM 0.33's rule): a full block is registered in the prefix cache only if some
prefix hit could ever use it. Hits end on multiples of ``alignment_tokens`` (the lcm of the
groups' block sizes), so the coordinator never caches past the last such boundary, and a
sliding-window group caches only the blocks inside the window before an aligned end
(`SlidingWindowManager.reachable_block_mask`). Blocks left unhashed go to the front of the free
queue when freed, so they are recycled before any cached block is evicted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from pagedkv.core.block_pool import BlockPool, KVCacheBlock
from pagedkv.core.hashing import BlockHash
from pagedkv.core.request import KVCacheRequest
from pagedkv.core.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from pagedkv.core.units import cdiv


class SingleTypeKVCacheManager:
    """Block tables of one KV cache group and the allocation rules of its attention type."""

    # Whether a request holds a block for every token it has (False when blocks that fell out
    # of a window or chunk are released as it advances): what "the whole sequence fits" counts.
    keeps_all_tokens = True

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        alignment_tokens: int | None = None,
    ) -> None:
        """``alignment_tokens``: every prefix hit ends on a multiple of it (the lcm of all
        groups' block sizes; a multiple of this group's block size). Defaults to the block
        size (one group)."""
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        alignment_tokens = alignment_tokens or self.block_size
        if alignment_tokens % self.block_size:
            raise ValueError(
                f"alignment_tokens {alignment_tokens} is not a multiple of the block "
                f"size {self.block_size}"
            )
        self.alignment_tokens = alignment_tokens
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self._null_block = block_pool.null_block
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        # Number of leading blocks of a RUNNING request already registered in the prefix cache.
        # Presence in this dict also marks the request as running (no new prefix hits).
        self.num_cached_block: dict[str, int] = {}

    # ---- rules of the attention type ------------------------------------------------------

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0

    def reachable_block_mask(self, start: int, end: int) -> list[bool] | None:
        """For blocks ``start..end-1``: whether a prefix hit could ever use each one (only
        those are cached). None means all of them (the fast path)."""
        return None

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        alignment_tokens: int,
    ) -> tuple[list[KVCacheBlock], ...]:
        """The longest usable prefix hit of at most ``max_length`` tokens whose length is a
        multiple of ``alignment_tokens``; one block list per group id (null blocks for skipped
        positions). Does not touch the blocks."""
        raise NotImplementedError

    # ---- allocation -------------------------------------------------------------------------

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
    ) -> int:
        """Blocks `allocate_slots` would take from the free queue for ``num_tokens`` slots,
        counting cache-hit blocks that are currently evictable (touching them removes them from
        the free count too)."""
        num_required = cdiv(num_tokens, self.block_size)
        num_req_blocks = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:  # running: no new hits
            return max(num_required - num_req_blocks, 0)
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_new = max(
            num_required - max(num_skipped_blocks, len(new_computed_blocks) + num_req_blocks), 0
        )
        num_evictable = sum(
            1 for b in new_computed_blocks[num_skipped_blocks:] if b.ref_cnt == 0 and not b.is_null
        )
        return num_new + num_evictable

    def allocate_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock], num_computed_tokens: int
    ) -> None:
        """Adopt prefix-hit blocks for a new request: skipped positions get the null block, the
        rest are touched (ref_cnt + 1) and appended to the block table."""
        if request_id in self.num_cached_block:
            assert not new_computed_blocks, "a running request cannot get new prefix hits"
            return
        req_blocks = self.req_to_blocks[request_id]
        assert not req_blocks, "computed blocks can only be adopted by a new request"
        num_skipped_blocks = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        if num_skipped_blocks > 0:
            new_computed_blocks = new_computed_blocks[num_skipped_blocks:]
            req_blocks.extend([self._null_block] * num_skipped_blocks)
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(req_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the block table to hold ``num_tokens`` slots; returns the new blocks."""
        req_blocks = self.req_to_blocks[request_id]
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(
        self, request: KVCacheRequest, block_hashes: Sequence[BlockHash], num_tokens: int
    ) -> None:
        """Register the request's blocks that are full within its first ``num_tokens`` tokens."""
        num_cached = self.num_cached_block.get(request.request_id, 0)
        num_full = min(num_tokens // self.block_size, len(block_hashes))
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[request.request_id],
            block_hashes,
            num_cached,
            num_full,
            self.block_size,
            self.kv_cache_group_id,
            self.reachable_block_mask(num_cached, num_full),
        )
        self.num_cached_block[request.request_id] = num_full

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release the blocks that fell out of the attention window, newest first (so the
        longer prefixes are evicted first), replacing them with the null block."""
        num_skipped_tokens = self.get_num_skipped_tokens(num_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks[request_id]
        removed = []
        for i in range(min(num_skipped_tokens // self.block_size, len(blocks)) - 1, -1, -1):
            if blocks[i] is self._null_block:
                break  # everything before was already removed
            removed.append(blocks[i])
            blocks[i] = self._null_block
        self.block_pool.free_blocks(removed)

    def invalidate(self, request_id: str, num_valid_tokens: int) -> None:
        """The request's KV after its first ``num_valid_tokens`` tokens is not valid (a failed
        load): those blocks lose their prefix-cache hashes, and are cached again once
        recomputed. Reference counts are unchanged."""
        first = num_valid_tokens // self.block_size
        blocks = self.req_to_blocks.get(request_id, [])
        self.block_pool.evict_blocks([b.block_id for b in blocks[first:] if not b.is_null])
        if self.num_cached_block.get(request_id, 0) > first:
            self.num_cached_block[request_id] = first

    def free(self, request_id: str) -> None:
        """Release all blocks of the request, tail first (chain tails are evicted before heads)."""
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request_id, None)

    def get_num_blocks_to_fork(self, num_tokens: int) -> int:
        """New blocks `fork` takes for a child of ``num_tokens`` tokens: one partial block."""
        return 1 if num_tokens % self.block_size else 0

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> tuple[int, int] | None:
        """Start ``child_id``'s block table from ``parent_id``'s first ``num_tokens`` tokens
        (parallel sampling, ``n > 1``). Full blocks are shared by reference (``ref_cnt + 1``;
        null blocks as they are); a partially filled last block is copied into a fresh block,
        since both sequences write their next tokens into it (copy-on-write at fork time).
        Returns that copy's ``(src, dst)`` block ids for the worker, or None. The caller checks
        that the pool has `get_num_blocks_to_fork` free blocks."""
        blocks = self.req_to_blocks.get(parent_id, [])
        num_full = num_tokens // self.block_size
        table = self.req_to_blocks[child_id] = blocks[:num_full]
        num_shared = len(table)
        self.block_pool.touch(b for b in table if not b.is_null)
        copy = None
        if num_tokens % self.block_size:
            (new,) = self.block_pool.get_new_blocks(1)
            table.append(new)
            copy = (blocks[num_full].block_id, new.block_id)
        # The child's leading blocks are registered exactly where the parent's are.
        self.num_cached_block[child_id] = min(self.num_cached_block.get(parent_id, 0), num_shared)
        return copy

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full (causal) attention, also MLA: every token stays readable."""

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes,
        max_length,
        kv_cache_group_ids,
        block_pool,
        kv_cache_spec,
        alignment_tokens,
    ):
        hits: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        max_blocks = min(max_length // kv_cache_spec.block_size, len(block_hashes))
        for i in range(max_blocks):
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                break  # hashes are chained: after one miss every later block misses too
            for hit, block in zip(hits, cached):
                hit.append(block)
        ratio = alignment_tokens // kv_cache_spec.block_size
        if ratio > 1 and len(hits[0]) % ratio:
            keep = len(hits[0]) // ratio * ratio
            for hit in hits:
                del hit[keep:]
        return hits


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention: a query at position p reads keys in ``(p - window, p]``."""

    keeps_all_tokens = False

    def __init__(
        self,
        kv_cache_spec: SlidingWindowSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        alignment_tokens: int | None = None,
    ) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, alignment_tokens)
        self.sliding_window = kv_cache_spec.sliding_window
        # A hit ending at aligned block e uses blocks [e - needed, e) (see find_longest_cache_hit),
        # so in each aligned segment of ``ratio`` blocks only the last ``needed`` can ever serve
        # a hit; the leading ``ratio - needed`` never can, and are not cached.
        self._segment_blocks = self.alignment_tokens // self.block_size
        needed = cdiv(self.sliding_window - 1, self.block_size)
        self._unreachable_per_segment = max(0, self._segment_blocks - needed)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def reachable_block_mask(self, start: int, end: int) -> list[bool] | None:
        """vLLM's ``reachable_block_mask``: block ``i`` can serve a hit iff
        ``i % ratio >= ratio - needed`` (the window's blocks before an aligned end)."""
        skip = self._unreachable_per_segment
        if skip == 0:
            return None
        seg = self._segment_blocks
        return [i % seg >= skip for i in range(start, end)]

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes,
        max_length,
        kv_cache_group_ids,
        block_pool,
        kv_cache_spec,
        alignment_tokens,
    ):
        bs = kv_cache_spec.block_size
        # The next token (at position hit_length) reads the window-1 tokens before it.
        needed = cdiv(kv_cache_spec.sliding_window - 1, bs)
        ratio = alignment_tokens // bs
        max_blocks = min(max_length // bs, len(block_hashes))
        null = block_pool.null_block
        if needed == 0:  # a window of one token reads nothing from the cache
            return tuple([null] * (max_blocks // ratio * ratio) for _ in kv_cache_group_ids)
        hits = tuple([null] * max_blocks for _ in kv_cache_group_ids)
        run_end = -1  # exclusive end of the current run of hits (scanning right to left)
        for i in range(max_blocks - 1, -1, -1):
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                run_end = -1
                continue
            if run_end < 0:
                run_end = i + 1
            for hit, block in zip(hits, cached):
                hit[i] = block
            end = run_end // ratio * ratio  # the longest aligned hit inside this run
            if end - i >= needed:
                for hit in hits:
                    hit[: end - needed] = [null] * (end - needed)
                    del hit[end:]
                return hits
        # No full window anywhere: a run starting at block 0 is still a valid (short) prefix.
        end = (run_end if run_end > 0 else 0) // ratio * ratio
        for hit in hits:
            del hit[end:]
        return hits


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Chunked local attention (Llama 4): a query reads only keys of its own chunk of
    ``attention_chunk_size`` tokens."""

    keeps_all_tokens = False

    def __init__(
        self,
        kv_cache_spec: ChunkedLocalAttentionSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        alignment_tokens: int | None = None,
    ) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, alignment_tokens)
        self.attention_chunk_size = kv_cache_spec.attention_chunk_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes,
        max_length,
        kv_cache_group_ids,
        block_pool,
        kv_cache_spec,
        alignment_tokens,
    ):
        bs = kv_cache_spec.block_size
        chunk = kv_cache_spec.attention_chunk_size
        max_blocks = min(max_length // bs, len(block_hashes))
        # Blocks of earlier chunks are never read again: null, and they count as computed.
        start_block = max_length // chunk * chunk // bs
        null = block_pool.null_block
        hits = tuple([null] * start_block for _ in kv_cache_group_ids)
        for i in range(start_block, max_blocks):
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                break
            for hit, block in zip(hits, cached):
                hit.append(block)
        ratio = alignment_tokens // bs
        if ratio > 1 and len(hits[0]) % ratio:
            keep = len(hits[0]) // ratio * ratio
            for hit in hits:
                del hit[keep:]
        return hits


class MambaManager(SingleTypeKVCacheManager):
    """Mamba (recurrent) state with prefix caching through checkpoints (vLLM's align mode).

    The block table is position-indexed: block ``i`` holds the conv + SSM state after the last
    computed token of ``[i·bs, (i+1)·bs)``; once full, that is the checkpoint at boundary
    ``(i+1)·bs``, cached under block ``i``'s hash. A step over ``[s, e)`` reads the state of
    the block of position ``s - 1`` and needs a page for the block of ``e - 1`` (the live
    state); blocks before the live one are released after the step (cached ones stay in the
    free queue, evictable), so between steps a request holds the live block, and at a block
    boundary also the previous checkpoint it reads from. Which full blocks in between get a
    page of their own (a checkpoint the runner writes) is ``prefix_cache_retention_interval``:

    * ``None`` (dense): every block boundary the request crosses is checkpointed and cached;
    * ``0``: only the state at the end of each step (vLLM's align mode: the scheduler ends
      prefill chunks on block boundaries, up to the last one before the prompt end, the
      "replay boundary"), and it is cached when that block is full;
    * ``k`` (a multiple of the block size): boundaries at multiples of ``k`` tokens only (an
      end-of-step state elsewhere is kept while live, never cached).

    Other boundaries get the null block: their state is never stored. A prefix hit needs only
    the last checkpoint (``find_longest_cache_hit`` scans right to left); without prefix
    caching nothing but the live block is allocated.
    """

    keeps_all_tokens = False

    def __init__(
        self,
        kv_cache_spec: MambaSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        alignment_tokens: int | None = None,
        prefix_cache_retention_interval: int | None = None,
    ) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, alignment_tokens)
        r = prefix_cache_retention_interval
        if r is not None and (not isinstance(r, int) or r < 0 or r % self.alignment_tokens):
            raise ValueError(
                f"prefix_cache_retention_interval must be None, 0 or a multiple of the block "
                f"size {self.alignment_tokens}, got {r!r}"
            )
        self.prefix_cache_retention_interval = r
        self.caching = block_pool.enable_caching

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, (num_computed_tokens - 1) // self.block_size * self.block_size)

    def _checkpoint(self, i: int) -> bool:
        """Whether full block ``i`` gets a page of its own when a step crosses its end."""
        end = (i + 1) * self.block_size
        r = self.prefix_cache_retention_interval
        return (
            self.caching
            and end % self.alignment_tokens == 0
            and (r is None or (r > 0 and end % r == 0))
        )

    def _pages(self, first: int, num_blocks: int) -> list[bool]:
        """For positions ``first..num_blocks-1``: whether each gets a page (else null)."""
        return [i == num_blocks - 1 or self._checkpoint(i) for i in range(first, num_blocks)]

    def reachable_block_mask(self, start: int, end: int) -> list[bool] | None:
        r = self.prefix_cache_retention_interval
        if not r:
            return None
        return [((i + 1) * self.block_size) % r == 0 for i in range(start, end)]

    def get_num_blocks_to_allocate(
        self, request_id, num_tokens, new_computed_blocks, total_computed_tokens
    ):
        held = len(self.req_to_blocks.get(request_id, ()))
        evictable = 0
        if request_id not in self.num_cached_block:  # a new request: adopts its hit
            held = max(held, len(new_computed_blocks))
            evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return sum(self._pages(held, cdiv(num_tokens, self.block_size))) + evictable

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        req_blocks = self.req_to_blocks[request_id]
        pages = self._pages(len(req_blocks), cdiv(num_tokens, self.block_size))
        if not pages:
            return []
        new_blocks = self.block_pool.get_new_blocks(sum(pages))
        fresh = iter(new_blocks)
        req_blocks.extend(next(fresh) if page else self._null_block for page in pages)
        return new_blocks

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release every block before the live one (null positions sit between pages, so
        the base class's stop at the first null would miss older checkpoints)."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        n = min(self.get_num_skipped_tokens(num_computed_tokens) // self.block_size, len(blocks))
        removed = []
        for i in range(n - 1, -1, -1):
            if not blocks[i].is_null:
                removed.append(blocks[i])
                blocks[i] = self._null_block
        self.block_pool.free_blocks(removed)

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes,
        max_length,
        kv_cache_group_ids,
        block_pool,
        kv_cache_spec,
        alignment_tokens,
    ):
        bs = kv_cache_spec.block_size
        ratio = alignment_tokens // bs
        null = block_pool.null_block
        for i in range(min(max_length // bs, len(block_hashes)) - 1, -1, -1):
            if (i + 1) % ratio:
                continue
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is not None:  # only the last state is needed: nulls before it
                return tuple([null] * i + [block] for block in cached)
        return tuple([] for _ in kv_cache_group_ids)


def get_manager_class(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager for a spec type (MLA is full attention)."""
    if isinstance(spec, MambaSpec):
        return MambaManager
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return ChunkedLocalAttentionManager
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager
    raise NotImplementedError(f"no KV cache manager for {type(spec).__name__}")
