"""Quantized KV caches (issue 14): the byte codecs against a float64 reference with the error
bound of each format, the Hadamard rotation, attention over quantized pages, and the engine
end to end (page sizes, preemption and prefix hits, offload round trips, format mismatches)."""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv.core.specs import FullAttentionSpec, KVQuantMode
from pagedkv.ops.attention import paged_attention
from pagedkv.ops.cache import compute_slot_mapping, reshape_and_cache
from pagedkv.ops.kv_cache import allocate_kv_cache
from pagedkv.ops.kv_quant import KVQuant, dequantize_part, hadamard_rotation, round_half_away
from pagedkv.ops.metadata import AttentionMetadata

MODES = [
    ("fp8", "fp8_per_tensor"),
    ("fp8_e5m2", "fp8_per_tensor"),
    ("int8", "int8_per_token_head"),
    ("fp8", "fp8_per_token_head"),
    ("int4", "int4_per_token_head"),
    ("int4", "int4_per_token_group"),
    ("int8", "int8_per_token_head_f16"),
    ("fp8", "fp8_per_token_head_f16"),
    ("int3", "int3_per_token_group"),
    ("int2", "int2_per_token_group"),
]


def spec_for(
    dtype: str, mode: str, hs: int = 64, heads: int = 3, bs: int = 16, rotation: str | None = None
) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=bs,
        num_kv_heads=heads,
        head_size=hs,
        dtype=dtype,
        kv_quant_mode=mode,
        kv_rotation=rotation,
    )


