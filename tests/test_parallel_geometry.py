"""Tensor / decode-context-parallel geometry (core/parallel.py): which heads, rows and tokens
each rank holds. Pure Python, no torch."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.core.parallel import (
    check_parallel_sizes,
    dcp_local_count,
    dcp_owner,
    kv_replicas,
    kv_shard_writers,
    max_rank_kv_heads,
    rank_layout,
    shard_heads,
    split_range,
)


@given(st.integers(0, 500), st.integers(1, 16))
def test_split_range_covers_everything_once_near_evenly(n: int, parts: int) -> None:
    ranges = [split_range(n, parts, i) for i in range(parts)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [e - s for s, e in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_smollm2_heads_at_tp2_split_by_whole_kv_groups() -> None:
    # 9 query heads, 3 KV heads (groups of 3): 2 + 1 KV heads, query heads follow.
    r0, r1 = (shard_heads(9, 3, 2, r) for r in range(2))
    assert (r0.q_start, r0.q_end, r0.kv_start, r0.kv_end) == (0, 6, 0, 2)
    assert (r1.q_start, r1.q_end, r1.kv_start, r1.kv_end) == (6, 9, 2, 3)
    assert max_rank_kv_heads(9, 3, 2) == 2 and kv_replicas(3, 2) == 1


def test_tp_beyond_kv_heads_replicates_each_kv_head() -> None:
    shards = [shard_heads(9, 3, 6, r) for r in range(6)]
    assert [(s.kv_start, s.kv_end) for s in shards] == [
        (0, 1),
        (0, 1),
        (1, 2),
        (1, 2),
        (2, 3),
        (2, 3),
    ]
    assert [(s.q_start, s.q_end) for s in shards] == [
        (0, 2),
        (2, 3),
        (3, 5),
        (5, 6),
        (6, 8),
        (8, 9),
    ]
    assert kv_replicas(3, 6) == 2
    mqa = [shard_heads(4, 1, 4, r) for r in range(4)]
    assert all(s.num_kv_heads == 1 and s.kv_start == 0 for s in mqa)


@pytest.mark.parametrize(
    ("heads", "kv", "tp", "match"),
    [
        (9, 3, 4, "not a multiple"),  # 4 ranks cannot replicate 3 KV heads evenly
        (4, 1, 8, "exceeds the model's 4 attention heads"),
    ],
)
def test_heads_that_do_not_split_are_refused(heads: int, kv: int, tp: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_parallel_sizes(tp, 1, heads, kv)


def test_dcp_needs_ranks_holding_the_same_kv_heads() -> None:
    check_parallel_sizes(6, 2, 9, 3)  # 2 copies of each KV head: DCP 2 shards them
    with pytest.raises(ValueError, match="must divide tensor_parallel_size"):
        check_parallel_sizes(4, 3, 4, 1)
    with pytest.raises(ValueError, match="copies of the same KV heads"):
        check_parallel_sizes(3, 3, 9, 3)  # no KV head has a copy at TP 3
    with pytest.raises(ValueError, match="cp_kv_cache_interleave_size"):
        check_parallel_sizes(2, 2, 4, 1, interleave=0)


@settings(max_examples=200, deadline=None)
@given(
    kv=st.integers(1, 8),
    group=st.integers(1, 6),
    tp=st.integers(1, 12),
)
def test_every_query_head_lives_on_exactly_one_rank_with_its_kv_head(
    kv: int, group: int, tp: int
) -> None:
    heads = kv * group
    try:
        check_parallel_sizes(tp, 1, heads, kv)
    except ValueError:
        return
    owner: dict[int, int] = {}
    for r in range(tp):
        s = shard_heads(heads, kv, tp, r)
        assert s.num_heads >= 1 and s.num_kv_heads >= 1
        # a uniform GQA on the rank: its query heads are whole groups of its KV heads, or all
        # read its single (replicated) KV head
        assert s.num_kv_heads == 1 or s.num_heads == s.num_kv_heads * group
        for h in range(s.q_start, s.q_end):
            assert h not in owner
            owner[h] = r
            assert s.kv_start <= h // group < s.kv_end
    assert sorted(owner) == list(range(heads))


@settings(max_examples=200, deadline=None)
@given(
    bs_blocks=st.integers(1, 4),
    dcp=st.integers(1, 4),
    interleave=st.sampled_from([1, 2, 4]),
    n=st.integers(0, 300),
)
def test_dcp_tokens_fill_each_ranks_local_positions_densely(
    bs_blocks: int, dcp: int, interleave: int, n: int
) -> None:
    bs = bs_blocks * interleave  # the interleave divides the block size
    span = bs * dcp
    local: dict[int, list[int]] = {r: [] for r in range(dcp)}
    for p in range(n):
        owner, off = dcp_owner(p % span, dcp, interleave)
        assert 0 <= off < bs
        local[owner].append((p // span) * bs + off)
    for r in range(dcp):
        # a rank's tokens sit at its local positions 0, 1, 2, ... in order: the attention reads
        # positions [0, count) through the block table
        assert local[r] == list(range(len(local[r])))
        assert dcp_local_count(n, bs, dcp, interleave, r) == len(local[r])


def test_rank_layout_namespace_and_dcp_group() -> None:
    lay = rank_layout(
        rank=3, tp=4, num_heads=4, num_kv_heads=1, intermediate_size=10, vocab_size=11, dcp=2
    )
    assert (lay.dcp_rank, lay.dcp_group_start, lay.dcp_head_counts) == (1, 2, (1, 1))
    assert lay.intermediate == (8, 10) and lay.vocab == (9, 11)
    assert lay.namespace == "@tp_rank:3@dcp1"


@pytest.mark.parametrize(
    ("tp", "kv_heads", "dcp", "writers"),
    [
        (3, 3, 1, [0, 1, 2]),  # split: every rank holds its own heads
        (6, 3, 1, [0, 0, 2, 2, 4, 4]),  # replicated twice: min(tp, kv heads) = 3 writers
        (4, 1, 1, [0, 0, 0, 0]),  # MQA: one shard
        (4, 1, 2, [0, 1, 0, 1]),  # DCP: ranks 0/1 hold different tokens; 2/3 repeat them
    ],
)
def test_kv_shard_writers_deduplicate_replicated_heads(
    tp: int, kv_heads: int, dcp: int, writers: list[int]
) -> None:
    layouts = [
        rank_layout(
            rank=r,
            tp=tp,
            num_heads=12,
            num_kv_heads=kv_heads,
            intermediate_size=24,
            vocab_size=50,
            dcp=dcp,
        )
        for r in range(tp)
    ]
    assert kv_shard_writers(layouts) == writers


def test_mamba_heads_make_every_rank_its_own_shard() -> None:
    layouts = [
        rank_layout(
            rank=r,
            tp=2,
            num_heads=4,
            num_kv_heads=1,
            intermediate_size=8,
            vocab_size=10,
            mamba_heads=(4, 1),
        )
        for r in range(2)
    ]
    assert kv_shard_writers(layouts) == [0, 1]
