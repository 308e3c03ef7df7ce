"""KVCacheManager behaviour: the reference §9.2 cases (vLLM 0.33 free-order policy, which is
ours: unhashed blocks are prepended, hashed blocks appended) and past bugs of peer projects."""

from __future__ import annotations

import pytest
from core_utils import admit, full_spec, make_manager, make_request, swa_spec

from pagedkv.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv.core.hashing import get_none_hash, hash_block_tokens, sha256
from pagedkv.core.kv_cache_manager import KVCacheManager
from pagedkv.core.request import RequestStatus
from pagedkv.core.specs import KVCacheConfig, KVCacheGroupSpec


def free_ids(m):
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def test_case1_no_hit_then_allocate():
    m = make_manager()
    tokens = list(range(55))
    req0 = make_request(tokens, m)
    assert len(req0.block_hashes) == 3
    hits, num_hit, new = admit(m, req0)
    assert num_hit == 0 and hits.get_block_ids() == ([],)
    assert new.get_block_ids() == ([1, 2, 3, 4],)
    parent = None
    for i, block in enumerate(new.blocks[0][:3]):
        parent = hash_block_tokens(sha256, parent, tokens[i * 16 : (i + 1) * 16])
        assert block.block_hash == parent + (0).to_bytes(4, "big")
        assert block.ref_cnt == 1
    assert new.blocks[0][3].block_hash is None
    m.check_invariants()


