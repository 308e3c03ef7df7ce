"""Decode attention over a KIVI cache (``ops/kivi.py``) in Triton: the CUDA twin of
``ops/csrc/kivi_decode.c``, tested on CPU under ``TRITON_INTERPRET=1``.

One program per (row, KV head), one page block per iteration: each key of the block is read
from the row's int8 residual when it is *hot* (``start <= j`` and ``j < sink`` or ``j >=
hot_lo``, ``hot_lo`` the first position of the residual's last blocks) and from the page's
codes otherwise — K per channel over the block (the block's channel scales sit after the codes,
``head_size / block_size`` per token), V per token in groups. The two sources are merged with
``tl.where`` before the dot products, so a block mixing hot and cold keys costs one tile. The
step's writes (residual, V codes, K codes of filled blocks) happen before, in torch
(``ops.kivi``), as on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.core.specs import kivi_residual_blocks
from pagedkv.ops.kv_quant import KVQuant
from pagedkv.ops.triton.kv_quant import f16_bits_to_f32, load_le
from pagedkv.ops.triton.utils import pow2


@triton.jit
def _codes(ptr, off, mask, BITS: tl.constexpr):
    """``BITS``-bit codes (little-endian bit stream) of values ``off`` of parts at ``ptr``
    (uint8 pointers; ``off``/``mask`` broadcast to their shape), as float32 (0 where masked);
    int3 codes may straddle two bytes (the next one exists: scales follow the codes)."""
    bit = off * BITS
    if BITS == 3:
        word = load_le(ptr + (bit >> 3), mask, 2)
    else:
        word = tl.load(ptr + (bit >> 3), mask=mask, other=0).to(tl.int32)
    return ((word >> (bit & 7)) & ((1 << BITS) - 1)).to(tl.float32)


@triton.jit
def _kivi_decode(
    q_ptr, k_ptr, v_ptr, rk_ptr, rv_ptr, out_ptr, table_ptr, lens_ptr, rows_ptr, starts_ptr,
    sink_lo_ptr, kb, kt, kh, vb, vt, vh, rk_row, rk_tok, rv_row, rv_tok, bt_stride, scale, sink, window,
    blocks,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BS: tl.constexpr,
    BITS: tl.constexpr, VGROUP: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    hk = tl.program_id(1)
    HQ_STRIDE: tl.constexpr = D
    C: tl.constexpr = D // BS  # channel scales a token carries
    KVALS: tl.constexpr = D * BITS // 8
    VVALS: tl.constexpr = DV * BITS // 8
    LOW: tl.constexpr = (1 << BITS) - 1
    length = tl.load(lens_ptr + r)
    start = tl.load(starts_ptr + r)
    sink_lo = tl.load(sink_lo_ptr + r)  # the first sink the row holds (<= min(start, sink))
    row = tl.load(rows_ptr + r).to(tl.int64)
    hot_lo = tl.maximum(((length - 1) // BS - blocks + 1) * BS, 0)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    j = tl.arange(0, BS)
    g_mask = g < G
    heads = hk * G + g
    q = tl.load(q_ptr + r * (G * tl.num_programs(1) * HQ_STRIDE) + heads[:, None] * D + d[None, :],
                mask=g_mask[:, None], other=0.0).to(tl.float32)  # fmt: skip
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DV], tl.float32)
    for b in range(0, tl.cdiv(length, BS)):
        blk = tl.load(table_ptr + r * bt_stride + b).to(tl.int64)
        t = b * BS + j
        valid = t < length
        hot = valid & (((t >= start) & (t >= hot_lo)) | ((t < sink) & (t >= sink_lo)))
        idx = tl.where(t < sink, t, sink + t % window).to(tl.int64)
        # K [D, BS]: the codes with the block's channel scales, or the residual's int8 parts
        kpart = k_ptr + blk * kb + j[None, :] * kt + hk * kh
        kc = _codes(kpart + 0 * d[:, None], d[:, None], valid[None, :] & (d[:, None] < D), BITS)
        sb = load_le(k_ptr + blk * kb + (d // C) * kt + hk * kh + KVALS + 2 * (d % C), d == d, 2)
        ks = (sb & -(LOW + 1)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        k_cold = (kc - (sb & LOW).to(tl.float32)[:, None]) * ks[:, None]
        rk = rk_ptr + row * rk_row + idx * rk_tok + hk * (D + 2)
        k8 = tl.load(rk[None, :] + d[:, None], mask=hot[None, :], other=0)
        k_hot = (
            k8.to(tl.int8, bitcast=True).to(tl.float32)
            * f16_bits_to_f32(load_le(rk + D, hot, 2))[None, :]
        )
        k = tl.where(hot[None, :], k_hot, k_cold)
        s = tl.sum(q[:, :, None] * k[None, :, :], 1) * scale  # [GP, BS]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        # V [BS, DV]: per-token group codes, or the residual's int8 parts
        vpart = v_ptr + blk * vb + j[:, None] * vt + hk * vh
        vc = _codes(vpart + 0 * dv[None, :], dv[None, :], valid[:, None] & (dv[None, :] < DV), BITS)
        vsb = load_le(vpart + VVALS + 2 * (dv[None, :] // VGROUP), valid[:, None], 2)
        vs = (vsb & -(LOW + 1)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        v_cold = (vc - (vsb & LOW).to(tl.float32)) * vs
        rv = rv_ptr + row * rv_row + idx * rv_tok + hk * (DV + 2)
        v8 = tl.load(rv[:, None] + dv[None, :], mask=hot[:, None], other=0)
        v_hot = (
            v8.to(tl.int8, bitcast=True).to(tl.float32)
            * f16_bits_to_f32(load_le(rv + DV, hot, 2))[:, None]
        )
        v = tl.where(hot[:, None], v_hot, tl.where(valid[:, None], v_cold, 0.0))
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
        m_i = m_new
    out = acc / l_i[:, None]
    o_ptr = out_ptr + r * (G * tl.num_programs(1) * DV) + heads[:, None] * DV + dv[None, :]
    tl.store(o_ptr, out, mask=g_mask[:, None])


def supports(head_size: int, head_size_v: int, block_size: int) -> bool:
    """The shapes the kernel takes: powers of two, the block size dividing the head size."""
    return all(n == pow2(n) for n in (head_size, head_size_v, block_size)) and not (
        head_size % block_size
    )


def kivi_decode_triton(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_quant: KVQuant,
    rows: torch.Tensor,
    starts: torch.Tensor,
    sink_lo: torch.Tensor | None = None,
) -> torch.Tensor:
    """What ``native.kivi_decode`` computes (same arguments and contract), on the caches'
    device: ``out [R, Hq, Dv]`` float32. Head sizes must be powers of two; raises ValueError
    for shapes the kernel does not take."""
    res, fmt = kv_quant.residual, kv_quant.fmt
    if res is None:
        raise ValueError("a KIVI decode needs the layer's residual")
    r, hq, d = q.shape
    hkv, bs, dv = key_cache.shape[2], key_cache.shape[1], fmt.head_size_v
    if not supports(d, dv, bs):
        raise ValueError(f"head sizes {d}/{dv} and block size {bs}: powers of two, bs | D")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the caches' parts must be contiguous")
    q = q.float().contiguous()
    out = torch.empty(r, hq, dv, dtype=torch.float32, device=q.device)
    ks, vs, rks, rvs = key_cache.stride(), value_cache.stride(), res.k.stride(), res.v.stride()
    table = block_table.to(torch.int32).contiguous()
    g = hq // hkv
    if sink_lo is None:
        sink_lo = starts.clamp(max=res.sink)
    _kivi_decode[(r, hkv)](
        q, key_cache, value_cache, res.k, res.v, out, table,
        seq_lens.to(torch.int32).contiguous(), rows.to(torch.int32).contiguous(),
        starts.to(torch.int32).contiguous(), sink_lo.to(torch.int32).contiguous(),
        ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], rks[0], rks[1], rvs[0], rvs[1],
        table.stride(0), scale, res.sink, res.window, kivi_residual_blocks(bs),
        G=g, GP=pow2(g), D=d, DV=dv, BS=bs, BITS=fmt.mode.code_bits, VGROUP=fmt.v_group,
    )  # fmt: skip
    return out


__all__ = ["kivi_decode_triton", "supports"]
