"""Gathering paged K/V blocks into dense scratch tensors (the one copy attention needs).

Attention kernels here are dense torch ops, so a sequence's scattered blocks are first copied
into a contiguous workspace: one ``index_select`` per call moves whole blocks (memcpy speed for
layouts whose blocks are contiguous) and, when K and V interleave in one buffer, moves both at
once. The workspace is reused: multi-MB tensors allocated fresh on every call come straight
from mmap and pay a page fault per 4 KiB on first touch, which costs more than the copy.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from pagedkv.ops.kv_cache import kv_combined_view
from pagedkv.ops.kv_quant import KVQuant


class Workspace:
    """Grow-only scratch buffers reused across calls, one per (name, device, dtype).

    A view returned by :meth:`get` stays valid until the next ``get`` of the same name. Buffers
    are per thread (two engines may step on two threads of one process) and per inference
    mode (a buffer made under ``torch.inference_mode`` cannot be written outside it).
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def _bufs(self) -> dict[tuple[str, torch.device, torch.dtype, bool], torch.Tensor]:
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = {}
        return bufs

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        numel = math.prod(shape)
        bufs = self._bufs()
        key = (name, device, dtype, torch.is_inference_mode_enabled())
        buf = bufs.get(key)
        if buf is None or buf.numel() < numel:
            buf = bufs[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)

    def clear(self) -> None:
        """Release this thread's scratch memory (e.g. after a rare very long prefill)."""
        self._bufs().clear()


WORKSPACE = Workspace()


@dataclass(slots=True)
class PagedKV:
    """One layer's paged K/V: ``key_cache [NB, BS, Hkv, D]``, ``value_cache [NB, BS, Hkv, Dv]``.

    ``kv`` is their fused ``[NB, BS, Hkv, D + Dv]`` view when they interleave in one buffer
    (as :func:`allocate_kv_cache` lays them out), else ``None``. ``quant`` is the layer's
    :class:`KVQuant` when the cache is quantized: the caches are then ``uint8`` parts
    (``[..., k_bytes]``/``[..., v_bytes]``) and :meth:`gather` returns dequantized float32.
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    kv: torch.Tensor | None
    quant: KVQuant | None = None

    @classmethod
    def of(
        cls, key_cache: torch.Tensor, value_cache: torch.Tensor, quant: KVQuant | None = None
    ) -> PagedKV:
        if quant is not None and not quant.fmt.quantized:
            quant = None  # rotation only: the cache holds plain (rotated) values
        return cls(key_cache, value_cache, kv_combined_view(key_cache, value_cache), quant)

    @property
    def num_kv_heads(self) -> int:
        return self.key_cache.shape[2]

    @property
    def head_size(self) -> int:
        """Elements of one gathered key (for a quantized cache, after dequantization)."""
        return self.quant.fmt.head_size if self.quant is not None else self.key_cache.shape[3]

    @property
    def head_size_v(self) -> int:
        return self.quant.fmt.head_size_v if self.quant is not None else self.value_cache.shape[3]

    @property
    def token_bytes(self) -> int:
        """Bytes one gathered token (K and V of all KV heads) takes (float32 when dequantized)."""
        per_head = self.head_size + self.head_size_v
        size = 4 if self.quant is not None else self.key_cache.element_size()
        return self.num_kv_heads * per_head * size

    def gather(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k [B, n*BS, Hkv, D], v [B, n*BS, Hkv, Dv])`` for block ids ``blocks [B, n]``.

        Token ``j`` of row ``b`` is token ``j % BS`` of block ``blocks[b, j // BS]``. Cache
        dtype (float32 for a quantized cache, dequantized from the gathered bytes); the tensors
        live in :data:`WORKSPACE`, so use them before the next gather.
        """
        b, n = blocks.shape
        idx = blocks.reshape(-1)
        if self.kv is not None:
            kv = _gather("kv", self.kv, idx)
            kv = kv.view(b, n * kv.shape[1], *kv.shape[2:])
            split = self.key_cache.shape[3]
            k, v = kv[..., :split], kv[..., split:]
        else:
            k, v = _gather("k", self.key_cache, idx), _gather("v", self.value_cache, idx)
            k, v = k.view(b, n * k.shape[1], *k.shape[2:]), v.view(b, n * v.shape[1], *v.shape[2:])
        if self.quant is not None:
            return self.quant.dequantize(k, v)
        return k, v


def _gather(name: str, src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``src[idx]`` into workspace memory, contiguous in logical order whatever src's strides."""
    dst = WORKSPACE.get(name, (idx.numel(), *src.shape[1:]), src.dtype, src.device)
    return torch.index_select(src, 0, idx, out=dst)
