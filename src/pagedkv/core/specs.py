"""KV-cache specs: how many bytes one block of one layer takes, and how layers share a pool.

A ``KVCacheSpec`` describes one layer's cache *format* (vLLM v1's ``kv_cache_interface``):
tokens per block, heads, head sizes, storage dtype and quantization mode. From it follow
``page_size_bytes`` (bytes of one block of one layer) and ``max_memory_usage_bytes`` (bytes
one max-length request can pin in that layer).

Layers with equal specs form one ``KVCacheGroupSpec``; all groups share ONE block pool whose
block holds ``max(len(group) * page)`` bytes (groups alias the same bytes, which is safe because
a block id belongs to one group at a time). Layers of one attention type whose head geometry
differs still form one group, whose spec is a ``UniformTypeKVCacheSpecs`` (page = the sum of
the layers' pages). Hybrid models (full + sliding window, attention + Mamba) first get equal
page sizes (``unify_kv_cache_spec_page_size``) and are then split into equally sized groups
(``get_kv_cache_groups``).

Storage dtypes are plain strings (stdlib only here): "float32", "float16", "bfloat16",
"fp8" (aliases "fp8_e4m3", "fp8_e5m2"), "int8", "int4", "int3", "int2". Content bytes of one token-head
(the ``C`` run of the layout) are a K part then a V part:

    unquantized / fp8 per-tensor:  ceil((head_size + head_size_v) * bits / 8)
    quantized with inline scales:  part(head_size) + part(head_size_v),
                                   part(d) = ceil(d * bits / 8) + scale_bytes(d)

``scale_bytes`` is 4 (one fp32 per token-head) for vLLM's ``*_per_token_head`` modes, 2 (one
fp16) for pagedkv's ``*_per_token_head_f16`` modes, and 2 per
group of :func:`group_size` values (fp16) for the ``int{4,3,2}_per_token_group`` modes
(int4: K groups of 16, V one group; int3/int2: groups of 32); so each part is
``[values | scales]`` and the K part and the V part can be viewed (and moved) on their own.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pagedkv.core.layout import DEFAULT_KV_CACHE_LAYOUT, KVCacheLayout
from pagedkv.core.units import cdiv

# ---------------------------------------------------------------- dtypes and quantization

_DTYPE_ALIASES: dict[str, str] = {
    "float": "float32",
    "fp32": "float32",
    "float32": "float32",
    "half": "float16",
    "fp16": "float16",
    "float16": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp8": "fp8",
    "fp8_e4m3": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
    "int8": "int8",
    "uint8": "uint8",
    "int4": "int4",
    "int3": "int3",
    "int2": "int2",
}

# Storage bits per element. int4 is packed two values per byte, int3 eight values in three bytes,
# int2 four values per byte (a little-endian bit stream: value i at bit bits*i).
DTYPE_BITS: dict[str, int] = {
    "float32": 32,
    "float16": 16,
    "bfloat16": 16,
    "fp8": 8,
    "fp8_e4m3": 8,
    "fp8_e5m2": 8,
    "int8": 8,
    "uint8": 8,
    "int4": 4,
    "int3": 3,
    "int2": 2,
}

SCALE_BYTES = 4  # one fp32 scale
HALF_SCALE_BYTES = 2  # one fp16 scale (the *_per_token_head_f16 modes)
GROUP_SCALE_BYTES = 2  # one fp16 scale (with the 4-bit zero point in its low mantissa bits)
INT4_K_GROUP = 16  # K values per scale in int4_per_token_group when the head size allows it
# Values per scale of int3/int2_per_token_group (K and V) when the head size allows it: 32 keeps
# the scales at 0.5 bits a value, which the capacity bars need (int3 at head 64: 56 B per
# token-head, 4.57x fewer than bf16; int2: 40 B, 6.4x); groups of 16 would be 4.0x and 5.3x.
LOWBIT_GROUP = 32
KV_ROTATIONS = ("hadamard",)
# The KIVI modes' residual (see KVQuantMode): the first KIVI_SINK_TOKENS tokens of a request
# and its last ``kivi_residual_blocks(block_size)`` blocks (the filling one included, at least
# KIVI_RESIDUAL_TOKENS tokens of room) are read as int8 codes, not as 3/2-bit codes. Measured
# by emulation (bench_kv_formats): without the residual, per-channel int3 keys give 92% top-1;
# with it, 95-97%.
KIVI_SINK_TOKENS = 4
KIVI_RESIDUAL_TOKENS = 32
KIVI_RESIDUAL_PART = 2  # fp16 scale after each int8 part of a residual token-head
# First blocks whose int8 sinks the runner keeps for prefix-cache hits (`ops.kivi.KiviSinkStore`),
# reserved outside the pool like the residual: 3 MB on the default model. Requests that share a
# chat template or system prompt share a first block, so a few entries serve most hits.
KIVI_SINK_ENTRIES = 64


def kivi_residual_blocks(block_size: int) -> int:
    """Whole blocks the KIVI residual keeps (the filling block counts): ``32 // block_size``,
    at least one."""
    return max(1, KIVI_RESIDUAL_TOKENS // block_size)


def int4_group_size(d: int, part: str = "k") -> int:
    """Values per scale group of ``int4_per_token_group`` in a part of ``d`` values.

    K: 16 when it divides ``d`` (else the whole part); V: the whole part. Why: keys carry
    per-channel outliers, so finer K scales pay most; on SmolLM2 (Hadamard, greedy corpus)
    K groups of 16 with one V group cut the KL divergence from 0.038 (one group each) to
    0.026, more than groups of 32 for both (0.033), in the same 8 scale bytes at head 64
    (+2 B: 74 B per token-head, 3.46x fewer than bf16)."""
    if part not in ("k", "v"):
        raise ValueError(f"part must be 'k' or 'v', got {part!r}")
    if part == "k" and d % INT4_K_GROUP == 0:
        return INT4_K_GROUP
    return max(d, 1)


def group_size(mode: KVQuantMode, d: int, part: str = "k") -> int:
    """Values per scale group of a ``*_per_token_group`` mode in a part of ``d`` values (``d``
    for every other mode): :func:`int4_group_size` for int4, :data:`LOWBIT_GROUP` for int3 and
    int2 when it divides ``d`` (else the whole part)."""
    if mode is KVQuantMode.INT4_PER_TOKEN_GROUP:
        return int4_group_size(d, part)
    if mode.is_kivi:  # V only (K is per channel): int3 one group, int2 groups of 32
        if part != "v":
            raise ValueError("a KIVI K part is quantized per channel, not in token groups")
        if mode is KVQuantMode.INT2_KIVI and d % LOWBIT_GROUP == 0:
            return LOWBIT_GROUP
        return max(d, 1)
    if mode in (KVQuantMode.INT3_PER_TOKEN_GROUP, KVQuantMode.INT2_PER_TOKEN_GROUP):
        if part not in ("k", "v"):
            raise ValueError(f"part must be 'k' or 'v', got {part!r}")
        return LOWBIT_GROUP if d % LOWBIT_GROUP == 0 else max(d, 1)
    return d


def normalize_dtype(dtype: Any) -> str:
    """Canonical dtype name; accepts aliases, "torch.float16" and torch.dtype objects."""
    name = str(dtype).removeprefix("torch.").lower()
    if name not in _DTYPE_ALIASES:
        raise ValueError(f"unknown KV dtype {dtype!r}; known: {sorted(DTYPE_BITS)}")
    return _DTYPE_ALIASES[name]


def dtype_bits(dtype: Any) -> int:
    return DTYPE_BITS[normalize_dtype(dtype)]


def dtype_size(dtype: Any) -> int:
    """Bytes per element for whole-byte dtypes (int4 has no whole-byte size)."""
    bits = dtype_bits(dtype)
    if bits % 8:
        raise ValueError(f"{dtype!r} has {bits} bits per element; use dtype_bits")
    return bits // 8


class KVQuantMode(enum.Enum):
    """How K/V values are quantized, which decides where scales live (vLLM's KVQuantMode).

    NONE: stored as-is in ``dtype``.
    FP8_PER_TENSOR: fp8 values; one scale per tensor kept *outside* the cache (page unchanged).
    INT8_PER_TOKEN_HEAD / FP8_PER_TOKEN_HEAD: 1 byte per value plus fp32 K and V scales
        stored inline for every (token, head): +8 bytes per token-head.
    INT8_PER_TOKEN_HEAD_F16 / FP8_PER_TOKEN_HEAD_F16: the same codes with each scale stored as
        fp16 (rounded up, so no code clips): +4 bytes per token-head instead of +8, which at head
        size 64 takes the page from 1.88x to 1.94x fewer bytes than bf16 (pagedkv's own modes,
        like llama.cpp's q8_0 scale; ``kv_cache_dtype="int8"`` picks the int8 one).
    INT4_PER_TOKEN_HEAD: two 4-bit values per byte plus the same inline fp32 scales (vLLM's:
        asymmetric, the 4-bit zero point in the scale's low mantissa bits).
    INT4_PER_TOKEN_GROUP: two 4-bit values per byte, asymmetric, one fp16 scale (zero point in
        its low 4 mantissa bits) per group of ``int4_group_size(d, part)`` values (K: 16, V:
        the head): finer K scales for 2 more bytes at head size 64 (pagedkv's own mode;
        ``kv_cache_dtype="int4"`` picks it).
    INT3_PER_TOKEN_GROUP / INT2_PER_TOKEN_GROUP: 3- and 2-bit asymmetric codes (a little-endian
        bit stream), one fp16 scale (the zero point in its low 3 / 2 mantissa bits) per group of
        32 values, K and V (``kv_cache_dtype="int3"`` / ``"int2"``, with a Hadamard rotation):
        lossy KV for capacity (issue 36's bars: >= 4.5x and >= 6x bf16's requests).
    INT3_KIVI / INT2_KIVI (KIVI's layout): the same codes, K quantized *per channel* across the
        tokens of a block (a block's K is coded when it fills; the channel scales, fp16 with the
        zero point in the mantissa, are spread over its tokens: ``head_size / block_size`` per
        token-head), V per token (int3: one scale; int2: groups of 32). Each running request
        also keeps a *residual* outside the pages: its first ``KIVI_SINK_TOKENS`` tokens and its
        last ``kivi_residual_blocks`` blocks as int8 per token-head; attention reads those from
        it (``ops/kivi.py``). No rotation (it would smear the channels KIVI scales apart).
    """

    NONE = "none"
    FP8_PER_TENSOR = "fp8_per_tensor"
    INT8_PER_TOKEN_HEAD = "int8_per_token_head"
    FP8_PER_TOKEN_HEAD = "fp8_per_token_head"
    INT8_PER_TOKEN_HEAD_F16 = "int8_per_token_head_f16"
    FP8_PER_TOKEN_HEAD_F16 = "fp8_per_token_head_f16"
    INT4_PER_TOKEN_HEAD = "int4_per_token_head"
    INT4_PER_TOKEN_GROUP = "int4_per_token_group"
    INT3_PER_TOKEN_GROUP = "int3_per_token_group"
    INT2_PER_TOKEN_GROUP = "int2_per_token_group"
    INT3_KIVI = "int3_kivi"
    INT2_KIVI = "int2_kivi"

    @property
    def storage_dtype(self) -> str | None:
        """The element dtype this mode stores (None: whatever the spec says)."""
        return _MODE_DTYPE[self]

    @property
    def is_per_token_head(self) -> bool:
        return (
            self
            in (
                KVQuantMode.INT8_PER_TOKEN_HEAD,
                KVQuantMode.FP8_PER_TOKEN_HEAD,
                KVQuantMode.INT4_PER_TOKEN_HEAD,
            )
            or self.has_half_scales
        )

    @property
    def has_half_scales(self) -> bool:
        """One fp16 scale per part instead of vLLM's fp32 (the ``*_per_token_head_f16`` modes)."""
        return self in (KVQuantMode.INT8_PER_TOKEN_HEAD_F16, KVQuantMode.FP8_PER_TOKEN_HEAD_F16)

    @property
    def is_fp8_per_token_head(self) -> bool:
        return self in (KVQuantMode.FP8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD_F16)

    @property
    def is_int8_per_token_head(self) -> bool:
        return self in (KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.INT8_PER_TOKEN_HEAD_F16)

    @property
    def is_per_token_group(self) -> bool:
        """Asymmetric integer codes with one fp16 scale per group (int4, int3, int2)."""
        return self in (
            KVQuantMode.INT4_PER_TOKEN_GROUP,
            KVQuantMode.INT3_PER_TOKEN_GROUP,
            KVQuantMode.INT2_PER_TOKEN_GROUP,
        )

    @property
    def is_kivi(self) -> bool:
        """K per channel across a block, V per token, a residual per request (int3/int2)."""
        return self in (KVQuantMode.INT3_KIVI, KVQuantMode.INT2_KIVI)

    @property
    def code_bits(self) -> int:
        """Bits of one integer code (4/3/2 for the integer-group modes, 4 for int4 per token
        head, 8 otherwise): also the bits of the zero point stored under the scale."""
        dtype = _MODE_DTYPE[self]
        return DTYPE_BITS[dtype] if dtype else 8

    @property
    def has_inline_scales(self) -> bool:
        """Scales live in the page next to the values (every mode but NONE and per-tensor)."""
        return self.is_per_token_head or self.is_per_token_group or self.is_kivi

    def scale_bytes(self, d: int, part: str = "k") -> int:
        """Inline scale bytes of one part (``"k"`` or ``"v"``) of ``d`` values of one token-head."""
        if self.has_half_scales:
            return HALF_SCALE_BYTES
        if self.is_per_token_head:
            return SCALE_BYTES
        if self.is_per_token_group or (self.is_kivi and part == "v"):
            return GROUP_SCALE_BYTES * cdiv(d, group_size(self, d, part)) if d else 0
        if self.is_kivi:
            raise ValueError("a KIVI K part's scales depend on the block size (AttentionSpec)")
        return 0

    def part_bytes(self, d: int, bits: int, part: str = "k") -> int:
        """Bytes of one part (K or V): ``d`` values packed at ``bits``, then its scales."""
        return cdiv(d * bits, 8) + self.scale_bytes(d, part)

    @classmethod
    def parse(cls, value: KVQuantMode | str | None) -> KVQuantMode:
        if value is None:
            return cls.NONE
        if isinstance(value, cls):
            return value
        v = str(value).lower()
        for m in cls:
            if v in (m.value, m.name.lower()):
                return m
        raise ValueError(f"unknown KV quant mode {value!r}; known: {[m.value for m in cls]}")


_MODE_DTYPE: dict[KVQuantMode, str | None] = {
    KVQuantMode.NONE: None,
    KVQuantMode.FP8_PER_TENSOR: "fp8",
    KVQuantMode.INT8_PER_TOKEN_HEAD: "int8",
    KVQuantMode.FP8_PER_TOKEN_HEAD: "fp8",
    KVQuantMode.INT8_PER_TOKEN_HEAD_F16: "int8",
    KVQuantMode.FP8_PER_TOKEN_HEAD_F16: "fp8",
    KVQuantMode.INT4_PER_TOKEN_HEAD: "int4",
    KVQuantMode.INT4_PER_TOKEN_GROUP: "int4",
    KVQuantMode.INT3_PER_TOKEN_GROUP: "int3",
    KVQuantMode.INT2_PER_TOKEN_GROUP: "int2",
    KVQuantMode.INT3_KIVI: "int3",
    KVQuantMode.INT2_KIVI: "int2",
}


_DEFAULT_MODE_FOR_DTYPE: dict[str, KVQuantMode] = {
    "fp8": KVQuantMode.FP8_PER_TENSOR,
    "fp8_e4m3": KVQuantMode.FP8_PER_TENSOR,
    "fp8_e5m2": KVQuantMode.FP8_PER_TENSOR,
    "int8": KVQuantMode.INT8_PER_TOKEN_HEAD_F16,  # the best INT8 pagedkv ships (see README)
    "int4": KVQuantMode.INT4_PER_TOKEN_GROUP,  # the best INT4 pagedkv ships (see README)
    "int3": KVQuantMode.INT3_PER_TOKEN_GROUP,
    "int2": KVQuantMode.INT2_PER_TOKEN_GROUP,
}

# The accepted ``kv_cache_dtype`` values (vLLM's ``--kv-cache-dtype`` names), written once for
# the CLI's help, EngineConfig's error message and the docs: the storage dtypes and shortcuts,
# then the explicit quantization modes (`KVQuantMode` order). `resolve_kv_cache_dtype` is the
# validator; it also takes dtype aliases (``bf16``...) and ``fp8_per_tensor``, not listed.
KV_CACHE_DTYPE_SHORTCUTS: tuple[str, ...] = (
    "auto",
    "float32",
    "bfloat16",
    "float16",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "int8",
    "int4",
    "int3",
    "int2",
)
KV_CACHE_DTYPE_MODES: tuple[str, ...] = tuple(
    m.value for m in KVQuantMode if m.is_per_token_head or m.is_per_token_group or m.is_kivi
)
KV_CACHE_DTYPES: tuple[str, ...] = KV_CACHE_DTYPE_SHORTCUTS + KV_CACHE_DTYPE_MODES
# What a value means where its name does not say it (help text and docs); consecutive values
# with the same note are shown as one group ("fp8 / fp8_e4m3 / fp8_e5m2 (per-tensor scales)").
KV_CACHE_DTYPE_NOTES: dict[str, str] = {
    "auto": "= --dtype",
    "fp8": "per-tensor scales",
    "fp8_e4m3": "per-tensor scales",
    "fp8_e5m2": "per-tensor scales",
    "int8": "the best INT8: per token-head, fp16 scales + Hadamard",
    "int4": "the best INT4: K groups of 16 + Hadamard",
    "int3": "lossy: 3-bit groups of 32 + Hadamard",
    "int2": "lossy: 2-bit groups of 32 + Hadamard",
    "int8_per_token_head": "vLLM's: fp32 scales",
    "fp8_per_token_head": "vLLM's: fp32 scales",
    "int8_per_token_head_f16": "fp16 scales",
    "int3_kivi": "lossy: K per channel over a block, V per token, int8 residual",
    "int2_kivi": "lossy: K per channel over a block, V per token, int8 residual",
    "fp8_per_token_head_f16": "fp16 scales",
}


def resolve_kv_cache_dtype(
    kv_cache_dtype: str, model_dtype: Any, kv_quant_mode: KVQuantMode | str | None = None
) -> tuple[str, KVQuantMode]:
    """Turn a user's ``--kv-cache-dtype`` (+ optional quant mode) into (storage dtype, mode).

    "auto" → the model dtype. A mode name ("int8_per_token_head", "fp8_per_tensor", ...) as
    the dtype selects that mode. Without a mode, "fp8" means FP8_PER_TENSOR (as in vLLM),
    "int8" the best INT8 configuration, int8_per_token_head_f16 (1.94x bf16's capacity at head
    size 64, where vLLM's fp32 scales cap int8_per_token_head at 1.88x), and "int4" the best
    INT4 configuration, int4_per_token_group (both shortcuts with a Hadamard rotation, see
    :func:`resolve_kv_rotation`).
    """
    mode = KVQuantMode.parse(kv_quant_mode)
    as_mode = None
    try:
        as_mode = KVQuantMode.parse(kv_cache_dtype)
    except ValueError:
        pass
    if as_mode is not None and as_mode is not KVQuantMode.NONE:
        if mode not in (KVQuantMode.NONE, as_mode):
            raise ValueError(
                f"kv_cache_dtype {kv_cache_dtype!r} conflicts with kv_quant_mode {mode.value!r}"
            )
        return as_mode.storage_dtype, as_mode  # type: ignore[return-value]
    dtype = normalize_dtype(model_dtype if kv_cache_dtype in ("auto", None) else kv_cache_dtype)
    if mode is KVQuantMode.NONE:
        # Integer storage is meaningless without scales: int8/int4 imply per-token-head.
        mode = _DEFAULT_MODE_FOR_DTYPE.get(dtype, KVQuantMode.NONE)
    if mode.storage_dtype is not None and kv_cache_dtype == "auto":
        dtype = mode.storage_dtype
    return dtype, mode


def resolve_kv_rotation(
    kv_cache_dtype: str | None, kv_rotation: str | None, mode: KVQuantMode | None = None
) -> str | None:
    """The rotation applied to K/V (and Q) before quantization: an explicit ``kv_rotation``
    ("hadamard", or "none"/None) wins; otherwise the shortcuts "int8" and "int4" (pagedkv's
    best INT8 / INT4: measured, the rotation is what lifts INT8 past 99% top-1 agreement)
    imply "hadamard", and the explicit mode names (vLLM's), a KIVI ``mode`` (it scales K per
    channel) and everything else none."""
    if kv_rotation is not None:
        r = str(kv_rotation).lower()
        if r == "none":
            return None
        if r not in KV_ROTATIONS:
            raise ValueError(
                f"unknown kv_rotation {kv_rotation!r}; choose one of {KV_ROTATIONS} or 'none'"
            )
        return r
    if mode is not None and mode.is_kivi:
        return None
    return "hadamard" if kv_cache_dtype in ("int8", "int4", "int3", "int2") else None


# ---------------------------------------------------------------- specs


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Base spec: one layer's cache format. Frozen and hashable, so equal specs group.

    Subclasses define ``page_size_bytes`` (bytes of one block of one layer) and
    ``max_memory_usage_bytes`` (bytes one request of ``max_model_len`` tokens can need).
    """

    block_size: int  # tokens per block

    kind: ClassVar[str] = "abstract"

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int = 0) -> int:
        raise NotImplementedError

    def max_num_blocks_per_req(self, max_model_len: int) -> int:
        return cdiv(max_model_len, self.block_size)

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> KVCacheSpec:
        """One spec standing for ``specs``; they must all be equal (ValueError otherwise)."""
        if not specs:
            raise ValueError("merge() needs at least one spec")
        first = specs[0]
        for s in specs[1:]:
            if s != first:
                raise ValueError(f"cannot merge different KV cache specs: {first} vs {s}")
        return first


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """Paged K/V of ``num_kv_heads`` heads.

    ``page_size_bytes = page_size_padded or num_kv_heads * block_size * content_bytes`` where
    ``content_bytes`` (one token-head: the K part, then the V part) follows the module
    docstring. ``kv_rotation`` ("hadamard" or None) changes what the bytes mean, not their
    number: it is part of :attr:`kv_format`, which fingerprints and handshakes compare.
    """

    num_kv_heads: int
    head_size: int
    dtype: str  # see module docstring; normalized in __post_init__
    head_size_v: int | None = None  # None → head_size (0 for MLA: K only)
    kv_quant_mode: KVQuantMode = KVQuantMode.NONE
    page_size_padded: int | None = None
    kv_rotation: str | None = None

    def __post_init__(self) -> None:
        KVCacheSpec.__post_init__(self)
        if self.kv_rotation is not None and self.kv_rotation not in KV_ROTATIONS:
            raise ValueError(f"unknown kv_rotation {self.kv_rotation!r}; known: {KV_ROTATIONS}")
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        object.__setattr__(self, "kv_quant_mode", KVQuantMode.parse(self.kv_quant_mode))
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        want = self.kv_quant_mode.storage_dtype
        if want is not None and dtype_bits(self.dtype) != dtype_bits(want):
            raise ValueError(f"{self.kv_quant_mode.name} stores {want}, not {self.dtype}")
        bits = self.kv_quant_mode.code_bits
        if bits in (3, 2) and (self.head_size * bits % 8 or self.head_size_v * bits % 8):  # type: ignore[operator]
            raise ValueError(
                f"{self.kv_quant_mode.value} packs {8 // math.gcd(8, bits)} values to whole bytes: "
                f"head sizes {self.head_size}/{self.head_size_v} are not multiples of it"
            )
        if self.kv_quant_mode.is_kivi:
            if self.head_size % self.block_size:  # type: ignore[operator]
                raise ValueError(
                    f"{self.kv_quant_mode.value} spreads a block's {self.head_size} channel "
                    f"scales over its tokens: block_size {self.block_size} must divide it"
                )
            if self.kv_rotation is not None:
                raise ValueError(
                    f"{self.kv_quant_mode.value} scales K per channel: a rotation would smear "
                    "the channels together (use kv_rotation='none')"
                )
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise ValueError(
                f"page_size_padded={self.page_size_padded} < real page {self.real_page_size_bytes}"
            )

    @property
    def kivi_residual_bytes(self) -> int:
        """Bytes of one request's KIVI residual in this layer (0 for other modes): sink and
        residual tokens, every KV head, K and V as int8 plus an fp16 scale."""
        if not self.kv_quant_mode.is_kivi:
            return 0
        tokens = KIVI_SINK_TOKENS + kivi_residual_blocks(self.block_size) * self.block_size
        d = self.head_size + self.head_size_v  # type: ignore[operator]
        return tokens * self.num_kv_heads * (d + 2 * KIVI_RESIDUAL_PART)

    @property
    def kivi_sink_bytes(self) -> int:
        """Bytes of one `KiviSinkStore` entry in this layer (0 for other modes): the sink
        tokens of the residual."""
        if not self.kv_quant_mode.is_kivi:
            return 0
        d = self.head_size + self.head_size_v  # type: ignore[operator]
        return KIVI_SINK_TOKENS * self.num_kv_heads * (d + 2 * KIVI_RESIDUAL_PART)

    @property
    def content_bytes(self) -> int:
        """Bytes of one (token, head): the K part then the V part (C of the layout)."""
        return self.k_part_bytes + self.v_part_bytes

    @property
    def k_part_bytes(self) -> int:
        """Bytes of one token-head's K (values, then inline scales). Without inline scales and
        with sub-byte values the K/V split is not byte-aligned; ``content_bytes`` still is."""
        mode, bits = self.kv_quant_mode, dtype_bits(self.dtype)
        if mode.is_kivi:  # the block's channel scales, spread over its tokens
            return cdiv(self.head_size * bits, 8) + GROUP_SCALE_BYTES * (
                self.head_size // self.block_size
            )
        if mode.has_inline_scales:
            return mode.part_bytes(self.head_size, bits, "k")
        return self.head_size * bits // 8

    @property
    def v_part_bytes(self) -> int:
        mode, bits = self.kv_quant_mode, dtype_bits(self.dtype)
        if mode.has_inline_scales:
            return mode.part_bytes(self.head_size_v, bits, "v")  # type: ignore[arg-type]
        return cdiv((self.head_size + self.head_size_v) * bits, 8) - self.head_size * bits // 8  # type: ignore[operator]

    @property
    def kv_format(self) -> str:
        """What one page's bytes mean, as a string: storage dtype, quant mode, rotation (e.g.
        ``"int4:int4_per_token_group:hadamard"``). Tiers, disk files and transfers carry it in
        their fingerprints, so a cache of another format is a miss, never a wrong read."""
        return ":".join(
            [self.dtype, self.kv_quant_mode.value]
            + ([self.kv_rotation] if self.kv_rotation else [])
        )

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token in this layer (unpadded)."""
        return self.num_kv_heads * self.content_bytes

    @property
    def real_page_size_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def page_size_bytes(self) -> int:
        return (
            self.page_size_padded
            if self.page_size_padded is not None
            else self.real_page_size_bytes
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Causal attention over the whole prefix: a request needs all its blocks.

    ``sliding_window`` / ``attention_chunk_size`` are set only when a windowed layer was
    promoted to full attention (hybrid manager off): memory is planned as full, but compute
    stays windowed.
    """

    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    kind: ClassVar[str] = "full_attention"

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int = 0) -> int:
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> KVCacheSpec:
        """Equal except for (promoted) windows; at most one distinct window/chunk survives."""
        if not specs:
            raise ValueError("merge() needs at least one spec")
        first = specs[0]
        if not all(type(s) is type(first) for s in specs):
            raise ValueError("cannot merge specs of different types")
        base = [
            dataclasses.replace(s, sliding_window=None, attention_chunk_size=None) for s in specs
        ]  # type: ignore[call-arg]
        KVCacheSpec.merge(base)
        windows = {s.sliding_window for s in specs if s.sliding_window is not None}  # type: ignore[attr-defined]
        chunks = {s.attention_chunk_size for s in specs if s.attention_chunk_size is not None}  # type: ignore[attr-defined]
        if len(windows) > 1 or len(chunks) > 1:
            raise ValueError(
                f"cannot merge layers with different windows {windows} / chunks {chunks}"
            )
        if windows and chunks:
            raise ValueError("cannot merge sliding-window and chunked-local layers")
        return dataclasses.replace(
            base[0],
            sliding_window=next(iter(windows), None),  # type: ignore[call-arg]
            attention_chunk_size=next(iter(chunks), None),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one compressed latent per token (K only, no V).

    e.g. DeepSeek's 512 latent + 64 rope dims = head_size 576 → 1152 B/token in bf16.
    Per-token-head quant adds its 8 inline scale bytes the same way.
    """

    num_kv_heads: int = 1
    head_size_v: int | None = 0

    kind: ClassVar[str] = "mla_attention"

    def __post_init__(self) -> None:
        AttentionSpec.__post_init__(self)
        if self.num_kv_heads != 1 or self.head_size_v != 0:
            raise ValueError("MLA stores one latent per token: num_kv_heads=1, head_size_v=0")


@dataclass(frozen=True, slots=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Attention over the last ``sliding_window`` tokens; older blocks are freed."""

    sliding_window: int

    kind: ClassVar[str] = "sliding_window"

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int = 0) -> int:
        # A step can add max_num_batched_tokens beyond the window; +1 block because the window
        # need not start on a block boundary.
        tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return (cdiv(tokens, self.block_size) + 1) * self.page_size_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Attention within fixed chunks of ``attention_chunk_size`` tokens (Llama-4 style)."""

    attention_chunk_size: int

    kind: ClassVar[str] = "chunked_local_attention"

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int = 0) -> int:
        tokens = min(self.attention_chunk_size + max_num_batched_tokens, max_model_len)
        return cdiv(tokens, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    """Encoder-decoder cross attention: sized by the encoder input, not the decoder length."""

    max_num_encoder_input_tokens: int

    kind: ClassVar[str] = "cross_attention"

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int = 0) -> int:
        return cdiv(self.max_num_encoder_input_tokens, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """Recurrent state (conv + SSM tensors) of one Mamba layer: one state per block.

    ``page_size_bytes = page_size_padded or sum(prod(shape) * dtype_size)``. With
    ``mamba_cache_mode`` "none"/"all" a request holds 1 (+ speculative) state blocks; "align"
    keeps one more (the previous aligned checkpoint).
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    page_size_padded: int | None = None
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0

    kind: ClassVar[str] = "mamba"

    def __post_init__(self) -> None:
        KVCacheSpec.__post_init__(self)
        object.__setattr__(self, "shapes", tuple(tuple(s) for s in self.shapes))
        object.__setattr__(self, "dtypes", tuple(normalize_dtype(d) for d in self.dtypes))
        if len(self.shapes) != len(self.dtypes):
            raise ValueError("MambaSpec needs one dtype per state shape")
        if self.mamba_cache_mode not in ("none", "align", "all"):
            raise ValueError(f"unknown mamba_cache_mode {self.mamba_cache_mode!r}")
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise ValueError(
                f"page_size_padded={self.page_size_padded} < real page {self.real_page_size_bytes}"
            )

    @property
    def real_page_size_bytes(self) -> int:
        return sum(math.prod(s) * dtype_size(d) for s, d in zip(self.shapes, self.dtypes))

    @property
    def page_size_bytes(self) -> int:
        return (
            self.page_size_padded
            if self.page_size_padded is not None
            else self.real_page_size_bytes
        )

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int = 0) -> int:
        extra = 2 if self.mamba_cache_mode == "align" else 1
        if self.mamba_cache_mode == "align":
            # vLLM's prefill checkpoint blocks: one step of max_num_batched_tokens tokens may
            # checkpoint every block boundary it crosses (MambaManager, dense retention).
            extra += cdiv(min(max_num_batched_tokens, max_model_len), self.block_size)
        return (extra + self.num_speculative_blocks) * self.page_size_bytes


@dataclass(frozen=True, slots=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Layers of ONE attention type and block size whose head geometry (heads, head size,
    dtype) differs, as one KV cache group (vLLM's name): one block id holds a block of every
    layer, so ``page_size_bytes`` is the **sum** of the layers' pages, and a request needs
    ``max_i cdiv(mem_i, page_i)`` blocks. The allocation rules (type, window or chunk, block
    size) are shared, so the scheduler side works on :attr:`representative` alone; the runner
    reads each layer's own spec from ``kv_cache_specs``.
    """

    kv_cache_specs: dict[str, KVCacheSpec] = dataclasses.field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        KVCacheSpec.__post_init__(self)
        if not self.kv_cache_specs:
            raise ValueError("UniformTypeKVCacheSpecs needs at least one layer spec")
        if not self.is_uniform_type(self.kv_cache_specs):
            raise ValueError(
                "UniformTypeKVCacheSpecs layers must share one attention type (and its window, "
                f"chunk or Mamba mode): {sorted({s.kind for s in self.kv_cache_specs.values()})}"
            )
        sizes = {s.block_size for s in self.kv_cache_specs.values()}
        if sizes != {self.block_size}:
            raise ValueError(
                f"UniformTypeKVCacheSpecs block_size {self.block_size} != layer block sizes {sorted(sizes)}"
            )

    @property
    def representative(self) -> KVCacheSpec:
        """One layer's spec: what the block managers need (type, window, block size)."""
        return next(iter(self.kv_cache_specs.values()))

    @property
    def kind(self) -> str:  # type: ignore[override]
        return self.representative.kind

    @property
    def page_size_bytes(self) -> int:
        return sum(s.page_size_bytes for s in self.kv_cache_specs.values())

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token writes across the layers (0 for recurrent state)."""
        return sum(
            s.bytes_per_token for s in self.kv_cache_specs.values() if isinstance(s, AttentionSpec)
        )

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int = 0) -> int:
        blocks = max(
            cdiv(s.max_memory_usage_bytes(max_model_len, max_num_batched_tokens), s.page_size_bytes)
            for s in self.kv_cache_specs.values()
        )
        return blocks * self.page_size_bytes

    @classmethod
    def is_uniform_type(cls, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        """Same spec class and the same allocation parameters (window, chunk, Mamba mode)."""
        specs = list(kv_cache_specs.values())
        if not specs or any(type(s) is not type(specs[0]) for s in specs):
            return False
        rule = (
            "sliding_window",
            "attention_chunk_size",
            "mamba_cache_mode",
            "num_speculative_blocks",
            "max_num_encoder_input_tokens",
        )
        return all(getattr(s, a, None) == getattr(specs[0], a, None) for s in specs for a in rule)

    @classmethod
    def from_specs(cls, kv_cache_specs: dict[str, KVCacheSpec]) -> UniformTypeKVCacheSpecs | None:
        """One spec for all layers if they are of one type and block size, else None."""
        if not cls.is_uniform_type(kv_cache_specs):
            return None
        sizes = {s.block_size for s in kv_cache_specs.values()}
        if len(sizes) != 1:
            return None
        return cls(block_size=sizes.pop(), kv_cache_specs=dict(kv_cache_specs))


def get_kv_cache_spec_sliding_window(spec: KVCacheSpec) -> int | None:
    """The window KV events annotate a group with (vLLM's rule): a `SlidingWindowSpec`'s, a
    `UniformTypeKVCacheSpecs`' when its layers share one, else None (chunked local attention
    and a full-attention spec that merged windowed layers included)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        windows = {get_kv_cache_spec_sliding_window(s) for s in spec.kv_cache_specs.values()}
        return next(iter(windows)) if len(windows) == 1 else None
    return spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None


# ---------------------------------------------------------------- groups and configs


@dataclass(slots=True)
class KVCacheGroupSpec:
    """Layers that share one block table (same spec ⇒ same block ids for all of them)."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block id takes across the group's layers (the sum of their pages)."""
        spec = self.kv_cache_spec
        return spec.page_size_bytes * (
            1 if isinstance(spec, UniformTypeKVCacheSpecs) else len(self.layer_names)
        )

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token writes in the group's attention layers (unpadded; 0 for Mamba)."""
        spec = self.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            return spec.bytes_per_token
        return (
            len(self.layer_names) * spec.bytes_per_token if isinstance(spec, AttentionSpec) else 0
        )


@dataclass(slots=True)
class VMMReservation:
    """The virtual side of a ``kv_cache_memory_mode="vmm"`` cache (vAttention): ``max_rows``
    request rows of ``max_blocks`` pages each, reserved as address space only. The pool's
    blocks are the physical pages (one per layer and KV head), so capacity is still the
    pool's ``num_blocks``."""

    max_rows: int
    max_blocks: int


@dataclass(slots=True)
class KVCacheConfig:
    """The planned cache: a pool of ``num_blocks`` blocks (block 0 is the null block, so
    ``num_blocks - 1`` are usable), each ``bytes_per_block`` bytes across all layers of the
    largest group, stored in ``layout`` (stride order of ``[L, B, H, N, C]``). ``vmm``: the
    request rows of a virtual-memory cache (None: the paged cache)."""

    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec]
    bytes_per_block: int
    layout: KVCacheLayout = DEFAULT_KV_CACHE_LAYOUT
    # Which Mamba checkpoints are kept (None: every block boundary; 0: end of step; k: every
    # k tokens): see ``MambaManager``.
    prefix_cache_retention_interval: int | None = None
    vmm: VMMReservation | None = None
    # KIVI caches: the request rows of each layer's residual (0: no KIVI layer), allocated
    # outside the pool (`kivi_residual_bytes` each per layer; the planner subtracts them).
    kivi_rows: int = 0

    @property
    def num_usable_blocks(self) -> int:
        return max(self.num_blocks - 1, 0)


def unify_kv_cache_spec_page_size(layer_specs: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Make every layer's page the same size so one pool block fits any layer.

    Rules (vLLM's): the target is the largest attention page; if a Mamba state is bigger, the
    target grows by the smallest integer factor that holds it. An attention layer whose page
    divides the target gets ``block_size *= target // page`` (more tokens per block, same
    bytes per token). A Mamba layer is padded (``page_size_padded``). Anything else raises
    NotImplementedError.
    """
    if not layer_specs:
        return {}
    pages = {s.page_size_bytes for s in layer_specs.values()}
    if len(pages) == 1:
        return dict(layer_specs)
    non_mamba = [s.page_size_bytes for s in layer_specs.values() if not isinstance(s, MambaSpec)]
    mamba = [s.page_size_bytes for s in layer_specs.values() if isinstance(s, MambaSpec)]
    target = max(non_mamba) if non_mamba else max(mamba)
    if mamba and max(mamba) > target:
        target *= cdiv(max(mamba), target)
    out: dict[str, KVCacheSpec] = {}
    for name, s in layer_specs.items():
        page = s.page_size_bytes
        if page == target:
            out[name] = s
        elif isinstance(s, MambaSpec):
            out[name] = dataclasses.replace(s, page_size_padded=target)
        elif isinstance(s, AttentionSpec) and s.page_size_padded is None and target % page == 0:
            out[name] = dataclasses.replace(s, block_size=s.block_size * (target // page))
        else:
            raise NotImplementedError(
                f"cannot unify KV cache page sizes: layer {name!r} ({s.kind}) has a "
                f"{page}-byte page, which does not divide the {target}-byte target page; "
                "pick a block size / head geometry whose pages are integer multiples"
            )
    return out


HYBRID_BLOCK_ALIGNMENT = 16  # attention block sizes of a Mamba hybrid are multiples of this


def align_hybrid_block_size(
    layer_specs: dict[str, KVCacheSpec], block_size: int, alignment: int = HYBRID_BLOCK_ALIGNMENT
) -> int:
    """The block size of a hybrid attention + Mamba model (vLLM's ``_align_hybrid_block_size``):
    an attention page must hold the largest Mamba state, so the attention block grows to
    ``alignment·cdiv(mamba_page, alignment·attn_bytes_per_token)`` tokens when ``block_size``
    is smaller (the Mamba page is then padded to the attention page). ``layer_specs`` are the
    model's specs at any block size; without Mamba or attention layers ``block_size`` is kept."""
    mamba = [s.real_page_size_bytes for s in layer_specs.values() if isinstance(s, MambaSpec)]
    attn = [s.bytes_per_token for s in layer_specs.values() if isinstance(s, AttentionSpec)]
    if not mamba or not attn:
        return block_size
    per_token = min(attn)  # the smallest attention page must hold the state
    return max(block_size, alignment * cdiv(max(mamba), alignment * per_token))


def get_kv_cache_groups(layer_specs: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Split layers into KV cache groups sharing one pool.

    * no layers → ``[]`` (attention-free model);
    * all specs merge (equal) → one group with every layer;
    * one attention type and block size, different head geometry → one group whose spec is a
      ``UniformTypeKVCacheSpecs`` (vLLM's rule: not the hybrid path, no padding);
    * otherwise (hybrid) → unify page sizes, bucket layers by spec, and deal each bucket
      round-robin into groups of ``group_size`` layers (``layers[i::num_groups]``), so every
      group has (about) the same number of layers and one block costs the same in each.
    """
    if not layer_specs:
        return []
    specs = list(layer_specs.values())
    try:
        merged = type(specs[0]).merge(specs)
        if all(type(s) is type(merged) for s in specs):
            return [KVCacheGroupSpec(list(layer_specs), merged)]
    except ValueError:
        pass
    uniform = UniformTypeKVCacheSpecs.from_specs(layer_specs)
    if uniform is not None:
        return [KVCacheGroupSpec(list(layer_specs), uniform)]
    return _groups_uniform_page_size(unify_kv_cache_spec_page_size(layer_specs))


def _groups_uniform_page_size(layer_specs: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    buckets: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        buckets.setdefault(spec, []).append(name)
    sizes = [len(v) for v in buckets.values()]
    lo, hi = min(sizes), max(sizes)
    # Prefer one group per type when counts are close (less padding); else the smallest count.
    group_size = hi if hi < 1.5 * lo else lo
    groups: list[KVCacheGroupSpec] = []
    for spec, names in buckets.items():
        num_groups = cdiv(len(names), group_size)
        groups.extend(KVCacheGroupSpec(names[i::num_groups], spec) for i in range(num_groups))
    return groups


def iter_layer_specs(groups: Iterable[KVCacheGroupSpec]) -> Iterable[tuple[str, KVCacheSpec]]:
    """``(layer name, its own spec)`` over all groups (a uniform-type group's layer specs)."""
    for g in groups:
        spec = g.kv_cache_spec
        for name in g.layer_names:
            yield (
                name,
                spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec,
            )


def scheduler_kv_cache_groups(groups: Iterable[KVCacheGroupSpec]) -> list[KVCacheGroupSpec]:
    """The groups as the block managers see them: a ``UniformTypeKVCacheSpecs`` replaced by its
    representative layer spec (vLLM's ``generate_scheduler_kv_cache_config``); the pool's
    block size in bytes is not their concern."""
    return [
        KVCacheGroupSpec(g.layer_names, g.kv_cache_spec.representative)
        if isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs)
        else g
        for g in groups
    ]
