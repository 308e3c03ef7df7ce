"""The coordinator: one shared `BlockPool`, one single-type manager per KV cache group.

* `KVCacheCoordinatorNoPrefixCache`: caching off; any number of groups; never a hit.
* `UnitaryKVCacheCoordinator`: one group (the common case): the group's own hit rule.
* `HybridKVCacheCoordinator`: several groups (e.g. full + sliding window). A prefix hit must be
  usable by *every* group, so the hit length is found by a fixed point: start at the maximum,
  let each attention type shrink it in turn (full attention first), and repeat until no type
  shrinks it. All lengths are multiples of the lcm of the group block sizes, so every group's
  hit ends on one of its block boundaries.

Caching follows the same alignment (vLLM's ``_align_cacheable``): the cacheable length is
rounded down to a multiple of the lcm, so a block past the last lcm boundary — which no hit can
use yet — is never cached (it stays unhashed and is recycled first once freed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pagedkv.core.block_pool import BlockPool, KVCacheBlock
from pagedkv.core.events import MEDIUM_GPU
from pagedkv.core.hashing import BlockHash
from pagedkv.core.request import KVCacheRequest
from pagedkv.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    get_manager_class,
)
from pagedkv.core.specs import KVCacheGroupSpec, KVCacheSpec, MambaSpec, scheduler_kv_cache_groups


class BlockHashListWithBlockSize(Sequence[BlockHash]):
    """``hashes`` computed every ``hash_block_size`` tokens, viewed at a coarser block size.

    Element ``i`` is the hash at the end of coarse block ``i``: since hashes are chained, the
    last fine hash already fingerprints the whole prefix.
    """

    __slots__ = ("hashes", "scale")

    def __init__(self, hashes: Sequence[BlockHash], hash_block_size: int, block_size: int) -> None:
        if block_size % hash_block_size:
            raise ValueError(
                f"block size {block_size} is not a multiple of the hash block size "
                f"{hash_block_size}"
            )
        self.hashes = hashes
        self.scale = block_size // hash_block_size

    def __len__(self) -> int:
        return len(self.hashes) // self.scale

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.hashes[(i + 1) * self.scale - 1]


def view_block_hashes(
    hashes: Sequence[BlockHash], hash_block_size: int, block_size: int
) -> Sequence[BlockHash]:
    if block_size == hash_block_size:
        return hashes
    return BlockHashListWithBlockSize(hashes, hash_block_size, block_size)


class KVCacheCoordinator:
    """Fans allocation calls out to the group managers; owns the shared pool."""

    def __init__(
        self,
        kv_cache_groups: Sequence[KVCacheGroupSpec],
        num_blocks: int,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        hash_block_size: int,
        medium: str = MEDIUM_GPU,
        prefix_cache_retention_interval: int | None = None,
    ) -> None:
        self.kv_cache_groups = scheduler_kv_cache_groups(
            kv_cache_groups
        )  # uniform-type → one layer's spec
        self.hash_block_size = hash_block_size
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_kv_cache_events, medium)
        # Hits (and so cached blocks) end on multiples of the lcm of the group block sizes.
        self.lcm_block_size = math.lcm(*(g.kv_cache_spec.block_size for g in self.kv_cache_groups))
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_class(g.kv_cache_spec)(
                g.kv_cache_spec,
                self.block_pool,
                i,
                self.lcm_block_size,
                **(
                    {"prefix_cache_retention_interval": prefix_cache_retention_interval}
                    if isinstance(g.kv_cache_spec, MambaSpec)
                    else {}
                ),
            )
            for i, g in enumerate(self.kv_cache_groups)
        )

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        total_computed_tokens: int,
    ) -> int:
        return sum(
            m.get_num_blocks_to_allocate(
                request_id, num_tokens, new_computed_blocks[i], total_computed_tokens
            )
            for i, m in enumerate(self.single_type_managers)
        )

    def get_num_blocks_for_whole_sequence(
        self,
        request_id: str,
        sequence_len: int,
        step_len: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        total_computed_tokens: int,
    ) -> int:
        """Blocks to admit a request only if its whole sequence (``sequence_len`` tokens) will
        fit: groups that keep every token (full attention) count the whole sequence; windowed
        groups count this step's ``step_len`` slots, since what they hold is trimmed to the
        window as the sequence advances (counting the whole sequence there would refuse, for
        ever, a request that fits)."""
        return sum(
            m.get_num_blocks_to_allocate(
                request_id,
                sequence_len if m.keeps_all_tokens else step_len,
                new_computed_blocks[i],
                total_computed_tokens,
            )
            for i, m in enumerate(self.single_type_managers)
        )

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_computed_tokens: int,
    ) -> None:
        for i, m in enumerate(self.single_type_managers):
            m.allocate_new_computed_blocks(request_id, new_computed_blocks[i], num_computed_tokens)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int
    ) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            m.allocate_new_blocks(request_id, num_tokens) for m in self.single_type_managers
        )

    def cache_blocks(self, request: KVCacheRequest, num_tokens: int) -> None:
        """Register the request's full blocks within its first ``num_tokens`` tokens, rounded
        down to the lcm boundary (a no-op rounding with one group)."""
        lcm = self.lcm_block_size
        num_tokens = num_tokens // lcm * lcm
        for m in self.single_type_managers:
            m.cache_blocks(
                request,
                view_block_hashes(request.block_hashes, self.hash_block_size, m.block_size),
                num_tokens,
            )

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.single_type_managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def free(self, request_id: str) -> None:
        for m in self.single_type_managers:
            m.free(request_id)

    def invalidate(self, request_id: str, num_valid_tokens: int) -> None:
        for m in self.single_type_managers:
            m.invalidate(request_id, num_valid_tokens)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give ``child_id`` the blocks of ``parent_id``'s first ``num_tokens`` tokens in every
        group (`SingleTypeKVCacheManager.fork`). Returns the ``(src, dst)`` copies of partial
        blocks, or None, with nothing changed, when the pool lacks blocks for them."""
        managers = self.single_type_managers
        if (
            sum(m.get_num_blocks_to_fork(num_tokens) for m in managers)
            > self.block_pool.get_num_free_blocks()
        ):
            return None
        copies = []
        for m in managers:
            copy = m.fork(parent_id, child_id, num_tokens)
            if copy is not None:
                copies.append(copy)
        return copies

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.get_blocks(request_id) for m in self.single_type_managers)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """``(hit blocks per group, hit length in tokens)``; does not touch the blocks."""
        raise NotImplementedError


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        return tuple([] for _ in self.single_type_managers), 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.manager = self.single_type_managers[0]
        self.spec = self.kv_cache_groups[0].kv_cache_spec
        if self.spec.block_size != self.hash_block_size:
            raise ValueError(
                "with one KV cache group the hash block size must equal the block size"
            )

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        hits = type(self.manager).find_longest_cache_hit(
            block_hashes,
            max_cache_hit_length,
            (0,),
            self.block_pool,
            self.spec,
            self.spec.block_size,
        )
        return hits, len(hits[0]) * self.spec.block_size


