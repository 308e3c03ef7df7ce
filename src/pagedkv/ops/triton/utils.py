"""Small helpers shared by the Triton kernels."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The operand dtype of ``tl.dot`` for a ``dtype`` query: the query's own, except under the
    interpreter for bfloat16, whose ``tl.dot`` multiplies the raw uint16 bits (triton 3.7)."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("0", "")
    if interpreting and dtype == torch.bfloat16:
        return tl.float32
    return _TL_DTYPES.get(dtype, tl.float32)


def pow2(n: int, floor: int = 1) -> int:
    """Next power of two ``>= max(n, floor)`` (``tl.arange`` sizes must be powers of two)."""
    return max(floor, triton.next_power_of_2(n))


@triton.jit
def find_seq_idx(
    query_start_loc_ptr, target_idx, num_seqs, BLOCK_Q: tl.constexpr, use_q_block_mode: tl.constexpr
):
    """The sequence owning ``target_idx``: a query token, or (``use_q_block_mode``) a global
    q-block index where sequence ``i``'s blocks start at ``query_start_loc[i] // BLOCK_Q + i``.
    Binary search over the ``num_seqs + 1`` monotone offsets."""
    left: tl.int32 = 0  # typed: the loop-carried variables must keep one type when compiled
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        val = tl.load(query_start_loc_ptr + mid)
        if use_q_block_mode:
            val = val // BLOCK_Q + mid
        if val <= target_idx:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def apply_softcap(s, cap):
    """``cap·tanh(s/cap)`` as ``±cap·(1-e)/(1+e)`` with ``e = exp(-2|s|/cap) ∈ (0, 1]``: no
    overflow for any ``s`` (the two-exponential form gives inf/inf = NaN for large logits)."""
    e = tl.exp(-2.0 * tl.abs(s) / cap)
    t = cap * (1.0 - e) / (1.0 + e)
    return tl.where(s < 0.0, -t, t)
