"""Token eviction's tensor side (`core.token_eviction` holds the policy): SnapKV's selection,
the per-head compaction of kept tokens into new blocks, and the re-rotation of keys that
StreamingLLM's cache positions need.

Everything here reads and writes the paged cache through the per-layer views
``key_cache [NB, BS, Hkv, C]`` / ``value_cache [NB, BS, Hkv, Cv]`` (any layout, any KV format:
a token-head's bytes, codes and scales alike, sit in its own ``C`` row, so moving rows moves
the quantized data exactly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from pagedkv.ops.kv_gather import PagedKV


def snapkv_select(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: float,
    budget: int,
    sink_tokens: int,
    recent_tokens: int,
    pool_kernel: int,
) -> torch.Tensor:
    """SnapKV's choice: ``idx [Hkv, budget]`` (int64, ascending) of the cache indices each KV
    head keeps out of ``key [L, Hkv, D]``'s ``L > budget`` tokens.

    ``query [w, Hq, D]`` are the observation window's queries, at cache indices ``L - w ..
    L - 1`` (causal: query ``i`` reads keys ``<= L - w + i``). Scores: each window query's
    softmax over the keys, summed over the window, averaged over the ``Hq / Hkv`` query heads
    that share the KV head, then average-pooled (``pool_kernel`` wide, zero-padded, SnapKV's
    ``avg_pool1d``). A head keeps its first ``sink_tokens``, its last ``recent_tokens`` and the
    ``budget - sink - recent`` best-scored tokens between them.
    """
    L, hkv, d = key.shape
    w, hq = query.shape[0], query.shape[1]
    if L <= budget or budget < sink_tokens + recent_tokens:
        raise ValueError(f"cannot keep {budget} of {L} tokens with {sink_tokens}+{recent_tokens}")
    g = hq // hkv
    q = query.float().reshape(w, hkv, g, d)
    logits = torch.einsum("whgd,lhd->hgwl", q, key.float()) * scale
    rows = torch.arange(w, device=key.device)[:, None] + (L - w)
    logits.masked_fill_(torch.arange(L, device=key.device)[None, :] > rows, -math.inf)
    scores = torch.softmax(logits, dim=-1).sum(dim=2).mean(dim=1)  # [Hkv, L]
    if pool_kernel > 1:
        scores = F.avg_pool1d(scores[:, None], pool_kernel, 1, pool_kernel // 2)[:, 0]
    lo, hi = sink_tokens, L - recent_tokens
    picked = scores[:, lo:hi].topk(budget - sink_tokens - recent_tokens, dim=-1).indices + lo
    fixed = torch.cat([torch.arange(lo), torch.arange(hi, L)]).to(key.device)
    idx = torch.cat([picked, fixed.expand(hkv, -1)], dim=1)
    return idx.sort(dim=1).values


class CompactionPlan(Protocol):
    """What to keep (the engine's ``KVCompaction``): ``budgets[l]`` of ``num_tokens`` cached
    tokens in attention layer ``l``, with ``sink_tokens``, ``recent_tokens`` and the scores'
    ``pool_kernel``."""

    num_tokens: int
    budgets: list[int]
    sink_tokens: int
    recent_tokens: int
    pool_kernel: int


@dataclass(slots=True)
class SnapKVTarget:
    """One request compressing this step: its queries end at flat row ``q_end`` (exclusive),
    its cached tokens sit in ``block_ids`` and ``plan`` says what to keep; ``selected`` gets
    one ``[Hkv, budgets[l]]`` index tensor per attention layer ``l``, in forward order."""

    q_end: int
    num_q: int
    block_ids: list[int]
    plan: CompactionPlan
    selected: list[torch.Tensor] = field(default_factory=list)


class SnapKVObserver:
    """Set as ``AttentionMetadata.kv_observer`` for a step with compressing requests:
    ``paged_attention`` calls it once per layer, after the step's K/V are written, with the
    queries as attention sees them (rotated where the cache is) and the layer's paged K/V."""

    def __init__(self, targets: list[SnapKVTarget]) -> None:
        self.targets = targets

    def __call__(self, query: torch.Tensor, paged: PagedKV, block_size: int, scale: float) -> None:
        for t in self.targets:
            p = t.plan
            w = min(p.recent_tokens, t.num_q)
            n = -(-p.num_tokens // block_size)
            blocks = torch.tensor([t.block_ids[:n]], dtype=torch.int64, device=query.device)
            budget = p.budgets[len(t.selected)]
            if budget >= p.num_tokens:  # this layer keeps everything (a large pyramid budget)
                hkv = paged.num_kv_heads
                t.selected.append(torch.arange(p.num_tokens, device=query.device).expand(hkv, -1))
                continue
            k, _ = paged.gather(blocks)
            idx = snapkv_select(
                query[t.q_end - w : t.q_end],
                k[0, : p.num_tokens],
                scale,
                budget,
                p.sink_tokens,
                p.recent_tokens,
                p.pool_kernel,
            )
            t.selected.append(idx)


def _slots(block_ids: list[int], index: torch.Tensor, block_size: int) -> tuple[torch.Tensor, ...]:
    """``(block, offset)`` of cache indices ``index`` in a request's table."""
    table = torch.tensor(block_ids, dtype=torch.int64, device=index.device)
    return table[index // block_size], index % block_size


def compact(
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    src_blocks: list[int],
    dst_blocks: list[int],
    idx: torch.Tensor,
) -> None:
    """Copy, per KV head ``h``, the tokens ``idx[h]`` of the table ``src_blocks`` to cache
    indices ``0 .. budget-1`` of ``dst_blocks`` (K and V rows as stored). Reads everything
    before writing, so ``dst_blocks`` may be the first blocks of ``src_blocks``."""
    key_cache, value_cache = kv_cache
    bs = key_cache.shape[1]
    hkv, budget = idx.shape
    heads = torch.arange(hkv, device=idx.device)[:, None]
    sb, so = _slots(src_blocks, idx, bs)
    db, do = _slots(dst_blocks, torch.arange(budget, device=idx.device)[None, :], bs)
    for cache in (key_cache, value_cache):
        rows = cache[sb, so, heads]  # [Hkv, budget, C]
        cache[db, do, heads] = rows


def rerotate_keys(
    key_cache: torch.Tensor,
    block_ids: list[int],
    first: int,
    last: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotate: object,
) -> None:
    """Rotate the cached keys at cache indices ``[first, last)`` of a table in place by the
    angle ``(cos, sin)`` (``[1, 1, D/2]``; ``rotate`` is the model's ``RotaryEmbedding.apply``):
    RoPE is a rotation, so a key written at position ``p`` becomes the key at ``p - s`` under
    ``cos(s·θ), -sin(s·θ)``."""
    if last <= first:
        return
    bs = key_cache.shape[1]
    index = torch.arange(first, last, device=key_cache.device)
    b, o = _slots(block_ids, index, bs)
    keys = key_cache[b, o]  # [n, Hkv, D]
    key_cache[b, o] = rotate(keys, cos, sin)  # type: ignore[operator]
