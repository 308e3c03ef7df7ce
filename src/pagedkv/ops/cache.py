"""Slot mapping and cache writes: where each new token's K/V lives in the paged cache.

A *slot* is a flat token address in the cache: ``slot = block_id * block_size + offset``, with
``offset = position % block_size``. The engine computes one slot per scheduled token; each
layer then scatters its new K/V rows to those slots (vLLM's ``reshape_and_cache_flash``).
"""

from __future__ import annotations

import torch

from pagedkv.ops.kv_quant import KVQuant
from pagedkv.ops.triton import available as triton_available


def compute_slot_mapping(
    block_table: torch.Tensor, req_indices: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Slots of ``T`` tokens: ``block_table[req, pos // bs] * bs + pos % bs``.

    ``block_table`` is ``[S, max_blocks]`` (int32), ``req_indices`` and ``positions`` are
    ``[T]`` (int64: the row of each token's sequence, and its absolute position).
    Returns ``[T]`` int64. Positions must lie inside the table (no bounds padding here).
    """
    block_ids = block_table[req_indices, positions // block_size].to(torch.int64)
    return block_ids * block_size + positions % block_size


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_quant: KVQuant | None = None,
) -> None:
    """Write the rows ``key[t]``/``value[t]`` to slot ``slot_mapping[t]`` of the caches.

    Shapes: ``key [T, Hkv, D]``, ``value [T, Hkv, Dv]``, ``key_cache [NB, BS, Hkv, D]``,
    ``value_cache [NB, BS, Hkv, Dv]`` (any strides: views of a flat buffer in any layout),
    ``slot_mapping [T]``. A negative slot is skipped (padding). Slots must be distinct among
    the non-negative ones. Values are cast to the cache dtype.

    ``kv_quant`` (a quantized or rotated cache): rows are rotated and/or quantized first, and a
    quantized cache's ``uint8`` parts (``[NB, BS, Hkv, k_bytes]``) receive the packed bytes.
    """
    if kv_quant is not None and kv_quant.fmt.mode.is_kivi:
        # A KIVI block is coded when it fills, which needs the step's metadata: attention
        # (`ops.kivi.kivi_attention`) writes these rows.
        kv_quant.pending = (key, value, slot_mapping.to(torch.int64))
        return
    on_gpu = key_cache.device.type == "cuda" and triton_available()
    if kv_quant is not None and kv_quant.fmt.quantized and on_gpu:
        from pagedkv.ops.triton.reshape_and_cache import reshape_and_cache_triton

        key, value = kv_quant.prepare(key, value)  # the kernel quantizes, in the codec's bytes
        reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping, kv_quant)
        return
    if kv_quant is not None:
        key, value = kv_quant.quantize(key, value)
    elif on_gpu:
        from pagedkv.ops.triton.reshape_and_cache import reshape_and_cache_triton

        reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping)
        return
    block_size = key_cache.shape[1]
    slots = slot_mapping.to(device=key_cache.device, dtype=torch.int64)
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    blocks, offsets = slots // block_size, slots % block_size
    # Indexing [block, offset] (not a flattened [NB*BS] view) works for every layout: a
    # flatten of B and N would silently copy when they are not adjacent in memory.
    key_cache[blocks, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.dtype)
