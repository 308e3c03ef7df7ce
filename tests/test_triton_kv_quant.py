"""Triton kernels over quantized KV caches (ops/triton/kv_quant.py) against the torch codecs
(``pagedkv.ops.kv_quant``) and the dense float64 reference on dequantized values.

* Writes: ``reshape_and_cache_triton(..., kv_quant)`` stores exactly the bytes of the torch
  path (``reshape_and_cache(..., kv_quant)`` on CPU) for every mode, layout and edge case
  (ties, zeros, subnormal fp8, clamping, -0.0), and every fp8 value and midpoint.
* Reads: ``paged_attention_triton(..., kv_quant)`` over a quantized cache equals the reference
  computed on ``dequantize_part`` of the same bytes (mixed prefill/decode, GQA, windows,
  block sizes 16/32, random block tables, padding slots).

Runs on CPU under ``TRITON_INTERPRET=1`` (set before triton is imported), like
tests/test_triton_kernels.py; with ``TRITON_INTERPRET=0`` on CUDA the same tests run compiled.
"""

from __future__ import annotations

import os

_WE_SET_INTERPRET = "TRITON_INTERPRET" not in os.environ
os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from ref_attention import PagedBatch, make_paged_batch  # noqa: E402
from triton_env import interpret_during_module  # noqa: E402

