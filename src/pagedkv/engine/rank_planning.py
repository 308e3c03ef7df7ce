"""Per-rank KV planning for tensor / decode context parallelism, shared by the engine's workers
and `pagedkv plan` (torch-free), so the plan prints what the ranks allocate.

The scheduler plans blocks for the rank whose block is largest (every rank must hold every
block id the scheduler hands out); each rank then allocates that many blocks of its own page
size. With DCP the scheduler's blocks are virtual blocks of ``block_size × dcp`` tokens and each
rank's physical block holds ``block_size`` of them; the KV memory is per rank.
"""

from __future__ import annotations

from pagedkv.core.parallel import RankLayout, rank_layout
from pagedkv.core.planning import bytes_per_block, make_kv_cache_config
from pagedkv.core.specs import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    align_hybrid_block_size,
    get_kv_cache_groups,
)
from pagedkv.engine.config import EngineConfig
from pagedkv.models.config import ModelConfig


def layout_for(config: EngineConfig, mc: ModelConfig, rank: int) -> RankLayout:
    """Rank ``rank``'s share of ``mc`` under ``config``'s TP/DCP sizes (ValueError if they do
    not fit the model)."""
    return rank_layout(
        rank=rank,
        tp=config.tensor_parallel_size,
        num_heads=mc.num_attention_heads,
        num_kv_heads=mc.num_kv_heads,
        intermediate_size=mc.intermediate_size,
        vocab_size=mc.vocab_size,
        dcp=config.decode_context_parallel_size,
        interleave=config.cp_kv_cache_interleave_size,
        mamba_heads=None if mc.mamba is None else (mc.mamba.n_heads, mc.mamba.n_groups),
    )


def rank_model_config(config: EngineConfig, mc: ModelConfig, rank: int) -> ModelConfig:
    """``mc`` as rank ``rank`` holds it (``mc`` itself without TP)."""
    if config.tensor_parallel_size == 1:
        return mc
    layout = layout_for(config, mc, rank)
    i0, i1 = layout.intermediate
    m = layout.mamba
    mamba = None if m is None else (m.num_heads, m.num_kv_heads)
    return mc.for_rank(layout.heads.num_heads, layout.heads.num_kv_heads, i1 - i0, mamba)


def kv_cache_specs(
    config: EngineConfig, mc: ModelConfig, dtype: str, block_size: int
) -> dict[str, KVCacheSpec]:
    return mc.kv_cache_specs(
        block_size, config.kv_cache_dtype, torch_dtype=dtype, kv_rotation=config.kv_rotation
    )


def widest_rank(config: EngineConfig, mc: ModelConfig, dtype: str, block_size: int) -> int:
    """The rank whose blocks take the most bytes (the most KV heads, or Mamba state): the
    scheduler plans for it, so every rank holds every block id it hands out."""
    tp = config.tensor_parallel_size
    sizes = [
        bytes_per_block(rank_kv_cache_groups(config, mc, dtype, block_size, r)) for r in range(tp)
    ]
    return sizes.index(max(sizes))


def hybrid_block_size(config: EngineConfig, mc: ModelConfig, dtype: str, block_size: int) -> int:
    """A Mamba hybrid's block size (`align_hybrid_block_size`), the largest any rank needs: at
    it every rank's attention page holds its own Mamba state, so all ranks group alike."""
    ranks = range(config.tensor_parallel_size)
    return max(
        align_hybrid_block_size(
            kv_cache_specs(config, rank_model_config(config, mc, r), dtype, 1), block_size
        )
        for r in ranks
    )


def scheduler_kv_cache_specs(
    config: EngineConfig, mc: ModelConfig, dtype: str, block_size: int
) -> dict[str, KVCacheSpec]:
    """The specs the scheduler plans with: those of `widest_rank`, in virtual blocks of
    ``block_size × dcp`` tokens (``mc``'s own specs without TP)."""
    tp, dcp = config.tensor_parallel_size, config.decode_context_parallel_size
    if tp == 1:
        return kv_cache_specs(config, mc, dtype, block_size)
    widest = widest_rank(config, mc, dtype, block_size)
    return kv_cache_specs(config, rank_model_config(config, mc, widest), dtype, block_size * dcp)


def rank_kv_cache_groups(
    config: EngineConfig, mc: ModelConfig, dtype: str, block_size: int, rank: int
) -> list[KVCacheGroupSpec]:
    """Rank ``rank``'s KV cache groups: its own KV heads in blocks of ``block_size`` tokens."""
    return get_kv_cache_groups(
        kv_cache_specs(config, rank_model_config(config, mc, rank), dtype, block_size)
    )


def rank_kv_cache_config(
    config: EngineConfig,
    mc: ModelConfig,
    dtype: str,
    block_size: int,
    scheduler: KVCacheConfig,
    rank: int,
) -> KVCacheConfig:
    """What rank ``rank`` allocates: the scheduler's number of blocks, each of ``block_size``
    tokens of its own KV heads (the scheduler's own config without TP)."""
    if config.tensor_parallel_size == 1:
        return scheduler
    groups = rank_kv_cache_groups(config, mc, dtype, block_size, rank)
    dcp = config.decode_context_parallel_size
    want = [g.kv_cache_spec.block_size // dcp for g in scheduler.kv_cache_groups]
    if [g.kv_cache_spec.block_size for g in groups] != want or [g.layer_names for g in groups] != [
        g.layer_names for g in scheduler.kv_cache_groups
    ]:
        raise RuntimeError(
            f"rank {rank}'s KV cache groups differ from the scheduler's: its blocks would not "
            "mean the same tokens"
        )
    out = make_kv_cache_config(
        groups, 0, num_blocks_override=scheduler.num_blocks, layout=scheduler.layout
    )
    out.prefix_cache_retention_interval = scheduler.prefix_cache_retention_interval
    return out
