"""The engine's side of ``kv_cache_memory_mode="vmm"`` (vAttention; the memory is `ops.vmm`).

What the mode changes, and what it does not:

* The scheduler, `KVCacheManager` and block pool are unchanged: they count blocks, find
  prefix hits and free blocks as in the paged mode (one accounting for both modes). A block
  is one physical page per (layer, KV head), so the block size is the page's tokens
  (`vmm_block_size`) and prefix hits fall on page boundaries.
* The runner gives each running request a row (`VMMRows`) and maps its block table's pages
  into the row before each step; attention then reads the row as one contiguous range
  (``AttentionMetadata.contiguous``: the block table is one entry, the row).
* A prefix hit maps the *same* physical pages into the second request's row, read-only; an
  ``n > 1`` request's forked samples copy the shared partial page (the scheduler's
  ``blocks_to_copy``, copy-on-write), done on the physical pages.

Refused with a ValueError naming the reason (`unsupported_reason`): any layer that is not full
attention over one KV geometry (sliding window, chunked local, MLA, Mamba, per-layer head
counts), so models with those run paged until the mode covers them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pagedkv.core.specs import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    dtype_size,
)
from pagedkv.ops.vmm import tokens_per_page

# The physical pages' layout: [L, H, B, N, C], so page (l, h, b) is one contiguous range.
VMM_LAYOUT = "LHBNC"


def unsupported_reason(groups: list[KVCacheGroupSpec]) -> str | None:
    """Why a model with these KV cache groups cannot run in vmm mode, or None."""
    if len(groups) != 1:
        return "kv_cache_memory_mode='vmm' needs one KV cache group (no hybrid models)"
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec or isinstance(spec, MLAAttentionSpec):
        return (
            "kv_cache_memory_mode='vmm' needs every layer to be full attention with one KV "
            f"geometry; this model's cache is {type(spec).__name__}"
        )
    return None


def vmm_block_size(groups: list[KVCacheGroupSpec], page_bytes: int) -> int:
    """Tokens of one KV head in a ``page_bytes`` page (the scheduler's block size in vmm
    mode). Raises ValueError for a model the mode does not run or a page that does not hold a
    whole number of tokens."""
    why = unsupported_reason(groups)
    if why is not None:
        raise ValueError(why)
    spec = groups[0].kv_cache_spec
    elem = dtype_size(spec.dtype)
    return tokens_per_page(page_bytes, (spec.head_size + spec.head_size_v) * elem)


@dataclass(slots=True)
class VMMRows:
    """Which row of the virtual cache each request holds.

    A request keeps its row while it runs; a finished request's row is freed at once
    (`release`). A preempted request's row (the scheduler does not tell the runner) stays
    mapped until another request needs a row and none is free: the least recently scheduled
    row not in the current step is taken (`acquire` returns it to be unmapped first). The
    step never holds more requests than ``max_num_seqs`` = the rows, so one is always found.
    """

    num_rows: int
    by_request: OrderedDict[str, int] = field(default_factory=OrderedDict)
    free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free = list(range(self.num_rows - 1, -1, -1))

    def acquire(self, request_id: str, in_step: set[str]) -> tuple[int, str | None]:
        """``(row, evicted request id or None)``: the request's row (most recently used now),
        or a new one. Raises RuntimeError if every row belongs to a request in ``in_step``."""
        row = self.by_request.get(request_id)
        if row is not None:
            self.by_request.move_to_end(request_id)
            return row, None
        evicted = None
        if not self.free:
            evicted = next((rid for rid in self.by_request if rid not in in_step), None)
            if evicted is None:
                raise RuntimeError(f"all {self.num_rows} request rows are in use by this step")
            self.free.append(self.by_request.pop(evicted))
        row = self.free.pop()
        self.by_request[request_id] = row
        return row, evicted

    def release(self, request_id: str) -> int | None:
        """Free the request's row; returns it (to unmap) or None if it held none."""
        row = self.by_request.pop(request_id, None)
        if row is not None:
            self.free.append(row)
        return row


def describe(kv_cache_config: Any) -> str:
    """One log line: the pages and the reservation."""
    r = kv_cache_config.vmm
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    return (
        f"vmm: {kv_cache_config.num_blocks} physical pages of {spec.block_size} tokens per "
        f"(layer, KV head); {r.max_rows} rows x {r.max_blocks} pages of virtual space"
    )
