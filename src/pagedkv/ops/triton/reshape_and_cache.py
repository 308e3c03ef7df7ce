"""Cache writes in Triton (vLLM's ``triton_reshape_and_cache_flash``).

One program per (token, KV head) copies the token's K and V rows of that head to slot
``slot_mapping[t]`` (``block = slot // block_size``, ``offset = slot % block_size``) through
the caches' strides, so every layout of ``allocate_kv_cache`` (and separate caches) works.
Negative slots (padding) are skipped; values are cast to the cache dtype.

A quantized cache (``kv_quant``): the same grid quantizes each (token, head) row in registers
and writes its packed part bytes (values, then inline scales) to the ``uint8`` caches,
byte-identical to ``KVQuant.quantize`` (see ``ops/triton/kv_quant.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.ops.kv_quant import KVQuant
from pagedkv.ops.triton.kv_quant import (
    check_quantized_caches,
    fp8_max,
    kvq_constexprs,
    mode_code,
    quantize_part,
    words_per_group_pad,
)
from pagedkv.ops.triton.utils import pow2


@triton.jit
def _reshape_and_cache(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_kc_b,
    stride_kc_n,
    stride_kc_h,
    stride_vc_b,
    stride_vc_n,
    stride_vc_h,
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_V: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    HEAD_PAD_V: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # padding token: nothing to write
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_d = tl.arange(0, HEAD_PAD)
    offs_dv = tl.arange(0, HEAD_PAD_V)
    d_mask = offs_d < HEAD_SIZE
    dv_mask = offs_dv < HEAD_SIZE_V
    k = tl.load(key_ptr + token * stride_key_t + head * stride_key_h + offs_d, mask=d_mask)
    v = tl.load(value_ptr + token * stride_value_t + head * stride_value_h + offs_dv, mask=dv_mask)
    tl.store(
        key_cache_ptr + blk * stride_kc_b + off * stride_kc_n + head * stride_kc_h + offs_d,
        k.to(key_cache_ptr.dtype.element_ty),
        mask=d_mask,
    )
    tl.store(
        value_cache_ptr + blk * stride_vc_b + off * stride_vc_n + head * stride_vc_h + offs_dv,
        v.to(value_cache_ptr.dtype.element_ty),
        mask=dv_mask,
    )


@triton.jit
def _reshape_and_cache_kvq(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    k_scale,
    v_scale,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_kc_b,
    stride_kc_n,
    stride_kc_h,
    stride_vc_b,
    stride_vc_n,
    stride_vc_h,
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_V: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    HEAD_PAD_V: tl.constexpr,
    KV_MODE: tl.constexpr,
    K_GROUP: tl.constexpr,
    V_GROUP: tl.constexpr,
    K_NG_PAD: tl.constexpr,
    V_NG_PAD: tl.constexpr,
    K_HG_PAD: tl.constexpr,
    V_HG_PAD: tl.constexpr,
    E5M2: tl.constexpr,
    FP8_MAX: tl.constexpr,
    K_WG_PAD: tl.constexpr,
    V_WG_PAD: tl.constexpr,
):
    """``_reshape_and_cache`` into a quantized cache: caches are ``uint8`` parts (strides in
    bytes); ``k_scale``/``v_scale`` are the per-tensor fp8 scales (unused otherwise)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # padding token: nothing to write
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    quantize_part(
        key_ptr + token * stride_key_t + head * stride_key_h,
        key_cache_ptr + blk * stride_kc_b + off * stride_kc_n + head * stride_kc_h,
        k_scale,
        KV_MODE,
        HEAD_SIZE,
        HEAD_PAD,
        K_GROUP,
        K_NG_PAD,
        K_HG_PAD,
        E5M2,
        FP8_MAX,
        K_WG_PAD,
    )
    quantize_part(
        value_ptr + token * stride_value_t + head * stride_value_h,
        value_cache_ptr + blk * stride_vc_b + off * stride_vc_n + head * stride_vc_h,
        v_scale,
        KV_MODE,
        HEAD_SIZE_V,
        HEAD_PAD_V,
        V_GROUP,
        V_NG_PAD,
        V_HG_PAD,
        E5M2,
        FP8_MAX,
        V_WG_PAD,
    )


def reshape_and_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_quant: KVQuant | None = None,
) -> None:
    """``pagedkv.ops.cache.reshape_and_cache``'s contract: ``key [T, Hkv, D]``,
    ``value [T, Hkv, Dv]`` (any strides), caches ``[NB, BS, Hkv, D|Dv]`` with a unit last
    stride, ``slot_mapping [T]`` (negative = skip).

    ``kv_quant`` with a quantized format: the caches are its ``uint8`` parts
    ``[NB, BS, Hkv, k_bytes|v_bytes]`` and receive ``quantize_part``'s bytes of ``key``/
    ``value`` as given — the caller rotates them first (``KVQuant.prepare``) (what
    ``KVQuant.quantize`` does before its codec). A rotation-only ``kv_quant`` changes nothing
    here."""
    num_tokens, num_kv_heads, head_size = key.shape
    head_size_v = value.shape[-1]
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("K/V caches need a unit stride along the head dimension")
    slots = slot_mapping.to(device=key_cache.device, dtype=torch.int64)
    if mode_code(kv_quant):
        check_quantized_caches(kv_quant, key_cache, value_cache)
        c = kvq_constexprs(kv_quant)
        _reshape_and_cache_kvq[(num_tokens, num_kv_heads)](
            key,
            value,
            key_cache,
            value_cache,
            slots,
            kv_quant.k_scale,
            kv_quant.v_scale,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            value_cache.stride(0),
            value_cache.stride(1),
            value_cache.stride(2),
            BLOCK_SIZE=key_cache.shape[1],
            HEAD_SIZE=head_size,
            HEAD_SIZE_V=head_size_v,
            HEAD_PAD=pow2(head_size),
            HEAD_PAD_V=pow2(head_size_v),
            K_NG_PAD=pow2(head_size // c["K_GROUP"]),
            V_NG_PAD=pow2(head_size_v // c["V_GROUP"]),
            K_HG_PAD=pow2(c["K_GROUP"] // 2),
            V_HG_PAD=pow2(c["V_GROUP"] // 2),
            FP8_MAX=fp8_max(kv_quant),
            K_WG_PAD=words_per_group_pad(kv_quant, c["K_GROUP"]),
            V_WG_PAD=words_per_group_pad(kv_quant, c["V_GROUP"]),
            **c,
        )
        return
    _reshape_and_cache[(num_tokens, num_kv_heads)](
        key,
        value,
        key_cache,
        value_cache,
        slots,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        BLOCK_SIZE=key_cache.shape[1],
        HEAD_SIZE=head_size,
        HEAD_SIZE_V=head_size_v,
        HEAD_PAD=pow2(head_size),
        HEAD_PAD_V=pow2(head_size_v),
    )
