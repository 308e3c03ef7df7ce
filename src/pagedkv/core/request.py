"""The KV-cache side of a request: its tokens, its block hashes and its scheduling status.

The engine's `Request` extends `KVCacheRequest` with sampling state; the core only needs what is
here. Block hashes are computed incrementally (`get_request_block_hasher`): each block is hashed
once, when its last token arrives, so caching a block later only reads ``block_hashes``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedkv.core.hashing import BlockHash, HashFn, hash_block_tokens
from pagedkv.core.token_eviction import KVEvictionConfig


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Values above PREEMPTED are finished states."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # blocks allocated, KV arriving from a connector/tier
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()  # its external KV failed to load (kv_load_failure_policy "fail")

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


@dataclass(slots=True, frozen=True)
class MultiModalFeature:
    """A multimodal item's placeholder run in the prompt: tokens ``[offset, offset+length)``.

    ``identifier`` is the item's content hash; it enters the hash of every block it overlaps,
    together with its offset relative to that block (so the same image at another position, or
    another image at the same position, gives other hashes).
    """

    identifier: str
    offset: int
    length: int


@dataclass(slots=True, eq=False)
class KVCacheRequest:
    """What the KV cache manager knows about a request.

    Invariants: ``all_token_ids == prompt_token_ids + output_token_ids``;
    ``len(block_hashes) == num_tokens // hash_block_size`` whenever a hasher is set (after every
    append); ``0 <= num_computed_tokens <= num_tokens``.
    """

    request_id: str
    prompt_token_ids: list[int]
    block_hasher: Callable[[KVCacheRequest], list[BlockHash]] | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    # The adapter's integer id (vLLM's ``LoRARequest.adapter_id``): not hashed (the name and
    # path are), but reported in KV events so routers can key by it.
    lora_id: int | None = None
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    cache_salt: str | None = None
    # Prompt-logprob or pooling requests write the cache but never read it (their logits for
    # every prompt position are needed).
    skip_reading_prefix_cache: bool = False
    # KV connector options of this request (e.g. max_offload_tokens, offload_policy).
    kv_transfer_params: dict[str, Any] | None = None
    # Token eviction (`core.token_eviction`): the policy, where its blocks stop being exact
    # (blocks starting there or later carry the policy in their hashes' extra keys), and how
    # many tokens it has dropped: a token's cache index is ``position - num_evicted_tokens``.
    kv_eviction: KVEvictionConfig | None = None
    kv_eviction_onset: int = 0
    num_evicted_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    all_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        else:
            self.output_token_ids.extend(token_ids)
            self.all_token_ids.extend(token_ids)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        if self.block_hasher is not None:
            self.block_hashes.extend(self.block_hasher(self))


def generate_block_hash_extra_keys(
    request: KVCacheRequest, start: int, end: int, start_mm_idx: int = 0
) -> tuple[tuple[Any, ...] | None, int]:
    """Extra keys for the block covering tokens ``[start, end)``, in vLLM's order:
    LoRA, multimodal items, cache salt (first block only), then pagedkv's token-eviction policy
    for blocks at or after the request's eviction onset. Returns ``(keys or None, next_mm_idx)``;
    ``next_mm_idx`` lets the caller resume the scan of the offset-sorted items at the next block.
    """
    keys: list[Any] = []
    if request.lora_name is not None:
        keys.append(("lora", request.lora_name, request.lora_path))
    mm = request.mm_features
    idx = start_mm_idx
    while idx < len(mm) and mm[idx].offset + mm[idx].length <= start:
        idx += 1  # items wholly before this block can never overlap a later one
    scan = idx
    while scan < len(mm) and mm[scan].offset < end:
        item = mm[scan]
        if item.offset + item.length > start:
            keys.append(("mm", item.identifier, item.offset - start))
        scan += 1
    if start == 0 and request.cache_salt is not None:
        keys.append(("cache_salt", request.cache_salt))
    if request.kv_eviction is not None and start >= request.kv_eviction_onset:
        keys.append(("kv_eviction", request.kv_eviction.key))
    return (tuple(keys) if keys else None), idx


def to_event_extra_keys(extra_keys: tuple[Any, ...] | None) -> list[Any] | None:
    """Strip the tags for KV events, so consumers see vLLM's untagged shape
    (lora name, ``(mm_hash, offset)``, salt)."""
    if extra_keys is None:
        return None
    out: list[Any] = []
    for key in extra_keys:
        tag = key[0]
        out.append(key[1] if tag in ("lora", "cache_salt", "kv_eviction") else (key[1], key[2]))
    return out


def get_request_block_hasher(
    block_size: int, hash_fn: HashFn
) -> Callable[[KVCacheRequest], list[BlockHash]]:
    """A closure returning the hashes of the request's blocks that became full since the last
    call (starting at ``len(request.block_hashes) * block_size``)."""

    def request_block_hasher(request: KVCacheRequest) -> list[BlockHash]:
        start = len(request.block_hashes) * block_size
        num_tokens = request.num_tokens
        if start + block_size > num_tokens:
            return []
        tokens = request.all_token_ids
        parent = request.block_hashes[-1] if request.block_hashes else None
        plain = (
            request.lora_name is None
            and not request.mm_features
            and request.cache_salt is None
            and request.kv_eviction is None
        )
        mm_idx = 0
        new_hashes: list[BlockHash] = []
        while start + block_size <= num_tokens:
            end = start + block_size
            if plain:
                extra = None
            else:
                extra, mm_idx = generate_block_hash_extra_keys(request, start, end, mm_idx)
            parent = hash_block_tokens(hash_fn, parent, tokens[start:end], extra)
            new_hashes.append(parent)
            start = end
        return new_hashes

    return request_block_hasher