from pagedkv.core.specs import AttentionSpec  # noqa: E402
from pagedkv.ops.attention import paged_attention  # noqa: E402
from pagedkv.ops.cache import reshape_and_cache  # noqa: E402
from pagedkv.ops.kv_cache import allocate_kv_cache  # noqa: E402
from pagedkv.ops.kv_quant import KVQuant, dequantize_part, quantize_part  # noqa: E402
from pagedkv.ops.metadata import AttentionMetadata  # noqa: E402
from pagedkv.ops.triton.reshape_and_cache import reshape_and_cache_triton  # noqa: E402
from pagedkv.ops.triton.unified_attention import paged_attention_triton  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] not in ("0", "")
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip(
        "compiled Triton needs CUDA (set TRITON_INTERPRET=1 for the CPU interpreter)",
        allow_module_level=True,
    )
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
# (kv_cache_dtype, mode): every quantized format.
FORMATS = [
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
FORMAT_IDS = [
    "fp8",
    "fp8_e5m2",
    "int8_pth",
    "fp8_pth",
    "int4_pth",
    "int4_group",
    "int8_pth16",
    "fp8_pth16",
    "int3_group",
    "int2_group",
]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


_interpret_during_module = interpret_during_module(_WE_SET_INTERPRET, INTERPRET)


def make_quant(
    dtype: str,
    mode: str,
    head_size: int,
    head_size_v: int | None = None,
    scales: tuple[float, float] = (1.0, 0.37),
    rotation: str | None = None,
) -> KVQuant:
    """A layer's :class:`KVQuant` (per-tensor fp8 scales ``scales``; unused by other modes)."""
    spec = AttentionSpec(
        block_size=16,
        num_kv_heads=1,
        head_size=head_size,
        dtype=dtype,
        head_size_v=head_size_v,
        kv_quant_mode=mode,
        kv_rotation=rotation,
    )
    kq = KVQuant.for_spec(spec)
    if mode == "fp8_per_tensor":
        kq.k_scale, kq.v_scale = scales
    return kq


def quant_caches(
    kq: KVQuant,
    layout: str | None,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    random_seed: int | None = None,
    device: torch.device = DEVICE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``uint8`` K/V part caches: separate tensors (``layout=None``) or views of one buffer
    in ``layout``; zeros, or random bytes from ``random_seed``."""
    f = kq.fmt
    if layout is None:
        kc = torch.zeros(
            num_blocks, block_size, num_kv_heads, f.k_bytes, dtype=torch.uint8, device=device
        )
        vc = torch.zeros(
            num_blocks, block_size, num_kv_heads, f.v_bytes, dtype=torch.uint8, device=device
        )
        buffers = [kc, vc]
    else:
        buf, views = allocate_kv_cache(
            layout,
            1,
            num_blocks,
            block_size,
            num_kv_heads,
            f.k_bytes,
            torch.uint8,
            device,
            head_size_v=f.v_bytes,
        )
        (kc, vc), buffers = views[0], [buf]
    if random_seed is not None:
        gen = torch.Generator().manual_seed(random_seed)
        for b in buffers:
            b.copy_(torch.randint(0, 256, b.shape, generator=gen, dtype=torch.uint8))
    return kc, vc


def on_device(md: AttentionMetadata) -> AttentionMetadata:
    return dataclasses.replace(
        md,
        slot_mapping=md.slot_mapping.to(DEVICE),
        query_start_loc=md.query_start_loc.to(DEVICE),
        seq_lens=md.seq_lens.to(DEVICE),
        block_table=md.block_table.to(DEVICE),
        _rows=None,
    )


def edge_rows(d: int) -> torch.Tensor:
    """Rows ``[n, d]`` that hit the codecs' corners at scale 1 (per-tensor ``k_scale`` 1;
    int8 rows with amax 127, fp8 rows with amax 448, int4 rows spanning [-7.5, 7.5]: their
    scales are exactly 1, so the listed values are exact ties)."""

    def row(vals: list[float], amax: float | None) -> torch.Tensor:
        r = torch.tensor((vals * d)[:d], dtype=torch.float32)
        if amax is not None:
            r[0], r[-1] = amax, -amax
        return r

    ties8 = [0.5, -0.5, 1.5, -2.5, 2.5, 126.5, -126.5, 3.4999998]
    fp8 = [17.0, 19.0, 31.5, -31.5, 0.003, -0.0004, 1e-9, 240.0, 0.0009765625, 2.0**-10, -0.0]
    int4 = [0.5, -0.5, 1.5, -2.5, 6.5, 7.0, -6.9999995, 0.0]
    return torch.stack(
        [
            torch.zeros(d),
            torch.full((d,), -0.0),
            torch.full((d,), 3.25),  # int4: lo = 0
            row(ties8, 127.0),
            row(fp8, 448.0),
            row(fp8 + [500.0], None),
            row(int4, 7.5),
            row([1e-30, -2e-30, 0.0], None),  # amax under MIN_SCALE
        ]
    )


def kv_rows(t: int, h: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """``[t, h, d]`` float32: random rows of magnitudes 1e-3..1e3 with an outlier channel,
    then :func:`edge_rows` over the first (token, head) rows."""
    x = torch.randn(t, h, d, generator=gen) * 10.0 ** (torch.rand(t, h, 1, generator=gen) * 6 - 3)
    x[..., 3] *= 20.0
    edges = edge_rows(d)
    flat = x.view(t * h, d)
    flat[: len(edges)] = edges[: t * h]
    return x


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("layout", [None, "LBHNC"])
@pytest.mark.slow
def test_reshape_and_cache_bytes_match_torch_codec(
    fmt: tuple[str, str], layout: str | None
) -> None:
    """Every byte of both caches equals the torch path's: values, inline scales, untouched
    slots, negative slots skipped. K (head 64, two INT4 groups) and V (head 32) are strided
    slices of a fused qkv row; edge rows and random magnitudes."""
    kq = make_quant(*fmt, head_size=64, head_size_v=32)
    t, h, nb, bs = 11, 2, 3, 16
    gen = torch.Generator().manual_seed(1)
    qkv = torch.zeros(t, h * 96 + 5)
    qkv[:, : h * 64] = kv_rows(t, h, 64, gen).reshape(t, -1)
    qkv[:, h * 64 : h * 96] = kv_rows(t, h, 32, gen).flip(0).reshape(t, -1)
    key, value = qkv[:, : h * 64].view(t, h, 64), qkv[:, h * 64 : h * 96].view(t, h, 32)
    slots = torch.tensor([5, -1, 17, 0, -3, 47, 40, 41, -1, 30, 18])  # 47: the last slot
    want = quant_caches(kq, layout, nb, bs, h, device=torch.device("cpu"))
    reshape_and_cache(key, value, *want, slots, kv_quant=kq)  # the torch codec
    got = quant_caches(kq, layout, nb, bs, h)
    reshape_and_cache_triton(key.to(DEVICE), value.to(DEVICE), *got, slots.to(DEVICE), kq)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu(), w), (g.cpu() != w).nonzero()[:8].tolist()
    assert bool(want[0][1, 1].any())  # slot 17 was written


def test_reshape_and_cache_bf16_input_and_separate_scales() -> None:
    """bfloat16 K/V (what a model without rotation writes) and per-tensor fp8 scales that
    are not powers of two: still the torch codec's bytes."""
    for dtype, mode in (("fp8", "fp8_per_tensor"), ("int4", "int4_per_token_group")):
        kq = make_quant(dtype, mode, 32, scales=(0.0173, 2.9))
        gen = torch.Generator().manual_seed(4)
        key = (torch.randn(6, 1, 32, generator=gen) * 5).bfloat16()
        value = (torch.randn(6, 1, 32, generator=gen) * 300).bfloat16()
        slots = torch.tensor([3, 9, -1, 31, 16, 0])
        want = quant_caches(kq, None, 2, 16, 1, device=torch.device("cpu"))
        reshape_and_cache(key, value, *want, slots, kv_quant=kq)
        got = quant_caches(kq, None, 2, 16, 1)
        reshape_and_cache_triton(key.to(DEVICE), value.to(DEVICE), *got, slots.to(DEVICE), kq)
        assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True)), mode