class HybridKVCacheCoordinator(KVCacheCoordinator):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Groups with equal specs are looked up together (one get_cached_block per hash).
        by_spec: dict[KVCacheSpec, list[int]] = {}
        for i, g in enumerate(self.kv_cache_groups):
            by_spec.setdefault(g.kv_cache_spec, []).append(i)
        self.spec_groups = sorted(
            ((spec, tuple(ids), get_manager_class(spec)) for spec, ids in by_spec.items()),
            key=lambda t: t[2] is not FullAttentionManager,
        )  # full attention first

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        lcm = self.lcm_block_size
        hit_length = max_cache_hit_length // lcm * lcm
        found: dict[KVCacheSpec, tuple[list[KVCacheBlock], ...]] = {}
        while True:
            start = hit_length
            for spec, group_ids, cls in self.spec_groups:
                if cls is FullAttentionManager and spec in found:
                    # A full-attention hit is downward closed: shrinking only truncates it.
                    hits = found[spec]
                    for hit in hits:
                        del hit[hit_length // spec.block_size :]
                else:
                    view = view_block_hashes(block_hashes, self.hash_block_size, spec.block_size)
                    hits = cls.find_longest_cache_hit(
                        view, hit_length, group_ids, self.block_pool, spec, lcm
                    )
                    found[spec] = hits
                hit_length = min(hit_length, len(hits[0]) * spec.block_size)
            if hit_length == start:
                break
        out: list[list[KVCacheBlock]] = [[] for _ in self.kv_cache_groups]
        for spec, group_ids, _ in self.spec_groups:
            for gid, hit in zip(group_ids, found[spec]):
                out[gid] = hit
        return tuple(out), hit_length


def get_kv_cache_coordinator(
    kv_cache_groups: Sequence[KVCacheGroupSpec],
    num_blocks: int,
    enable_caching: bool,
    enable_kv_cache_events: bool,
    hash_block_size: int,
    medium: str = MEDIUM_GPU,
    prefix_cache_retention_interval: int | None = None,
) -> KVCacheCoordinator:
    if not enable_caching:
        cls: type[KVCacheCoordinator] = KVCacheCoordinatorNoPrefixCache
    elif len(kv_cache_groups) == 1:
        cls = UnitaryKVCacheCoordinator
    else:
        cls = HybridKVCacheCoordinator
    return cls(
        kv_cache_groups,
        num_blocks,
        enable_caching,
        enable_kv_cache_events,
        hash_block_size,
        medium,
        prefix_cache_retention_interval,
    )
