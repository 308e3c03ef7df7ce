"""Sliding-window, chunked-local and hybrid hit rules (reference §5.5/§5.6)."""

from __future__ import annotations

from core_utils import admit, full_spec, make_manager, make_request, swa_spec

from pagedkv.core.block_pool import BlockPool
from pagedkv.core.hashing import BlockHash
from pagedkv.core.single_type_kv_cache_manager import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    SlidingWindowManager,
)
from pagedkv.core.specs import ChunkedLocalAttentionSpec


def pool_with(cached: list[bool], n_blocks: int = 64):
    """A pool where hash i is cached iff cached[i]."""
    pool = BlockPool(n_blocks)
    hashes = [BlockHash(bytes([i]) * 8) for i in range(len(cached))]
    for h, hit in zip(hashes, cached):
        if hit:
            (blk,) = pool.get_new_blocks(1)
            blk.block_hash = h + (0).to_bytes(4, "big")
            pool.cached_block_hash_to_block.insert(blk.block_hash, blk)
    return pool, hashes


def hit_pattern(blocks, pool):
    return ["-" if b is pool.null_block else "x" for b in blocks]


def test_swa_hit_needs_a_window_of_contiguous_blocks():
    spec = swa_spec(block_size=2, window=4)  # needs cdiv(3, 2) = 2 contiguous blocks
    pool, hashes = pool_with([True, True, False, True, True, True, False, True])
    (hits,) = SlidingWindowManager.find_longest_cache_hit(hashes, 16, (0,), pool, spec, 2)
    # Scanning from the right: block 7 alone is not enough; blocks 4-5 form the last full run.
    assert hit_pattern(hits, pool) == ["-", "-", "-", "-", "x", "x"]
    (hits,) = SlidingWindowManager.find_longest_cache_hit(hashes, 9, (0,), pool, spec, 2)
    # Capped at 4 blocks: the run [3] is too short, so the run [0, 1] wins.
    assert hit_pattern(hits, pool) == ["x", "x"]


def test_swa_short_prefix_run_from_block_zero_counts():
    spec = swa_spec(block_size=2, window=16)  # needs 8 blocks
    pool, hashes = pool_with([True, True, True, False, True])
    (hits,) = SlidingWindowManager.find_longest_cache_hit(hashes, 10, (0,), pool, spec, 2)
    assert hit_pattern(hits, pool) == ["x", "x", "x"]


def test_swa_alignment_truncates_to_lcm():
    spec = swa_spec(block_size=2, window=4)
    pool, hashes = pool_with([True] * 7)
    (hits,) = SlidingWindowManager.find_longest_cache_hit(hashes, 14, (0,), pool, spec, 4)
    assert len(hits) * 2 == 12 and hit_pattern(hits, pool)[-2:] == ["x", "x"]


def test_full_attention_stops_at_first_miss():
    pool, hashes = pool_with([True, True, False, True])
    (hits,) = FullAttentionManager.find_longest_cache_hit(hashes, 100, (0,), pool, full_spec(2), 2)
    assert len(hits) == 2


def test_chunked_local_earlier_chunks_are_null_and_count():
    spec = ChunkedLocalAttentionSpec(block_size=2, num_kv_heads=1, head_size=1, dtype="float32",
                                     attention_chunk_size=4)
    pool, hashes = pool_with([False, False, False, False, True, False, True])
    (hits,) = ChunkedLocalAttentionManager.find_longest_cache_hit(hashes, 13, (0,), pool, spec, 2)
    # max_length 13 → current chunk starts at token 12 = block 6; blocks 0-5 are null.
    assert hit_pattern(hits, pool) == ["-"] * 6
    (hits,) = ChunkedLocalAttentionManager.find_longest_cache_hit(hashes, 11, (0,), pool, spec, 2)
    assert hit_pattern(hits, pool) == ["-", "-", "-", "-", "x"]


def test_swa_remove_skipped_blocks_frees_out_of_window_blocks():
    m = make_manager(num_blocks=20, specs=[swa_spec(block_size=4, window=8)])
    req = make_request(list(range(24)), m)
    admit(m, req)
    mgr = m.coordinator.single_type_managers[0]
    assert mgr.get_num_skipped_tokens(24) == 17
    free_before = m.num_free_blocks
    req.append_output_token_ids([1000])
    m.allocate_slots(req, 1)  # remove_skipped_blocks(24) first: 17 // 4 = 4 blocks go
    blocks = m.get_blocks(req.request_id).blocks[0]
    assert [b.is_null for b in blocks] == [True] * 4 + [False] * 3
    assert m.num_free_blocks == free_before + 4 - 1
    m.check_invariants()
    # Freed tail-first: the later (longer-prefix) blocks are evicted first.
    m.free(req)
    m.check_invariants()


def test_swa_prefix_hit_end_to_end():
    m = make_manager(num_blocks=30, specs=[swa_spec(block_size=4, window=8)])
    a = make_request(list(range(40)), m)
    admit(m, a)
    m.free(a)
    b = make_request(list(range(40)) + [7, 7], m)
    hits, num_hit, new = admit(m, b)
    assert num_hit == 40
    blocks = hits.blocks[0]
    assert sum(not x.is_null for x in blocks) == 2  # cdiv(window - 1, 4) = 2 blocks suffice
    table = m.get_blocks(b.request_id).blocks[0]
    assert all(x.is_null for x in table[:8]) and len(table) == 11
    m.free(b)
    m.check_invariants()


def test_hybrid_full_and_swa_hit_is_the_common_length():
    specs = [full_spec(4), swa_spec(4, window=8)]
    m = make_manager(num_blocks=60, specs=specs)
    a = make_request(list(range(48)), m)
    admit(m, a)
    m.free(a)
    b = make_request(list(range(48)) + [1], m)
    hits, num_hit, _ = admit(m, b)
    assert num_hit == 48
    full_hits, swa_hits = hits.blocks
    assert len(full_hits) == 12 and len(swa_hits) == 12
    m.free(b)
    # Evict the SWA copy of block 10 and 11 (the window tail): SWA must fall back to an
    # earlier run, and full attention is truncated to the same length.
    pool = m.block_pool
    for h in a.block_hashes[10:12]:
        blk = pool.get_cached_block(h, [1])[0]
        pool.evict_blocks([blk.block_id])
    c = make_request(list(range(48)) + [2], m)
    hits, num_hit = m.get_computed_blocks(c)
    assert num_hit == 40
    assert len(hits.blocks[0]) == 10 and len(hits.blocks[1]) == 10
    m.check_invariants()


def test_hybrid_different_block_sizes_align_to_lcm():
    specs = [full_spec(4), swa_spec(8, window=16)]
    m = make_manager(num_blocks=60, specs=specs)
    assert m.hash_block_size == 4
    a = make_request(list(range(44)), m)
    admit(m, a)
    m.free(a)
    b = make_request(list(range(44)) + [9], m)
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 40  # 44 rounded down to the lcm (8)
    assert len(hits.blocks[0]) == 10 and len(hits.blocks[1]) == 5
