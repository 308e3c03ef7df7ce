"""Quantized KV caches: the byte format of a quantized page, quantize-on-write, dequantize-on-read.

A quantized cache is a ``uint8`` buffer; each (token, KV head) ``C`` run is a K part then a V part
(``core.specs``), and each part is ``[values | inline scales]``:

* ``fp8_per_tensor`` (``fp8``, ``fp8_e4m3``, ``fp8_e5m2``): ``d`` fp8 bytes of ``x / scale``, the
  scale one float per layer for K and one for V, kept outside the page (:class:`KVQuant`).
* ``int8_per_token_head``: ``d`` int8 codes ``q = round_half_away(x / s)`` clamped to
  [-128, 127], ``s = max(amax / 127, 1e-6)``, then ``s`` as fp32 (4 bytes).
* ``fp8_per_token_head``: ``d`` fp8 e4m3 bytes of ``x / s``, ``s = max(amax / 448, 1e-6)``, fp32.
* ``int8_per_token_head_f16`` / ``fp8_per_token_head_f16``: the same, with ``s`` first rounded
  *up* to fp16 (at most 65504) and stored as fp16 (2 bytes), so ``|x / s|`` still fits the range.
* ``int4_per_token_head`` (vLLM's layout): ``d / 2`` bytes of asymmetric 4-bit codes (element
  ``2i`` in the low nibble, ``2i + 1`` in the high), then one fp32 scale whose low 4 mantissa
  bits hold the zero point ``z``: ``x ≈ (q - z) · s``.
* ``int4_per_token_group``: the same codes, one fp16 scale (zero point in its low 4 mantissa
  bits) per group of ``group_size(mode, d, part)`` values: K in groups of 16, V in one group
  (at head size 64: 4 + 1 scales, 10 bytes, 74 per token-head). A part's group count follows
  from its byte size: ``(part_bytes - ceil(d * bits / 8)) / 2`` scales.
* ``int3_per_token_group`` / ``int2_per_token_group``: ``b``-bit asymmetric codes (``b`` = 3, 2)
  as a little-endian bit stream (value ``i`` at bits ``[b·i, b·i + b)``: int2 four a byte, int3
  eight in three bytes; the int4 nibble order is the same rule at ``b = 4``), one fp16 scale per
  group of 32 values with the zero point in its low ``b`` mantissa bits.

Integer-code ranges always include 0 (``min ≤ 0 ≤ max``), so the integer zero point is exact and a
group of equal positive values is still representable. Scales are rounded *up* to their stored
precision, so no value clips.

Rotation (``kv_rotation="hadamard"``): a randomized Hadamard transform ``R = H·D / sqrt(b)``
(``D`` a fixed ±1 diagonal, ``H`` the Walsh–Hadamard matrix of the largest power-of-two block
``b`` dividing the head size, block-diagonal otherwise) is orthonormal, so ``(Rq)·(Rk) = q·k``
and ``Σ p·Rv = R·o``: K and V are rotated before quantization, the query is rotated the same
way and the attention output rotated back (:meth:`KVQuant.rotate_query` / ``unrotate_output``).
Rotation spreads a few outlier channels over the whole head, which is what INT4 needs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv.core.specs import AttentionSpec, KVQuantMode, group_size

FP8_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
MIN_SCALE = 1e-6
FP16_MAX = 65504.0
RHT_SEED = 0x9E3779B9  # vLLM's seed for the random signs


@dataclass(frozen=True, slots=True)
class KVQuantFormat:
    """How one layer's cache stores K and V (derived from its ``AttentionSpec``)."""

    mode: KVQuantMode
    head_size: int
    head_size_v: int
    k_bytes: int  # K part of one token-head (values + inline scales)
    v_bytes: int
    fp8_dtype: torch.dtype | None = None  # fp8 modes: e4m3fn or e5m2
    rotation: str | None = None

    @classmethod
    def from_spec(cls, spec: AttentionSpec) -> KVQuantFormat:
        fp8 = (
            FP8_DTYPES.get(spec.dtype) if spec.kv_quant_mode is KVQuantMode.FP8_PER_TENSOR else None
        )
        if spec.kv_quant_mode.is_fp8_per_token_head:
            fp8 = torch.float8_e4m3fn  # per-token-head fp8 is e4m3 (vLLM)
        return cls(
            spec.kv_quant_mode,
            spec.head_size,
            spec.head_size_v,
            spec.k_part_bytes,  # type: ignore[arg-type]
            spec.v_part_bytes,
            fp8,
            spec.kv_rotation,
        )

    @property
    def quantized(self) -> bool:
        return self.mode is not KVQuantMode.NONE

    def group_size(self, d: int, part: str = "k") -> int:
        """Integer-group values per scale in part ``"k"`` or ``"v"`` of ``d`` values (``d`` for
        the per-token-head modes)."""
        return group_size(self.mode, d, part)

    @property
    def k_group(self) -> int:
        return self.group_size(self.head_size, "k")

    @property
    def v_group(self) -> int:
        return self.group_size(self.head_size_v, "v")