def test_cases_2_to_4_hits_free_order_and_eviction():
    m = make_manager(events=True)
    common = list(range(48))
    req0 = make_request(common + list(range(100, 107)), m)
    admit(m, req0)
    req1 = make_request(common + list(range(200, 205)), m)
    hits, num_hit, new = admit(m, req1)
    assert hits.get_block_ids() == ([1, 2, 3],) and num_hit == 48
    assert new.get_block_ids() == ([5],)
    assert [m.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 2, 2]
    assert m.num_free_blocks == 5
    m.check_invariants()

    m.free(req0)
    m.free(req1)
    assert m.num_free_blocks == 10
    # Unhashed tails (5, then 4) at the front; the hashed chain tail-first at the back.
    assert free_ids(m) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    m.check_invariants()

    req2 = make_request(common + list(range(300, 306)), m)
    hits, num_hit, new = admit(m, req2)
    assert hits.get_block_ids() == ([1, 2, 3],) and new.get_block_ids() == ([5],)
    m.free(req2)
    m.take_events()
    req3 = make_request(list(range(1000, 1160)), m)
    hits, num_hit, new = admit(m, req3)
    assert num_hit == 0
    assert new.get_block_ids() == ([5, 4, 6, 7, 8, 9, 10, 3, 2, 1],)
    assert m.num_free_blocks == 0
    q = m.block_pool.free_block_queue
    assert q.fake_free_list_head.next_free_block is q.fake_free_list_tail
    # The reused cached blocks lost their old hashes (stale-hash bug, nano-vllm #163) ...
    removed = [e for e in m.take_events() if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(req0.block_hashes)
    for h in req0.block_hashes:
        assert m.block_pool.get_cached_block(h, [0]) is None
    m.free(req3)
    # ... so the old prefix no longer hits anything.
    req4 = make_request(common + [1], m)
    assert m.get_computed_blocks(req4)[1] == 0
    m.check_invariants()


def test_case5_full_prompt_hit_recomputes_last_block():
    m = make_manager()
    prompt = list(range(48))
    req0 = make_request(prompt, m)
    admit(m, req0)
    req1 = make_request(prompt, m)
    hits, num_hit, new = admit(m, req1)
    assert num_hit == 32  # capped at 47 tokens, rounded down to whole blocks
    assert len(hits.blocks[0]) == 2 and len(new.blocks[0]) == 1
    # The recomputed last block is cached too: one hash now maps to two blocks.
    key = req0.block_hashes[2] + (0).to_bytes(4, "big")
    assert len(m.block_pool.cached_block_hash_to_block.blocks_for(key)) == 2
    m.check_invariants()
    m.free(req0)
    m.free(req1)
    m.check_invariants()


def test_case6_decode_hashes_blocks_as_they_fill():
    m = make_manager()
    req = make_request(list(range(55)), m)
    admit(m, req)
    req.append_output_token_ids([900, 901, 902, 903])
    new = m.allocate_slots(req, 4)
    req.num_computed_tokens += 4
    assert new.num_blocks == 0
    assert m.get_blocks(req.request_id).blocks[0][-1].block_hash is None
    req.append_output_token_ids(list(range(910, 929)))
    new = m.allocate_slots(req, 19)
    req.num_computed_tokens += 19
    assert new.num_blocks == 1
    blocks = m.get_blocks(req.request_id).blocks[0]
    assert blocks[-2].block_hash is not None and blocks[-1].block_hash is None
    m.check_invariants()


def test_allocate_fails_without_side_effects():
    m = make_manager(num_blocks=6)
    req0 = make_request(list(range(48)), m)
    admit(m, req0)
    m.free(req0)  # blocks 1-3 cached and evictable
    before = [b.ref_cnt for b in m.block_pool.blocks]
    order = free_ids(m)
    big = make_request(list(range(32)) + list(range(500, 600)), m)
    hits, num_hit = m.get_computed_blocks(big)
    assert num_hit == 32
    # 132 tokens need 9 blocks; only 5 usable: must fail and leave everything as it was.
    assert m.allocate_slots(big, big.num_tokens - num_hit, num_hit, hits) is None
    assert [b.ref_cnt for b in m.block_pool.blocks] == before
    assert free_ids(m) == order
    m.check_invariants()


def test_evictable_hits_count_against_free_blocks():
    m = make_manager(num_blocks=5)  # 4 usable
    req0 = make_request(list(range(32)) + [7], m)
    admit(m, req0)
    m.free(req0)
    assert m.num_free_blocks == 4
    # Hit 2 evictable blocks + need 2 new blocks = 4: fits exactly.
    req1 = make_request(list(range(32)) + list(range(40, 72)), m)
    hits, num_hit, new = admit(m, req1)
    assert num_hit == 32 and new is not None and new.num_blocks == 2
    assert m.num_free_blocks == 0
    m.check_invariants()


def test_watermark_applies_to_admission_only():
    m = make_manager(num_blocks=11, watermark=0.2)  # keeps 2 blocks free for new requests
    req = make_request(list(range(16 * 8)), m)
    hits, num_hit = m.get_computed_blocks(req)
    assert m.allocate_slots(req, 16 * 9) is None  # 9 + 2 > 10
    assert m.allocate_slots(req, 16 * 8) is not None  # 8 + 2 <= 10
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = 16 * 8
    req.append_output_token_ids(list(range(32)))
    assert m.allocate_slots(req, 32) is not None  # running: may use the watermark
    assert m.num_free_blocks == 0
    m.free(req)
    m.check_invariants()


def test_lookahead_tokens_reserve_slots_but_are_not_cached():
    m = make_manager()
    req = make_request(list(range(16)), m)
    new = m.allocate_slots(req, 16, num_lookahead_tokens=20)
    assert new.num_blocks == 3
    assert [b.block_hash is not None for b in new.blocks[0]] == [True, False, False]
    m.free(req)
    m.check_invariants()


def test_full_sequence_must_fit_refuses_admission():
    m = make_manager(num_blocks=5)
    req = make_request(list(range(100)), m)
    assert m.allocate_slots(req, 32, full_sequence_must_fit=True) is None
    assert m.allocate_slots(req, 32) is not None
    m.free(req)


def test_full_sequence_must_fit_counts_windowed_groups_per_step():
    """Hybrid full + sliding window: a whole sequence of 160 tokens needs 10 full-attention
    blocks, while the window group only ever holds a chunk plus its window. Counting the
    window group's whole sequence too (20 blocks) would refuse, for ever, a request that fits."""
    m = make_manager(num_blocks=17, specs=[full_spec(16), swa_spec(16, window=32)])
    req = make_request(list(range(160)), m)
    assert m.allocate_slots(req, 32, full_sequence_must_fit=True) is not None
    req.num_computed_tokens = 32
    for done in range(32, 160, 32):  # the rest of the prompt in chunks: the window trims as it goes
        assert m.allocate_slots(req, 32) is not None
        req.num_computed_tokens = done + 32
    assert sum(b != 0 for b in m.get_block_ids(req.request_id)[1]) <= 4
    m.check_invariants()
    m.free(req)
    # ...and a sequence whose full-attention part alone exceeds the pool is still refused.
    big = make_request(list(range(16 * 17)), m)
    assert m.allocate_slots(big, 32, full_sequence_must_fit=True) is None
    m.check_invariants()


def test_duplicate_prefixes_in_one_step():
    """Two identical prompts: looked up before either allocates (nano-vllm #219)."""
    m = make_manager()
    a = make_request(list(range(40)), m)
    b = make_request(list(range(40)), m)
    ha, na = m.get_computed_blocks(a)
    hb, nb = m.get_computed_blocks(b)
    assert na == nb == 0
    m.allocate_slots(a, 40, na, ha)
    m.allocate_slots(b, 40, nb, hb)
    key = a.block_hashes[0] + (0).to_bytes(4, "big")
    assert len(m.block_pool.cached_block_hash_to_block.blocks_for(key)) == 2
    m.check_invariants()
    m.free(a)
    # Reusing a's blocks must not drop b's index entries.
    c = make_request(list(range(500, 500 + 16 * 7)), m)
    assert admit(m, c)[2].num_blocks == 7  # every free block, a's cached ones included
    assert (
        m.block_pool.get_cached_block(b.block_hashes[0], [0])[0]
        in m.get_blocks(b.request_id).blocks[0]
    )
    d = make_request(list(range(40)), m)
    assert m.get_computed_blocks(d)[1] == 32
    for r in (b, c):
        m.free(r)
    m.check_invariants()


def test_second_request_in_same_step_hits_first_requests_blocks():
    m = make_manager()
    a = make_request(list(range(40)), m)
    admit(m, a)
    b = make_request(list(range(40)), m)
    _, num_hit, _ = admit(m, b)
    assert num_hit == 32  # blocks are hashed at schedule time
    m.free(a)
    m.free(b)
    m.check_invariants()


def test_events_stored_removed_cleared():
    m = make_manager(num_blocks=4, events=True)
    req = make_request(list(range(33)), m)
    admit(m, req)
    events = m.take_events()
    assert len(events) == 1 and isinstance(events[0], BlockStored)
    ev = events[0]
    assert ev.block_hashes == req.block_hashes[:2] and ev.parent_block_hash is None
    assert ev.token_ids == list(range(32)) and ev.block_size == 16 and ev.group_idx == 0
    assert ev.kv_cache_spec_kind == "full_attention"
    req.append_output_token_ids(list(range(100, 115)))
    m.allocate_slots(req, 15)
    ev = m.take_events()[0]
    assert ev.parent_block_hash == req.block_hashes[1] and ev.block_hashes == [req.block_hashes[2]]
    assert not m.reset_prefix_cache()  # blocks in use
    m.free(req)
    assert m.reset_prefix_cache()
    assert isinstance(m.take_events()[-1], AllBlocksCleared)
    assert len(m.block_pool.cached_block_hash_to_block) == 0
    m.check_invariants()


def test_prefix_cache_stats_count_tokens():
    m = make_manager()
    a = make_request(list(range(40)), m)
    admit(m, a)
    b = make_request(list(range(40)), m)
    admit(m, b)
    stats = m.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 80, 32)
    assert m.make_prefix_cache_stats().queries == 0
    assert m.total_prefix_cache_stats.hits == 32


