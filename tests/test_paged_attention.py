"""paged_attention and merge_attn_states against the dense reference in tests/ref_attention.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ref_attention import make_paged_batch, ref_attention

from pagedkv.ops import attention as attention_mod
from pagedkv.ops import dense_attention as dense_mod
from pagedkv.ops import native
from pagedkv.ops.attention import paged_attention
from pagedkv.ops.merge_attn_states import merge_attn_states, merge_attn_states_multi

LAYOUTS = [None, "LBNHC", "BLNHC", "LBHNC"]


@st.composite
def batches(draw: st.DrawFn) -> dict:
    """A mixed step: decodes and prefill chunks (with or without cached context)."""
    num_seqs = draw(st.integers(1, 5))
    seq_lens, query_lens = [], []
    for _ in range(num_seqs):
        n = draw(st.integers(1, 90))
        kind = draw(st.sampled_from(["decode", "chunk", "prompt"]))
        lq = {"decode": 1, "prompt": n, "chunk": draw(st.integers(1, n))}[kind]
        seq_lens.append(n)
        query_lens.append(lq)
    return dict(
        seq_lens=seq_lens,
        query_lens=query_lens,
        block_size=draw(st.sampled_from([1, 16, 32])),
        num_kv_heads=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([1, 3])),
        head_size=draw(st.sampled_from([8, 32])),
        head_size_v=draw(st.sampled_from([None, None, 16])),  # Dv != D: the matmul kernel
        layout=draw(st.sampled_from(LAYOUTS)),
        shared_prefix=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31)),
    )


def check(
    spec: dict,
    dtype: torch.dtype,
    sliding_window: int | None,
    soft_cap: float | None,
    num_kv_splits: int | None,
    atol: float,
    rtol: float,
) -> None:
    batch = make_paged_batch(dtype=dtype, **spec)
    scale = spec["head_size"] ** -0.5
    out = paged_attention(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.md,
        scale,
        sliding_window,
        soft_cap,
        num_kv_splits=num_kv_splits,
    )
    ref = batch.reference(scale, sliding_window, soft_cap)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


window = st.one_of(st.none(), st.integers(1, 40))
soft_cap = st.one_of(st.none(), st.floats(0.5, 30.0))
splits = st.sampled_from([None, 1, 2, 5])
# (KV_CHUNK_BYTES, MIN_SPLIT_TOKENS, PREFILL_TILE_BYTES, PREFILL_TILE_TOKENS): the defaults,
# and small budgets that force many decode chunks and pieces, automatic KV splits and 1- or
# 7-row query tiles.
BUDGET_NAMES = ("KV_CHUNK_BYTES", "MIN_SPLIT_TOKENS", "PREFILL_TILE_BYTES", "PREFILL_TILE_TOKENS")
budgets = st.sampled_from(
    [
        tuple(getattr(attention_mod, n) for n in BUDGET_NAMES),
        (2048, 1, 4096, 128),
        (64 << 10, 16, 16 << 20, 7),
    ]
)


@settings(max_examples=70, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=batches(),
    w=window,
    cap=soft_cap,
    n_splits=splits,
    budget=budgets,
    use_native=st.booleans(),
)
def test_matches_dense_reference_fp32(
    spec: dict,
    w: int | None,
    cap: float | None,
    n_splits: int | None,
    budget: tuple[int, ...],
    use_native: bool,
) -> None:
    with pytest.MonkeyPatch.context() as mp:
        for name, value in zip(BUDGET_NAMES, budget, strict=True):
            mp.setattr(attention_mod, name, value)
        if not use_native:  # the torch decode path (else decodes take ops/csrc when it builds)
            mp.setattr(native, "lib", lambda: None)
        check(spec, torch.float32, w, cap, n_splits, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=batches(), w=window, cap=soft_cap, n_splits=splits)
def test_matches_dense_reference_bf16(
    spec: dict, w: int | None, cap: float | None, n_splits: int | None
) -> None:
    # The reference sees the same bf16-rounded inputs; only the output rounding (2^-8) and
    # float32 accumulation separate them.
    check(spec, torch.bfloat16, w, cap, n_splits, atol=2e-2, rtol=2e-2)


def test_strided_query_view_like_a_fused_qkv_projection() -> None:
    """Models pass q as a column slice of a fused qkv output: a non-contiguous view."""
    spec = dict(
        seq_lens=[40, 70, 9],
        query_lens=[1, 30, 9],
        block_size=16,
        num_kv_heads=2,
        group=3,
        head_size=32,
        layout="LBNHC",
        shared_prefix=False,
        seed=6,
    )
    batch = make_paged_batch(dtype=torch.float32, **spec)
    qkv = torch.randn(batch.query.shape[0], 10, 32)
    qkv[:, :6] = batch.query
    query = qkv[:, :6]
    assert not query.is_contiguous()
    out = paged_attention(query, batch.key_cache, batch.value_cache, batch.md, 0.2)
    torch.testing.assert_close(out.double(), batch.reference(0.2), atol=1e-5, rtol=1e-5)


def test_value_head_size_differs_from_key_head_size() -> None:
    spec = dict(
        seq_lens=[40, 7, 33],
        query_lens=[1, 7, 5],
        block_size=16,
        num_kv_heads=2,
        group=3,
        head_size=32,
        layout="LBNHC",
        shared_prefix=False,
        seed=3,
        head_size_v=16,
    )
    check(spec, torch.float32, None, None, None, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["LBNHC", None])
def test_split_kv_decode_equals_single_pass_long_context(layout: str | None) -> None:
    spec = dict(
        seq_lens=[4096, 4000, 3001, 4096, 17],
        query_lens=[1] * 5,
        block_size=16,
        num_kv_heads=2,
        group=3,
        head_size=64,
        layout=layout,
        shared_prefix=True,
        seed=11,
    )
    batch = make_paged_batch(dtype=torch.float32, **spec)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.md, 0.125)
    single = paged_attention(*args, num_kv_splits=1)
    ref = batch.reference(0.125)
    torch.testing.assert_close(single.double(), ref, atol=1e-5, rtol=1e-5)
    for n in (2, 7, 16, None):
        split = paged_attention(*args, num_kv_splits=n)
        torch.testing.assert_close(split, single, atol=1e-5, rtol=1e-5)
    # With a sliding window the split must also skip segments no query can see.
    windowed = paged_attention(*args, sliding_window=700, num_kv_splits=9)
    torch.testing.assert_close(windowed.double(), batch.reference(0.125, 700), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cap", [None, 5.0])  # flash kernel / matmul kernel
def test_split_with_rows_that_end_before_a_segment(cap: float | None) -> None:
    """Short and long rows share a chunk: later segments hold no key of the short rows, whose
    partial results must then carry lse = −inf (weight 0), not a finite lse."""
    spec = dict(
        seq_lens=[300, 40, 5, 280, 161],
        query_lens=[1] * 5,
        block_size=16,
        num_kv_heads=2,
        group=3,
        head_size=32,
        layout="LBNHC",
        shared_prefix=False,
        seed=8,
    )
    for splits in (3, 4, 19):
        check(spec, torch.float32, None, cap, splits, atol=1e-5, rtol=1e-5)
        check(spec, torch.float32, 33, cap, splits, atol=1e-5, rtol=1e-5)


def test_automatic_split_and_pieces_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lone long row is split automatically (parallel segments) and, above the chunk
    budget, read in several pieces: both merge to the single-pass result (torch path)."""
    monkeypatch.setattr(native, "lib", lambda: None)
    spec = dict(
        seq_lens=[2048],
        query_lens=[1],
        block_size=16,
        num_kv_heads=1,
        group=3,
        head_size=32,
        layout="LBNHC",
        shared_prefix=False,
        seed=5,
    )
    batch = make_paged_batch(dtype=torch.float32, **spec)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.md, 0.2)
    single = paged_attention(*args, num_kv_splits=1)
    merges: list[int] = []
    real_merge = attention_mod.merge_attn_states_multi
    monkeypatch.setattr(
        attention_mod,
        "merge_attn_states_multi",
        lambda o, l: merges.append(len(o)) or real_merge(o, l),
    )
    auto = paged_attention(*args)
    assert merges == [attention_mod._auto_kv_splits(1, 1, 2048)] and merges[0] > 1
    torch.testing.assert_close(auto, single, atol=1e-5, rtol=1e-5)
    merges.clear()
    monkeypatch.setattr(attention_mod, "KV_CHUNK_BYTES", 64 << 10)  # 2048 tokens: 8 pieces
    pieces = paged_attention(*args, num_kv_splits=1)
    assert merges == [8]
    torch.testing.assert_close(pieces, single, atol=1e-5, rtol=1e-5)


