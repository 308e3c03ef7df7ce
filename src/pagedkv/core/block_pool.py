"""The block pool: every physical KV block, its reference count, the free queue and the
prefix-cache index.

States of a block (exactly one at any time):

* the **null block** (block 0): a placeholder for skipped blocks (outside a sliding window);
  never allocated, never freed, its ``ref_cnt`` is not maintained;
* **in use**: ``ref_cnt > 0``, held by that many live block tables, not in the free queue;
* **free**: ``ref_cnt == 0``, in the free queue. A free block may still carry a hash: it is then
  a *cached, evictable* block that a prefix hit can revive (`touch`) until `get_new_blocks`
  reuses it (evicting its hash first).

Free-queue order policy (vLLM 0.33's): the front is reused first. `free_blocks` takes blocks in
eviction-priority order (callers pass a request's blocks tail first) and puts

* blocks **without** a hash at the **front** (`prepend_n`): they hold nothing reusable, so they
  are recycled first (LIFO, warm in cache);
* blocks **with** a hash at the **back** (`append_n`): cached content is evicted least recently
  freed first (LRU), and within one request the chain tail before its head.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pagedkv.core.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from pagedkv.core.hashing import BlockHash, BlockHashWithGroupId, maybe_convert_block_hash
from pagedkv.core.request import KVCacheRequest, generate_block_hash_extra_keys, to_event_extra_keys

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical KV block. ``prev_free_block``/``next_free_block`` are the intrusive links of
    `FreeKVCacheBlockQueue` (only it touches them); ``_block_hash`` is set only while the block is
    full and registered in the prefix cache."""

    block_id: int
    ref_cnt: int = 0
    _block_hash: BlockHashWithGroupId | None = None
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHashWithGroupId) -> None:
        assert self._block_hash is None, "the block already has a hash"
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        self._block_hash = None


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction order (front = reused first).

    Intrusive (the links live in the blocks) with two sentinels, so every operation is O(1) per
    block, needs no branch for the ends, and allocates no Python object. ``remove`` takes a block
    out of the middle: that is how a prefix hit revives a cached free block.
    """

    __slots__ = ("num_free_blocks", "fake_free_list_head", "fake_free_list_tail")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        for prev, nxt in zip(blocks, blocks[1:]):
            prev.next_free_block = nxt
            nxt.prev_free_block = prev
        self.fake_free_list_head = head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = tail = KVCacheBlock(block_id=-1)
        if blocks:
            head.next_free_block, blocks[0].prev_free_block = blocks[0], head
            tail.prev_free_block, blocks[-1].next_free_block = blocks[-1], tail
        else:
            head.next_free_block, tail.prev_free_block = tail, head

    def popleft(self) -> KVCacheBlock:
        first = self.fake_free_list_head.next_free_block
        if first is self.fake_free_list_tail:
            raise ValueError("No free blocks available")
        nxt = first.next_free_block
        self.fake_free_list_head.next_free_block = nxt
        nxt.prev_free_block = self.fake_free_list_head
        first.prev_free_block = first.next_free_block = None
        self.num_free_blocks -= 1
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The first ``n`` blocks, in order. The caller checks ``n <= num_free_blocks``."""
        if n == 0:
            return []
        assert n <= self.num_free_blocks, "not enough free blocks"
        self.num_free_blocks -= n
        curr = self.fake_free_list_head.next_free_block
        out = []
        for _ in range(n):
            out.append(curr)
            last, curr = curr, curr.next_free_block
            last.prev_free_block = last.next_free_block = None
        self.fake_free_list_head.next_free_block = curr
        curr.prev_free_block = self.fake_free_list_head
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() called on a block not in the free queue: {block}")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = tail
        tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Append ``blocks`` to the back, in the given order."""
        if not blocks:
            return
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
        last.next_free_block = tail
        tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the front, in the given order (``blocks[0]`` pops first)."""
        if not blocks:
            return
        head = self.fake_free_list_head
        first = head.next_free_block
        prev = head
        for block in blocks:
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, front to back (for tests and invariant checks)."""
        out = []
        curr = self.fake_free_list_head.next_free_block
        while curr is not self.fake_free_list_tail:
            out.append(curr)
            curr = curr.next_free_block
        return out


class BlockHashToBlockMap:
    """Prefix-cache index: ``hash + group id`` → cached block(s).

    One key may map to several blocks: block tables are append-only (a block id never changes
    under a running request), so when two requests compute the same block independently (a
    full-prompt hit recomputes its last block; two identical prompts in one step) both blocks stay
    and both are indexed. A single block is stored bare (the common case, less GC pressure);
    a second insert turns the entry into ``{block_id: block}``.
    """

    __slots__ = ("_cache",)

    def __init__(self) -> None:
        self._cache: dict[BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        entry = self._cache.get(key)
        if entry is None or type(entry) is KVCacheBlock:
            return entry  # type: ignore[return-value]
        return next(iter(entry.values()))  # type: ignore[union-attr]

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        entry = self._cache.get(key)
        if entry is None:
            self._cache[key] = block
        elif type(entry) is KVCacheBlock:
            self._cache[key] = {entry.block_id: entry, block.block_id: block}  # type: ignore[union-attr]
        else:
            entry[block.block_id] = block  # type: ignore[index]

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Remove only ``block_id`` under ``key``; other blocks under the key stay."""
        entry = self._cache.pop(key, None)
        if entry is None:
            return None
        if type(entry) is KVCacheBlock:
            if entry.block_id == block_id:  # type: ignore[union-attr]
                return entry  # type: ignore[return-value]
            self._cache[key] = entry
            return None
        block = entry.pop(block_id, None)  # type: ignore[union-attr]
        if len(entry) == 1:  # type: ignore[arg-type]
            self._cache[key] = next(iter(entry.values()))  # type: ignore[union-attr]
        elif entry:
            self._cache[key] = entry
        return block

    def contains(self, key: BlockHashWithGroupId, block_id: int) -> bool:
        entry = self._cache.get(key)
        if entry is None:
            return False
        if type(entry) is KVCacheBlock:
            return entry.block_id == block_id  # type: ignore[union-attr]
        return block_id in entry  # type: ignore[operator]

    def blocks_for(self, key: BlockHashWithGroupId) -> list[KVCacheBlock]:
        entry = self._cache.get(key)
        if entry is None:
            return []
        return [entry] if type(entry) is KVCacheBlock else list(entry.values())  # type: ignore[union-attr,list-item]

    def items(self) -> Iterable[tuple[BlockHashWithGroupId, KVCacheBlock]]:
        for key, entry in self._cache.items():
            if type(entry) is KVCacheBlock:
                yield key, entry  # type: ignore[misc]
            else:
                for block in entry.values():  # type: ignore[union-attr]
                    yield key, block

    def __len__(self) -> int:
        return len(self._cache)