def test_caching_disabled_never_hits():
    m = make_manager(caching=False)
    a = make_request(list(range(40)), m)
    admit(m, a)
    b = make_request(list(range(40)), m)
    assert admit(m, b)[1] == 0
    assert all(blk.block_hash is None for blk in m.get_blocks(a.request_id).blocks[0])
    m.free(a)
    m.free(b)
    m.check_invariants()


def test_skip_reading_prefix_cache_still_writes():
    m = make_manager()
    a = make_request(list(range(40)), m, skip_reading_prefix_cache=True)
    admit(m, a)
    a2 = make_request(list(range(40)), m, skip_reading_prefix_cache=True)
    assert m.get_computed_blocks(a2)[1] == 0
    b = make_request(list(range(40)), m)
    assert m.get_computed_blocks(b)[1] == 32


def test_cache_salt_and_lora_separate_prefixes():
    m = make_manager()
    a = make_request(list(range(40)), m, cache_salt="tenant-a")
    admit(m, a)
    assert m.get_computed_blocks(make_request(list(range(40)), m, cache_salt="tenant-b"))[1] == 0
    assert m.get_computed_blocks(make_request(list(range(40)), m))[1] == 0
    assert m.get_computed_blocks(make_request(list(range(40)), m, cache_salt="tenant-a"))[1] == 32
    c = make_request(list(range(40)), m, lora_name="sql", lora_path="/a")
    assert m.get_computed_blocks(c)[1] == 0


