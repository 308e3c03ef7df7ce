"""KV cache specs: exact page sizes per dtype/quant mode, memory bounds, merging and grouping."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.core.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    cdiv,
    get_kv_cache_groups,
    resolve_kv_cache_dtype,
    unify_kv_cache_spec_page_size,
)

ELEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1}


def full(
    bs: int = 16, h: int = 4, hs: int = 64, dtype: str = "bfloat16", **kw
) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=h, head_size=hs, dtype=dtype, **kw)


def swa(
    sw: int = 128, bs: int = 16, h: int = 4, hs: int = 64, dtype: str = "bfloat16"
) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=bs, num_kv_heads=h, head_size=hs, dtype=dtype, sliding_window=sw
    )


# ---------------------------------------------------------------- page sizes


@pytest.mark.parametrize("dtype", list(ELEM_BYTES))
@pytest.mark.parametrize("bs,h,hs", [(16, 3, 64), (1, 1, 128), (32, 8, 80)])
def test_dense_page_is_2_bs_h_hs_dtype(dtype: str, bs: int, h: int, hs: int) -> None:
    spec = full(bs, h, hs, dtype)
    assert spec.page_size_bytes == 2 * bs * h * hs * ELEM_BYTES[dtype]
    assert spec.bytes_per_token * bs == spec.page_size_bytes


def test_fp8_per_tensor_scale_lives_outside_the_page() -> None:
    a = full(dtype="fp8", kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    b = full(dtype="fp8")
    assert a.page_size_bytes == b.page_size_bytes == 2 * 16 * 4 * 64


@pytest.mark.parametrize(
    "mode,dtype",
    [(KVQuantMode.INT8_PER_TOKEN_HEAD, "int8"), (KVQuantMode.FP8_PER_TOKEN_HEAD, "fp8")],
)
def test_per_token_head_adds_two_fp32_scales_per_token_head(mode: KVQuantMode, dtype: str) -> None:
    spec = full(bs=16, h=3, hs=64, dtype=dtype, kv_quant_mode=mode)
    assert spec.content_bytes == 64 + 64 + 8
    assert spec.page_size_bytes == 16 * 3 * (128 + 8)


@pytest.mark.parametrize(
    "mode,dtype",
    [(KVQuantMode.INT8_PER_TOKEN_HEAD_F16, "int8"), (KVQuantMode.FP8_PER_TOKEN_HEAD_F16, "fp8")],
)
def test_per_token_head_f16_adds_two_fp16_scales_per_token_head(
    mode: KVQuantMode, dtype: str
) -> None:
    """pagedkv's *_f16 formats: 132 bytes a token-head at head size 64, 1.94x fewer than bf16's
    256 (vLLM's fp32 scales: 136, 1.88x)."""
    spec = full(bs=16, h=3, hs=64, dtype=dtype, kv_quant_mode=mode)
    assert spec.content_bytes == 64 + 64 + 4
    assert spec.page_size_bytes == 16 * 3 * 132
    assert full(bs=16, h=3, hs=64, dtype="bfloat16").page_size_bytes / spec.page_size_bytes > 1.93


@pytest.mark.parametrize(
    "hs,hs_v,content", [(64, 64, 64 + 8), (3, 2, 3 + 8), (5, 5, 6 + 8), (1, 0, 1 + 8)]
)
def test_int4_packs_two_values_per_byte_rounding_up(hs: int, hs_v: int, content: int) -> None:
    """Each part (K, V) packs its own values and is byte-aligned: part = ceil(d/2) + 4."""
    spec = AttentionSpec(
        block_size=8,
        num_kv_heads=2,
        head_size=hs,
        head_size_v=hs_v,
        dtype="int4",
        kv_quant_mode=KVQuantMode.INT4_PER_TOKEN_HEAD,
    )
    assert spec.content_bytes == content == math.ceil(hs / 2) + math.ceil(hs_v / 2) + 8
    assert (spec.k_part_bytes, spec.v_part_bytes) == (
        math.ceil(hs / 2) + 4,
        math.ceil(hs_v / 2) + 4,
    )
    assert spec.page_size_bytes == 8 * 2 * content


@pytest.mark.parametrize(
    "hs,content",
    [
        (64, 32 + 4 * 2 + 32 + 2),
        (128, 64 + 8 * 2 + 64 + 2),
        (80, 40 + 5 * 2 + 40 + 2),
        (24, 12 + 2 + 12 + 2),
    ],
)
def test_int4_per_token_group_one_fp16_scale_per_group(hs: int, content: int) -> None:
    """K in groups of 16 (else the whole head), V in one group; one fp16 scale each."""
    spec = AttentionSpec(
        block_size=16,
        num_kv_heads=3,
        head_size=hs,
        dtype="int4",
        kv_quant_mode=KVQuantMode.INT4_PER_TOKEN_GROUP,
    )
    assert spec.content_bytes == content
    assert spec.page_size_bytes == 16 * 3 * content


def test_kv_format_names_dtype_mode_and_rotation() -> None:
    a = full(dtype="int4", kv_quant_mode=KVQuantMode.INT4_PER_TOKEN_GROUP, kv_rotation="hadamard")
    assert a.kv_format == "int4:int4_per_token_group:hadamard"
    assert full(dtype="bfloat16").kv_format == "bfloat16:none"
    with pytest.raises(ValueError, match="kv_rotation"):
        full(kv_rotation="fourier")


def test_distinct_v_head_size() -> None:
    spec = full(bs=16, h=2, hs=192, head_size_v=128, dtype="float16")
    assert spec.page_size_bytes == 16 * 2 * (192 + 128) * 2


def test_mla_one_latent_no_v() -> None:
    spec = MLAAttentionSpec(block_size=16, head_size=576, dtype="bfloat16")
    assert spec.bytes_per_token == 1152
    assert spec.page_size_bytes == 16 * 1152
    q = MLAAttentionSpec(
        block_size=16, head_size=576, dtype="fp8", kv_quant_mode="fp8_per_token_head"
    )
    assert q.bytes_per_token == 576 + 8
    with pytest.raises(ValueError):
        MLAAttentionSpec(block_size=16, head_size=576, num_kv_heads=2, dtype="bfloat16")


def test_quant_mode_must_match_storage_dtype() -> None:
    with pytest.raises(ValueError):
        full(dtype="float16", kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD)
    with pytest.raises(ValueError):
        full(dtype="int8", kv_quant_mode=KVQuantMode.INT4_PER_TOKEN_HEAD)


def test_page_size_padded_overrides_and_is_validated() -> None:
    real = full().page_size_bytes
    assert full(page_size_padded=real + 100).page_size_bytes == real + 100
    with pytest.raises(ValueError):
        full(page_size_padded=real - 1)


def test_dtype_aliases_normalize_and_unknown_rejected() -> None:
    assert full(dtype="bf16") == full(dtype="torch.bfloat16") == full(dtype="bfloat16")
    with pytest.raises(ValueError):
        full(dtype="float7")


@settings(max_examples=200, deadline=None)
@given(
    bs=st.integers(1, 64),
    h=st.integers(1, 16),
    hs=st.integers(1, 256),
    mode=st.sampled_from(list(KVQuantMode)),
)
def test_page_formula_property(bs: int, h: int, hs: int, mode: KVQuantMode) -> None:
    dtype = mode.storage_dtype or "float16"
    bits = {"float16": 16, "fp8": 8, "int8": 8, "int4": 4, "int3": 3, "int2": 2}[dtype]
    if bits in (3, 2) and hs * bits % 8:  # int3 packs 8 values in 3 bytes, int2 4 in one
        with pytest.raises(ValueError, match="whole bytes"):
            full(bs, h, hs, dtype, kv_quant_mode=mode)
        return
    if mode.is_kivi and hs % bs:  # a block's channel scales are spread over its tokens
        with pytest.raises(ValueError, match="must divide"):
            full(bs, h, hs, dtype, kv_quant_mode=mode)
        return
    spec = full(bs, h, hs, dtype, kv_quant_mode=mode)
    if mode.is_kivi:  # K: codes + hs / bs channel scales; V: int3 one scale, int2 groups of 32
        g = 32 if mode is KVQuantMode.INT2_KIVI and hs % 32 == 0 else hs
        content = 2 * (hs * bits // 8) + 2 * (hs // bs) + 2 * (hs // g)
    elif bits in (3, 2):
        g = 32 if hs % 32 == 0 else hs
        content = 2 * (hs * bits // 8 + 2 * (hs // g))
    elif "per_token_head" in mode.value:
        content = 2 * (-(-(hs * bits) // 8) + (2 if mode.value.endswith("_f16") else 4))
    elif mode is KVQuantMode.INT4_PER_TOKEN_GROUP:
        g = 16 if hs % 16 == 0 else hs
        content = 2 * -(-hs // 2) + 2 * (hs // g) + 2
    else:
        content = -(-(2 * hs * bits) // 8)
    assert spec.page_size_bytes == bs * h * content


# ---------------------------------------------------------------- memory bounds


def test_full_attention_max_memory() -> None:
    s = full(bs=16)
    assert s.max_memory_usage_bytes(100) == 7 * s.page_size_bytes
    assert s.max_memory_usage_bytes(96, max_num_batched_tokens=4096) == 6 * s.page_size_bytes
    assert s.max_num_blocks_per_req(97) == 7


def test_sliding_window_max_memory() -> None:
    s = swa(sw=128, bs=16)
    p = s.page_size_bytes
    # (cdiv(min(sw - 1 + batched, max_len), bs) + 1) * page
    assert s.max_memory_usage_bytes(10_000) == (cdiv(127, 16) + 1) * p == 9 * p
    assert s.max_memory_usage_bytes(10_000, 64) == (cdiv(191, 16) + 1) * p == 13 * p
    assert s.max_memory_usage_bytes(50) == (cdiv(50, 16) + 1) * p == 5 * p


def test_chunked_local_max_memory() -> None:
    s = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype="float16", attention_chunk_size=256
    )
    p = s.page_size_bytes
    assert s.max_memory_usage_bytes(10_000, 32) == cdiv(288, 16) * p
    assert s.max_memory_usage_bytes(100, 32) == cdiv(100, 16) * p


def test_mamba_page_and_memory() -> None:
    s = MambaSpec(block_size=1024, shapes=((3, 512), (8, 64, 16)), dtypes=("bfloat16", "float32"))
    assert s.page_size_bytes == 3 * 512 * 2 + 8 * 64 * 16 * 4
    assert s.max_memory_usage_bytes(1_000_000) == s.page_size_bytes
    assert (
        dataclasses.replace(s, mamba_cache_mode="align").max_memory_usage_bytes(10)
        == 2 * s.page_size_bytes
    )
    assert (
        dataclasses.replace(s, num_speculative_blocks=2).max_memory_usage_bytes(10)
        == 3 * s.page_size_bytes
    )
    with pytest.raises(ValueError):
        MambaSpec(block_size=16, shapes=((2,),), dtypes=("float32", "float32"))


def test_cross_attention_sized_by_encoder() -> None:
    s = CrossAttentionSpec(
        block_size=16,
        num_kv_heads=2,
        head_size=64,
        dtype="float16",
        max_num_encoder_input_tokens=1500,
    )
    assert (
        s.max_memory_usage_bytes(10)
        == s.max_memory_usage_bytes(100_000)
        == cdiv(1500, 16) * s.page_size_bytes
    )


def test_kinds() -> None:
    assert full().kind == "full_attention"
    assert swa().kind == "sliding_window"
    assert MLAAttentionSpec(block_size=16, head_size=576, dtype="bfloat16").kind == "mla_attention"
    assert MambaSpec(block_size=16, shapes=((1,),), dtypes=("float32",)).kind == "mamba"
    assert (
        ChunkedLocalAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=8, dtype="float16", attention_chunk_size=64
        ).kind
        == "chunked_local_attention"
    )
    assert (
        CrossAttentionSpec(
            block_size=16,
            num_kv_heads=1,
            head_size=8,
            dtype="float16",
            max_num_encoder_input_tokens=8,
        ).kind
        == "cross_attention"
    )


# ---------------------------------------------------------------- merge


def test_merge_equal_and_unequal() -> None:
    assert KVCacheSpec.merge([full(), full()]) == full()
    with pytest.raises(ValueError):
        KVCacheSpec.merge([full(), full(h=8)])
    with pytest.raises(ValueError):
        FullAttentionSpec.merge([full(), swa()])


def test_full_attention_merge_keeps_one_promoted_window() -> None:
    merged = FullAttentionSpec.merge([full(), full(sliding_window=128), full()])
    assert merged == full(sliding_window=128)
    with pytest.raises(ValueError):
        FullAttentionSpec.merge([full(sliding_window=64), full(sliding_window=128)])


def test_specs_are_frozen_and_hashable() -> None:
    s = full()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.block_size = 32  # type: ignore[misc]
    assert len({full(), full(), swa()}) == 2


# ---------------------------------------------------------------- grouping


def names(groups) -> list[tuple[str, list[int]]]:
    return [(g.kv_cache_spec.kind, [int(n.split(".")[1]) for n in g.layer_names]) for g in groups]


def layers(kinds: str) -> dict:
    """'FFSSSS' → layers 1.. with full / sliding specs of equal page size."""
    return {f"layer.{i}": full() if k == "F" else swa() for i, k in enumerate(kinds, start=1)}


def test_groups_empty_and_uniform() -> None:
    assert get_kv_cache_groups({}) == []
    groups = get_kv_cache_groups({f"layer.{i}": full() for i in range(5)})
    assert (
        len(groups) == 1 and len(groups[0].layer_names) == 5 and groups[0].kv_cache_spec == full()
    )


def test_groups_2_full_4_swa() -> None:
    assert names(get_kv_cache_groups(layers("FFSSSS"))) == [
        ("full_attention", [1, 2]),
        ("sliding_window", [3, 5]),
        ("sliding_window", [4, 6]),
    ]


def test_groups_3_full_7_swa() -> None:
    assert names(get_kv_cache_groups(layers("FFFSSSSSSS"))) == [
        ("full_attention", [1, 2, 3]),
        ("sliding_window", [4, 7, 10]),
        ("sliding_window", [5, 8]),
        ("sliding_window", [6, 9]),
    ]


def test_groups_close_counts_use_one_group_per_type() -> None:
    # max (5) < 1.5 * min (4) → group_size = 5: one group per type.
    assert names(get_kv_cache_groups(layers("FSFSFSFSS"))) == [
        ("full_attention", [1, 3, 5, 7]),
        ("sliding_window", [2, 4, 6, 8, 9]),
    ]


def test_groups_cover_every_layer_once() -> None:
    specs = layers("FSSSSSFSSSSSFSSSSS")
    groups = get_kv_cache_groups(specs)
    flat = [n for g in groups for n in g.layer_names]
    assert sorted(flat) == sorted(specs) and len(flat) == len(set(flat))
    assert all(specs[n] == g.kv_cache_spec for g in groups for n in g.layer_names)


def test_unify_scales_block_size_of_smaller_pages() -> None:
    specs = {"a": full(h=4), "b": swa(h=2), "c": swa(h=1)}
    out = unify_kv_cache_spec_page_size(specs)
    assert {s.page_size_bytes for s in out.values()} == {full(h=4).page_size_bytes}
    assert out["a"].block_size == 16 and out["b"].block_size == 32 and out["c"].block_size == 64
    # Bytes per token are unchanged: only tokens per block grew.
    assert [out[k].bytes_per_token for k in "abc"] == [specs[k].bytes_per_token for k in "abc"]
    groups = get_kv_cache_groups(specs)
    assert len({g.kv_cache_spec.page_size_bytes for g in groups}) == 1


def test_unify_rejects_non_integer_ratio() -> None:
    with pytest.raises(NotImplementedError, match="does not divide"):
        get_kv_cache_groups({"a": full(h=3), "b": swa(h=2)})


def test_unify_pads_small_mamba_pages() -> None:
    m = MambaSpec(block_size=16, shapes=((10, 10),), dtypes=("float32",))
    out = unify_kv_cache_spec_page_size({"attn": full(), "mamba": m})
    assert out["attn"] == full()
    assert out["mamba"].page_size_bytes == full().page_size_bytes
    assert out["mamba"].real_page_size_bytes == 400


def test_unify_grows_attention_blocks_for_large_mamba_state() -> None:
    page = full().page_size_bytes  # 16 * 4 * 128 * 2 = 16384
    m = MambaSpec(block_size=16, shapes=((page * 2 + 1,),), dtypes=("int8",))
    out = unify_kv_cache_spec_page_size({"attn": full(), "mamba": m})
    assert out["attn"].block_size == 16 * 3  # smallest integer factor holding the state
    assert out["attn"].page_size_bytes == out["mamba"].page_size_bytes == 3 * page


# ---------------------------------------------------------------- dtype resolution


@pytest.mark.parametrize(
    "kv,mode,want",
    [
        ("auto", None, ("bfloat16", KVQuantMode.NONE)),
        ("float32", None, ("float32", KVQuantMode.NONE)),
        ("fp8", None, ("fp8", KVQuantMode.FP8_PER_TENSOR)),
        ("fp8", "fp8_per_token_head", ("fp8", KVQuantMode.FP8_PER_TOKEN_HEAD)),
        ("int8", None, ("int8", KVQuantMode.INT8_PER_TOKEN_HEAD_F16)),
        ("int8_per_token_head_f16", None, ("int8", KVQuantMode.INT8_PER_TOKEN_HEAD_F16)),
        ("fp8_per_token_head_f16", None, ("fp8", KVQuantMode.FP8_PER_TOKEN_HEAD_F16)),
        ("int4", None, ("int4", KVQuantMode.INT4_PER_TOKEN_GROUP)),
        ("int8_per_token_head", None, ("int8", KVQuantMode.INT8_PER_TOKEN_HEAD)),
        ("auto", KVQuantMode.INT4_PER_TOKEN_HEAD, ("int4", KVQuantMode.INT4_PER_TOKEN_HEAD)),
    ],
)
def test_resolve_kv_cache_dtype(kv: str, mode, want) -> None:
    assert resolve_kv_cache_dtype(kv, "bfloat16", mode) == want


def test_resolve_conflict_raises() -> None:
    with pytest.raises(ValueError):
        resolve_kv_cache_dtype("int8_per_token_head", "bfloat16", "int4_per_token_head")


def test_core_imports_nothing_heavy() -> None:
    code = (
        "import sys, pagedkv.core.specs, pagedkv.core.layout, pagedkv.core.planning; "
        "bad = [m for m in ('torch', 'numpy', 'gguf') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "kv_cache_dtype,kv_rotation,want",
    [
        ("int4", None, "hadamard"),
        ("int8", None, "hadamard"),
        ("int4", "none", None),
        ("int8_per_token_head", None, None),
        ("int4_per_token_group", None, None),
        ("fp8", "hadamard", "hadamard"),
        ("auto", None, None),
    ],
)
def test_shortcuts_imply_the_rotation_explicit_modes_do_not(
    kv_cache_dtype, kv_rotation, want
) -> None:
    from pagedkv.core.specs import resolve_kv_rotation

    assert resolve_kv_rotation(kv_cache_dtype, kv_rotation) == want
