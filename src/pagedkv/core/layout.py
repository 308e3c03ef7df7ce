"""KV-cache memory layout: where byte (layer, block, head, token, content) lives in a flat buffer.

The logical shape is always ``[L, B, H, N, C]``:

    L  layers (of one KV cache group's layer slots)
    B  blocks (the pool; block 0 is the null block)
    H  KV heads
    N  tokens per block (``block_size``)
    C  content bytes of one (token, head): K, then V, then inline scales if quantized

A ``KVCacheLayout`` is a stride order: its name lists the dimensions outermost → innermost
(vLLM's ``KVCacheLayout`` names: LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, ...). All 120 orders
exist as members; the ones with C innermost (``is_kernel_usable``, 24 of them) keep a
token-head's K|V bytes contiguous, which every attention kernel here needs. Useful picks:

    LBHNC  per-layer tensors ``[B, H, N, C]`` (vLLM's CPU-attention shape); layer-compact.
    LBNHC  per-layer ``[B, N, H, C]`` (flash/triton "NHD" order); layer-compact.
    BLHNC  one block of every layer is one range: offload/transfer a block with one memcpy.
    BLNHC  block-contiguous with NHD order inside each layer page.
"""

from __future__ import annotations

import enum
import itertools
import math

DIMS = "LBHNC"


class _KVCacheLayoutBase(enum.Enum):
    """Methods of ``KVCacheLayout``; members are generated below (one per permutation)."""

    @property
    def order(self) -> str:
        """Dimensions outermost → innermost, e.g. "LBHNC"."""
        return self.value

    @property
    def is_kernel_usable(self) -> bool:
        """C is innermost, so one token-head's content is contiguous (K|V|scales)."""
        return self.value[-1] == "C"

    @property
    def is_layer_compact(self) -> bool:
        """One layer's bytes form one contiguous range (for every shape): L is outermost."""
        return self.value[0] == "L"

    @property
    def is_block_contiguous(self) -> bool:
        """One block's bytes across all layers form one contiguous range: B is outermost.

        Then a whole block (every layer of the group) moves with one memcpy (offload, P/D).
        """
        return self.value[0] == "B"

    @property
    def is_page_contiguous(self) -> bool:
        """One (layer, block) page is one contiguous range: L and B are the two outermost."""
        return set(self.value[:2]) == {"L", "B"}

    def physical_shape(self, shape_lbhnc: tuple[int, int, int, int, int]) -> tuple[int, ...]:
        """The shape in storage order (what ``torch.empty`` would get before permuting)."""
        return tuple(shape_lbhnc[DIMS.index(d)] for d in self.value)

    def strides(self, shape_lbhnc: tuple[int, int, int, int, int]) -> tuple[int, ...]:
        """Byte strides of the logical dims L, B, H, N, C (in that order) for a dense buffer."""
        _check_shape(shape_lbhnc)
        stride: dict[str, int] = {}
        acc = 1
        for d in reversed(self.value):  # innermost first
            stride[d] = acc
            acc *= shape_lbhnc[DIMS.index(d)]
        return tuple(stride[d] for d in DIMS)

    def offset(
        self,
        l: int,
        b: int,
        h: int,
        n: int,
        c: int,  # noqa: E741 (L is the dim name)
        shape: tuple[int, int, int, int, int],
    ) -> int:
        """Byte offset of element (l, b, h, n, c) in a dense buffer of logical ``shape``."""
        idx = (l, b, h, n, c)
        for i, (x, size) in enumerate(zip(idx, shape)):
            if not 0 <= x < size:
                raise IndexError(f"index {x} out of range for dim {DIMS[i]} of size {size}")
        return sum(x * s for x, s in zip(idx, self.strides(shape)))

    @staticmethod
    def num_bytes(shape_lbhnc: tuple[int, int, int, int, int]) -> int:
        return math.prod(shape_lbhnc)

    @classmethod
    def parse(cls, name: str | _KVCacheLayoutBase) -> KVCacheLayout:
        if isinstance(name, KVCacheLayout):
            return name
        try:
            return KVCacheLayout[str(name).upper()]
        except KeyError:
            raise ValueError(f"unknown KV cache layout {name!r}: a permutation of {DIMS}") from None


def _check_shape(shape: tuple[int, ...]) -> None:
    if len(shape) != 5 or any(int(x) <= 0 for x in shape):
        raise ValueError(f"expected a positive [L, B, H, N, C] shape, got {shape}")


KVCacheLayout = _KVCacheLayoutBase(  # type: ignore[call-overload]
    "KVCacheLayout",
    [("".join(p), "".join(p)) for p in itertools.permutations(DIMS)],
    module=__name__,
    qualname="KVCacheLayout",
)
KVCacheLayout.__doc__ = "Stride order of the ``[L, B, H, N, C]`` KV cache (see module docstring)."

DEFAULT_KV_CACHE_LAYOUT: KVCacheLayout = KVCacheLayout.LBHNC  # type: ignore[attr-defined]
KERNEL_USABLE_LAYOUTS: tuple[KVCacheLayout, ...] = tuple(
    m for m in KVCacheLayout if m.is_kernel_usable
)


def logical_shape(
    num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, content_bytes: int
) -> tuple[int, int, int, int, int]:
    """``[L, B, H, N, C]`` for one group's layers (C from ``AttentionSpec.content_bytes``)."""
    shape = (num_layers, num_blocks, num_kv_heads, block_size, content_bytes)
    _check_shape(shape)
    return shape