def _code_bytes(d: int, bits: int) -> int:
    """Bytes of ``d`` packed ``bits``-bit codes."""
    return (d * bits + 7) // 8


def _int_group(fmt: KVQuantFormat, d: int, part_bytes: int) -> int:
    """Values per scale of an integer-code part, from its byte size (K and V may differ)."""
    if not (fmt.mode.is_per_token_group or fmt.mode.is_kivi):
        return d
    groups = (part_bytes - _code_bytes(d, fmt.mode.code_bits)) // 2
    if groups < 1 or d % groups:
        raise ValueError(f"{part_bytes} bytes is not a {fmt.mode.value} part of {d} values")
    return d // groups


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``q [..., d]`` (uint8, each below ``2**bits``) as a little-endian bit stream
    ``uint8 [..., ceil(d * bits / 8)]``: value ``i`` at bits ``[bits·i, bits·i + bits)``."""
    d = q.shape[-1]
    if bits == 4:  # the common case, two nibbles a byte without the int32 detour
        if d % 2:
            q = torch.nn.functional.pad(q, (0, 1))
        return q[..., 0::2] | (q[..., 1::2] << 4)
    per = 8 // math.gcd(8, bits)  # values per whole number of bytes
    nbytes = per * bits // 8
    pad = -d % per
    if pad:
        q = torch.nn.functional.pad(q, (0, pad))
    words = q.reshape(*q.shape[:-1], -1, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32, device=q.device) * bits
    word = (words << shifts).sum(-1, dtype=torch.int32)
    out = torch.stack([(word >> (8 * j)) & 0xFF for j in range(nbytes)], -1).to(torch.uint8)
    return out.reshape(*q.shape[:-1], -1)[..., : _code_bytes(d, bits)]


def unpack_codes(raw: torch.Tensor, d: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``uint8 [..., ceil(d * bits / 8)]`` → ``uint8 [..., d]``."""
    if bits == 4:
        q = torch.stack([raw & 15, raw >> 4], dim=-1)
        return q.reshape(*raw.shape[:-1], 2 * raw.shape[-1])[..., :d]
    per = 8 // math.gcd(8, bits)
    nbytes = per * bits // 8
    total = -(-d // per) * nbytes
    if raw.shape[-1] < total:
        raw = torch.nn.functional.pad(raw, (0, total - raw.shape[-1]))
    b = raw[..., :total].reshape(*raw.shape[:-1], -1, nbytes).to(torch.int32)
    word = (b << (8 * torch.arange(nbytes, dtype=torch.int32, device=raw.device))).sum(
        -1, dtype=torch.int32
    )
    shifts = torch.arange(per, dtype=torch.int32, device=raw.device) * bits
    q = (word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return q.reshape(*raw.shape[:-1], -1)[..., :d].to(torch.uint8)


@dataclass(slots=True)
class KVQuant:
    """One attention layer's quantization state: its format, the per-tensor fp8 scales
    (``k_scale``/``v_scale``: 1.0 unless loaded or calibrated) and the rotation matrix.
    (Subtracting a calibrated per-channel K mean, exact under softmax, was measured too: it
    lowered INT4's KL but not its top-1 disagreement, so it is not shipped.)

    ``observe`` (when set) is called with every ``(key, value)`` the layer writes, rotated but
    not yet quantized: the calibration pass records amax through it.
    """

    fmt: KVQuantFormat
    k_scale: float = 1.0
    v_scale: float = 1.0
    rotation: torch.Tensor | None = None  # [D, D] float32, orthonormal: x_rot = x @ R.T
    observe: object = field(default=None)
    # KIVI caches (`ops.kivi`): the layer's residual (allocated by the runner) and the step's
    # rows ``(key, value, slot_mapping)`` that reshape_and_cache leaves for attention to write.
    residual: Any = field(default=None)
    pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None)

    @classmethod
    def for_spec(cls, spec: AttentionSpec, device: torch.device | str = "cpu") -> KVQuant:
        fmt = KVQuantFormat.from_spec(spec)
        rot = None
        if fmt.rotation == "hadamard":
            if fmt.head_size != fmt.head_size_v:
                raise ValueError("kv_rotation='hadamard' needs equal K and V head sizes")
            rot = hadamard_rotation(fmt.head_size).to(device)
        return cls(fmt, rotation=rot)

    # ---- rotation -------------------------------------------------------------------------------

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., D]`` → ``R·x`` (float32)."""
        return x.float() @ self.rotation.T if self.rotation is not None else x

    def unrotate(self, x: torch.Tensor) -> torch.Tensor:
        """``R⁻¹·x = Rᵀ·x``, back in ``x``'s dtype."""
        return (x.float() @ self.rotation).to(x.dtype) if self.rotation is not None else x

    # ---- write / read ---------------------------------------------------------------------------

    def prepare(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows as the codec sees them: rotated, and shown to ``observe``. Every writer (the
        torch codec here, the Triton kernel) starts from this."""
        key, value = self.rotate(key), self.rotate(value)
        if self.observe is not None:
            self.observe(key, value)  # type: ignore[operator]
        return key, value

    def quantize(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``key [T, H, D]``, ``value [T, H, Dv]`` → their parts ``uint8 [T, H, k_bytes]`` and
        ``[T, H, v_bytes]`` (after :meth:`prepare`). An unquantized format with a rotation
        returns the rotated float32 rows."""
        key, value = self.prepare(key, value)
        f = self.fmt
        if f.mode.is_kivi:
            raise ValueError(f"{f.mode.value} codes K a block at a time: see ops.kivi")
        if not f.quantized:
            return key, value
        return (
            quantize_part(key, f, self.k_scale, f.k_bytes),
            quantize_part(value, f, self.v_scale, f.v_bytes),
        )

    def dequantize(
        self, k_raw: torch.Tensor, v_raw: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Parts ``uint8 [..., k_bytes]``/``[..., v_bytes]`` → ``(k [..., D], v [..., Dv])`` in
        ``dtype``, still rotated (attention rotates the query instead of un-rotating keys)."""
        f = self.fmt
        if f.mode.is_kivi:
            raise ValueError(f"{f.mode.value} codes K a block at a time: see ops.kivi")
        return (
            dequantize_part(k_raw, f, f.head_size, self.k_scale, dtype),
            dequantize_part(v_raw, f, f.head_size_v, self.v_scale, dtype),
        )


# ---------------------------------------------------------------- codecs


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties away from zero (torch.round ties to even; vLLM's int8 does not)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A float32/float16 tensor ``[..., n]`` as its raw bytes ``uint8 [..., n * size]``."""
    return t.contiguous().view(torch.uint8)


def _scale_from(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Raw bytes ``[..., n * size]`` → ``[..., n]`` of ``dtype`` (copy: may be unaligned)."""
    return raw.contiguous().view(dtype)


def quantize_part(
    x: torch.Tensor, fmt: KVQuantFormat, tensor_scale: float, part_bytes: int
) -> torch.Tensor:
    """One part (K or V) ``x [..., d]`` → ``uint8 [..., part_bytes]`` in ``fmt``."""
    mode, d = fmt.mode, x.shape[-1]
    xf = x.float()
    if mode is KVQuantMode.FP8_PER_TENSOR:
        lim = FP8_MAX[fmt.fp8_dtype]  # type: ignore[index]
        return (xf / tensor_scale).clamp_(-lim, lim).to(fmt.fp8_dtype).view(torch.uint8)
    out = torch.empty(*x.shape[:-1], part_bytes, dtype=torch.uint8, device=x.device)
    if mode.is_int8_per_token_head or mode.is_fp8_per_token_head:
        amax = xf.abs().amax(-1, keepdim=True)
        qmax = 127.0 if mode.is_int8_per_token_head else 448.0
        s = (amax / qmax).clamp_(min=MIN_SCALE)
        if mode.has_half_scales:
            s = _round_up_f16(s.clamp_(max=FP16_MAX))
        if mode.is_int8_per_token_head:
            q = round_half_away(xf / s).clamp_(-128, 127).to(torch.int8).view(torch.uint8)
        else:
            q = (xf / s).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
        out[..., :d] = q
        out[..., d:] = _bytes_of(s.to(torch.float16) if mode.has_half_scales else s)
        return out
    # Integer codes (int4/int3/int2), asymmetric over groups of g values (g = d: per token-head).
    bits = mode.code_bits
    top = float((1 << bits) - 1)
    g = _int_group(fmt, d, part_bytes)
    xg = xf.reshape(*x.shape[:-1], d // g, g)
    lo = xg.amin(-1, keepdim=True).clamp_(max=0.0)
    hi = xg.amax(-1, keepdim=True).clamp_(min=0.0)
    s = ((hi - lo) / top).clamp_(min=MIN_SCALE)
    if mode is KVQuantMode.INT4_PER_TOKEN_HEAD:
        s, sbits = _pack_scale_f32(s)
    else:
        s, sbits = _pack_scale_f16(s, bits)
    z = torch.round(-lo / s).clamp_(0, top)
    q = torch.round(xg / s + z).clamp_(0, top).to(torch.uint8).reshape(*x.shape[:-1], d)
    nv = _code_bytes(d, bits)
    out[..., :nv] = pack_codes(q, bits)
    zb = z.to(torch.int32).squeeze(-1)
    out[..., nv:] = _bytes_of(sbits(zb))
    return out


def _pack_scale_f32(s: torch.Tensor):
    """fp32 scales with the low 4 mantissa bits freed for the zero point (rounded up)."""
    bits = s.contiguous().view(torch.int32)
    bits = (bits + 15) & ~15
    s = bits.view(torch.float32)
    return s, lambda z: (bits.squeeze(-1) | z).view(torch.float32)


def _round_up_f16(s: torch.Tensor) -> torch.Tensor:
    """float32 ``s`` (at most 65504) rounded up to the nearest fp16, as float32."""
    h = s.to(torch.float16)
    return torch.where(
        h.float() < s, torch.nextafter(h, torch.tensor(float("inf"), dtype=torch.float16)), h
    ).float()


def _pack_scale_f16(s: torch.Tensor, zbits: int = 4):
    """fp16 scales (rounded up to 10 - zbits mantissa bits), the zero point in the low
    ``zbits`` bits."""
    h = _round_up_f16(s).to(torch.float16)
    bits = h.view(torch.int16).to(torch.int32)
    low = (1 << zbits) - 1
    bits = (bits + low) & ~low
    s = bits.to(torch.int16).view(torch.float16).float()
    return s, lambda z: (bits.squeeze(-1) | z).to(torch.int16).view(torch.float16)


def dequantize_part(
    raw: torch.Tensor,
    fmt: KVQuantFormat,
    d: int,
    tensor_scale: float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``uint8 [..., part_bytes]`` → ``[..., d]`` in ``dtype`` (inverse of :func:`quantize_part`)."""
    mode = fmt.mode
    if mode is KVQuantMode.FP8_PER_TENSOR:
        return (raw[..., :d].contiguous().view(fmt.fp8_dtype).float() * tensor_scale).to(dtype)
    if mode.is_int8_per_token_head or mode.is_fp8_per_token_head:
        vals = (
            raw[..., :d]
            .contiguous()
            .view(torch.int8 if mode.is_int8_per_token_head else torch.float8_e4m3fn)
        )
        scale = (
            _scale_from(raw[..., d : d + 2], torch.float16).float()
            if mode.has_half_scales
            else _scale_from(raw[..., d : d + 4], torch.float32)
        )
        return (vals.float() * scale).to(dtype)
    cb = mode.code_bits
    low = (1 << cb) - 1
    g = _int_group(fmt, d, raw.shape[-1])
    nv = _code_bytes(d, cb)
    q = unpack_codes(raw[..., :nv], d, cb)
    if mode is KVQuantMode.INT4_PER_TOKEN_HEAD:
        bits = _scale_from(raw[..., nv : nv + 4], torch.int32)
        s = (bits & ~15).view(torch.float32)
    else:
        bits = _scale_from(raw[..., nv:], torch.int16).to(torch.int32)
        s = (bits & ~low).to(torch.int16).view(torch.float16).float()
    z = (bits & low).float()
    qg = q.reshape(*raw.shape[:-1], d // g, g).float()
    return ((qg - z.unsqueeze(-1)) * s.unsqueeze(-1)).reshape(*raw.shape[:-1], d).to(dtype)


# ---------------------------------------------------------------- rotation


@functools.cache
def hadamard_rotation(d: int) -> torch.Tensor:
    """The orthonormal randomized Hadamard matrix ``R [d, d]`` (float32): block-diagonal
    ``H_b·D / sqrt(b)`` with ``b`` the largest power of two dividing ``d`` and ``D`` random ±1
    signs from a generator seeded :data:`RHT_SEED` (the same matrix in every process)."""
    b = d & -d
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    gen = torch.Generator().manual_seed(RHT_SEED)
    signs = torch.where(torch.rand(d, generator=gen, dtype=torch.float64) < 0.5, -1.0, 1.0)
    r = torch.block_diag(*[h] * (d // b)) / b**0.5
    return (r * signs).float()  # R·x = H·(D·x): column j scaled by sign j


# Layer name → the KVQuant of its cache (absent: a plain cache). The engine builds it from the KV
# cache specs (engine/model_runner.py: layer_kv_quants) and hands it to the model class, whose
# attention layers each receive theirs when they are built.
LayerKVQuants = Mapping[str, KVQuant]
