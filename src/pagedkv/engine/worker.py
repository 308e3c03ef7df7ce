"""`Worker`: one rank of an engine — its share of the model, its `ModelRunner`, its KV cache.

A single-process engine has one Worker (rank 0, no process groups). A tensor-parallel engine
has one per rank: rank 0 lives in the engine's process (the *driver*: it builds each step's
`ModelInput` and returns the logits), the others in worker processes or Ray actors
(`engine/executor.py`), all running the same `ModelInput` each step.

Each rank allocates what `engine/rank_planning.py` (shared with `pagedkv plan`) says.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.core.specs import KVCacheConfig
from pagedkv.distributed.parallel_state import GroupCoordinator, ParallelContext, make_store
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.model_runner import ModelRunner, layer_kv_quants
from pagedkv.engine.rank_planning import (
    hybrid_block_size,
    kv_cache_specs,
    layout_for,
    rank_kv_cache_config,
    rank_model_config,
)
from pagedkv.kv_transfer.base import KVConnectorBase
from pagedkv.models.config import ModelConfig, load_model_config
from pagedkv.models.loader import LoadedModel, get_model
from pagedkv.ops.kv_quant import KVQuant


def kv_quants_for(config: EngineConfig) -> Any:
    """The ``kv_quants`` callback of `get_model`: the KV formats of the specs the engine will
    allocate (same dtype, quant mode and rotation; a format does not depend on the block size)."""

    def build(mc: ModelConfig, dtype: torch.dtype) -> dict[str, KVQuant]:
        specs = kv_cache_specs(config, mc, str(dtype).split(".")[-1], config.block_size)
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
        mc = self.loaded.config
        # the engine's block size: a Mamba hybrid's is raised so pages hold a state
        block_size = hybrid_block_size(self.config, mc, dtype, self.config.block_size)
        cfg = rank_kv_cache_config(self.config, mc, dtype, block_size, scheduler, self.rank)
        self.runner.initialize_kv_cache(cfg)