@pytest.mark.slow
def test_reshape_and_cache_head_sizes_not_powers_of_two() -> None:
    """K head 80 (INT4 groups of 16: five per part), V head 48: padded lanes masked."""
    for fmt in FORMATS:
        kq = make_quant(*fmt, head_size=80, head_size_v=48)
        gen = torch.Generator().manual_seed(3)
        key, value = kv_rows(5, 2, 80, gen), kv_rows(5, 2, 48, gen)
        slots = torch.tensor([3, -1, 7, 20, 9])
        want = quant_caches(kq, "BLNHC", 2, 16, 2, device=torch.device("cpu"))
        reshape_and_cache(key, value, *want, slots, kv_quant=kq)
        got = quant_caches(kq, "BLNHC", 2, 16, 2)
        reshape_and_cache_triton(key.to(DEVICE), value.to(DEVICE), *got, slots.to(DEVICE), kq)
        assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True)), fmt


@pytest.mark.parametrize("fp8", ["fp8", "fp8_e5m2"])
def test_fp8_encoding_of_every_value_and_midpoint(fp8: str) -> None:
    """Every finite fp8 value, every midpoint between neighbours (ties: to even) and the
    floats one ulp either side, plus values past the largest (clamped): torch's codes."""
    tdt = torch.float8_e5m2 if fp8 == "fp8_e5m2" else torch.float8_e4m3fn
    vals = torch.arange(256, dtype=torch.uint8).view(tdt).float()
    vals = vals[vals.isfinite() & (vals >= 0)].sort().values
    mid = (vals[1:] + vals[:-1]) / 2
    xs = torch.cat(
        [
            vals,
            mid,
            torch.nextafter(mid, torch.tensor(0.0)),
            torch.nextafter(mid, torch.tensor(1e9)),
            vals[-1:] * 1.1,
            vals[-1:] * 2,
        ]
    )
    xs = torch.cat([xs, -xs])
    d = 64
    xs = torch.cat([xs, xs[: (-len(xs)) % d]])
    rows = xs.view(-1, 1, d)
    kq = make_quant(fp8, "fp8_per_tensor", d, scales=(1.0, 1.0))
    n = rows.shape[0]
    slots = torch.arange(n)
    want = quant_caches(kq, None, 1, n, 1, device=torch.device("cpu"))
    reshape_and_cache(rows, rows, *want, slots, kv_quant=kq)
    got = quant_caches(kq, None, 1, n, 1)
    reshape_and_cache_triton(rows.to(DEVICE), rows.to(DEVICE), *got, slots.to(DEVICE), kq)
    assert torch.equal(got[0].cpu(), want[0]), (got[0].cpu() != want[0]).sum()