class BlockPool:
    """All KV blocks of one device cache, shared by every KV cache group.

    Block ids are per pool: a group's layers read and write a block only while that group's
    manager holds it. ``num_gpu_blocks`` includes the null block, so ``num_gpu_blocks - 1`` are
    usable. ``medium`` is what KV events report as the blocks' location: ``"GPU"`` (vLLM's
    default) for an accelerator's cache, ``"CPU"`` when the device cache is host memory.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        medium: str = MEDIUM_GPU,
    ) -> None:
        if num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1 (the null block), got {num_gpu_blocks}")
        if not isinstance(medium, str) or not medium:
            raise ValueError(
                f"medium must be a non-empty string such as 'GPU' or 'CPU', got {medium!r}"
            )
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.medium = medium
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.kv_event_queue: list[KVCacheEvent] = []

    # ---- prefix cache lookups -------------------------------------------------------------

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """The cached block of ``block_hash`` for every group, or None if any group misses."""
        out = []
        for group_id in kv_cache_group_ids:
            block = self.cached_block_hash_to_block.get_one_block(
                block_hash + group_id.to_bytes(4, "big")
            )
            if block is None:
                return None
            out.append(block)
        return out

    def cache_full_blocks(
        self,
        request: KVCacheRequest,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` in the prefix cache.

        ``block_hashes[i]`` is the hash of block ``i`` at this group's ``block_size``. Null
        blocks are skipped, and so are blocks whose ``block_mask[i - num_cached_blocks]`` is
        False (blocks no prefix hit can ever use: left unhashed, they are recycled first when
        freed instead of crowding out useful cached blocks). A block that already carries a
        hash is left as is. Emits one `BlockStored` for the batch (none if nothing was stored);
        its ``token_ids`` cover the whole range, skipped blocks included, as vLLM's do.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        suffix = kv_cache_group_id.to_bytes(4, "big")
        index = self.cached_block_hash_to_block
        stored: list[BlockHash] = []
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null or (block_mask is not None and not block_mask[i - num_cached_blocks]):
                continue
            block_hash = block_hashes[i]
            if block._block_hash is None:
                key = block_hash + suffix
                block._block_hash = key
                index.insert(key, block)
            stored.append(block_hash)
        if self.enable_kv_cache_events and stored:
            self._emit_stored(
                request,
                block_hashes,
                stored,
                num_cached_blocks,
                num_full_blocks,
                block_size,
                kv_cache_group_id,
            )

    def _emit_stored(
        self,
        request: KVCacheRequest,
        block_hashes: Sequence[BlockHash],
        stored: list[BlockHash],
        start: int,
        end: int,
        block_size: int,
        group_id: int,
    ) -> None:
        parent = block_hashes[start - 1] if start > 0 else None
        extra: list[object] | None = None
        if request.lora_name is not None or request.mm_features or request.cache_salt is not None:
            extra = []
            for i in range(start, end):
                keys, _ = generate_block_hash_extra_keys(
                    request, i * block_size, (i + 1) * block_size
                )
                extra.append(to_event_extra_keys(keys))
        self.kv_event_queue.append(
            BlockStored(
                block_hashes=[maybe_convert_block_hash(h) for h in stored],
                parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
                token_ids=request.all_token_ids[start * block_size : end * block_size],
                block_size=block_size,
                lora_id=request.lora_id,
                medium=self.medium,
                lora_name=request.lora_name,
                extra_keys=extra,
                group_idx=group_id,
            )
        )

    # ---- allocation -----------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue (evicting their cached
        hashes), each with ``ref_cnt == 1``. ValueError if fewer are free."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"Cannot get {num_blocks} free blocks from the pool "
                f"({self.free_block_queue.num_free_blocks} free)"
            )
        if num_blocks == 1:  # the decode hot path: skip the list building of popleft_n
            block = self.free_block_queue.popleft()
            if block._block_hash is not None:
                self._evict_cached_block(block)
            block.ref_cnt = 1
            return [block]
        out = self.free_block_queue.popleft_n(num_blocks)
        for block in out:
            if block._block_hash is not None:
                self._evict_cached_block(block)
            block.ref_cnt = 1
        return out

    def _evict_cached_block(self, block: KVCacheBlock) -> None:
        key = block._block_hash
        assert key is not None
        block._block_hash = None
        if self.cached_block_hash_to_block.pop(key, block.block_id) is None:
            return
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(
                BlockRemoved(
                    block_hashes=[maybe_convert_block_hash(key[:-4])],
                    medium=self.medium,
                    group_idx=int.from_bytes(key[-4:], "big"),
                )
            )

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, reviving free ones out of the free queue."""
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 return to the free queue
        (see the module docstring for the order). ``ordered_blocks`` is in eviction priority
        order: first = evicted first. Null blocks are ignored."""
        unhashed: list[KVCacheBlock] = []
        hashed: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (unhashed if block._block_hash is None else hashed).append(block)
        if unhashed:
            self.free_block_queue.prepend_n(unhashed)
        if hashed:
            self.free_block_queue.append_n(hashed)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cached hashes of these blocks (e.g. reported corrupt by a connector);
        reference counts are unchanged, so running requests keep their blocks."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block._block_hash is not None:
                self._evict_cached_block(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refuses (returns False) while any block is in use, since a
        running request's blocks would otherwise lose their content addresses under it."""
        num_used = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used != 1:
            logger.warning(
                "Failed to reset the prefix cache: %d blocks are still in use", num_used - 1
            )
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        for block in self.blocks:
            block.reset_hash()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def get_usage(self) -> float:
        """Fraction of usable blocks (the null block excluded) that are in use."""
        usable = self.num_gpu_blocks - 1
        return 0.0 if usable == 0 else 1.0 - self.get_num_free_blocks() / usable

    def take_events(self) -> list[KVCacheEvent]:
        if not self.enable_kv_cache_events:
            return []
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    # ---- invariants -------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the pool-local invariants (see the README, "core/"). O(num_blocks)."""
        free = self.free_block_queue.get_all_free_blocks()
        assert len(free) == self.free_block_queue.num_free_blocks, "free count drifted"
        prev = self.free_block_queue.fake_free_list_head
        for block in free:
            assert block.prev_free_block is prev, f"broken back link at {block.block_id}"
            assert block.ref_cnt == 0, f"block {block.block_id} in the free queue with refs"
            assert not block.is_null, "the null block is in the free queue"
            prev = block
        assert self.free_block_queue.fake_free_list_tail.prev_free_block is prev
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free), "a block is in the free queue twice"
        assert self.null_block is self.blocks[0] and self.null_block.is_null
        for block in self.blocks[1:]:
            if block.block_id in free_ids:
                continue
            assert block.ref_cnt > 0, f"block {block.block_id} is neither free nor in use"
            assert block.prev_free_block is None and block.next_free_block is None
        indexed = set()
        for key, block in self.cached_block_hash_to_block.items():
            assert block._block_hash == key, f"index maps a stale hash to block {block.block_id}"
            indexed.add(block.block_id)
        for block in self.blocks:
            if block._block_hash is not None:
                assert block.block_id in indexed, f"block {block.block_id} hash is not indexed"
