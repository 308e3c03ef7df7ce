"""Which part of each checkpoint tensor a tensor-parallel rank keeps (vLLM's weight loaders of
ColumnParallelLinear, RowParallelLinear, QKVParallelLinear and VocabParallelEmbedding, as
rules on HF names).

* column-parallel (output rows split): ``q_proj`` by query heads, ``k_proj``/``v_proj`` by KV
  heads (a replicated KV head is kept by every rank that reads it), ``gate_proj``/``up_proj`` by
  intermediate rows, ``embed_tokens``/``lm_head`` by vocabulary rows; biases alike.
* row-parallel (input columns split, outputs summed by an all-reduce): ``o_proj`` by query
  heads, ``down_proj`` by intermediate columns.
* everything else (norms, rope factors) is replicated.

Quantized GGUF rows (``[out, bytes]`` of ggml blocks) split the same way: output rows freely,
input columns only at block boundaries; a tensor whose column split would cut a block is
reported unsplittable (None) and its layer keeps the dense weights.
"""

from __future__ import annotations

import torch

from pagedkv.core.parallel import RankLayout
from pagedkv.models.config import ModelConfig

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def _kind(name: str) -> tuple[str, str] | None:
    """``("column"|"row"|"vocab", projection)`` of an HF parameter name, or None (replicated)."""
    if name in _VOCAB:
        return "vocab", name
    parts = name.split(".")
    proj = parts[-2] if len(parts) >= 2 else ""
    if proj in _COLUMN:
        return "column", proj
    if proj in _ROW and parts[-1] == "weight":
        return "row", proj
    if proj in _ROW:  # a row-parallel bias is added once, after the all-reduce: rank 0 keeps it
        return "row_bias", proj
    return None


def _range(proj: str, layout: RankLayout, head_dim: int) -> tuple[int, int]:
    h = layout.heads
    if proj in ("q_proj", "o_proj"):
        return h.q_start * head_dim, h.q_end * head_dim
    if proj in ("k_proj", "v_proj"):
        return h.kv_start * head_dim, h.kv_end * head_dim
    if proj in ("gate_proj", "up_proj", "down_proj"):
        return layout.intermediate
    return layout.vocab


def shard_weight(name: str, w: torch.Tensor, layout: RankLayout, head_dim: int) -> torch.Tensor:
    """Rank ``layout.rank``'s part of dense checkpoint tensor ``name`` (a view; ``w`` itself
    when replicated)."""
    kind = _kind(name)
    if kind is None:
        return w
    what, proj = kind
    if what == "row_bias":
        return w if layout.rank == 0 else torch.zeros_like(w)
    start, end = _range(proj, layout, head_dim)
    dim = 1 if what == "row" else 0
    return w.narrow(dim, start, end - start)


def shard_quantized(
    name: str,
    rows: torch.Tensor,
    layout: RankLayout,
    head_dim: int,
    block_weights: int,
    block_bytes: int,
) -> torch.Tensor | None:
    """Rank ``layout.rank``'s part of the ggml rows ``rows [out, bytes]`` of ``name``
    (``block_weights`` weights in ``block_bytes`` bytes per ggml block), or None when a column
    split would cut a block."""
    kind = _kind(name)
    if kind is None:
        return rows
    what, proj = kind
    if what == "row_bias":
        return None
    start, end = _range(proj, layout, head_dim)
    if what != "row":
        return rows.narrow(0, start, end - start).contiguous()
    if start % block_weights or end % block_weights:
        return None
    b0, b1 = start // block_weights * block_bytes, end // block_weights * block_bytes
    return rows[:, b0:b1].contiguous()


def local_model_config(config: ModelConfig, layout: RankLayout) -> ModelConfig:
    """``config`` as rank ``layout.rank`` sees it (`ModelConfig.for_rank`)."""
    i0, i1 = layout.intermediate
    m = layout.mamba
    mamba = None if m is None else (m.num_heads, m.num_kv_heads)
    return config.for_rank(layout.heads.num_heads, layout.heads.num_kv_heads, i1 - i0, mamba)
