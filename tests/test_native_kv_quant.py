"""The native decode kernel over quantized KV caches (issue 14): codes read in place.

Every quantized format is checked against the same codes dequantized by the torch codec
(``kv_quant.dequantize_part``) and a float64 dense reference, and against ``paged_attention``'s
torch path (gather → dequantize → dense attention): both read the same bytes, so the
tolerance is float32's. Both builds run: this machine's (AVX-512 here) and the portable C path.
"""

from __future__ import annotations

import random

import pytest
import torch
from ref_attention import ref_attention
from test_native import kernels  # noqa: F401 (a fixture: this build and the portable C path)

from pagedkv.core.specs import AttentionSpec, KVQuantMode
from pagedkv.ops import native
from pagedkv.ops.attention import paged_attention
from pagedkv.ops.kv_cache import allocate_kv_cache
from pagedkv.ops.kv_quant import KVQuant, dequantize_part, quantize_part
from pagedkv.ops.metadata import AttentionMetadata

pytestmark = pytest.mark.skipif(
    not native.available(), reason="no C compiler: native kernels unavailable"
)

# (mode, storage dtype) of every format the kernel reads.
FORMATS = [
    (KVQuantMode.INT8_PER_TOKEN_HEAD, "int8"),
    (KVQuantMode.FP8_PER_TOKEN_HEAD, "fp8"),
    (KVQuantMode.FP8_PER_TENSOR, "fp8"),
    (KVQuantMode.FP8_PER_TENSOR, "fp8_e5m2"),
    (KVQuantMode.INT4_PER_TOKEN_HEAD, "int4"),
    (KVQuantMode.INT4_PER_TOKEN_GROUP, "int4"),
    (KVQuantMode.INT8_PER_TOKEN_HEAD_F16, "int8"),
    (KVQuantMode.FP8_PER_TOKEN_HEAD_F16, "fp8"),
    (KVQuantMode.INT3_PER_TOKEN_GROUP, "int3"),
    (KVQuantMode.INT2_PER_TOKEN_GROUP, "int2"),
]
FORMAT_IDS = [f"{m.value}-{d}" for m, d in FORMATS]