def sample(*shape: int, seed: int = 0) -> torch.Tensor:
    """Activations with a few outlier channels, as real keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[..., 3] *= 8.0
    x[..., 0, :] *= 0.0  # a token-head of zeros: scales must not divide by zero
    return x


# ---------------------------------------------------------------- codecs


def test_int8_codes_are_bit_equal_to_round_half_away_and_scale_is_inline():
    q = KVQuant.for_spec(spec_for("int8", "int8_per_token_head"))
    x = sample(7, 3, 64)
    x[1, 1] = 0.0
    x[1, 1, :5] = torch.tensor([0.5, -0.5, 1.5, -2.5, 127.0])  # amax 127: scale 1, exact ties
    raw, _ = q.quantize(x, x)
    xd = x.double()
    s = (xd.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-6).float()
    want = round_half_away(x / s).clamp(-128, 127).to(torch.int8)
    assert torch.equal(raw[..., :64].view(torch.int8), want)
    assert torch.equal(raw[..., 64:68].contiguous().view(torch.float32), s)
    deq = dequantize_part(raw, q.fmt, 64, 1.0).double()
    assert float((deq - xd).abs().max()) <= float(s.max()) / 2 * (1 + 1e-6)
    # ties round away from zero: 0.5 → 1, -0.5 → -1, 1.5 → 2, -2.5 → -3
    assert raw[1, 1, :4].view(torch.int8).tolist() == [1, -1, 2, -3]


@pytest.mark.parametrize("dtype,mode", MODES)
def test_round_trip_within_the_format_error_bound(dtype, mode):
    """|x - deq(q(x))| against float64, bounded by half a quantization step of the format."""
    spec = spec_for(dtype, mode)
    q = KVQuant.for_spec(spec)
    q.k_scale = q.v_scale = 0.05  # per-tensor fp8 uses these; others ignore them
    x = sample(9, 3, 64, seed=1)
    raw, _ = q.quantize(x, x)
    assert raw.dtype == torch.uint8 and raw.shape[-1] == spec.k_part_bytes
    deq = dequantize_part(raw, q.fmt, 64, q.k_scale).double()
    err = (deq - x.double()).abs()
    xd = x.double()
    half = mode.endswith(
        "_f16"
    )  # the scale rounded up to fp16: at most 2^-10 larger (normal range)
    if mode.startswith("int8_per_token_head"):
        bound = xd.abs().amax(-1, keepdim=True) / 127 / 2 * (1 + 2.0**-10 if half else 1)
    elif mode.startswith("fp8_per"):
        e4m3 = dtype != "fp8_e5m2"
        rel, sub = (2.0**-4, 2.0**-10) if e4m3 else (2.0**-3, 2.0**-17)
        s = (
            (xd.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-6) * (1 + 2.0**-10 if half else 1)
            if mode != "fp8_per_tensor"
            else 0.05
        )
        lim = 448.0 if e4m3 else 57344.0
        clipped = (xd.abs() - lim * s).clamp(min=0)  # per-tensor: saturation past ±max·scale
        bound = xd.abs() * rel + sub * s + clipped
    else:
        bits = {"int4": 4, "int3": 3, "int2": 2}[dtype]
        g = {"int4_per_token_head": 64, "int4_per_token_group": 16}.get(mode, 32)  # the K part
        xg = xd.reshape(9, 3, 64 // g, g)
        rng = xg.amax(-1, keepdim=True).clamp(min=0) - xg.amin(-1, keepdim=True).clamp(max=0)
        # half a step, the stored scale rounded up by at most 2^-(10 - bits) (the zero point
        # takes the fp16 mantissa's low `bits` bits)
        top = 2**bits - 1
        bound = (rng / top * (1 + 2.0 ** -(10 - bits)) / 2 + 1e-7).expand_as(xg).reshape(9, 3, 64)
    assert bool((err <= bound * (1 + 1e-6) + 1e-12).all()), float((err - bound).max())
    assert float(deq[..., 0, :].abs().max()) == 0.0  # a head of zeros stays zeros


@pytest.mark.parametrize("mode", ["int4_per_token_head", "int4_per_token_group"])
def test_int4_zero_point_lives_in_the_scale_low_bits(mode):
    q = KVQuant.for_spec(spec_for("int4", mode))
    x = torch.full((1, 1, 64), 3.0)  # all positive: the range must still include 0
    x[0, 0, 1::2] = -1.0
    raw, _ = q.quantize(x, x)
    deq = dequantize_part(raw, q.fmt, 64, 1.0)
    assert torch.allclose(deq, x, atol=4.0 / 15 / 2 * 1.02)
    if mode == "int4_per_token_head":
        bits = raw[0, 0, 32:36].contiguous().view(torch.int32)
        assert int(bits) & 15 == round(1.0 / (4.0 / 15))  # z = round(-min / s)
    else:
        assert raw.shape[-1] == 32 + 4 * 2  # K: groups of 16


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codes_pack_as_a_little_endian_bit_stream(bits: int) -> None:
    """Value i of a part at bits [bits*i, bits*i + bits) of its bytes: int4's nibble order is
    the same rule, int3 packs 8 values in 3 bytes, int2 4 in one (the kernels' contract)."""
    from pagedkv.ops.kv_quant import pack_codes, unpack_codes

    g = torch.Generator().manual_seed(bits)
    q = torch.randint(0, 2**bits, (4, 2, 64), dtype=torch.uint8, generator=g)
    raw = pack_codes(q, bits)
    assert raw.shape[-1] == 64 * bits // 8
    stream = int.from_bytes(bytes(raw[1, 1].tolist()), "little")
    assert [(stream >> (bits * i)) & (2**bits - 1) for i in range(64)] == q[1, 1].tolist()
    assert torch.equal(unpack_codes(raw, 64, bits), q)


@pytest.mark.parametrize("dtype", ["int3", "int2"])
def test_low_bit_parts_have_the_capacity_bars_bytes(dtype: str) -> None:
    """Head size 64: int3 56 bytes a token-head (4.57x fewer than bf16's 256), int2 40 (6.4x);
    the zero point lives in the low 3 / 2 bits of each group's fp16 scale."""
    spec = spec_for(dtype, f"{dtype}_per_token_group")
    bits = int(dtype[-1])
    assert spec.k_part_bytes == spec.v_part_bytes == 64 * bits // 8 + 2 * 2
    q = KVQuant.for_spec(spec)
    x = torch.full((1, 1, 64), 3.0)
    x[0, 0, 1::2] = -1.0  # range [-1, 3]: z = round(1 / s)
    raw, _ = q.quantize(x, x)
    scales = raw[0, 0, 64 * bits // 8 :].contiguous().view(torch.int16).to(torch.int32)
    s = (scales & ~(2**bits - 1)).to(torch.int16).view(torch.float16).float()
    assert ((scales & (2**bits - 1)).float() == torch.round(1.0 / s)).all()
    assert torch.allclose(dequantize_part(raw, q.fmt, 64, 1.0), x, atol=4.0 / (2**bits - 1))


def test_equal_positive_values_are_representable():
    """vLLM's asymmetric formula clamps z to [0, 15] and so cannot reach a range that excludes
    0 (e.g. all values 5.0 came back as 15 · 1e-6). Ranges here always include 0."""
    q = KVQuant.for_spec(spec_for("int4", "int4_per_token_group"))
    x = torch.full((2, 3, 64), 5.0)
    raw, _ = q.quantize(x, x)
    assert torch.allclose(dequantize_part(raw, q.fmt, 64, 1.0), x, rtol=0.02)


# ---------------------------------------------------------------- rotation


@pytest.mark.parametrize("d", [64, 128, 80, 96])
def test_hadamard_is_orthonormal_and_deterministic(d):
    r = hadamard_rotation(d)
    assert torch.allclose(r @ r.T, torch.eye(d), atol=1e-6)
    assert set(torch.unique(r.abs() * math.sqrt(d & -d)).round(decimals=4).tolist()) <= {0.0, 1.0}
    hadamard_rotation.cache_clear()
    assert torch.equal(hadamard_rotation(d), r)


def _cache_and_md(
    spec: FullAttentionSpec, lens: list[int], qlens: list[int], num_blocks: int = 40, seed: int = 0
):
    """A shuffled block table for sequences of ``lens`` tokens whose last ``qlens`` are this
    step's queries, and the full K/V history to write."""
    g = torch.Generator().manual_seed(seed)
    bs = spec.block_size
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    tables, at = [], 0
    for n in lens:
        nb = -(-n // bs)
        tables.append(perm[at : at + nb].tolist())
        at += nb
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = [0]
    for ql in qlens:
        qsl.append(qsl[-1] + ql)
    md = AttentionMetadata(
        slot_mapping=torch.empty(0),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=table,
        block_size=bs,
        max_query_len=max(qlens),
        max_seq_len=max(lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
    )
    return md, table


def _write_history(spec, quant, lens, table, heads, hs, seed):
    quantized = spec.kv_quant_mode is not KVQuantMode.NONE
    k_sz, v_sz = (spec.k_part_bytes, spec.v_part_bytes) if quantized else (hs, hs)
    _, views = allocate_kv_cache(
        "LBNHC",
        1,
        40,
        spec.block_size,
        heads,
        k_sz,
        torch.uint8 if quantized else torch.float32,
        head_size_v=v_sz,
    )
    kc, vc = views[0]
    ks, vs = [], []
    for i, n in enumerate(lens):
        k, v = sample(n, heads, hs, seed=seed + i), sample(n, heads, hs, seed=seed + 100 + i)
        req = torch.full((n,), i, dtype=torch.int64)
        slots = compute_slot_mapping(table, req, torch.arange(n), spec.block_size)
        reshape_and_cache(k, v, kc, vc, slots, quant)
        ks.append(k)
        vs.append(v)
    return kc, vc, ks, vs


def _dense(q, k, v, scale, window=None):
    """float64 causal attention of the last ``len(q)`` positions over ``k``/``v`` ([n, H, D])."""
    n, g = k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    pos_q = torch.arange(n - q.shape[0], n)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    diff = pos_q[:, None] - torch.arange(n)[None]
    mask = diff >= 0
    if window:
        mask &= diff < window
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("window", [None, 20])
def test_rotation_without_quantization_leaves_attention_unchanged(window):
    """RHT only: (Rq)·(Rk) = q·k and Rᵀ(Σ p·Rv) = Σ p·v, within float32 rounding (1e-5 relative)."""
    spec = spec_for("float32", "none", bs=16)
    quant = KVQuant.for_spec(spec_for("float32", "none", rotation="hadamard"))
    lens, qlens = [37, 50, 9], [1, 14, 9]
    md, table = _cache_and_md(spec, lens, qlens)
    plain = _write_history(spec, None, lens, table, 3, 64, seed=5)
    rot = _write_history(spec, quant, lens, table, 3, 64, seed=5)
    q = sample(sum(qlens), 9, 64, seed=9)
    a = paged_attention(q, plain[0], plain[1], md, 0.125, sliding_window=window)
    b = paged_attention(q, rot[0], rot[1], md, 0.125, sliding_window=window, kv_quant=quant)
    # relative to the output's magnitude (the outlier channel makes values of ~20)
    assert float((a - b).abs().max()) < 1e-5 * float(a.abs().max())


@pytest.mark.parametrize("dtype,mode", MODES)
@pytest.mark.parametrize("rotation", [None, "hadamard"])
def test_attention_over_quantized_pages_equals_dense_over_dequantized_values(dtype, mode, rotation):
    """Mixed prefill (with cached context) + decode rows, GQA 3, block 16: the torch path over
    the pages equals float64 attention over exactly the values the pages hold."""
    spec = spec_for(dtype, mode, rotation=rotation)
    quant = KVQuant.for_spec(spec)
    quant.k_scale, quant.v_scale = 0.02, 0.03
    lens, qlens = [33, 70, 5, 17], [1, 21, 5, 1]
    md, table = _cache_and_md(spec, lens, qlens, seed=3)
    kc, vc, ks, vs = _write_history(spec, quant, lens, table, 3, 64, seed=7)
    q = sample(sum(qlens), 9, 64, seed=11)
    out = paged_attention(q, kc, vc, md, 0.125, kv_quant=quant)
    at = 0
    for i, (_n, ql) in enumerate(zip(lens, qlens)):
        k_raw, _ = quant.quantize(ks[i], ks[i])
        _, v_raw = quant.quantize(vs[i], vs[i])
        k_deq, v_deq = quant.dequantize(k_raw, v_raw)  # rotated values, as stored
        ref = _dense(quant.rotate(q[at : at + ql]), k_deq, v_deq, 0.125)
        ref = ref.float() @ quant.rotation if quant.rotation is not None else ref
        err = float((out[at : at + ql].double() - ref.double()).abs().max())
        assert err < 1e-5 * max(1.0, float(ref.abs().max())), (i, mode, err)  # float32 rounding
        at += ql


@pytest.mark.parametrize(
    "mode,qmax", [("int8_per_token_head_f16", 127.0), ("fp8_per_token_head_f16", 448.0)]
)
def test_f16_scale_is_amax_over_qmax_rounded_up_to_fp16_and_two_bytes_inline(mode, qmax):
    """The *_f16 formats: the part is [d codes | fp16 scale], the scale the smallest fp16 >=
    max(amax / qmax, 1e-6) (so no code clips), and the page 4 bytes a token-head smaller than
    vLLM's fp32-scale format."""
    dtype = mode.split("_")[0]
    q = KVQuant.for_spec(spec_for(dtype, mode))
    f32 = spec_for(dtype, mode.removesuffix("_f16"))
    assert spec_for(dtype, mode).page_size_bytes == f32.page_size_bytes - 16 * 3 * 4
    x = sample(11, 3, 64, seed=3)
    x[2, 1] *= 1e-9  # tiny amax: the scale floor, a subnormal fp16
    raw, _ = q.quantize(x, x)
    assert raw.shape[-1] == 66
    s = raw[..., 64:66].contiguous().view(torch.float16)
    want = (x.double().abs().amax(-1, keepdim=True) / qmax).clamp(min=1e-6)
    s64 = s.double()
    below = torch.nextafter(s, torch.tensor(0.0, dtype=torch.float16)).double()
    assert bool((s64 >= want).all()) and bool((below < want).all())  # the smallest fp16 >= want
    codes = (
        raw[..., :64]
        .contiguous()
        .view(torch.int8 if dtype == "int8" else torch.float8_e4m3fn)
        .double()
    )
    assert float(codes.abs().max()) <= qmax
    if dtype == "int8":
        assert torch.equal(codes, round_half_away(x.double() / s64).clamp(-128, 127))
