"""Small builders shared by the core tests (pure Python, no torch)."""

from __future__ import annotations

import itertools

from pagedkv.core.hashing import HashFn, sha256
from pagedkv.core.kv_cache_manager import KVCacheManager
from pagedkv.core.request import KVCacheRequest, get_request_block_hasher
from pagedkv.core.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)

_ids = itertools.count()


def full_spec(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32")


def swa_spec(block_size: int = 16, window: int = 64) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32", sliding_window=window
    )


def make_kv_cache_config(
    num_blocks: int = 11, specs: list[KVCacheSpec] | None = None, *, block_size: int = 16
) -> KVCacheConfig:
    """One group per spec (one layer each), ``num_blocks`` blocks of 1 byte."""
    specs = specs or [full_spec(block_size)]
    groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups, bytes_per_block=1)


def make_manager(
    num_blocks: int = 11,
    specs: list[KVCacheSpec] | None = None,
    *,
    block_size: int = 16,
    max_model_len: int = 8192,
    caching: bool = True,
    events: bool = False,
    watermark: float = 0.0,
) -> KVCacheManager:
    config = make_kv_cache_config(num_blocks, specs, block_size=block_size)
    return KVCacheManager(
        config,
        max_model_len=max_model_len,
        enable_caching=caching,
        enable_kv_cache_events=events,
        watermark=watermark,
    )


def make_request(
    tokens: list[int],
    manager: KVCacheManager | None = None,
    *,
    hash_block_size: int | None = None,
    hash_fn: HashFn = sha256,
    request_id: str | None = None,
    **kwargs,
) -> KVCacheRequest:
    hbs = hash_block_size or (manager.hash_block_size if manager else 16)
    return KVCacheRequest(
        request_id or f"req-{next(_ids)}",
        list(tokens),
        block_hasher=get_request_block_hasher(hbs, hash_fn),
        **kwargs,
    )


def admit(manager: KVCacheManager, req: KVCacheRequest, num_new: int | None = None):
    """get_computed_blocks + allocate_slots for a new request, as the scheduler does."""
    hits, num_hit = manager.get_computed_blocks(req)
    num_new = req.num_tokens - num_hit if num_new is None else num_new
    new = manager.allocate_slots(req, num_new, num_hit, hits)
    if new is not None:
        req.num_computed_tokens = num_hit + num_new
        from pagedkv.core.request import RequestStatus

        req.status = RequestStatus.RUNNING
    return hits, num_hit, new
