"""`Worker`: one rank of an engine — its share of the model, its `ModelRunner`, its KV cache.

A single-process engine has one Worker (rank 0, no process groups). A tensor-parallel engine
has one per rank: rank 0 lives in the engine's process (the *driver*: it builds each step's
`ModelInput` and returns the logits), the others in worker processes or Ray actors
(`engine/executor.py`), all running the same `ModelInput` each step.

Planning is shared with `pagedkv plan` (`scheduler_kv_cache_specs`, `rank_kv_cache_config`): the
scheduler plans blocks for the rank holding the most KV heads; each rank then allocates the same
number of blocks of its own page size (with DCP, blocks of ``block_size`` tokens standing for
the scheduler's virtual blocks of ``block_size × dcp``).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.core.parallel import RankLayout, max_rank_kv_heads, rank_layout, shard_heads
from pagedkv.core.planning import make_kv_cache_config
from pagedkv.core.specs import KVCacheConfig, KVCacheSpec, get_kv_cache_groups
from pagedkv.distributed.parallel_state import GroupCoordinator, ParallelContext, make_store
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.model_runner import ModelRunner, layer_kv_quants
from pagedkv.kv_transfer.base import KVConnectorBase
from pagedkv.models.config import ModelConfig, load_model_config
from pagedkv.models.loader import LoadedModel, get_model
from pagedkv.models.tp_sharding import local_model_config
from pagedkv.ops.kv_quant import KVQuant


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
    )


def rank_model_config(config: EngineConfig, mc: ModelConfig, rank: int) -> ModelConfig:
    """``mc`` as rank ``rank`` holds it (``mc`` itself without TP)."""
    if config.tensor_parallel_size == 1:
        return mc
    return local_model_config(mc, layout_for(config, mc, rank))


def _specs(
    config: EngineConfig, mc: ModelConfig, dtype: str, block_size: int
) -> dict[str, KVCacheSpec]:
    return mc.kv_cache_specs(
        block_size, config.kv_cache_dtype, torch_dtype=dtype, kv_rotation=config.kv_rotation
    )


def scheduler_kv_cache_specs(
    config: EngineConfig, mc: ModelConfig, dtype: str, block_size: int
) -> dict[str, KVCacheSpec]:
    """The specs the scheduler plans with: those of the rank holding the most KV heads, in
    virtual blocks of ``block_size × dcp`` tokens (``mc``'s own specs without TP)."""
    tp, dcp = config.tensor_parallel_size, config.decode_context_parallel_size
    if tp == 1:
        return _specs(config, mc, dtype, block_size)
    heads = max_rank_kv_heads(mc.num_attention_heads, mc.num_kv_heads, tp)
    widest = next(
        r
        for r in range(tp)
        if shard_heads(mc.num_attention_heads, mc.num_kv_heads, tp, r).num_kv_heads == heads
    )
    return _specs(config, rank_model_config(config, mc, widest), dtype, block_size * dcp)


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
    groups = get_kv_cache_groups(
        _specs(config, rank_model_config(config, mc, rank), dtype, block_size)
    )
    out = make_kv_cache_config(
        groups, 0, num_blocks_override=scheduler.num_blocks, layout=scheduler.layout
    )
    out.prefix_cache_retention_interval = scheduler.prefix_cache_retention_interval
    return out


def kv_quants_for(config: EngineConfig) -> Any:
    """The ``kv_quants`` callback of `get_model`: the KV formats of the specs the engine will
    allocate (same dtype, quant mode and rotation; a format does not depend on the block size)."""

    def build(mc: ModelConfig, dtype: torch.dtype) -> dict[str, KVQuant]:
        specs = _specs(config, mc, str(dtype).split(".")[-1], config.block_size)
        return layer_kv_quants(mc, specs, config.device)

    return build


class Worker:
    """Rank ``rank`` of an engine: loads its share of the model (joining the process groups'
    rendezvous at ``init_method`` first when there are several ranks) and owns its runner.

    ``connect()`` must follow on every rank of a TP engine before the first step (it blocks until
    all ranks joined), so a rank loads its weights while the others still load theirs.
    """

    def __init__(self, config: EngineConfig, rank: int = 0, init_method: str | None = None) -> None:
        self.config = config
        self.rank = rank
        tp, dcp = config.tensor_parallel_size, config.decode_context_parallel_size
        self.parallel: ParallelContext | None = None
        if tp > 1:
            if init_method is None:
                raise ValueError("a tensor-parallel worker needs distributed_init_method")
            mc = load_model_config(config.model)
            layout = layout_for(config, mc, rank)
            store = make_store(init_method, rank, tp, config.distributed_timeout_s)
            dev = config.device
            self.parallel = ParallelContext(
                layout,
                GroupCoordinator.create(store, rank, tp, dev, "tp", config.distributed_timeout_s),
                GroupCoordinator.create(
                    store,
                    layout.dcp_rank,
                    dcp,
                    dev,
                    f"dcp{layout.dcp_group_start}",
                    config.distributed_timeout_s,
                ),
            )
        self.loaded: LoadedModel = get_model(
            config.model,
            config.dtype,
            config.device,
            kv_quants=kv_quants_for(config),
            parallel=self.parallel,
        )
        mc = self.loaded.config
        self.model_config = rank_model_config(config, mc, rank)
        dcp_info = None
        if self.parallel is not None and dcp > 1:
            lay = self.parallel.layout
            dcp_info = (dcp, lay.dcp_interleave, lay.dcp_rank)
        self.runner = ModelRunner(
            self.loaded.model, self.model_config, self.loaded.dtype, config.device, dcp=dcp_info
        )

    def connect(self) -> None:
        """Join the process groups (blocks until every rank did; no-op for one rank)."""
        if self.parallel is not None:
            self.parallel.connect()

    def initialize_kv_cache(
        self, scheduler: KVCacheConfig, connector: KVConnectorBase | None = None
    ) -> None:
        """Allocate this rank's KV cache for the scheduler's plan (and register it with the
        connector, rank 0 only)."""
        self.runner.connector = connector
        dtype = str(self.loaded.dtype).split(".")[-1]
        cfg = rank_kv_cache_config(
            self.config, self.loaded.config, dtype, self.config.block_size, scheduler, self.rank
        )
        self.runner.initialize_kv_cache(cfg)