def test_auto_kv_splits_only_when_threads_would_idle() -> None:
    threads = torch.get_num_threads()
    assert attention_mod._auto_kv_splits(64, 3, 4096) == 1  # plenty of (row, head) items
    assert attention_mod._auto_kv_splits(1, 1, 1 << 20) == 2 * threads
    assert attention_mod._auto_kv_splits(1, 1, 100) == 1  # too short to be worth it


def test_decode_chunks_cover_rows_by_length_within_budget() -> None:
    lens = [500, 20, 700, 30, 650, 5000, 40]
    rows = [0, 1, 2, 3, 4, 5]  # row 6 is not a decode row
    chunks = attention_mod._decode_chunks(lens, rows, token_bytes=1, budget=1500)
    assert sorted(i for c in chunks for i in c) == rows
    flat = [lens[i] for c in chunks for i in c]
    assert flat == sorted(flat)  # length order: each chunk pads to little
    assert chunks[-1] == [5]  # alone above the budget
    for c in chunks[:-1]:
        assert len(c) * max(lens[i] for i in c) <= 1500
    # With a window a chunk only spans [shortest - w, longest): more rows fit.
    lens = [600, 650, 700, 680]
    assert len(attention_mod._decode_chunks(lens, [0, 1, 2, 3], 1, 1500)) == 2
    assert attention_mod._decode_chunks(lens, [0, 1, 2, 3], 1, 1500, 100) == [[0, 1, 3, 2]]


