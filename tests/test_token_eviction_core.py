"""Token eviction in the core (no torch): the policy's validation and arithmetic, streaming's
block release from the middle of the table, SnapKV's compaction, hashes and capacity."""

from __future__ import annotations

import pytest
from core_utils import admit, make_manager, make_request
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.core.request import RequestStatus
from pagedkv.core.token_eviction import KVEvictionConfig, KVEvictionError
from pagedkv.core.units import cdiv

BS = 16


def streaming(budget: int = 64, sink: int = 4) -> KVEvictionConfig:
    return KVEvictionConfig("streaming", sink_tokens=sink, budget_tokens=budget)


@pytest.mark.parametrize(
    "value, needle",
    [
        ({"policy": "h2o"}, "policy"),
        ({"budget_tokens": 8}, "needs a policy"),
        ({"policy": "streaming"}, "budget_tokens or recent_tokens"),
        ({"policy": "streaming", "budget_tokens": 4}, "exceed sink_tokens"),
        ({"policy": "snapkv"}, "needs budget_tokens"),
        ({"policy": "snapkv", "budget_tokens": 16}, r"sink_tokens \+ recent_tokens"),
        ({"policy": "snapkv", "budget_tokens": 64, "positions": "cache"}, "original"),
        ({"policy": "snapkv", "budget_tokens": 64, "pool_kernel": 4}, "odd"),
        ({"policy": "snapkv", "budget_tokens": 64, "pool_kernel": 1001}, "at most 255"),
        ({"policy": "streaming", "budget_tokens": 64, "compress_at": 9}, "snapkv setting"),
        ({"policy": "streaming", "budget_tokens": 64, "window": 9}, "unknown keys"),
        ({"policy": "streaming", "budget_tokens": True}, "integer"),
        ("streaming", "must be a dict"),
    ],
)
def test_bad_configs_are_refused_by_name(value, needle):
    with pytest.raises(KVEvictionError, match=needle):
        KVEvictionConfig.from_value(value)


def test_defaults():
    s = KVEvictionConfig.from_value({"policy": "streaming", "budget_tokens": 512})
    assert (s.sink_tokens, s.recent_tokens, s.budget_tokens) == (4, 508, 512)
    assert s.chunk_tokens(BS) == 112  # a quarter of the window, whole blocks
    k = KVEvictionConfig.from_value({"policy": "snapkv", "budget_tokens": 256})
    assert (k.recent_tokens, k.chunk_tokens(BS)) == (32, None)
    assert KVEvictionConfig.from_value(None) is None


def _run_streaming(m, req, steps: int) -> list[int]:
    """Decode ``steps`` tokens one step at a time; the blocks held after each step."""
    held = []
    for t in range(steps):
        req.append_output_token_ids(1000 + t)
        assert m.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        held.append(len(m.get_block_ids(req.request_id)[0]))
        m.check_invariants()
    return held


def test_streaming_releases_the_oldest_non_sink_block_and_stays_flat():
    ev = streaming(budget=64)  # 1 sink block, window 60
    m = make_manager(num_blocks=40)
    req = make_request(list(range(40)), m, kv_eviction=ev, kv_eviction_onset=ev.onset(BS, 40))
    admit(m, req)
    first = m.get_block_ids(req.request_id)[0]
    held = _run_streaming(m, req, 300)
    cap = ev.max_blocks_per_request(BS, 40, 300)
    assert max(held) <= cap and held[-1] >= cap - 1  # flat at the ceiling
    table = m.get_block_ids(req.request_id)[0]
    assert table[0] == first[0]  # the sink block never leaves
    kv = req.num_computed_tokens - req.num_evicted_tokens
    assert req.num_evicted_tokens % BS == 0 and req.num_evicted_tokens > 0
    # The cache still holds the sinks and at least the window.
    assert kv - BS >= ev.recent_tokens
    assert len(table) == cdiv(kv, BS)


def test_streaming_caches_only_the_exact_prefix_and_hits_stay_inside_it():
    ev = streaming(budget=64)
    m = make_manager(num_blocks=60)
    prompt = list(range(40))
    req = make_request(prompt, m, kv_eviction=ev, kv_eviction_onset=ev.onset(BS, 40))
    admit(m, req)
    _run_streaming(m, req, 200)
    onset_block = ev.onset(BS, 40) // BS

    def cached(h):
        return m.block_pool.get_cached_block(h, [0]) is not None

    # Blocks before the onset carry ordinary hashes; none after it is ever registered.
    assert all(cached(h) for h in req.block_hashes[:2])
    assert not any(cached(h) for h in req.block_hashes[onset_block:])
    m.free(req)
    # An uncompressed request with the same tokens hits the exact prefix only.
    plain = make_request(req.all_token_ids, m)
    hits, n = m.get_computed_blocks(plain)
    assert 32 <= n <= ev.onset(BS, 40)
    # A streaming request never adopts more than its sinks and window.
    again = make_request(req.all_token_ids, m, kv_eviction=ev, kv_eviction_onset=80)
    _, n2 = m.get_computed_blocks(again)
    assert n2 <= ev.max_prefix_hit(BS, 40)


