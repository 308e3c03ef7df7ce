"""Whole-block copies in Triton (copy-on-write), for every block-major tensor of a cache.

A block tensor is ``[num_blocks, X, Y, Z]`` (fewer inner dims are padded with size-1 dims)
with a unit stride along ``Z``: e.g. the fused ``[NB, BS, Hkv, D+Dv]`` K|V view of one layer in
any layout. One program copies one ``[Y, Z]`` row-plane of one (src, dst) pair.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.ops.triton.utils import pow2


@triton.jit
def _copy_blocks(
    cache_ptr,
    src_ptr,
    dst_ptr,
    stride_b,
    stride_x,
    stride_y,
    Y: tl.constexpr,
    Z: tl.constexpr,
    Y_PAD: tl.constexpr,
    Z_PAD: tl.constexpr,
):
    pair = tl.program_id(0)
    x = tl.program_id(1).to(tl.int64)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    offs_y = tl.arange(0, Y_PAD)
    offs_z = tl.arange(0, Z_PAD)
    inner = x * stride_x + offs_y[:, None] * stride_y + offs_z[None, :]
    mask = (offs_y[:, None] < Y) & (offs_z[None, :] < Z)
    row = tl.load(cache_ptr + src * stride_b + inner, mask=mask)
    tl.store(cache_ptr + dst * stride_b + inner, row, mask=mask)


def copy_blocks_triton(tensors: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """``t[dst[i]] = t[src[i]]`` for every tensor (block id = dim 0). The caller ensures no
    block is both a source and a destination (programs run concurrently) and that every
    tensor has 2 to 4 dims and a unit innermost stride."""
    if src.numel() == 0:
        return
    for t in tensors:
        v = t
        while v.dim() < 4:
            v = v.unsqueeze(1)
        _, x, y, z = v.shape
        _copy_blocks[(src.numel(), x)](
            v,
            src,
            dst,
            v.stride(0),
            v.stride(1),
            v.stride(2),
            Y=y,
            Z=z,
            Y_PAD=pow2(y),
            Z_PAD=pow2(z),
        )
