"""The quantized KV byte format of ``pagedkv.ops.kv_quant`` inside Triton kernels: encode on
write (:func:`quantize_part`), decode while reading tiles (:func:`dequant_tile`).

Contract: the bytes written are the torch codec's (``quantize_part``) for the same float32
inputs, bit for bit, and a decoded tile times its scale is ``dequantize_part``'s value. To hold
that on every target (and under the CPU interpreter) nothing relies on hardware rounding:

* divisions are ``div_rn`` (IEEE, like torch; plain ``/`` is approximate on CUDA);
* round-half-even (``torch.round``) is ``(x + 1.5·2²³) - 1.5·2²³`` (exact for ``|x| < 2²²``);
* fp8 is encoded with integer ops (round to nearest even, as torch's cast): the interpreter's
  float32 → fp8 cast drops the carry of a rounded-up mantissa (31.6 → 16), and fp8 dtypes
  need sm_89; decoding goes through the fp16 bit pattern (e5m2 is fp16's top byte, e4m3 is
  re-biased by 2⁸), exact on any GPU;
* inline scales are read and written a byte at a time (parts are not 4-byte aligned in
  general, e.g. the V part after a K part of ``d + 4`` bytes at odd ``d``).

NaN inputs are not handled (torch would store a NaN code).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.core.specs import KVQuantMode
from pagedkv.ops.kv_quant import FP8_MAX, MIN_SCALE, KVQuant

# KV_MODE constexpr of the kernels (0: a plain float cache).
KV_NONE = tl.constexpr(0)
KV_FP8 = tl.constexpr(1)  # fp8_per_tensor
KV_INT8_PTH = tl.constexpr(2)
KV_FP8_PTH = tl.constexpr(3)
KV_INT4_PTH = tl.constexpr(4)
KV_INT4_GROUP = tl.constexpr(5)
KV_INT8_PTH16 = tl.constexpr(6)  # int8_per_token_head_f16: the scale an fp16
KV_FP8_PTH16 = tl.constexpr(7)
KV_INT3_GROUP = tl.constexpr(8)  # b-bit codes as a little-endian bit stream, fp16 group scales
KV_INT2_GROUP = tl.constexpr(9)
_MODE_CODE = {
    KVQuantMode.NONE: 0,
    KVQuantMode.FP8_PER_TENSOR: 1,
    KVQuantMode.INT8_PER_TOKEN_HEAD: 2,
    KVQuantMode.FP8_PER_TOKEN_HEAD: 3,
    KVQuantMode.INT4_PER_TOKEN_HEAD: 4,
    KVQuantMode.INT4_PER_TOKEN_GROUP: 5,
    KVQuantMode.INT8_PER_TOKEN_HEAD_F16: 6,
    KVQuantMode.FP8_PER_TOKEN_HEAD_F16: 7,
    KVQuantMode.INT3_PER_TOKEN_GROUP: 8,
    KVQuantMode.INT2_PER_TOKEN_GROUP: 9,
}
# int3/int2 codes are packed in words: (values, bytes) a word.
LOWBIT_WORDS = {8: (8, 3), 9: (4, 1)}
# (x + RINT) - RINT rounds float32 x half to even (torch.round) for |x| < 2²²: the ulp of
# 1.5·2²³ is 1. Written inline: a nested jit call costs the interpreter milliseconds.
RINT = tl.constexpr(12582912.0)
SCALE_FLOOR = tl.constexpr(MIN_SCALE)


def mode_code(kv_quant: KVQuant | None) -> int:
    """The ``KV_MODE`` of a layer's cache: 0 unless ``kv_quant`` stores quantized bytes (a
    rotation-only format is a plain float cache to the kernels)."""
    if kv_quant is None:
        return 0
    code = _MODE_CODE.get(kv_quant.fmt.mode)
    if code is None:
        raise ValueError(
            f"kv_cache_dtype {kv_quant.fmt.mode.value!r} has no Triton (CUDA) kernel yet: "
            "it runs on the CPU paths only"
        )
    return code


def kvq_constexprs(kv_quant: KVQuant) -> dict[str, object]:
    """The format constexprs shared by the quantized write and read kernels: ``KV_MODE``,
    the integer codes' groups of K and V (``d`` per token-head) and the fp8 flavour
    (``E5M2``)."""
    fmt = kv_quant.fmt
    return dict(
        KV_MODE=mode_code(kv_quant),
        K_GROUP=fmt.k_group,
        V_GROUP=fmt.v_group,
        E5M2=fmt.fp8_dtype == torch.float8_e5m2,
    )


def fp8_max(kv_quant: KVQuant) -> float:
    """Largest finite value of the format's fp8 type (per-tensor writes clamp to it)."""
    return FP8_MAX[kv_quant.fmt.fp8_dtype or torch.float8_e4m3fn]