def test_window_of_one_sees_only_itself() -> None:
    spec = dict(
        seq_lens=[20, 9],
        query_lens=[1, 9],
        block_size=4,
        num_kv_heads=1,
        group=2,
        head_size=8,
        layout="LBNHC",
        shared_prefix=False,
        seed=2,
    )
    batch = make_paged_batch(dtype=torch.float32, **spec)
    out = paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.md, 1.0, sliding_window=1
    )
    expected = torch.cat([batch.values[0][-1:], batch.values[1]])  # own V, both query heads
    torch.testing.assert_close(out, expected.expand(-1, 2, -1))


def test_reads_only_blocks_in_the_block_table() -> None:
    spec = dict(
        seq_lens=[37, 50],
        query_lens=[1, 20],
        block_size=16,
        num_kv_heads=1,
        group=1,
        head_size=8,
        layout="LBNHC",
        shared_prefix=False,
        seed=4,
    )
    batch = make_paged_batch(dtype=torch.float32, **spec)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.md, 0.3)
    before = paged_attention(*args)
    table = batch.md.block_table
    used = {int(b) for i, n in enumerate(batch.md.seq_lens_cpu) for b in table[i, : -(-n // 16)]}
    unused = [b for b in range(batch.key_cache.shape[0]) if b not in used]
    batch.key_cache[unused] = 1e4  # includes the null block 0 read as padding
    batch.value_cache[unused] = -1e4
    torch.testing.assert_close(paged_attention(*args), before, atol=0, rtol=0)
    # ...and a block that is in the table does matter (the test above can fail).
    batch.value_cache[int(table[1, 0])] += 1.0
    assert not torch.equal(paged_attention(*args), before)


def test_rejects_bad_arguments() -> None:
    spec = dict(
        seq_lens=[5],
        query_lens=[5],
        block_size=4,
        num_kv_heads=2,
        group=1,
        head_size=8,
        layout=None,
        shared_prefix=False,
        seed=0,
    )
    batch = make_paged_batch(dtype=torch.float32, **spec)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.md, 1.0, 0)
    with pytest.raises(ValueError, match="num_kv_splits"):
        paged_attention(
            batch.query, batch.key_cache, batch.value_cache, batch.md, 1.0, num_kv_splits=-2
        )
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(batch.query[:, :1], batch.key_cache, batch.value_cache, batch.md, 1.0)


@pytest.mark.parametrize("m", [1, 6])  # decode (G folded into rows) and prefill shapes
@pytest.mark.parametrize("causal", [False, True])
def test_dense_kernels_agree_including_empty_rows(m: int, causal: bool) -> None:
    """The flash and matmul kernels behind ``attend`` give the same (out, lse), with
    ``lse = −inf`` and ``out = 0`` for rows whose mask hides every key."""
    g = torch.Generator().manual_seed(m)
    b, hkv, grp, n, d = 3, 2, 3, 9, 16
    q = torch.randn(b, hkv * grp, m, d, generator=g)
    kv = torch.randn(b, n, hkv, 2 * d, generator=g)  # interleaved, as gathered
    k, v = kv[..., :d], kv[..., d:]
    mask = torch.rand(b, m, n, generator=g) > 0.4
    mask[1] = False  # a sequence with no visible key at all
    outs = [
        kern(q, k, v, 0.3, mask, causal, *extra)
        for kern, extra in [
            (dense_mod._attend_flash_cpu, (True,)),
            (dense_mod._attend_matmul, (None,)),
        ]
    ]
    (o1, l1), (o2, l2) = outs
    torch.testing.assert_close(o1, o2, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(l1, l2, atol=1e-6, rtol=1e-5)
    assert bool(torch.isneginf(l1[1]).all()) and not o1[1].any()


# ---------------------------------------------------------------- merge_attn_states


def _attend_keys(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention of ``q [T, H, D]`` over ``k, v [L, H, D]``: (out, lse [T, H])."""
    s = torch.einsum("thd,lhd->thl", q, k)
    return torch.einsum("thl,lhd->thd", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


def test_merge_equals_attention_over_concatenated_range() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 4, 16, generator=g, dtype=torch.float64) for n in (6, 50, 50))
    full, full_lse = _attend_keys(q, k, v)
    a, lse_a = _attend_keys(q, k[:13], v[:13])
    b, lse_b = _attend_keys(q, k[13:], v[13:])
    out, lse = merge_attn_states(a, lse_a, b, lse_b)
    torch.testing.assert_close(out, full, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, full_lse.float(), atol=1e-5, rtol=1e-6)
    # Multi-way: 4 uneven parts in one call agree too.
    cuts = [0, 1, 20, 21, 50]
    parts = [_attend_keys(q, k[i:j], v[i:j]) for i, j in zip(cuts, cuts[1:])]
    out4, lse4 = merge_attn_states_multi([o for o, _ in parts], [s for _, s in parts])
    torch.testing.assert_close(out4, full, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse4, full_lse.float(), atol=1e-5, rtol=1e-6)


def test_merge_empty_and_infinite_lse() -> None:
    a, b = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    lse_b = torch.randn(3, 2)
    ninf, pinf = torch.full((3, 2), float("-inf")), torch.full((3, 2), float("inf"))
    for empty in (ninf, pinf):  # vLLM treats +inf like −inf: that side is empty
        out, lse = merge_attn_states(a, empty, b, lse_b)
        torch.testing.assert_close(out, b)
        torch.testing.assert_close(lse, lse_b)
    out, lse = merge_attn_states(a, ninf, b, pinf)  # both empty → 0, lse −inf
    assert torch.equal(out, torch.zeros_like(a)) and bool(torch.isneginf(lse).all())
    # Equal lse: plain average; lse gains log 2.
    out, lse = merge_attn_states(a, lse_b, b, lse_b)
    torch.testing.assert_close(out, (a + b) / 2)
    torch.testing.assert_close(lse, lse_b + torch.log(torch.tensor(2.0)))


def test_merge_keeps_bf16_output_dtype() -> None:
    a, b = torch.randn(2, 3, 8).bfloat16(), torch.randn(2, 3, 8).bfloat16()
    lse_a, lse_b = torch.randn(2, 3), torch.randn(2, 3)
    out, lse = merge_attn_states(a, lse_a, b, lse_b)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    w_a = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)
    torch.testing.assert_close(
        out.float(), w_a * a.float() + (1 - w_a) * b.float(), atol=1e-2, rtol=1e-2
    )


def test_reference_lse_matches_attention_merge() -> None:
    """ref_attention's lse is the one merge expects (sanity of the oracle itself)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(1, 2, 8, generator=g),
        torch.randn(9, 2, 8, generator=g),
        torch.randn(9, 2, 8, generator=g),
    )
    out, lse = ref_attention(q, k, v, 1.0)
    out2, lse2 = _attend_keys(q.double(), k.double(), v.double())
    torch.testing.assert_close(out, out2)
    torch.testing.assert_close(lse, lse2)