def test_check_invariants_catches_a_leak():
    m = make_manager()
    req = make_request(list(range(40)), m)
    admit(m, req)
    m.coordinator.single_type_managers[0].req_to_blocks.pop(req.request_id)
    with pytest.raises(AssertionError):
        m.check_invariants()


def test_none_hash_is_parent_of_first_block():
    tokens = list(range(16))
    assert hash_block_tokens(sha256, None, tokens) == sha256(
        (get_none_hash(sha256), tuple(tokens), None)
    )


def test_fork_request_shares_full_blocks_and_copies_partial():
    m = make_manager()
    parent = make_request(list(range(40)), m)
    admit(m, parent)
    child = make_request(list(range(40)), m)
    copies = m.fork_request(parent, child)
    p_ids, c_ids = m.get_block_ids(parent.request_id)[0], m.get_block_ids(child.request_id)[0]
    assert c_ids[:2] == p_ids[:2] and c_ids[2] != p_ids[2]
    assert copies == [(p_ids[2], c_ids[2])]
    assert [m.block_pool.blocks[i].ref_cnt for i in p_ids] == [2, 2, 1]
    assert child.num_computed_tokens == 40
    m.check_invariants()
    # Aligned prompt: nothing to copy.
    p2 = make_request(list(range(100, 132)), m)
    admit(m, p2)
    c2 = make_request(list(range(100, 132)), m)
    assert m.fork_request(p2, c2) == []
    # No room for the copy: refused with nothing changed.
    filler = make_request(list(range(1000, 1000 + 16 * m.num_free_blocks)), m)
    admit(m, filler)
    c3 = make_request(list(range(40)), m)
    assert m.fork_request(parent, c3) is None
    assert m.get_block_ids(c3.request_id) == ([],)
    m.check_invariants()
    for r in (parent, child, p2, c2, filler):
        m.free(r)
    m.check_invariants()


def _events_manager(specs=None, num_blocks: int = 11, **kwargs) -> KVCacheManager:
    groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs or [full_spec(16)])]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups, bytes_per_block=1)
    return KVCacheManager(config, max_model_len=8192, enable_kv_cache_events=True, **kwargs)


@pytest.mark.parametrize("medium", [None, "GPU", "CPU"])
def test_events_report_the_device_cache_medium(medium):
    """vLLM's default medium is "GPU"; an engine whose KV cache is host memory says "CPU"."""
    m = _events_manager(num_blocks=4, **({} if medium is None else {"medium": medium}))
    want = medium or "GPU"
    a = make_request(list(range(33)), m)
    admit(m, a)
    m.free(a)
    b = make_request(list(range(100, 133)), m)  # reuses a's cached blocks: BlockRemoved
    admit(m, b)
    events = m.take_events()
    assert {type(e) for e in events} == {BlockStored, BlockRemoved}
    assert all(e.medium == want for e in events)


def test_bad_medium_is_a_clear_error():
    with pytest.raises(ValueError, match="medium"):
        _events_manager(medium="")


def test_stored_event_carries_lora_id_and_name():
    m = _events_manager()
    req = make_request(list(range(33)), m, lora_name="sql", lora_path="/adapters/sql", lora_id=3)
    admit(m, req)
    (ev,) = m.take_events()
    assert (ev.lora_id, ev.lora_name) == (3, "sql")
    assert ev.extra_keys == [["sql"], ["sql"]]  # per block, untagged (vLLM's event shape)
    plain = make_request(list(range(200, 233)), m)
    admit(m, plain)
    (ev,) = m.take_events()
    assert ev.lora_id is None and ev.lora_name is None


def test_stored_event_block_size_is_the_groups_and_hashes_match_it():
    """Each group's BlockStored names that group's block size, and its hashes are the request's
    chained hashes at that size (the hash at the end of each block)."""
    m = _events_manager(specs=[full_spec(16), swa_spec(32, window=64)], num_blocks=20)
    req = make_request(list(range(65)), m)
    admit(m, req)
    by_group = {e.group_idx: e for e in m.take_events()}
    assert by_group[0].block_size == 16 and by_group[0].block_hashes == req.block_hashes[:4]
    assert by_group[1].block_size == 32 and by_group[1].block_hashes == req.block_hashes[1:4:2]
    assert by_group[1].token_ids == list(range(64))