def check_quantized_caches(
    kv_quant: KVQuant, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> None:
    """Raise unless the caches are ``kv_quant``'s ``uint8`` parts (INT4: even head sizes)."""
    fmt = kv_quant.fmt
    if key_cache.dtype != torch.uint8 or value_cache.dtype != torch.uint8:
        raise ValueError(f"a {fmt.mode.value} cache is uint8, got {key_cache.dtype}")
    if key_cache.shape[-1] != fmt.k_bytes or value_cache.shape[-1] != fmt.v_bytes:
        raise ValueError(
            f"{fmt.mode.value} parts are {fmt.k_bytes}/{fmt.v_bytes} bytes, caches "
            f"have {key_cache.shape[-1]}/{value_cache.shape[-1]}"
        )
    if mode_code(kv_quant) in (4, 5) and (fmt.head_size % 2 or fmt.head_size_v % 2):
        raise ValueError("the Triton INT4 kernels need even head sizes")
    if mode_code(kv_quant) in LOWBIT_WORDS and (fmt.head_size % 8 or fmt.head_size_v % 8):
        raise ValueError("the Triton INT3/INT2 kernels need head sizes that are multiples of 8")


def words_per_group_pad(kv_quant: KVQuant, group: int) -> int:
    """``WG_PAD`` of :func:`quantize_part`: an INT3/INT2 group's code words, padded to a power
    of two (1 for the other formats)."""
    per = LOWBIT_WORDS.get(mode_code(kv_quant), (group, 0))[0]
    return 1 << max(0, (group // per - 1).bit_length())


# ---------------------------------------------------------------- scalar codecs


@triton.jit
def encode_fp8(x, E5M2: tl.constexpr):
    """float32 ``x`` (clamped to the format's finite range) → fp8 code (int32 in 0..255),
    round to nearest even. With ``e`` the exponent clamped to the subnormal one and ``k`` the
    rounded mantissa in ulps of ``2^(e-M)``, the code is ``((e + bias - 1) << M) + k`` for
    normals, subnormals and a mantissa that carries into the next exponent alike."""
    M: tl.constexpr = 3 - E5M2  # mantissa bits
    BIAS: tl.constexpr = 7 + 8 * E5M2
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.abs(x)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, 1 - BIAS)
    inv_ulp = ((M - e + 127) << 23).to(tl.float32, bitcast=True)  # 2^(M-e): exact scaling
    k = ((a * inv_ulp + RINT) - RINT).to(tl.int32)
    return sign | (((e + BIAS - 1) << M) + k)


@triton.jit
def decode_fp8(b, E5M2: tl.constexpr):
    """fp8 code bytes (any integer type) → float32, exactly."""
    b = b.to(tl.int32) & 0xFF
    if E5M2:
        h = b << 8
    else:
        h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    f = h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    if not E5M2:
        f = f * 256.0  # e4m3's bias 7 vs fp16's 15
    return f


@triton.jit
def load_le(ptr, mask, NBYTES: tl.constexpr):
    """The little-endian integer (int32) of ``NBYTES`` bytes at ``ptr`` (a uint8 pointer
    tensor, any alignment); 0 where masked."""
    bits = tl.load(ptr, mask=mask, other=0).to(tl.int32)
    for i in tl.static_range(1, NBYTES):
        bits = bits | (tl.load(ptr + i, mask=mask, other=0).to(tl.int32) << (8 * i))
    return bits


@triton.jit
def store_le(ptr, bits, mask, NBYTES: tl.constexpr):
    """Store the low ``NBYTES`` bytes of each int32 of ``bits [N]`` little-endian at
    ``ptr [N]`` (uint8 pointers), one store."""
    i = tl.arange(0, NBYTES)
    tl.store(
        ptr[:, None] + i[None, :],
        ((bits[:, None] >> (8 * i)[None, :]) & 0xFF).to(tl.uint8),
        mask=mask[:, None],
    )


@triton.jit
def round_up_f16(s):
    """float32 ``s`` (finite, at most 65504) → the fp16 bits (int32) of the nearest fp16 at or
    above it: nearest-even, then one ulp up if that fell below (torch's ``_round_up_f16``)."""
    h = s.to(tl.float16, fp_downcast_rounding="rtne")
    bits = h.to(tl.uint16, bitcast=True).to(tl.int32)
    return tl.where(h.to(tl.float32) < s, bits + 1, bits)


@triton.jit
def f16_bits_to_f32(bits):
    """fp16 bits (the low 16 of an int32) → float32, exactly."""
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


# ---------------------------------------------------------------- write: one part of a token-head


@triton.jit
def quantize_part(
    src,
    dst,
    tensor_scale,
    MODE: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    NG_PAD: tl.constexpr,
    HG_PAD: tl.constexpr,
    E5M2: tl.constexpr,
    FP8_MAX: tl.constexpr,
    WG_PAD: tl.constexpr = 1,
):
    """Quantize the ``D`` values at ``src`` (unit stride, any float dtype) into the part at
    ``dst`` (uint8): ``quantize_part`` of ``pagedkv.ops.kv_quant``. INT4: ``GROUP`` values per
    scale (``D`` per token-head), even; ``NG_PAD``/``HG_PAD`` pad the groups and their
    ``GROUP / 2`` value pairs to powers of two. INT3/INT2: groups of ``GROUP`` values in code
    words (8 values in 3 bytes; 4 in 1), ``WG_PAD`` of them a group (padded)."""
    if MODE == KV_INT3_GROUP or MODE == KV_INT2_GROUP:
        BITS: tl.constexpr = 3 if MODE == KV_INT3_GROUP else 2
        W: tl.constexpr = 8 if BITS == 3 else 4  # values a word
        WB: tl.constexpr = 3 if BITS == 3 else 1  # bytes a word
        TOP: tl.constexpr = 7.0 if BITS == 3 else 3.0
        LOW: tl.constexpr = 7 if BITS == 3 else 3
        g = tl.arange(0, NG_PAD)
        w = tl.arange(0, WG_PAD)
        i = tl.arange(0, W)
        g_mask = g < D // GROUP
        wm = g_mask[:, None] & (w < GROUP // W)[None, :]
        m = wm[:, :, None] & (i < W)[None, None, :]
        idx = g[:, None, None] * GROUP + w[None, :, None] * W + i[None, None, :]
        x = tl.load(src + idx, mask=m, other=0.0).to(tl.float32)
        lo = tl.minimum(tl.min(tl.min(x, 2), 1), 0.0)
        hi = tl.maximum(tl.max(tl.max(x, 2), 1), 0.0)
        s = tl.maximum(tl.math.div_rn(hi - lo, TOP), SCALE_FLOOR)
        bits = (round_up_f16(s) + LOW) & -(LOW + 1)  # fp16 rounded up, its low BITS bits freed
        s = f16_bits_to_f32(bits)
        z = tl.minimum(tl.maximum((tl.math.div_rn(-lo, s) + RINT) - RINT, 0.0), TOP)
        q = ((tl.math.div_rn(x, s[:, None, None]) + z[:, None, None]) + RINT) - RINT
        q = tl.minimum(tl.maximum(q, 0.0), TOP).to(tl.int32)
        word = tl.sum(q << (BITS * i)[None, None, :], 2)  # disjoint bits: the sum is the OR
        at = (g[:, None] * (GROUP // W) + w[None, :]) * WB
        for k in tl.static_range(WB):
            tl.store(dst + at + k, ((word >> (8 * k)) & 0xFF).to(tl.uint8), mask=wm)
        store_le(dst + D * BITS // 8 + 2 * g, bits | z.to(tl.int32), g_mask, 2)
    elif MODE == KV_INT4_PTH or MODE == KV_INT4_GROUP:
        g = tl.arange(0, NG_PAD)
        j = tl.arange(0, HG_PAD)
        g_mask = g < D // GROUP
        m = g_mask[:, None] & (j < GROUP // 2)[None, :]
        even = g[:, None] * GROUP + 2 * j[None, :]
        xe = tl.load(src + even, mask=m, other=0.0).to(tl.float32)
        xo = tl.load(src + even + 1, mask=m, other=0.0).to(tl.float32)
        # The range always holds 0 (so masked zeros change nothing): an exact zero point.
        lo = tl.minimum(tl.min(tl.minimum(xe, xo), 1), 0.0)
        hi = tl.maximum(tl.max(tl.maximum(xe, xo), 1), 0.0)
        s = tl.maximum(tl.math.div_rn(hi - lo, 15.0), SCALE_FLOOR)
        if MODE == KV_INT4_PTH:  # fp32 rounded up to free its low 4 mantissa bits
            bits = (s.to(tl.int32, bitcast=True) + 15) & -16
            s = bits.to(tl.float32, bitcast=True)
        else:  # fp16 rounded up (nearest, then one ulp up if below), then the same
            bits = (round_up_f16(s) + 15) & -16
            s = f16_bits_to_f32(bits)
        z = tl.minimum(tl.maximum((tl.math.div_rn(-lo, s) + RINT) - RINT, 0.0), 15.0)
        qe = ((tl.math.div_rn(xe, s[:, None]) + z[:, None]) + RINT) - RINT
        qo = ((tl.math.div_rn(xo, s[:, None]) + z[:, None]) + RINT) - RINT
        qe = tl.minimum(tl.maximum(qe, 0.0), 15.0).to(tl.int32)
        qo = tl.minimum(tl.maximum(qo, 0.0), 15.0).to(tl.int32)
        tl.store(
            dst + g[:, None] * (GROUP // 2) + j[None, :], (qe | (qo << 4)).to(tl.uint8), mask=m
        )
        zbits = bits | z.to(tl.int32)
        if MODE == KV_INT4_PTH:
            store_le(dst + D // 2 + g, zbits, g_mask, 4)
        else:
            store_le(dst + D // 2 + 2 * g, zbits, g_mask, 2)
    else:
        offs = tl.arange(0, D_PAD)
        m = offs < D
        x = tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
        if MODE == KV_FP8:
            y = tl.math.div_rn(x, tensor_scale)
            code = encode_fp8(tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX), E5M2)
        else:
            amax = tl.max(tl.abs(x), 0)
            HALF: tl.constexpr = MODE == KV_INT8_PTH16 or MODE == KV_FP8_PTH16
            QMAX: tl.constexpr = 127.0 if MODE == KV_INT8_PTH or MODE == KV_INT8_PTH16 else 448.0
            s = tl.maximum(tl.math.div_rn(amax, QMAX), SCALE_FLOOR)
            if HALF:
                sbits = round_up_f16(tl.minimum(s, 65504.0))
                s = f16_bits_to_f32(sbits)
            else:
                sbits = s.to(tl.int32, bitcast=True)
            y = tl.math.div_rn(x, s)
            if QMAX == 127.0:
                r = tl.floor(tl.abs(y) + 0.5)  # round half away from zero (vLLM's int8)
                q = tl.minimum(tl.maximum(tl.where(y < 0.0, -r, r), -128.0), 127.0)
                code = q.to(tl.int32) & 0xFF
            else:  # fp8_per_token_head(_f16): e4m3
                code = encode_fp8(tl.minimum(tl.maximum(y, -448.0), 448.0), False)
            NS: tl.constexpr = 2 if HALF else 4
            i = tl.arange(0, NS)
            tl.store(dst + D + i, ((sbits >> (8 * i)) & 0xFF).to(tl.uint8))
        tl.store(dst + offs, code.to(tl.uint8), mask=m)


# ---------------------------------------------------------------- read: one K or V tile


@triton.jit
def dequant_tile(
    ptr,
    tok_off,
    tok_mask,
    d,
    d_mask,
    tensor_scale,
    TOKEN_AXIS: tl.constexpr,
    MODE: tl.constexpr,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    E5M2: tl.constexpr,
):
    """A tile of one KV head's parts: tokens at byte offsets ``tok_off [T]`` from ``ptr``
    (uint8), elements ``d [E]`` of each. Returns ``(x, s)``: ``x`` float32, ``[E, T]`` if
    ``TOKEN_AXIS == 1`` (a K tile) else ``[T, E]``; ``s [1, T]`` the per-token factor with
    ``value = x · s`` — the stored scale for fp8/int8/int4 per token-head (``x`` = codes, or
    ``q - z`` for int4: exact in any dot dtype, the scale is folded into the scores or the
    probabilities by the caller), the layer's ``tensor_scale`` for fp8 per tensor, 1 for
    int4 per group (``x`` already dequantized: its scales vary along ``d``). 0 where masked.
    """
    if TOKEN_AXIS == 1:
        tok2 = tok_off[None, :]
        d2 = d[:, None]
        m = d_mask[:, None] & tok_mask[None, :]
    else:
        tok2 = tok_off[:, None]
        d2 = d[None, :]
        m = tok_mask[:, None] & d_mask[None, :]
    ones = tl.where(tok_mask, 1.0, 0.0)[None, :]
    if MODE == KV_INT3_GROUP or MODE == KV_INT2_GROUP:
        BITS: tl.constexpr = 3 if MODE == KV_INT3_GROUP else 2
        LOW: tl.constexpr = 7 if BITS == 3 else 3
        bit = d2 * BITS
        if BITS == 3:  # a code may straddle two bytes (the next one exists: scales follow)
            word = load_le(ptr + tok2 + (bit >> 3), m, 2)
        else:
            word = tl.load(ptr + tok2 + (bit >> 3), mask=m, other=0).to(tl.int32)
        q = ((word >> (bit & 7)) & LOW).to(tl.float32)
        sb = load_le(ptr + tok2 + D * BITS // 8 + 2 * (d2 // GROUP), m, 2)
        s16 = (sb & -(LOW + 1)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        x = (q - (sb & LOW).to(tl.float32)) * s16
        s = ones
    elif MODE == KV_INT4_PTH or MODE == KV_INT4_GROUP:
        byte = tl.load(ptr + tok2 + d2 // 2, mask=m, other=0).to(tl.int32)
        q = ((byte >> ((d2 % 2) * 4)) & 0xF).to(tl.float32)
        if MODE == KV_INT4_PTH:
            bits = load_le(ptr + tok_off + D // 2, tok_mask, 4)
            z = (bits & 0xF).to(tl.float32)
            if TOKEN_AXIS == 1:
                x = q - z[None, :]
            else:
                x = q - z[:, None]
            s = (bits & -16).to(tl.float32, bitcast=True)[None, :]
        else:
            bits = load_le(ptr + tok2 + D // 2 + 2 * (d2 // GROUP), m, 2)
            s16 = (bits & -16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            x = (q - (bits & 0xF).to(tl.float32)) * s16
            s = ones
    else:
        b = tl.load(ptr + tok2 + d2, mask=m, other=0)
        if MODE == KV_INT8_PTH or MODE == KV_INT8_PTH16:
            x = b.to(tl.int8, bitcast=True).to(tl.float32)
        else:
            x = decode_fp8(b, E5M2)
        if MODE == KV_FP8:
            s = ones * tensor_scale
        elif MODE == KV_INT8_PTH16 or MODE == KV_FP8_PTH16:
            s = f16_bits_to_f32(load_le(ptr + tok_off + D, tok_mask, 2))[None, :]
        else:
            s = load_le(ptr + tok_off + D, tok_mask, 4).to(tl.float32, bitcast=True)[None, :]
    return x, s
