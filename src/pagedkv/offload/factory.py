"""`build_offloading`: the offloading manager and worker for a parsed ``--kv-offload`` spec.

Its own module so that nothing imports in a circle: the tiers (fs_tier, redis_tier, p2p_tier)
import only `base` (and the P2P tier `pagedkv.transfer`), `tiering` imports `base` and
`cpu_manager`, and this factory imports them all. Every tier of the spec is built here, the
P2P tier like the others.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pagedkv.offload.base import OffloadingManager, SecondaryTier
from pagedkv.offload.codec import KVCodec, make_codec
from pagedkv.offload.cpu_manager import CPUOffloadingManager
from pagedkv.offload.sharded import (
    RankShard,
    RankShardInfo,
    ShardedTier,
    SharedHostMemory,
    plan_shards,
    rank_host_buffer,
)
from pagedkv.offload.tiering import TieringOffloadingManager
from pagedkv.offload.worker import HostChunkBuffer, OffloadingWorker, block_major_view

if TYPE_CHECKING:
    import torch

    from pagedkv.offload.fingerprint import OffloadFingerprint
    from pagedkv.offload.spec import OffloadConfig


def build_offloading(
    config: OffloadConfig,
    fingerprint: OffloadFingerprint,
    kv_buffer: torch.Tensor,
    layout: Any,
    *,
    cache_policy: str = "lru",
    store_threshold: int = 0,
    enable_events: bool = True,
    hash_seed: str = "",
    p2p_backend: str | None = None,
) -> tuple[OffloadingManager, OffloadingWorker]:
    """The manager (scheduler side) and worker (device side) for a parsed ``--kv-offload``
    spec. CPU only → a `CPUOffloadingManager`; with disk/Redis/P2P → a
    `TieringOffloadingManager`. ``hash_seed`` (how block hashes, hence offload keys, are made)
    and ``p2p_backend`` ("nixl" | "tcp" | None: NIXL when it imports) matter to a P2P tier
    only: peers must agree on the seed, and read each other with the backend."""
    host = HostChunkBuffer.for_kv_cache(
        kv_buffer, layout, config.cpu.capacity_bytes, fingerprint.blocks_per_chunk
    )
    primary = CPUOffloadingManager(
        host.num_chunks,
        cache_policy,
        chunk_bytes=host.chunk_bytes,
        enable_events=enable_events,
        store_threshold=store_threshold,
    )
    worker = OffloadingWorker(kv_buffer, layout, host)
    tiers = _secondary_tiers(config, fingerprint, host.chunk_bytes, hash_seed, p2p_backend)
    if not tiers:
        return primary, worker
    return TieringOffloadingManager(primary, host, tiers), worker


@dataclass(slots=True)
class ShardedOffloading:
    """`build_sharded_offloading`'s result: the driver's manager and copy worker, the shared
    host memory (kept open while the engine lives) and its shards."""

    manager: OffloadingManager
    worker: OffloadingWorker
    memory: SharedHostMemory
    shards: list[RankShard]
    num_chunks: int
    chunk_bytes: int


def build_sharded_offloading(
    config: OffloadConfig,
    fingerprint: OffloadFingerprint,
    kv_buffer: torch.Tensor,
    layout: Any,
    infos: list[RankShardInfo],
    *,
    cache_policy: str = "lru",
    store_threshold: int = 0,
    enable_events: bool = True,
) -> ShardedOffloading:
    """`build_offloading` for a TP/DCP engine (`offload.sharded`): ``infos`` are every rank's,
    rank 0 (this process, ``kv_buffer``) first. The CPU capacity is the shared buffer's (all
    ranks together); each lower tier is one `ShardedTier` of per-shard tiers whose capacities
    split the configured one by part size."""
    if config.p2p is not None:
        raise ValueError(
            "a p2p tier under tensor_parallel_size > 1 is not supported: peers exchange whole "
            "chunks of one rank; use cpu/disk/redis tiers"
        )
    shards = plan_shards(infos)
    chunk_bytes = sum(s.nbytes for s in shards)
    num_chunks = config.cpu.capacity_bytes // chunk_bytes
    if num_chunks <= 0:
        raise ValueError(f"{config.cpu.capacity_bytes} B holds no chunk of {chunk_bytes} B")
    memory = SharedHostMemory(num_chunks * chunk_bytes)
    host = HostChunkBuffer(
        num_chunks,
        1,
        (chunk_bytes,),
        memory.tensor.dtype,
        tensor=memory.tensor.view(num_chunks, chunk_bytes),
    )
    blocks = block_major_view(kv_buffer, layout)
    own = next(s for s in shards if s.rank == infos[0].writer)
    part = rank_host_buffer(
        memory.tensor, num_chunks, chunk_bytes, own.offset, blocks.shape[1:], blocks.dtype
    )
    primary = CPUOffloadingManager(
        num_chunks,
        cache_policy,
        chunk_bytes=chunk_bytes,
        enable_events=enable_events,
        store_threshold=store_threshold,
    )
    worker = OffloadingWorker(kv_buffer, layout, part)
    per_shard = [
        _secondary_tiers(
            config,
            replace(
                fingerprint,
                tp_rank=s.rank,
                tp_size=len(infos),
                num_kv_heads=s.num_kv_heads,
                dcp_rank=s.dcp_rank,
                dcp_size=s.dcp_size,
            ),
            s.nbytes,
            "",
            None,
            rank_namespace=s.namespace,
            share=s.nbytes / chunk_bytes,
        )
        for s in shards
    ]
    tiers: list[SecondaryTier] = [
        ShardedTier([(t, s.offset, s.nbytes) for t, s in zip(kind, shards)])
        for kind in zip(*per_shard)
    ]
    manager = TieringOffloadingManager(primary, host, tiers) if tiers else primary
    return ShardedOffloading(manager, worker, memory, shards, num_chunks, chunk_bytes)


def tier_codec(name: str, fingerprint: OffloadFingerprint) -> KVCodec:
    """The `offload.codec` codec ``name`` for chunks of ``fingerprint``'s configuration
    (ValueError when it does not fit, e.g. the lossy codec over quantized pages)."""
    # kv_quant is the spec's kv_format, "dtype:quant mode[:rotation]" ("none" in older ones).
    parts = fingerprint.kv_quant.split(":")
    quantized = len(parts) > 1 and parts[1] != "none"
    return make_codec(name, fingerprint.dtype, fingerprint.head_size, quantized)


def _secondary_tiers(
    config: OffloadConfig,
    fingerprint: OffloadFingerprint,
    chunk_bytes: int,
    hash_seed: str,
    p2p_backend: str | None,
    *,
    rank_namespace: str = "",
    share: float = 1.0,
) -> list[SecondaryTier]:
    """The disk, Redis and P2P tiers of ``config``, in this order (fastest first);
    ``rank_namespace`` and ``share`` (of each capacity) for one shard of a TP/DCP engine."""
    tiers: list[SecondaryTier] = []
    if config.disk is not None:
        from pagedkv.offload.fs_tier import FileSystemTier

        codec = tier_codec(config.disk.codec, fingerprint)
        tiers.append(
            FileSystemTier(
                config.disk.path,
                replace(fingerprint, codec=codec.name),
                int(config.disk.capacity_bytes * share),
                chunk_bytes,
                rank_namespace=rank_namespace,
                codec=codec,
            )
        )
    if config.redis is not None:
        # Imported here: redis-py is needed only when a Redis tier is configured.
        from pagedkv.offload.redis_tier import RedisTier

        r = config.redis
        codec = tier_codec(r.codec, fingerprint)
        tiers.append(
            RedisTier(
                r.host,
                r.port,
                replace(fingerprint, codec=codec.name),
                chunk_bytes,
                db=r.db,
                ttl_s=r.ttl_s,
                password=r.password,
                rank_namespace=rank_namespace,
                codec=codec,
            )
        )
    if config.p2p is not None:
        # Imported here: ZMQ and the transfer backends are needed only when peers are configured.
        from pagedkv.offload.p2p_tier import P2PTier

        p = config.p2p
        codec = tier_codec(p.codec, fingerprint)
        tiers.append(
            P2PTier(
                p.peers,
                replace(fingerprint, codec=codec.name).hexdigest,
                hash_seed,
                chunk_bytes,
                listen_host=p.listen_host,
                listen_port=p.listen_port,
                capacity_bytes=p.capacity_bytes,
                backend=p2p_backend,
                codec=codec,
            )
        )
    return tiers
