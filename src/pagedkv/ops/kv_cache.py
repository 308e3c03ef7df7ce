"""KV cache storage: one flat buffer, per-layer strided K/V views, and whole-block copies.

The whole cache of all layers is ONE tensor whose dimensions are a permutation of
``LBHNC`` (outermost to innermost):

  * ``L`` layers, ``B`` blocks, ``H`` KV heads, ``N`` tokens per block (``block_size``),
  * ``C`` content: the key of one (token, head) followed by its value, so
    ``C = head_size + head_size_v`` elements.

``C`` must be innermost so every K row and every V row is contiguous (kernels and BLAS need a
unit stride along the head dimension). Everything above ``C`` is free: ``"LBNHC"`` (the default,
flash-attention's "NHD" order) keeps a block of one layer contiguous, ``"BLNHC"`` keeps a block
of *all* layers contiguous (one memcpy per block when offloading), ``"LBHNC"`` is vLLM's CPU
backend order. Whatever the layout, every layer sees the same logical views
``key_cache [num_blocks, block_size, num_kv_heads, head_size]`` and
``value_cache [num_blocks, block_size, num_kv_heads, head_size_v]``; they are strided views of
the flat buffer, so a write through them lands in the buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pagedkv import envs
from pagedkv.ops.triton import available as triton_available

LOGICAL_ORDER = "LBNHC"  # the order of the per-layer view dims: [L][B, N, H, C]
_LETTERS = frozenset("LBHNC")

KVCacheViews = list[tuple[torch.Tensor, torch.Tensor]]


def layout_name(layout: str | Any) -> str:
    """Normalise a layout given as a string or an object with ``.name`` (``KVCacheLayout``)."""
    name = layout if isinstance(layout, str) else getattr(layout, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"layout must be a str or have a str .name, got {layout!r}")
    name = name.upper()
    if len(name) != 5 or set(name) != _LETTERS:
        raise ValueError(f"layout {name!r} is not a permutation of 'LBHNC'")
    if name[-1] != "C":
        raise ValueError(f"layout {name!r}: C (K|V content) must be innermost")
    return name


MADV_HUGEPAGE = 14  # <sys/mman.h>
HUGE_PAGE = 2 << 20


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux for transparent huge pages under a large CPU tensor (``madvise(MADV_HUGEPAGE)``:
    THP is ``madvise``-only on most distributions). Fewer pages to walk make attention's
    gathers cheaper on the TLB and cross-process reads (UCX/CMA ``process_vm_readv`` pins
    every page) faster. Must run before the pages are first touched; a no-op (False) off
    Linux, on other devices, below 2 MiB, or where the kernel refuses."""
    import ctypes
    import sys

    if t.device.type != "cpu" or not sys.platform.startswith("linux") or not envs.PAGEDKV_THP:
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo = (start + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE  # madvise wants an aligned start
    if end - lo < HUGE_PAGE:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return (
            libc.madvise(
                ctypes.c_void_p(lo),
                ctypes.c_size_t((end - lo) // HUGE_PAGE * HUGE_PAGE),
                MADV_HUGEPAGE,
            )
            == 0
        )
    except (OSError, AttributeError):
        return False


def allocate_kv_cache(
    layout: str | Any,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    head_size_v: int | None = None,
) -> tuple[torch.Tensor, KVCacheViews]:
    """Allocate the flat, zero-filled KV buffer and return it with per-layer (K, V) views.

    Returns ``(buffer, [(key_cache, value_cache)] * num_layers)``; ``buffer`` has the dims of
    ``layout`` in order, ``key_cache`` is ``[num_blocks, block_size, num_kv_heads, head_size]``
    and ``value_cache`` ``[..., head_size_v]``, both views of ``buffer``.
    Zero-filled (not ``empty``) because masked-out slots are still multiplied by probability 0:
    uninitialised NaN bit patterns would poison the output.
    """
    name = layout_name(layout)
    head_size_v = head_size if head_size_v is None else head_size_v
    sizes = {
        "L": num_layers,
        "B": num_blocks,
        "H": num_kv_heads,
        "N": block_size,
        "C": head_size + head_size_v,
    }
    buffer = torch.empty([sizes[d] for d in name], dtype=dtype, device=device)
    advise_huge_pages(buffer)  # before the first touch: zero_ then faults 2 MiB pages
    buffer.zero_()
    logical = buffer.permute([name.index(d) for d in LOGICAL_ORDER])  # [L, B, N, H, C]
    views = [(layer[..., :head_size], layer[..., head_size:]) for layer in logical.unbind(0)]
    return buffer, views


def page_kv_views(
    pages: torch.Tensor, block_size: int, num_kv_heads: int, head_size: int, head_size_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) views of one layer whose pages are ``pages [num_blocks, page_elems]`` (unit stride
    on the last dim, in the cache's element dtype): each page read as ``[N, H, C]`` (the NHC
    order ``LBNHC`` uses inside a page), so ``key_cache`` is ``[num_blocks, block_size,
    num_kv_heads, head_size]`` and ``value_cache`` ``[..., head_size_v]`` as from
    `allocate_kv_cache`. How a layer whose geometry differs from the buffer's reads its slot
    (a Gemma 4 global layer, a group with a scaled block size, a UniformTypeKVCacheSpecs
    layer): only whole pages move between blocks, tiers and peers, so any reading of a page is
    fine as long as one layer always uses the same one. ValueError if the page is too small."""
    c = head_size + head_size_v
    need = block_size * num_kv_heads * c
    if pages.dim() != 2 or pages.stride(1) != 1 or need > pages.shape[1]:
        raise ValueError(
            f"a page of {tuple(pages.shape[1:])} elements cannot hold {block_size} tokens x "
            f"{num_kv_heads} heads x {c}"
        )
    base = pages.as_strided(
        (pages.shape[0], block_size, num_kv_heads, c),
        (pages.stride(0), num_kv_heads * c, c, 1),
        pages.storage_offset(),
    )
    return base[..., :head_size], base[..., head_size:]


def kv_combined_view(key_cache: torch.Tensor, value_cache: torch.Tensor) -> torch.Tensor | None:
    """The ``[B, N, H, D + Dv]`` view holding both K and V, if they interleave in one buffer.

    True for views made by ``allocate_kv_cache`` (V starts right after K inside each ``C`` run);
    returns ``None`` for separately allocated caches. Lets one gather/copy move K and V at once.
    """
    d = key_cache.shape[-1]
    if (
        key_cache.dim() != 4
        or value_cache.shape[:-1] != key_cache.shape[:-1]
        or key_cache.stride() != value_cache.stride()
        or key_cache.stride(-1) != 1
        or key_cache.dtype != value_cache.dtype
        or key_cache.device != value_cache.device
        or key_cache.untyped_storage().data_ptr() != value_cache.untyped_storage().data_ptr()
        or value_cache.storage_offset() != key_cache.storage_offset() + d
    ):
        return None
    c = d + value_cache.shape[-1]
    if key_cache.stride(-2) < c:  # the (head) rows would overlap: not a K|V interleave
        return None
    return key_cache.as_strided(
        (*key_cache.shape[:-1], c), key_cache.stride(), key_cache.storage_offset()
    )


def _as_pairs(
    block_mapping: Sequence[tuple[int, int]] | torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[(src, dst), ...]`` or ``Tensor[K, 2]`` → (src ids, dst ids) as int64 on ``device``."""
    pairs = torch.as_tensor(block_mapping, dtype=torch.int64).reshape(-1, 2).to(device)
    return pairs[:, 0], pairs[:, 1]


def _block_tensors(cache: torch.Tensor | Sequence[Any], merge: bool = True) -> list[torch.Tensor]:
    """Flatten a cache given as a tensor, (K, V) pairs or a list of tensors into block-major
    tensors (dim 0 = block id); ``merge`` fuses interleaved K/V into one view (half the copies)."""
    if isinstance(cache, torch.Tensor):
        return [cache]
    out: list[torch.Tensor] = []
    for item in cache:
        if isinstance(item, torch.Tensor):
            out.append(item)
            continue
        k, v = item
        kv = kv_combined_view(k, v) if merge else None
        out.extend([kv] if kv is not None else [k, v])
    return out


def copy_blocks(
    kv_caches: KVCacheViews, src_to_dst: Sequence[tuple[int, int]] | torch.Tensor
) -> None:
    """Copy whole blocks ``src → dst`` in every layer (copy-on-write for n > 1 sampling).

    All reads happen before any write, so a block may be both a source and a destination.
    Destinations must be distinct (otherwise which write wins is unspecified).
    """
    tensors = _block_tensors(kv_caches)
    if not tensors or len(src_to_dst) == 0:
        return
    src, dst = _as_pairs(src_to_dst, tensors[0].device)
    if (
        tensors[0].device.type == "cuda"
        and triton_available()
        and all(_can_copy(t) for t in tensors)
        and not _overlap(src_to_dst)
    ):
        from pagedkv.ops.triton.copy_blocks import copy_blocks_triton

        copy_blocks_triton(tensors, src, dst)
        return
    for t in tensors:
        t[dst] = t[src]  # index_put_ on a (possibly strided) view writes the buffer


def _can_copy(t: torch.Tensor) -> bool:
    """Block tensors the Triton copy handles: 2 to 4 dims, unit innermost stride."""
    return 2 <= t.dim() <= 4 and t.stride(-1) == 1


def _overlap(src_to_dst: Sequence[tuple[int, int]] | torch.Tensor) -> bool:
    """Some block is both a source and a destination: the concurrent Triton copy could read
    it after it was overwritten, so the torch path (reads first, then writes) must run."""
    pairs = torch.as_tensor(src_to_dst, dtype=torch.int64).reshape(-1, 2).cpu()
    return bool(torch.isin(pairs[:, 1], pairs[:, 0]).any())


def swap_blocks(
    src_views: torch.Tensor | Sequence[Any],
    dst_views: torch.Tensor | Sequence[Any],
    block_mapping: Sequence[tuple[int, int]] | torch.Tensor,
) -> None:
    """Copy blocks ``src_views[s] → dst_views[d]`` for each ``(s, d)``, across devices.

    ``src_views``/``dst_views`` are matching caches: a block-major tensor, a list of per-layer
    ``(key_cache, value_cache)`` pairs, or a list of tensors. Used to offload blocks to a host
    tier and to bring them back. Host→device copies are asynchronous (stream-ordered);
    device→host copies complete before returning.
    """
    srcs, dsts = _block_tensors(src_views), _block_tensors(dst_views)
    if len(srcs) != len(dsts):
        # One side is interleaved K|V and the other is not: fall back to separate K and V.
        srcs, dsts = _block_tensors(src_views, False), _block_tensors(dst_views, False)
    if not srcs or len(block_mapping) == 0:
        return
    src_ids, dst_ids = _as_pairs(block_mapping, srcs[0].device)
    dst_ids = dst_ids.to(dsts[0].device)
    for s, d in zip(srcs, dsts, strict=True):
        # Asynchronous only towards an accelerator: a host-side scatter would otherwise read
        # a device→host copy that may still be in flight.
        d[dst_ids] = s[src_ids].to(d.device, non_blocking=d.device.type != "cpu")
