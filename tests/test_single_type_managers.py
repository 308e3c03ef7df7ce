"""Sliding-window, chunked-local and hybrid hit rules (reference §5.5/§5.6)."""

from __future__ import annotations

import math

import pytest
from core_utils import admit, full_spec, make_manager, make_request, swa_spec

from pagedkv.core.block_pool import BlockPool
from pagedkv.core.hashing import BlockHash
from pagedkv.core.request import RequestStatus
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
    spec = ChunkedLocalAttentionSpec(
        block_size=2, num_kv_heads=1, head_size=1, dtype="float32", attention_chunk_size=4
    )
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


def num_hashed(m, req) -> list[int]:
    """Cached (hashed) blocks in ``req``'s block table, per KV cache group."""
    return [
        sum(1 for b in g if not b.is_null and b.block_hash is not None)
        for g in m.get_blocks(req.request_id).blocks
    ]


def num_cached(m) -> list[int]:
    """Entries of the prefix-cache index per KV cache group (blocks freed since included)."""
    counts = [0] * m.num_kv_cache_groups
    for key, _ in m.block_pool.cached_block_hash_to_block.items():
        counts[int.from_bytes(key[-4:], "big")] += 1
    return counts


@pytest.mark.parametrize(
    "specs,prompt_len,want,grown_len,want_grown",
    [
        # lcm 32: 50 cacheable tokens round down to 32 -> full 2 blocks (not 3), SWA 1 block.
        ([full_spec(16), swa_spec(32, window=64)], 50, [2, 1], 65, [4, 2]),
        # lcm 16: 41 -> 32 -> full 2 blocks; SWA (bs 8, window 9: one block before an aligned end
        # is all a hit reads) caches only the 2nd block of each 16-token segment: blocks 1 and 3.
        ([full_spec(16), swa_spec(8, window=9)], 41, [2, 2], 49, [3, 3]),
    ],
)
def test_hybrid_caches_only_blocks_a_hit_can_use(specs, prompt_len, want, grown_len, want_grown):
    """vLLM 0.33's rule (reference §5.5 `_align_cacheable`, §5.6 `reachable_block_mask`): the
    cacheable length is rounded down to the lcm of the group block sizes, and a sliding-window
    group caches only blocks that lie in the window before an lcm boundary. Once the sequence
    reaches the next boundary, the blocks up to it are cached."""
    m = make_manager(num_blocks=60, specs=specs)
    req = make_request(list(range(prompt_len)), m)
    admit(m, req)
    assert num_hashed(m, req) == want == num_cached(m)
    assert m.coordinator.lcm_block_size == math.lcm(*(s.block_size for s in specs))
    req.append_output_token_ids(list(range(1000, 1000 + grown_len - prompt_len)))
    assert m.allocate_slots(req, grown_len - prompt_len) is not None
    req.num_computed_tokens = grown_len
    assert num_cached(m) == want_grown
    m.check_invariants()
    # What is cached still serves the hits it can: the longest aligned prefix.
    m.free(req)
    again = make_request(list(range(prompt_len)) + [5], m)
    _, num_hit = m.get_computed_blocks(again)
    lcm = m.coordinator.lcm_block_size
    assert num_hit == prompt_len // lcm * lcm
    m.check_invariants()


def test_swa_unreachable_out_of_window_blocks_do_not_push_out_cached_prefixes():
    """full (bs 64) + SWA (bs 16, window 17): a hit ends on a 64-token boundary and its SWA part
    is the one block before it, so SWA blocks 0-2 of each 4-block segment are never cached
    (vLLM: ``reachable_block_mask``). When `remove_skipped_blocks` frees them as the window
    moves they carry no hash, so `free_blocks` puts them at the front of the free queue: they
    are reused before any cached block is evicted. (Originally they were hashed and appended
    at the back, after older useful cached blocks, which were then evicted first.)"""
    m = make_manager(num_blocks=40, specs=[full_spec(64), swa_spec(16, window=17)])
    pool = m.block_pool
    c = make_request([7] * 65, m)  # a useful prefix: 64 cacheable tokens
    admit(m, c)
    assert num_hashed(m, c) == [1, 1]  # full block 0; SWA block 3 only
    m.free(c)
    c_cached = [pool.get_cached_block(c.block_hashes[3], [0, 1])]
    assert c_cached[0] is not None
    # Request a: 130 tokens, prefilled in 64-token chunks; the second chunk's allocate_slots
    # first frees SWA blocks 0-2 (out of the window at 64 computed tokens).
    a = make_request(list(range(130)), m)
    hits, num_hit = m.get_computed_blocks(a)
    assert num_hit == 0
    assert m.allocate_slots(a, 64, 0, hits) is not None
    a.num_computed_tokens = 64
    a.status = RequestStatus.RUNNING
    freed = [b.block_id for b in m.get_blocks(a.request_id).blocks[1][:3]]
    assert m.allocate_slots(a, 64) is not None
    a.num_computed_tokens = 128
    # The freed blocks were unhashed, hence at the front: this very allocation reused them.
    full_table, swa_table = m.get_blocks(a.request_id).blocks
    assert [b.is_null for b in swa_table[:3]] == [True] * 3
    assert set(freed) <= {b.block_id for b in full_table[1:] + swa_table[4:]}
    assert num_hashed(m, a) == [2, 2]  # full blocks 0-1; SWA blocks 3 and 7
    # Use every free block except c's two cached ones: c's prefix must survive.
    pool.get_new_blocks(pool.get_num_free_blocks() - 2)
    again = make_request([7] * 65, m)
    _, num_hit = m.get_computed_blocks(again)
    assert num_hit == 64
