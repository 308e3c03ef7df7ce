"""`build_offloading`: the offloading manager and worker for a parsed ``--kv-offload`` spec.

Its own module so that nothing imports in a circle: the tiers (fs_tier, redis_tier) import
only `base`, `tiering` imports `base` and `cpu_manager`, and this factory imports them all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pagedkv.offload.base import OffloadingManager, SecondaryTier
from pagedkv.offload.cpu_manager import CPUOffloadingManager
from pagedkv.offload.tiering import TieringOffloadingManager
from pagedkv.offload.worker import HostChunkBuffer, OffloadingWorker

if TYPE_CHECKING:
    import torch

    from pagedkv.offload.fingerprint import OffloadFingerprint
    from pagedkv.offload.spec import OffloadConfig


def build_offloading(config: OffloadConfig, fingerprint: OffloadFingerprint, kv_buffer: torch.Tensor,
                     layout: Any, *, cache_policy: str = "lru", store_threshold: int = 0,
                     enable_events: bool = True,
                     extra_tiers: Sequence[Callable[[int], SecondaryTier]] = ()
                     ) -> tuple[OffloadingManager, OffloadingWorker]:
    """The manager (scheduler side) and worker (device side) for a parsed ``--kv-offload``
    spec. CPU only → a `CPUOffloadingManager`; with disk/Redis → a `TieringOffloadingManager`.
    ``extra_tiers``: builders (given the chunk size) of tiers defined above this package (the
    P2P tier, which needs the KV transfer backends), placed after disk and Redis."""
    host = HostChunkBuffer.for_kv_cache(kv_buffer, layout, config.cpu.capacity_bytes,
                                        fingerprint.blocks_per_chunk)
    primary = CPUOffloadingManager(host.num_chunks, cache_policy, chunk_bytes=host.chunk_bytes,
                                   enable_events=enable_events, store_threshold=store_threshold)
    worker = OffloadingWorker(kv_buffer, layout, host)
    tiers = _secondary_tiers(config, fingerprint, host.chunk_bytes)
    tiers.extend(build(host.chunk_bytes) for build in extra_tiers)
    if not tiers:
        return primary, worker
    return TieringOffloadingManager(primary, host, tiers), worker


def _secondary_tiers(config: OffloadConfig, fingerprint: OffloadFingerprint,
                     chunk_bytes: int) -> list[SecondaryTier]:
    """The disk and Redis tiers of ``config``, fastest first."""
    tiers: list[SecondaryTier] = []
    if config.disk is not None:
        from pagedkv.offload.fs_tier import FileSystemTier

        tiers.append(FileSystemTier(config.disk.path, fingerprint, config.disk.capacity_bytes, chunk_bytes))
    if config.redis is not None:
        # Imported here: redis-py is needed only when a Redis tier is configured.
        from pagedkv.offload.redis_tier import RedisTier

        r = config.redis
        tiers.append(RedisTier(r.host, r.port, fingerprint, chunk_bytes, db=r.db,
                               ttl_s=r.ttl_s, password=r.password))
    return tiers
