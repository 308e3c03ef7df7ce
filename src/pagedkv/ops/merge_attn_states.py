"""Merging partial attention results by log-sum-exp (flash-decoding, cascade, chunked context).

Attention over a key range split into parts can be computed part by part: each part gives its
normalised output ``o_i`` and ``lse_i = log Σ_k exp(s_k)`` over its keys. The whole is
``o = Σ_i w_i·o_i`` with ``w_i = exp(lse_i − lse)`` and ``lse = log Σ_i exp(lse_i)``.
An empty part (no visible key) has ``lse = −inf`` and weight 0; vLLM also maps ``+inf``
(its marker for "no output") to ``−inf``. If every part is empty the output is 0 and the
lse ``−inf``.

Shapes: ``out [..., D]`` and ``lse [...]`` (= ``out.shape[:-1]``, e.g. ``[T, H]``; note vLLM's
CUDA op takes lse head-major ``[H, T]``). Math is float32; ``out`` keeps the input dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def merge_attn_states_multi(
    outs: Sequence[torch.Tensor] | torch.Tensor,
    lses: Sequence[torch.Tensor] | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``K`` partial results: ``outs [K, ..., D]`` and ``lses [K, ...]`` (or lists)."""
    outs = torch.stack(list(outs)) if not isinstance(outs, torch.Tensor) else outs
    lses = torch.stack(list(lses)) if not isinstance(lses, torch.Tensor) else lses
    lses = lses.float().masked_fill(lses == float("inf"), float("-inf"))
    m = lses.amax(dim=0)
    # Shift by 0 where every part is empty so exp() gives 0, not exp(-inf + inf) = nan.
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses - m_safe)  # [K, ...]
    total = w.sum(dim=0)  # [...]
    w = w / torch.where(total > 0, total, torch.ones_like(total))
    out = (w.unsqueeze(-1) * outs.float()).sum(dim=0)
    return out.to(outs.dtype), torch.log(total) + m_safe


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial results (vLLM's ``merge_attn_states``, prefix + suffix).

    ``m = max(lse_a, lse_b)``; ``w_a = e^(lse_a−m) / (e^(lse_a−m) + e^(lse_b−m))``;
    ``out = w_a·o_a + w_b·o_b``; ``lse = log(e^(lse_a−m) + e^(lse_b−m)) + m``.
    Returns ``(out [..., D] in out_a's dtype, lse [...] float32)``.
    """
    return merge_attn_states_multi((out_a, out_b), (lse_a, lse_b))
