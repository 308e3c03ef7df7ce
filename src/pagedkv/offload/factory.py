"""`build_offloading`: the offloading manager and worker for a parsed ``--kv-offload`` spec.

Its own module so that nothing imports in a circle: the tiers (fs_tier, redis_tier, p2p_tier)
import only `base` (and the P2P tier `pagedkv.transfer`), `tiering` imports `base` and
`cpu_manager`, and this factory imports them all. Every tier of the spec is built here, the
P2P tier like the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedkv.offload.base import OffloadingManager, SecondaryTier
from pagedkv.offload.cpu_manager import CPUOffloadingManager
from pagedkv.offload.tiering import TieringOffloadingManager
from pagedkv.offload.worker import HostChunkBuffer, OffloadingWorker

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


def _secondary_tiers(
    config: OffloadConfig,
    fingerprint: OffloadFingerprint,
    chunk_bytes: int,
    hash_seed: str,
    p2p_backend: str | None,
) -> list[SecondaryTier]:
    """The disk, Redis and P2P tiers of ``config``, in this order (fastest first)."""
    tiers: list[SecondaryTier] = []
    if config.disk is not None:
        from pagedkv.offload.fs_tier import FileSystemTier

        tiers.append(
            FileSystemTier(config.disk.path, fingerprint, config.disk.capacity_bytes, chunk_bytes)
        )
    if config.redis is not None:
        # Imported here: redis-py is needed only when a Redis tier is configured.
        from pagedkv.offload.redis_tier import RedisTier

        r = config.redis
        tiers.append(
            RedisTier(
                r.host,
                r.port,
                fingerprint,
                chunk_bytes,
                db=r.db,
                ttl_s=r.ttl_s,
                password=r.password,
            )
        )
    if config.p2p is not None:
        # Imported here: ZMQ and the transfer backends are needed only when peers are configured.
        from pagedkv.offload.p2p_tier import P2PTier

        p = config.p2p
        tiers.append(
            P2PTier(
                p.peers,
                fingerprint.hexdigest,
                hash_seed,
                chunk_bytes,
                listen_host=p.listen_host,
                listen_port=p.listen_port,
                capacity_bytes=p.capacity_bytes,
                backend=p2p_backend,
            )
        )
    return tiers
