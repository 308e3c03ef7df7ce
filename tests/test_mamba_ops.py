"""Mamba-2 kernels (``pagedkv.ops.mamba``) against the token-by-token recurrence: the chunked
SSD scan for any chunk size and any split of the sequence (carrying the state), the decode
step, the causal conv with its state, and the state views inside a raw page."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedkv.ops.mamba import (
    causal_conv1d,
    causal_conv1d_update,
    mamba_state_views,
    selective_state_update,
    ssd_chunk_scan,
    ssd_sequential,
)

H, P, G, N = 4, 3, 2, 5


def inputs(t: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, P, generator=gen)
    dt = F.softplus(torch.randn(t, H, generator=gen))
    A = -torch.exp(torch.randn(H, generator=gen))
    B = torch.randn(t, G, N, generator=gen)
    C = torch.randn(t, G, N, generator=gen)
    D = torch.randn(H, generator=gen)
    return x, dt, A, B, C, D


@pytest.mark.parametrize("chunk", [1, 4, 7, 16, 64])
def test_chunk_scan_matches_recurrence(chunk: int) -> None:
    x, dt, A, B, C, D = inputs(37)
    init = torch.randn(H, P, N, generator=torch.Generator().manual_seed(5))
    ref_y, ref_state = ssd_sequential(x, dt, A, B, C, D, init)
    y, state = ssd_chunk_scan(x, dt, A, B, C, chunk, D, init)
    assert (y - ref_y).abs().max() < 1e-5
    assert (state - ref_state).abs().max() < 1e-5
    # the D skip and the initial state both matter (not inert in this check)
    assert (ssd_chunk_scan(x, dt, A, B, C, chunk, None, init)[0] - ref_y).abs().max() > 1e-2
    assert (ssd_chunk_scan(x, dt, A, B, C, chunk, D, None)[0] - ref_y).abs().max() > 1e-2


@pytest.mark.parametrize("cuts", [[0, 37], [0, 1, 37], [0, 16, 32, 37], [0, 5, 6, 20, 37]])
def test_split_scan_carries_state(cuts: list[int]) -> None:
    """Prefill in pieces, each starting from the previous piece's final state (chunked prefill,
    a restored checkpoint) equals the scan of the whole sequence."""
    x, dt, A, B, C, D = inputs(37, seed=1)
    ref_y, ref_state = ssd_sequential(x, dt, A, B, C, D)
    state, ys = None, []
    for a, b in zip(cuts, cuts[1:]):
        y, state = ssd_chunk_scan(x[a:b], dt[a:b], A, B[a:b], C[a:b], 8, D, state)
        ys.append(y)
    assert (torch.cat(ys) - ref_y).abs().max() < 1e-5
    assert (state - ref_state).abs().max() < 1e-5


def test_decode_step_matches_recurrence() -> None:
    x, dt, A, B, C, D = inputs(12, seed=2)
    ref_y, ref_state = ssd_sequential(x, dt, A, B, C, D)
    _, state = ssd_chunk_scan(x[:9], dt[:9], A, B[:9], C[:9], 4, D)
    state = torch.stack([state, state.clone()])  # two sequences, same history
    for i in range(9, 12):
        y = selective_state_update(
            state,
            x[i : i + 1].expand(2, H, P),
            dt[i : i + 1].expand(2, H),
            A,
            B[i : i + 1].expand(2, G, N),
            C[i : i + 1].expand(2, G, N),
            D,
        )
        assert (y[0] - ref_y[i]).abs().max() < 1e-5 and torch.equal(y[0], y[1])
    assert (state[0] - ref_state).abs().max() < 1e-5


def test_causal_conv_with_state_matches_one_pass() -> None:
    gen = torch.Generator().manual_seed(3)
    c, k, t = 6, 4, 11
    x = torch.randn(t, c, generator=gen)
    w = torch.randn(c, k, generator=gen)
    bias = torch.randn(c, generator=gen)
    # transformers' causal_conv1d_fn: left padding K-1, keep the first T outputs
    ref = F.conv1d(x.t()[None], w[:, None], bias, padding=k - 1, groups=c)[0, :, :t].t()
    out, state = causal_conv1d(x, None, w, bias)
    assert (out - ref).abs().max() < 1e-6
    assert torch.equal(state, x[-(k - 1) :].t())
    parts, state = [], None
    for a, b in [(0, 2), (2, 3), (3, 9), (9, 11)]:  # pieces shorter than the kernel too
        o, state = causal_conv1d(x[a:b], state, w, bias)
        parts.append(o)
    assert (torch.cat(parts) - ref).abs().max() < 1e-6


def test_state_views_alias_the_page() -> None:
    pages = torch.zeros(3, 200, dtype=torch.uint8)
    conv, ssm = mamba_state_views(pages, ((4, 3), (2, 2, 3)), ("float32", "float32"))
    assert conv.shape == (3, 4, 3) and ssm.shape == (3, 2, 2, 3)
    ssm[1].fill_(1.0)
    assert pages[1, 48:96].view(torch.float32).eq(1.0).all() and pages[0].eq(0).all()
    with pytest.raises(ValueError, match="page"):
        mamba_state_views(pages, ((40, 3),), ("float32",))


def test_conv_update_step_matches_conv() -> None:
    """The batched one-token conv step (decode) equals the sequence conv, state included."""
    gen = torch.Generator().manual_seed(4)
    c, k = 6, 4
    x = torch.randn(3, 9, c, generator=gen)  # 3 sequences of 9 tokens
    w, bias = torch.randn(c, k, generator=gen), torch.randn(c, generator=gen)
    refs = [causal_conv1d(x[s], None, w, bias) for s in range(3)]
    states = torch.stack([causal_conv1d(x[s, :8], None, w, bias)[1] for s in range(3)])
    out, new = causal_conv1d_update(x[:, 8], states, w, bias)
    for s in range(3):
        assert (out[s] - refs[s][0][8]).abs().max() < 1e-5
        assert torch.equal(new[s], refs[s][1])