def quant_batch(
    fmt: tuple[str, str],
    *,
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_size: int,
    head_size_v: int | None,
    layout: str | None,
    dtype: torch.dtype,
    seed: int,
) -> tuple[PagedBatch, KVQuant]:
    """A random mixed batch over a quantized cache: the cached context is written by the
    torch codec, this step's tokens by ``reshape_and_cache_triton`` (with padding rows whose
    slot is -1 and whose values would ruin any row they reached). The batch's dense K/V are
    the dequantized values (what the kernel must attend over); the cache's other bytes are
    random."""
    dv = head_size if head_size_v is None else head_size_v
    kq = make_quant(*fmt, head_size=head_size, head_size_v=dv, scales=(0.02, 0.011))
    f = kq.fmt
    base = make_paged_batch(
        seq_lens,
        query_lens,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_size=head_size,
        dtype=torch.float32,
        layout=None,
        shared_prefix=False,
        seed=seed,
        head_size_v=head_size_v,
    )
    gen = torch.Generator().manual_seed(seed)

    def spread(x: torch.Tensor) -> torch.Tensor:  # per-token magnitudes 0.2..3.2
        return x * (0.2 + 3 * torch.rand(x.shape[0], num_kv_heads, 1, generator=gen))

    keys, values = [spread(k) for k in base.keys], [spread(v) for v in base.values]
    kc, vc = quant_caches(
        kq, layout, base.key_cache.shape[0], block_size, num_kv_heads, random_seed=seed
    )
    table = base.md.block_table
    ctx, new = ([], [], []), ([], [], [])
    for i, (n, lq) in enumerate(zip(seq_lens, query_lens, strict=True)):
        for p in range(n):
            dst = ctx if p < n - lq else new
            dst[0].append(int(table[i, p // block_size]) * block_size + p % block_size)
            dst[1].append(keys[i][p])
            dst[2].append(values[i][p])
    if ctx[0]:
        reshape_and_cache(
            torch.stack(ctx[1]).to(DEVICE),
            torch.stack(ctx[2]).to(DEVICE),
            kc,
            vc,
            torch.tensor(ctx[0], device=DEVICE),
            kv_quant=kq,
        )
    pad_k = torch.full((num_kv_heads, head_size), 1e4)
    pad_v = torch.full((num_kv_heads, dv), -1e4)
    for at in (0, len(new[0]) // 2, len(new[0])):  # padding tokens before, inside, after
        new[0].insert(at, -1)
        new[1].insert(at, pad_k)
        new[2].insert(at, pad_v)
    reshape_and_cache_triton(
        torch.stack(new[1]).to(DEVICE),
        torch.stack(new[2]).to(DEVICE),
        kc,
        vc,
        torch.tensor(new[0], device=DEVICE),
        kq,
    )
    deq_k = [
        dequantize_part(quantize_part(k, f, kq.k_scale, f.k_bytes), f, head_size, kq.k_scale)
        for k in keys
    ]
    deq_v = [
        dequantize_part(quantize_part(v, f, kq.v_scale, f.v_bytes), f, dv, kq.v_scale)
        for v in values
    ]
    batch = dataclasses.replace(
        base,
        query=base.query.to(dtype),
        keys=deq_k,
        values=deq_v,
        key_cache=kc,
        value_cache=vc,
        md=base.md,
    )
    return batch, kq


# Mixed steps: decodes, a whole prompt, a chunk after cached context.
CONFIGS = [
    dict(
        seq_lens=[50, 12, 40, 5],
        query_lens=[1, 12, 9, 1],
        block_size=16,
        num_kv_heads=2,
        group=4,
        head_size=64,
        head_size_v=None,
        layout="LBHNC",
        window=24,
        cap=None,
        splits=None,
    ),
    dict(
        seq_lens=[70, 9, 3],
        query_lens=[1, 9, 3],
        block_size=32,
        num_kv_heads=1,
        group=3,
        head_size=64,
        head_size_v=32,
        layout=None,
        window=None,
        cap=5.0,
        splits=4,
    ),
]


@pytest.mark.parametrize("config", [0, 1])
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.slow
def test_attention_over_quantized_cache_matches_dequantized_reference(
    fmt: tuple[str, str], config: int
) -> None:
    """One launch over a quantized cache (mixed prefill with context + decodes, GQA, block
    sizes 16/32, random block tables, a window or a soft cap, split-KV) equals the float64
    reference on the dequantized values. Query dtypes cycle fp32/bf16/fp16."""
    c = dict(CONFIGS[config])
    window, cap, splits, layout = c.pop("window"), c.pop("cap"), c.pop("splits"), c["layout"]
    dtype = [torch.float32, torch.bfloat16, torch.float16][(FORMATS.index(fmt) + config) % 3]
    batch, kq = quant_batch(fmt, dtype=dtype, seed=10 * FORMATS.index(fmt) + config, **c)
    assert layout is None or not batch.key_cache.is_contiguous()
    scale = c["head_size"] ** -0.5
    out = paged_attention_triton(
        batch.query.to(DEVICE),
        batch.key_cache,
        batch.value_cache,
        on_device(batch.md),
        scale,
        window,
        cap,
        splits,
        kv_quant=kq,
    )
    ref = batch.reference(scale, window, cap)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.cpu().double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.slow
def test_window_of_one_reads_back_the_dequantized_values_exactly() -> None:
    """With a window of 1 each query sees only its own key (probability exactly 1), so the
    output is that token's V as the kernel decodes it: bit-equal to ``dequantize_part``
    for every format (catches any scale or zero-point bit the tolerance tests would miss).
    Head sizes 80/48: padded lanes, five INT4 groups of 16."""
    for i, fmt in enumerate(FORMATS):
        batch, kq = quant_batch(
            fmt,
            seq_lens=[21, 6],
            query_lens=[1, 6],
            block_size=16,
            num_kv_heads=1,
            group=2,
            head_size=80,
            head_size_v=48,
            layout="BLNHC",
            dtype=torch.float32,
            seed=50 + i,
        )
        out = paged_attention_triton(
            batch.query.to(DEVICE),
            batch.key_cache,
            batch.value_cache,
            on_device(batch.md),
            0.1,
            sliding_window=1,
            kv_quant=kq,
        )
        own = torch.cat([batch.values[0][-1:], batch.values[1]]).repeat_interleave(2, 1)
        assert torch.equal(out.cpu(), own), FORMAT_IDS[i]


@pytest.mark.slow
def test_dispatch_recipe_with_rotation_matches_torch_path() -> None:
    """The call sequence the CUDA dispatch uses (``KVQuant.prepare`` rotates K/V, then the
    Triton write; rotate the query, Triton attention, rotate back) gives the torch path's
    cache bytes and, within float32 rounding, its attention output."""
    kq = make_quant("int4", "int4_per_token_group", 64, rotation="hadamard")
    base = make_paged_batch(
        [24, 9],
        [1, 9],
        block_size=16,
        num_kv_heads=2,
        group=2,
        head_size=64,
        dtype=torch.float32,
        layout=None,
        shared_prefix=False,
        seed=8,
    )
    md = base.md
    key, value = torch.cat(base.keys), torch.cat(base.values)
    slots = torch.tensor(
        [
            int(md.block_table[i, p // 16]) * 16 + p % 16
            for i, n in enumerate(md.seq_lens_cpu)
            for p in range(n)
        ]
    )
    nb = base.key_cache.shape[0]
    want = quant_caches(kq, "LBNHC", nb, 16, 2, device=torch.device("cpu"))
    reshape_and_cache(key, value, *want, slots, kv_quant=kq)  # rotates, quantizes
    ref = paged_attention(base.query, *want, md, 0.125, kv_quant=kq)  # the torch path
    # The recipe, on DEVICE (KVQuant's rotation is a CPU tensor: move it as the engine would).
    kq.rotation = kq.rotation.to(DEVICE)
    got = quant_caches(kq, "LBNHC", nb, 16, 2)
    key, value = kq.prepare(key.to(DEVICE), value.to(DEVICE))
    reshape_and_cache_triton(key, value, *got, slots.to(DEVICE), kq)
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))
    query = base.query.to(DEVICE)
    out = paged_attention_triton(kq.rotate(query), *got, on_device(md), 0.125, kv_quant=kq)
    out = kq.unrotate(out).to(query.dtype)
    torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=2e-5)


def test_rejects_caches_that_do_not_match_the_format() -> None:
    kq = make_quant("int8", "int8_per_token_head", 16)
    kc, vc = quant_caches(kq, None, 2, 16, 1)
    key = torch.zeros(1, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="uint8"):
        reshape_and_cache_triton(
            key, key, kc.float(), vc.float(), torch.zeros(1, dtype=torch.long, device=DEVICE), kq
        )
    with pytest.raises(ValueError, match="bytes"):
        reshape_and_cache_triton(
            key, key, kc[..., :16], vc, torch.zeros(1, dtype=torch.long, device=DEVICE), kq
        )


@pytest.mark.slow
def test_quantized_kernels_compile_for_cuda_without_a_gpu() -> None:
    """Triton's whole pipeline down to sm_80 and sm_90 cubins for every format's write kernel
    and a prefill (bf16) and split-KV decode (fp16) attention variant: what the interpreter
    cannot check (types, layouts, shared memory)."""
    code = r"""
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from pagedkv.ops.triton.compile_check import MAX_SHARED_BYTES, _source
from pagedkv.ops.triton.reshape_and_cache import _reshape_and_cache_kvq
from pagedkv.ops.triton.unified_attention import _unified_attention_kvq, tiling
fails = []
for arch, mode, g, e5 in [(90, 1, 128, False), (80, 1, 128, True), (90, 2, 128, False),
                          (80, 3, 128, False), (90, 4, 128, False), (80, 5, 32, False),
                          (90, 6, 128, False), (80, 7, 128, False)]:
    dt, dot, segs, qlen = [("bf16", tl.bfloat16, 1, 512), ("fp16", tl.float16, 16, 1)][mode % 2]
    types = dict(out_ptr=f"*{dt}", q_ptr=f"*{dt}", k_ptr="*u8", v_ptr="*u8",
                 block_table_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32",
                 segm_out_ptr="*fp32", segm_max_ptr="*fp32", segm_expsum_ptr="*fp32",
                 scale="fp32", softcap="fp32", k_scale="fp32", v_scale="fp32")
    block_m, tile = tiling(4, qlen, 256)
    consts = dict(NUM_Q_HEADS=32, GROUP=4, HEAD_SIZE=128, HEAD_SIZE_V=128, HEAD_PAD=128,
                  HEAD_PAD_V=128, BLOCK_SIZE=16, TILE_SIZE=tile, BLOCK_Q=block_m // 4,
                  BLOCK_M=block_m, SLIDING_WINDOW=64 * (mode % 2), USE_SOFTCAP=mode == 3,
                  NUM_SEGMENTS=segs, DOT_DTYPE=dot, DOT_PREC="tf32", KV_MODE=mode, K_GROUP=g,
                  V_GROUP=g, E5M2=e5)
    wtypes = dict(key_ptr="*bf16", value_ptr="*bf16", key_cache_ptr="*u8",
                  value_cache_ptr="*u8", slot_mapping_ptr="*i64", k_scale="fp32", v_scale="fp32")
    wconsts = dict(BLOCK_SIZE=16, HEAD_SIZE=128, HEAD_SIZE_V=128, HEAD_PAD=128, HEAD_PAD_V=128,
                   KV_MODE=mode, K_GROUP=g, V_GROUP=g, K_NG_PAD=128 // g, V_NG_PAD=128 // g,
                   K_HG_PAD=g // 2, V_HG_PAD=g // 2, E5M2=e5, FP8_MAX=57344.0 if e5 else 448.0)
    for name, src in (("attention", _source(_unified_attention_kvq, types, consts)),
                      ("write", _source(_reshape_and_cache_kvq, wtypes, wconsts))):
        try:
            shared = triton.compile(src, target=GPUTarget("cuda", arch, 32)).metadata.shared
            if shared > MAX_SHARED_BYTES:
                fails.append(f"{name} mode {mode}: {shared} bytes of shared memory")
        except Exception as e:
            fails.append(f"{name} mode {mode} sm_{arch}: {e!r}"[:2000])
print(fails)
print(len(fails), "failures")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert res.returncode == 0 and "0 failures" in res.stdout, res.stdout + res.stderr
