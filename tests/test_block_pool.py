"""BlockPool, FreeKVCacheBlockQueue and BlockHashToBlockMap unit tests."""

from __future__ import annotations

import pytest

from pagedkv.core.block_pool import (
    BlockHashToBlockMap,
    BlockPool,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
)


def ids(blocks):
    return [b.block_id for b in blocks]


def test_block_uses_slots():
    assert not hasattr(KVCacheBlock(0), "__dict__")


def test_free_queue_operations():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 6 and ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4, 5]
    assert q.popleft().block_id == 0
    q.remove(blocks[3])
    assert ids(q.get_all_free_blocks()) == [1, 2, 4, 5] and q.num_free_blocks == 4
    with pytest.raises(RuntimeError):
        q.remove(blocks[3])
    assert ids(q.popleft_n(2)) == [1, 2]
    q.append(blocks[0])
    q.append_n([blocks[1], blocks[2]])
    assert ids(q.get_all_free_blocks()) == [4, 5, 0, 1, 2]
    q.popleft_n(5)
    q.prepend_n([blocks[4], blocks[5]])
    q.prepend_n([blocks[1], blocks[2]])
    assert ids(q.get_all_free_blocks()) == [1, 2, 4, 5]
    assert ids(q.popleft_n(4)) == [1, 2, 4, 5]
    assert q.num_free_blocks == 0
    assert q.fake_free_list_head.next_free_block is q.fake_free_list_tail
    with pytest.raises(ValueError, match="No free blocks"):
        q.popleft()
    assert q.popleft_n(0) == []


def test_block_hash_map_keeps_duplicates():
    m = BlockHashToBlockMap()
    a, b, c = KVCacheBlock(1), KVCacheBlock(2), KVCacheBlock(3)
    m.insert(b"k", a)
    assert m.get_one_block(b"k") is a
    m.insert(b"k", b)
    assert ids(m.blocks_for(b"k")) == [1, 2] and m.contains(b"k", 2)
    assert m.pop(b"k", 3) is None and len(m.blocks_for(b"k")) == 2
    assert m.pop(b"k", 1) is a
    assert m.get_one_block(b"k") is b and m.pop(b"x", 1) is None
    m.insert(b"j", c)
    assert m.pop(b"j", 9) is None and m.get_one_block(b"j") is c
    assert m.pop(b"k", 2) is b and m.get_one_block(b"k") is None


def test_pool_null_block_and_usage():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4 and pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(2)
    assert ids(blocks) == [1, 2] and all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_usage() == 0.5
    with pytest.raises(ValueError, match="Cannot get 3"):
        pool.get_new_blocks(3)
    pool.free_blocks([pool.null_block, *blocks])  # null blocks are ignored
    pool.check_invariants()
    assert pool.get_num_free_blocks() == 4


def test_touch_revives_cached_free_block_and_evict_blocks():
    pool = BlockPool(4, enable_kv_cache_events=True)
    (blk,) = pool.get_new_blocks(1)
    blk.block_hash = b"h" + (0).to_bytes(4, "big")
    pool.cached_block_hash_to_block.insert(blk.block_hash, blk)
    pool.free_blocks([blk])
    assert ids(pool.free_block_queue.get_all_free_blocks())[-1] == blk.block_id
    pool.touch([blk])
    assert blk.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.check_invariants()
    pool.evict_blocks([blk.block_id])
    assert blk.block_hash is None and pool.get_cached_block(b"h", [0]) is None
    assert pool.take_events()[0].block_hashes == [b"h"]
    pool.free_blocks([blk])
    pool.check_invariants()


def test_reset_refuses_while_in_use():
    pool = BlockPool(4, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(1)
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True


def test_pool_needs_the_null_block():
    with pytest.raises(ValueError):
        BlockPool(0)
