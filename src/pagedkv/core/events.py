"""KV cache events in vLLM's wire format (msgspec structs → msgpack).

An `EventBatch` encodes as an array ``[ts, [events], data_parallel_rank]``; each event encodes as
a map tagged with its class name (``{"type": "BlockStored", ...}``) and omits fields equal to
their default. Routers consume these to mirror every instance's prefix cache.

* `BlockStored`: blocks became cached (content addressed by ``block_hashes``; ``parent_block_hash``
  is the hash of the block before the first one, None at the start of a sequence).
* `BlockRemoved`: cached blocks were evicted (or dropped) from ``medium``.
* `AllBlocksCleared`: the whole prefix cache of the instance was reset.

pagedkv's extensions (omitted at their defaults, so vLLM's consumers never see them): each
block event's KV cache ``group_idx`` and spec, and ``tp_ranks``: on a tensor-parallel engine,
the ranks whose share of the blocks the medium holds (every rank for the device pool; the
ranks that write a distinct shard for an offload tier, replicated KV heads being stored once).
One scheduler announces each block once for all its ranks.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"  # an accelerator's KV cache (vLLM's default medium)
MEDIUM_CPU = "CPU"  # host memory: a CPU engine's KV cache, or the CPU offload tier
MEDIUM_STORAGE = "STORAGE"
MEDIUM_REMOTE = "REMOTE"

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=False, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base class of all KV cache events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    tp_ranks: list[int] | None = None  # TP engines: the ranks whose share the medium holds

    def __hash__(self) -> int:
        return hash(
            (
                tuple(self.block_hashes),
                self.parent_block_hash,
                tuple(self.token_ids),
                self.block_size,
                self.lora_id,
                self.medium,
                self.group_idx,
            )
        )


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    tp_ranks: list[int] | None = None  # TP engines: the ranks whose share left the medium

    def __hash__(self) -> int:
        return hash((tuple(self.block_hashes), self.medium, self.group_idx))


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def encode_batch(batch: KVEventBatch) -> bytes:
    return msgspec.msgpack.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return msgspec.msgpack.decode(payload, type=KVEventBatch)
