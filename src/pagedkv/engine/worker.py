"""`Worker`: one rank of an engine — its share of the model, its `ModelRunner`, its KV cache.

A single-process engine has one Worker (rank 0, no process groups). A tensor-parallel engine
has one per rank: rank 0 lives in the engine's process (the *driver*: it builds each step's
`ModelInput` and returns the logits), the others in worker processes or Ray actors
(`engine/executor.py`), all running the same `ModelInput` each step.

Each rank allocates what `engine/rank_planning.py` (shared with `pagedkv plan`) says.
"""

from __future__ import annotations

import socket
from typing import Any

import torch

from pagedkv.core.parallel import kv_shard_writers
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
from pagedkv.offload.rank_worker import RankOffloadWorker
from pagedkv.offload.sharded import (
    HostAttachment,
    RankShardInfo,
    SharedKVBuffer,
    share_kv_buffer,
)
from pagedkv.offload.worker import block_major_view
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
            gguf_activations=config.gguf_activations,
        )
        mc = self.loaded.config
        self.model_config = rank_model_config(config, mc, rank)
        dcp_info = None
        if self.parallel is not None and dcp > 1:
            lay = self.parallel.layout
            dcp_info = (dcp, lay.dcp_interleave, lay.dcp_rank)
        self.kv_cache_config: KVCacheConfig | None = None
        self.rank_offload: RankOffloadWorker | None = None  # ranks 1..N-1 with offload tiers
        self.shared_kv: SharedKVBuffer | None = None
        self.runner = ModelRunner(
            self.loaded.model, self.model_config, self.loaded.dtype, config.device, dcp=dcp_info
        )

    def connect(self) -> None:
        """Join the process groups (blocks until every rank did; no-op for one rank)."""
        if self.parallel is not None:
            self.parallel.connect()

    def initialize_kv_cache(
        self,
        scheduler: KVCacheConfig,
        connector: KVConnectorBase | None = None,
        share_kv: bool = False,
    ) -> None:
        """Allocate this rank's KV cache for the scheduler's plan (and register it with the
        connector, rank 0 only). ``share_kv``: move it to shared memory, for a driver-side
        connector that transfers every rank's blocks (`offload.sharded.share_kv_buffer`)."""
        self.runner.connector = connector
        dtype = str(self.loaded.dtype).split(".")[-1]
        mc = self.loaded.config
        # the engine's block size: a Mamba hybrid's is raised so pages hold a state
        block_size = hybrid_block_size(self.config, mc, dtype, self.config.block_size)
        cfg = rank_kv_cache_config(self.config, mc, dtype, block_size, scheduler, self.rank)
        self.kv_cache_config = cfg
        self.runner.initialize_kv_cache(cfg)
        if share_kv:
            self.shared_kv = share_kv_buffer(self.runner.kv_buffer)

    def shard_info(self) -> RankShardInfo:
        """This rank's KV shard, for the driver's offload tiers (after `initialize_kv_cache`)."""
        assert self.kv_cache_config is not None and self.runner.kv_buffer is not None
        mc = self.loaded.config
        tp = self.config.tensor_parallel_size
        layouts = [layout_for(self.config, mc, r) for r in range(tp)]
        lay = layouts[self.rank]
        blocks = block_major_view(self.runner.kv_buffer, self.kv_cache_config.layout)
        return RankShardInfo(
            rank=self.rank,
            writer=kv_shard_writers(layouts)[self.rank],
            block_shape=tuple(blocks.shape[1:]),
            dtype=str(blocks.dtype).removeprefix("torch."),
            block_bytes=blocks[0].numel() * blocks.element_size(),
            num_kv_heads=lay.heads.num_kv_heads,
            dcp_rank=lay.dcp_rank,
            dcp_size=lay.dcp_size,
            namespace=lay.namespace,
            host=socket.gethostname(),
            kv_memory=self.shared_kv,
        )

    def attach_offload(self, attachment: HostAttachment) -> None:
        """Map this rank's part of the driver's shared host buffer (ranks 1..N-1)."""
        assert self.kv_cache_config is not None and self.runner.kv_buffer is not None
        self.rank_offload = RankOffloadWorker(
            self.runner.kv_buffer, self.kv_cache_config.layout, attachment
        )

    def execute(self, mi: Any) -> set[int] | None:
        """Ranks 1..N-1: run the step ``mi`` with its offload copies around the forward pass;
        the ids of the copy jobs that failed (None when the step had none)."""
        work = mi.kv_work
        if work is None:
            self.runner.execute_model_input(mi)
            return None
        if self.rank_offload is None:
            raise RuntimeError("offload copies sent to a rank without the shared host buffer")
        failed = self.rank_offload.run(work.before)
        self.runner.execute_model_input(mi)
        return failed | self.rank_offload.run(work.after)
