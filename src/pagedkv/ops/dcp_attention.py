"""Decode-context-parallel attention: each rank of a DCP group holds 1/D of every sequence's
tokens (same KV heads), and their partial attentions are merged by log-sum-exp.

The step's new tokens' K/V are computed on every rank of the group (they hold the same heads),
so attention splits in two parts that need no causal bookkeeping across ranks:

* the **past** (positions before the step's first token of the sequence): every key is visible
  to every query of the step. Each rank attends the group's query heads (all-gathered) over its
  own shard of the past, stored densely at local positions ``[0, n_local)`` of the sequence's
  block table (see ``core/parallel.py``: a rank's tokens fill its physical blocks in order);
* the **chunk** (the step's own tokens, causal): each rank computes it for its own heads from
  the K/V it just computed, not from the cache.

The group all-gathers the past partials ``(out, lse)``; each rank merges the ``D`` past parts
of its heads with its chunk part (`merge_attn_states_multi`). vLLM merges DCP partials the same
way (its ``cp_lse_ag_out_rs``); it all-gathers queries, then reduce-scatters outputs.
"""

from __future__ import annotations

import torch

from pagedkv.distributed.parallel_state import GroupCoordinator
from pagedkv.ops.dense_attention import attend
from pagedkv.ops.kv_gather import PagedKV
from pagedkv.ops.merge_attn_states import merge_attn_states_multi
from pagedkv.ops.metadata import AttentionMetadata


def dcp_paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    group: GroupCoordinator,
    head_counts: tuple[int, ...],
    kv_quant: object | None = None,
) -> torch.Tensor:
    """Attention of this rank's query heads ``query [T, Hq, D]`` with the step's ``key``/
    ``value [T, Hkv, D]`` and this rank's past shard in the caches (already written).

    ``head_counts``: the query heads of each rank of the group (rank order).
    ``md`` is the rank's metadata: its ``block_table`` (blocks of ``block_size`` local tokens)
    and ``dcp_local_context_lens[i]`` (sequence ``i``'s past tokens held here); positions are
    global (``seq_lens``). Returns ``[T, Hq, Dv]`` in ``query.dtype``.
    """
    if kv_quant is not None:
        raise NotImplementedError("decode context parallelism with a quantized/rotated KV cache")
    sizes = list(head_counts)
    q_all = group.all_gather_uneven(query, sizes, dim=1)  # [T, H_group, D]
    paged = PagedKV.of(key_cache, value_cache)
    qsl, local_ctx = md.query_start_loc_cpu, md.dcp_local_context_lens
    t, hg = q_all.shape[0], q_all.shape[1]
    dv = value.shape[-1]
    past_out = torch.zeros(t, hg, dv, dtype=torch.float32, device=query.device)
    past_lse = torch.full((t, hg), float("-inf"), dtype=torch.float32, device=query.device)
    chunk_out = torch.empty(t, query.shape[1], dv, dtype=torch.float32, device=query.device)
    chunk_lse = torch.empty(t, query.shape[1], dtype=torch.float32, device=query.device)
    for i in range(md.num_seqs):
        a, b = qsl[i], qsl[i + 1]
        n = local_ctx[i]
        if n > 0:
            blocks = md.block_table[i : i + 1, : (n + md.block_size - 1) // md.block_size]
            k, v = paged.gather(blocks)
            o, lse = attend(q_all[a:b].transpose(0, 1).unsqueeze(0), k[:, :n], v[:, :n], scale)
            past_out[a:b] = o[0].transpose(0, 1).float()
            past_lse[a:b] = lse[0].transpose(0, 1)
        o, lse = attend(
            query[a:b].transpose(0, 1).unsqueeze(0),
            key[a:b].unsqueeze(0),
            value[a:b].unsqueeze(0),
            scale,
            causal=True,
        )
        chunk_out[a:b] = o[0].transpose(0, 1).float()
        chunk_lse[a:b] = lse[0].transpose(0, 1)
    outs = group.all_gather_list(past_out)
    lses = group.all_gather_list(past_lse)
    mine = sum(sizes[: group.rank])
    h = query.shape[1]
    parts_o = [o[:, mine : mine + h] for o in outs] + [chunk_out]
    parts_l = [lse[:, mine : mine + h] for lse in lses] + [chunk_lse]
    out, _ = merge_attn_states_multi(parts_o, parts_l)
    return out.to(query.dtype)