def quant_batch(
    mode: KVQuantMode,
    dtype: str,
    lens: list[int],
    *,
    bs: int,
    hkv: int,
    group: int,
    d: int,
    layout: str | None,
    seed: int,
    tensor_scales: tuple[float, float] = (0.05, 0.08),
):
    """Random decode rows over a quantized paged cache.

    Returns ``(kv_quant, query [R, Hq, D], key_cache, value_cache (uint8 parts), md, keys,
    values)`` where ``keys[r]``/``values[r]`` are row r's K/V as the torch codec dequantizes the
    stored codes (float32 ``[len, Hkv, D]``). Blocks are a shuffled pool (block 0 = null);
    unused slots hold quantized garbage, so a key read past a row's end shows up.
    """
    gen = torch.Generator().manual_seed(seed)
    spec = AttentionSpec(
        block_size=bs, num_kv_heads=hkv, head_size=d, dtype=dtype, kv_quant_mode=mode
    )
    kvq = KVQuant.for_spec(spec)
    if mode is KVQuantMode.FP8_PER_TENSOR:
        kvq.k_scale, kvq.v_scale = tensor_scales
    fmt = kvq.fmt
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + 3
    if layout is None:
        kc = torch.empty(nb, bs, hkv, fmt.k_bytes, dtype=torch.uint8)
        vc = torch.empty(nb, bs, hkv, fmt.v_bytes, dtype=torch.uint8)
    else:
        _, views = allocate_kv_cache(
            layout, 1, nb, bs, hkv, fmt.k_bytes, torch.uint8, head_size_v=fmt.v_bytes
        )
        kc, vc = views[0]
    # Channels of different magnitudes (and an offset), like real K: int4 zero points vary.
    chan = torch.rand(d, generator=gen) * 3 + 0.1
    kf = torch.randn(nb, bs, hkv, d, generator=gen) * chan + torch.randn(d, generator=gen)
    vf = torch.randn(nb, bs, hkv, d, generator=gen) * 2
    kc.copy_(quantize_part(kf, fmt, kvq.k_scale, fmt.k_bytes))
    vc.copy_(quantize_part(vf, fmt, kvq.v_scale, fmt.v_bytes))
    kd = dequantize_part(kc, fmt, d, kvq.k_scale)  # [NB, BS, Hkv, D] float32
    vd = dequantize_part(vc, fmt, d, kvq.v_scale)
    rnd = random.Random(seed)
    free = list(range(1, nb))
    rnd.shuffle(free)
    table = torch.zeros(len(lens), max(need) + rnd.randint(0, 2), dtype=torch.int32)
    keys, values = [], []
    for r, n in enumerate(lens):
        ids = [free.pop() for _ in range(need[r])]
        table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(n)
        blk = table[r, pos // bs].long()
        keys.append(kd[blk, pos % bs])
        values.append(vd[blk, pos % bs])
    query = torch.randn(len(lens), hkv * group, d, generator=gen)
    qsl = list(range(len(lens) + 1))
    md = AttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=table,
        block_size=bs,
        max_query_len=1,
        max_seq_len=max(lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(lens),
    )
    return kvq, query, kc, vc, md, keys, values


def reference(
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    scale: float,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(out [R, Hq, D], lse [R, Hq])`` over the dequantized K/V of each row."""
    outs = [
        ref_attention(query[r : r + 1], keys[r], values[r], scale, window) for r in range(len(keys))
    ]
    return torch.cat([o for o, _ in outs]), torch.cat([lse for _, lse in outs])


@pytest.mark.parametrize("mode,dtype", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize(
    "bs,hkv,group,d,layout,window",
    [
        (16, 3, 3, 64, "LBNHC", None),  # SmolLM2's geometry
        (1, 2, 4, 128, None, 50),  # block size 1, separate K/V caches, a window
        (32, 1, 1, 64, "LBHNC", 7),  # MHA, vLLM's CPU layout, a short window
        (16, 2, 3, 80, "BLNHC", None),  # head size 80: int4 groups of 16, a masked V tail pass
        (8, 1, 3, 72, None, 100),  # head size 72: masked chunks everywhere, one int4 group of 72
        (
            16,
            2,
            2,
            36,
            None,
            None,
        ),  # head size 36: not a multiple of 8 (AVX2: the tile-buffer path)
        (
            16,
            1,
            5,
            48,
            None,
            None,
        ),  # 5 query heads a KV head: AVX2's 3-head then 2-head value passes
    ],
)
def test_quantized_decode_matches_dequantized_reference(
    mode: KVQuantMode,
    dtype: str,
    bs: int,
    hkv: int,
    group: int,
    d: int,
    layout: str | None,
    window: int | None,
    kernels: str,
) -> None:
    lens = [1, 2, 17, 64, 65, 130, 300]
    if mode.value.startswith(("int3", "int2")) and d % 8:
        pytest.skip("int3/int2 parts need a head size that is a multiple of 8")
    kvq, query, kc, vc, md, keys, values = quant_batch(
        mode, dtype, lens, bs=bs, hkv=hkv, group=group, d=d, layout=layout, seed=d + bs + hkv
    )
    scale = d**-0.5
    res = native.paged_decode(
        query, kc, vc, md.block_table, md.seq_lens, scale, window, return_lse=True, kv_quant=kvq
    )
    assert res is not None, "the kernel declined a quantized format it should read"
    out, lse = res
    ref_out, ref_lse = reference(query, keys, values, scale, window)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-5)
    # One row alone: the kernel splits it by (row, KV head) instead of by row.
    one, _ = native.paged_decode(
        query[-1:], kc, vc, md.block_table[-1:], md.seq_lens[-1:], scale, window, kv_quant=kvq
    )
    torch.testing.assert_close(one.double(), ref_out[-1:], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("mode,dtype", FORMATS, ids=FORMAT_IDS)
def test_paged_attention_native_and_torch_paths_agree(
    mode: KVQuantMode, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ``paged_attention`` (Hadamard rotation around the kernel): the decode rows take
    the kernel, and it matches the torch path over the same bytes."""
    kvq, query, kc, vc, md, _, _ = quant_batch(
        mode, dtype, [5, 40, 1, 97], bs=16, hkv=3, group=3, d=64, layout="LBNHC", seed=11
    )
    kvq.rotation = KVQuant.for_spec(
        AttentionSpec(
            block_size=16,
            num_kv_heads=3,
            head_size=64,
            dtype=dtype,
            kv_quant_mode=mode,
            kv_rotation="hadamard",
        )
    ).rotation
    results: list[object] = []
    real = native.paged_decode

    def spy(*a: object, **k: object) -> object:
        results.append(real(*a, **k))  # type: ignore[arg-type]
        return results[-1]

    monkeypatch.setattr(native, "paged_decode", spy)
    with_native = paged_attention(query, kc, vc, md, 0.125, sliding_window=60, kv_quant=kvq)
    assert results and results[-1] is not None, "the decode rows did not take the native kernel"
    monkeypatch.setattr(native, "lib", lambda: None)
    with_torch = paged_attention(query, kc, vc, md, 0.125, sliding_window=60, kv_quant=kvq)
    torch.testing.assert_close(with_native, with_torch, atol=2e-5, rtol=1e-5)


def test_quantized_decode_reads_the_page_in_place() -> None:
    """The kernel reads each (token, head)'s own bytes: changing one stored code (or scale) of
    a visible key changes only the rows that see it."""
    kvq, query, kc, vc, md, _, _ = quant_batch(
        KVQuantMode.INT8_PER_TOKEN_HEAD,
        "int8",
        [20, 20],
        bs=16,
        hkv=1,
        group=2,
        d=64,
        layout=None,
        seed=3,
    )
    before, _ = native.paged_decode(query, kc, vc, md.block_table, md.seq_lens, 0.125, kv_quant=kvq)
    blk = int(md.block_table[1, 1])  # row 1's token 16..19 block
    vc[blk, 2, 0, 64:68] = torch.tensor([1.0]).view(torch.uint8)  # V scale of row 1's token 18
    after, _ = native.paged_decode(query, kc, vc, md.block_table, md.seq_lens, 0.125, kv_quant=kvq)
    assert torch.equal(after[0], before[0]) and not torch.allclose(after[1], before[1])


def test_quantized_decode_declines_what_it_does_not_cover() -> None:
    kvq, query, kc, vc, md, _, _ = quant_batch(
        KVQuantMode.INT8_PER_TOKEN_HEAD,
        "int8",
        [9],
        bs=16,
        hkv=1,
        group=1,
        d=64,
        layout=None,
        seed=0,
    )
    assert (
        native.paged_decode(query, kc[..., :-1], vc, md.block_table, md.seq_lens, 1.0, kv_quant=kvq)
        is None
    )  # not this format's part size
    assert (
        native.paged_decode(
            query,
            kc.view(torch.int8),
            vc.view(torch.int8),
            md.block_table,
            md.seq_lens,
            1.0,
            kv_quant=kvq,
        )
        is None
    )  # not raw bytes
    # Without the format the bytes are no KV dtype the kernel knows.
    assert native.paged_decode(query, kc, vc, md.block_table, md.seq_lens, 1.0) is None
