"""Rank-sharded offloading: the tiers of a tensor- or decode-context-parallel engine.

Under TP/DCP every rank holds a share of every block (its KV heads, its tokens: see
`core.parallel`). The offload path keeps one scheduler-side manager (the driver's: one LRU,
one index of which keys are stored) and lets every rank move its own bytes:

* **One shared host buffer.** A chunk slot is the concatenation of the *distinct* shards'
  blocks, in writer-rank order (`plan_shards`); ranks holding identical caches (a KV head
  replicated past ``num_kv_heads`` ranks, no DCP) share one part: the lowest of them writes it,
  the others only read it (`core.parallel.kv_shard_writers`). The buffer is a ``memfd`` the
  driver creates; each rank maps it (`attach_host_memory`) and copies between its device blocks
  and its part (`rank_host_buffer`). So every rank must be on the driver's host; a rank
  elsewhere is refused at start-up (`check_same_host`).
* **One namespace per shard in every lower tier.** `ShardedTier` fronts one disk/Redis tier per
  shard, each with the shard's fingerprint (``tp_rank``/``tp_size``/``dcp_rank``/KV heads: a tier
  written at TP=2 is a miss at TP=1, never a wrong read) and its namespace in the path or key
  (``pagedkv-<fingerprint>@tp_rank:1@dcp0``, MooncakeStore's form). A key is stored, present
  or loaded only when every shard is.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from pagedkv.offload.base import ChunkItems, OffloadingEvent, OffloadKey, SecondaryTier
from pagedkv.offload.worker import HostChunkBuffer


@dataclass(frozen=True, slots=True)
class RankShardInfo:
    """What a rank reports once its KV cache is allocated (the driver plans the host buffer
    from every rank's)."""

    rank: int
    writer: int  # the lowest rank whose cache is identical to this one's (itself if none)
    block_shape: tuple[int, ...]  # one block of the rank's cache, block-major
    dtype: str
    block_bytes: int
    num_kv_heads: int
    dcp_rank: int
    dcp_size: int
    namespace: str  # "@tp_rank:R@dcpD" (`core.parallel.RankLayout.namespace`)
    host: str  # the rank's hostname: the host buffer is shared memory
    # The rank's whole KV buffer in shared memory, when a connector reads and writes it from
    # the driver (PD transfers: `share_kv_buffer`); None otherwise.
    kv_memory: SharedKVBuffer | None = None


@dataclass(frozen=True, slots=True)
class SharedKVBuffer:
    """A rank's KV buffer moved to shared memory: what another process of this host needs to
    map the same pages (`map_kv_buffer`)."""

    pid: int
    fd: int
    nbytes: int  # of the whole storage
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: str


def share_kv_buffer(kv_buffer: torch.Tensor) -> SharedKVBuffer:
    """Move ``kv_buffer``'s storage to shared memory in place (every view of it follows: the
    storage object is kept, its pages are replaced) and say how to map it. Call before anything
    caches its address (the transfer backends register it afterwards)."""
    if kv_buffer.is_cuda:
        raise ValueError("a CUDA KV buffer cannot be shared through host memory")
    storage = kv_buffer.untyped_storage()
    storage.share_memory_()
    fd, nbytes = storage._share_fd_cpu_()
    return SharedKVBuffer(
        os.getpid(),
        fd,
        nbytes,
        tuple(kv_buffer.shape),
        tuple(kv_buffer.stride()),
        kv_buffer.storage_offset(),
        str(kv_buffer.dtype).removeprefix("torch."),
    )


def map_kv_buffer(handle: SharedKVBuffer) -> torch.Tensor:
    """The rank's KV buffer as a tensor of this process (the same pages, ``MAP_SHARED``)."""
    memory = attach_host_memory(f"/proc/{handle.pid}/fd/{handle.fd}", handle.nbytes)
    typed = memory.view(getattr(torch, handle.dtype))
    return typed.as_strided(handle.shape, handle.stride, handle.storage_offset)


@dataclass(frozen=True, slots=True)
class RankShard:
    """One distinct shard: where its part sits in a chunk slot, and its tier namespace."""

    rank: int  # the writer rank
    offset: int  # bytes into each chunk slot
    nbytes: int  # bytes of the part (one block of the writer's cache)
    num_kv_heads: int
    dcp_rank: int
    dcp_size: int
    namespace: str


@dataclass(frozen=True, slots=True)
class HostAttachment:
    """What rank ``rank`` needs to map its part of the shared host buffer."""

    path: str
    num_chunks: int
    chunk_bytes: int
    offset: int
    is_writer: bool


def plan_shards(infos: Sequence[RankShardInfo]) -> list[RankShard]:
    """The distinct shards of ``infos`` (one per writer, in rank order) with their offsets."""
    shards: list[RankShard] = []
    offset = 0
    for i in sorted(infos, key=lambda i: i.rank):
        if i.writer == i.rank:
            shards.append(
                RankShard(
                    i.rank,
                    offset,
                    i.block_bytes,
                    i.num_kv_heads,
                    i.dcp_rank,
                    i.dcp_size,
                    i.namespace,
                )
            )
            offset += i.block_bytes
    return shards


def check_same_host(infos: Sequence[RankShardInfo]) -> None:
    """ValueError unless every rank runs on this host (the host buffer is shared memory)."""
    here = socket.gethostname()
    away = [i.rank for i in infos if i.host != here]
    if away:
        raise ValueError(
            f"a KV connector under tensor_parallel_size > 1 needs every rank on the engine's "
            f"host ({here}): ranks share memory with it; rank(s) {away} run elsewhere"
        )


class SharedHostMemory:
    """``nbytes`` of zeroed shared memory (an anonymous ``memfd``), mappable by other processes
    of this user through `path` while this object lives; freed when every mapping is gone."""

    def __init__(self, nbytes: int) -> None:
        self.fd = os.memfd_create("pagedkv-host-kv", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, nbytes)
        self.nbytes = nbytes
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"
        self.tensor = attach_host_memory(self.path, nbytes)
        # Fault every page in now rather than during the first transfers (memfd pages are zero).
        self.tensor.zero_()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def attach_host_memory(path: str, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the shared memory at ``path`` (``MAP_SHARED``: writes are seen by
    every process that mapped it)."""
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def rank_host_buffer(
    memory: torch.Tensor,
    num_chunks: int,
    chunk_bytes: int,
    offset: int,
    block_shape: Sequence[int],
    dtype: torch.dtype,
) -> HostChunkBuffer:
    """A rank's part of the shared buffer as a `HostChunkBuffer` of one block per chunk: slot
    ``c`` is the ``prod(block_shape)`` elements at byte ``c * chunk_bytes + offset`` (a strided
    view: the other shards' parts lie between)."""
    elem = torch.empty((), dtype=dtype).element_size()
    if chunk_bytes % elem or offset % elem:
        raise ValueError("shard parts must be aligned to the cache's element size")
    typed = memory.view(dtype)
    inner = [1] * len(block_shape)
    for d in range(len(block_shape) - 2, -1, -1):
        inner[d] = inner[d + 1] * block_shape[d + 1]
    view = typed.as_strided(
        (num_chunks, *block_shape), (chunk_bytes // elem, *inner), offset // elem
    )
    return HostChunkBuffer(num_chunks, 1, block_shape, dtype, tensor=view)


class ShardedTier(SecondaryTier):
    """One logical lower tier over one tier per shard (``parts``: ``(tier, offset, nbytes)``,
    each chunk's bytes ``[offset, offset + nbytes)`` going to ``tier``). A key exists, is
    stored and is loaded only when it is in every part; its counters are per key, not per
    part. A key that one part holds and another lost is a miss (its bytes are not complete)."""

    def __init__(self, parts: Sequence[tuple[SecondaryTier, int, int]]) -> None:
        if not parts:
            raise ValueError("a sharded tier needs at least one part")
        first = parts[0][0]
        super().__init__(first.name, first.medium, sum(t.stats.capacity_bytes for t, _, _ in parts))
        self.parts = list(parts)
        self.pool = first.pool  # jobs run here; each part's calls block on its own I/O
        self.max_batch = min(t.max_batch for t, _, _ in parts)

    @property
    def healthy(self) -> bool:
        return all(t.healthy for t, _, _ in self.parts)

    def exists_batch(self, keys: Sequence[OffloadKey]) -> list[bool]:
        found = [True] * len(keys)
        for tier, _, _ in self.parts:
            found = [f and e for f, e in zip(found, tier.exists_batch(keys))]
        with self._lock:
            self.stats.hits += sum(found)
            self.stats.misses += len(found) - sum(found)
        return found

    def _each_part(self, items: ChunkItems, op: str) -> list[bool]:
        ok = [True] * len(items)
        for tier, off, n in self.parts:
            part = [(k, buf[off : off + n]) for k, buf in items]
            ok = [a and b for a, b in zip(ok, getattr(tier, op)(part))]
        return ok

    def store_batch(self, items: ChunkItems) -> list[bool]:
        ok = self._each_part(items, "store_batch")
        with self._lock:
            self.stats.stores += sum(ok)
            self.stats.store_failures += len(ok) - sum(ok)
            self.stats.bytes_written += sum(
                memoryview(b).nbytes for (_, b), g in zip(items, ok) if g
            )
        self._emit([k for (k, _), g in zip(items, ok) if g], removed=False)
        return ok

    def load_batch(self, items: ChunkItems) -> list[bool]:
        ok = self._each_part(items, "load_batch")
        with self._lock:
            self.stats.loads += sum(ok)
            self.stats.load_failures += len(ok) - sum(ok)
            self.stats.bytes_read += sum(memoryview(b).nbytes for (_, b), g in zip(items, ok) if g)
        return ok

    def take_events(self) -> list[OffloadingEvent]:
        """Stored: keys every part stored (this tier's own events). Removed: keys any part
        evicted or deleted (the key is no longer complete), once each."""
        events = super().take_events()
        removed: dict[OffloadKey, None] = {}
        for tier, _, _ in self.parts:
            for ev in tier.take_events():
                if ev.removed:
                    removed.update(dict.fromkeys(ev.keys))
        if removed:
            events.append(OffloadingEvent(tuple(removed), self.medium, True))
        return events

    def get_stats(self):  # noqa: ANN201 - TierStats, as the base class
        """Per-key counters of this tier; usage, evictions and corruptions summed over parts."""
        parts = [t.get_stats() for t, _, _ in self.parts]
        with self._lock:
            return replace(
                self.stats,
                usage_bytes=sum(p.usage_bytes for p in parts),
                capacity_unbounded=any(p.capacity_unbounded for p in parts),
                evictions=max(p.evictions for p in parts),
                corrupted=sum(p.corrupted for p in parts),
                healthy=self.healthy,
            )

    def shutdown(self, timeout: float = 5.0) -> None:
        for tier, _, _ in self.parts:
            tier.shutdown(timeout)