def test_policy_enters_the_hashes_after_the_onset_only():
    ev = streaming(budget=64)
    tokens = list(range(160))
    a = make_request(tokens, kv_eviction=ev, kv_eviction_onset=ev.onset(BS, 160))
    b = make_request(tokens)
    onset_block = ev.onset(BS, 160) // BS
    assert a.block_hashes[:onset_block] == b.block_hashes[:onset_block]
    assert all(x != y for x, y in zip(a.block_hashes[onset_block:], b.block_hashes[onset_block:]))


def test_preemption_restarts_with_nothing_evicted():
    ev = streaming(budget=64)
    m = make_manager(num_blocks=40)
    req = make_request(list(range(40)), m, kv_eviction=ev, kv_eviction_onset=80)
    admit(m, req)
    _run_streaming(m, req, 100)
    assert req.num_evicted_tokens > 0
    m.free(req)
    assert req.num_evicted_tokens == 0 and m.block_pool.get_num_free_blocks() == 39


def _admit_snapkv(m, n_prompt: int, budget: int):
    ev = KVEvictionConfig("snapkv", budget_tokens=budget)
    req = make_request(list(range(n_prompt)), m, kv_eviction=ev, kv_eviction_onset=n_prompt)
    admit(m, req)
    return ev, req


def test_snapkv_compaction_swaps_the_table_and_defers_the_old_blocks():
    m = make_manager(num_blocks=30)
    ev, req = _admit_snapkv(m, 100, 48)
    old = m.get_block_ids(req.request_id)[0]
    new = m.compact_blocks(req, 48)
    assert len(new) == 3 and not set(new) & set(old)
    assert m.get_block_ids(req.request_id)[0] == new
    assert req.num_evicted_tokens == 100 - 48
    m.check_invariants()  # the deferred blocks are still held
    free_before = m.block_pool.get_num_free_blocks()
    m.release_deferred()
    assert m.block_pool.get_num_free_blocks() == free_before + len(old)
    m.check_invariants()
    # The uncompressed prompt stays a prefix hit for a later request.
    later = make_request(list(range(100)) + [7], m)
    _, n = m.get_computed_blocks(later)
    assert n == 96
    # Decode goes on in cache indices after the kept tokens.
    req.append_output_token_ids(5)
    assert m.allocate_slots(req, 1) is not None
    assert len(m.get_block_ids(req.request_id)[0]) == cdiv(48 + 1, BS)


def test_snapkv_compaction_in_place_when_the_pool_is_full():
    m = make_manager(num_blocks=8)  # 7 usable: the prompt takes all of them
    ev, req = _admit_snapkv(m, 100, 48)
    old = m.get_block_ids(req.request_id)[0]
    assert m.block_pool.get_num_free_blocks() == 0
    new = m.compact_blocks(req, 48)
    assert new == old[:3]
    # Their hashes are gone (they will be overwritten); the rest are released next step.
    assert all(m.block_pool.blocks[b].block_hash is None for b in new)
    m.release_deferred()
    assert m.block_pool.get_num_free_blocks() == 4
    m.check_invariants()


@settings(max_examples=40, deadline=None)
@given(
    budget=st.integers(20, 120),
    sink=st.integers(0, 20),
    prompt=st.integers(1, 200),
    steps=st.integers(1, 200),
)
def test_streaming_never_exceeds_its_ceiling(budget, sink, prompt, steps):
    if budget <= sink:
        return
    ev = streaming(budget=budget, sink=sink)
    m = make_manager(num_blocks=200)
    req = make_request(list(range(prompt)), m, kv_eviction=ev, kv_eviction_onset=ev.onset(BS, 1))
    chunk = ev.chunk_tokens(BS)
    n = min(prompt, chunk)
    admit(m, req, n)
    cap = ev.max_blocks_per_request(BS, prompt, steps)
    while req.num_computed_tokens < prompt:
        n = min(prompt - req.num_computed_tokens, chunk)
        assert m.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
        assert len(m.get_block_ids(req.request_id)[0]) <= cap
    held = _run_streaming(m, req, steps)
    assert max(held, default=0) <= cap
    assert req.status == RequestStatus.RUNNING


def test_pyramid_budgets_shrink_with_depth_around_the_mean():
    ev = KVEvictionConfig("pyramidkv", budget_tokens=256, num_layers=30)
    b = ev.layer_budgets()
    assert len(b) == 30 and b == sorted(b, reverse=True)
    assert abs(sum(b) / 30 - 256) <= 1
    c = 256 - 36
    assert b[-1] == 36 + c // 20 and b[0] == 36 + 2 * c - c // 20
    assert ev.kept_tokens(300)[0] == 300  # a budget above the tokens keeps them all
    assert ev.compresses(300) and not ev.compresses(36 + c // 20)
    # The table is sized for the first layer's kept tokens.
    assert ev.max_blocks_per_request(BS, 1000, 10) == cdiv(1000, BS) + cdiv(b[0], BS)
    snap = KVEvictionConfig("snapkv", budget_tokens=256, num_layers=30)
    assert snap.layer_budgets() == [256] * 30
