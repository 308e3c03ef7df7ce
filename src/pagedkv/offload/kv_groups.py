"""Offloading a model with several KV cache groups (full + sliding window, chunked local,
Mamba): which blocks of each group a tier hit needs, and which it stores.

Pure bookkeeping (no torch); `OffloadingConnector` uses it on the scheduler side. The rules
(the seeds' store connector on multi-group models, vLLM's ``_sliding_window_lookup``):

* **Keys**: block ``i`` of group ``g`` is stored under ``make_offload_key(h_i, g)``, ``h_i`` the
  request's chained hash at the end of that block (at the group's block size, see
  `core.kv_cache_coordinator.view_block_hashes`). Groups never share keys.
* **Hit length**: a hit of ``L`` tokens (``L`` a multiple of `OffloadGroupLayout.alignment`,
  the lcm of the groups' block sizes) needs, in every group, the blocks a request holds after
  ``L`` computed tokens: the group's blocks from its skipped prefix (`skipped_tokens`, the
  same formula as its core manager) to ``L``, minus those already computed locally. Full
  attention: every block; sliding window: the window's blocks before ``L``; chunked local: the
  blocks of ``L``'s chunk; Mamba: the one checkpoint block ending at ``L``. The hit is the
  largest ``L`` every group serves: a fixed point, since each group's first miss caps ``L`` at
  that block's start (`find_hit`).
* **Stores**: a group's blocks that are full within the tokens computed, rounded down to the
  alignment (a block past the last lcm boundary cannot serve a hit yet; it is stored with the
  next boundary), only the range not offered before (the request's saved offset), and only
  real blocks: a position whose block the group already released (outside the window, before
  the chunk) or never had (a Mamba position without a checkpoint) stores nothing.

A Mamba group loads only at boundaries where the engine gives the request a checkpoint page
(``prefix_cache_retention_interval``: None, every block boundary; ``k``, multiples of ``k``;
0, only the end of a step, which a tier load cannot target: no loads then, stores still
happen), so such a layout's alignment is also a multiple of ``k``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedkv.core.kv_cache_coordinator import view_block_hashes
from pagedkv.core.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    scheduler_kv_cache_groups,
)
from pagedkv.offload.base import LookupResult, OffloadKey, make_offload_key

FULL, SLIDING, CHUNKED, MAMBA = "full", "sliding_window", "chunked_local", "mamba"

# ``lookup(group_idx, block_indices) -> results``: a prefix lookup of that group's keys
# (`OffloadingManager.lookup_many` semantics: after the first non-hit, results repeat it).
GroupLookup = Callable[[int, Sequence[int]], list[LookupResult]]


@dataclass(frozen=True, slots=True)
class OffloadGroup:
    """One KV cache group as offloading sees it: its block size and how much of a request's
    prefix it drops (``window``: the sliding window or the attention chunk size)."""

    kind: str
    block_size: int
    num_layers: int
    window: int = 0

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, num_layers: int) -> OffloadGroup:
        """ValueError for a spec offloading does not know (e.g. cross attention)."""
        if isinstance(spec, MambaSpec):
            return cls(MAMBA, spec.block_size, num_layers)
        if isinstance(spec, SlidingWindowSpec):
            return cls(SLIDING, spec.block_size, num_layers, spec.sliding_window)
        if isinstance(spec, ChunkedLocalAttentionSpec):
            return cls(CHUNKED, spec.block_size, num_layers, spec.attention_chunk_size)
        if isinstance(spec, FullAttentionSpec):  # MLA included
            return cls(FULL, spec.block_size, num_layers)
        raise ValueError(f"kv_offload cannot offload a {spec.kind!r} KV cache group")

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens whose blocks a request no longer holds after ``num_computed_tokens``
        (``get_num_skipped_tokens`` of the group's core manager)."""
        n = num_computed_tokens
        if self.kind == SLIDING:
            return max(0, n - self.window + 1)
        if self.kind == CHUNKED:
            return n // self.window * self.window
        if self.kind == MAMBA:
            return max(0, (n - 1) // self.block_size * self.block_size)
        return 0

    def describe(self) -> str:
        return f"{self.kind}:{self.block_size}:{self.window}:{self.num_layers}"


@dataclass(frozen=True, slots=True)
class OffloadGroupLayout:
    """The groups of one model and the rules above. ``hash_block_size``: the block size the
    request's hashes are computed at (the gcd of the group block sizes, as in
    `core.kv_cache_manager.KVCacheManager`)."""

    groups: tuple[OffloadGroup, ...]
    hash_block_size: int
    # Mamba checkpoint retention (see the module docstring); ignored without a Mamba group.
    prefix_cache_retention_interval: int | None = None

    @classmethod
    def from_kv_cache_groups(
        cls,
        kv_cache_groups: Sequence[KVCacheGroupSpec],
        prefix_cache_retention_interval: int | None = None,
    ) -> OffloadGroupLayout:
        groups = scheduler_kv_cache_groups(kv_cache_groups)  # uniform-type → one layer's spec
        if not groups:
            raise ValueError("kv_offload needs at least one KV cache group")
        out = tuple(OffloadGroup.from_spec(g.kv_cache_spec, len(g.layer_names)) for g in groups)
        return cls(out, math.gcd(*(g.block_size for g in out)), prefix_cache_retention_interval)

    @property
    def has_mamba(self) -> bool:
        return any(g.kind == MAMBA for g in self.groups)

    @property
    def alignment(self) -> int:
        """Every hit and every stored range ends on a multiple of this many tokens: the lcm of
        the block sizes (and of a Mamba group's checkpoint interval ``k``)."""
        lcm = math.lcm(*(g.block_size for g in self.groups))
        r = self.prefix_cache_retention_interval
        return math.lcm(lcm, r) if self.has_mamba and r else lcm

    @property
    def can_load(self) -> bool:
        """False only for Mamba with end-of-step checkpoints (retention 0): see the docstring."""
        return not (self.has_mamba and self.prefix_cache_retention_interval == 0)

    def describe(self) -> str:
        """Canonical text of the layout, for the config fingerprint (empty for one full
        attention group: the fingerprint's other fields already describe it)."""
        if len(self.groups) == 1 and self.groups[0].kind == FULL:
            return ""
        r = self.prefix_cache_retention_interval if self.has_mamba else None
        return ";".join(g.describe() for g in self.groups) + (
            f";retention:{r}" if r is not None else ""
        )

    # ---- keys -----------------------------------------------------------------------------------

    def keys(
        self, block_hashes: Sequence[bytes], group_idx: int, blocks: Sequence[int]
    ) -> list[OffloadKey]:
        """Keys of blocks ``blocks`` of group ``group_idx`` (hashes at `hash_block_size`)."""
        view = view_block_hashes(
            block_hashes, self.hash_block_size, self.groups[group_idx].block_size
        )
        return [make_offload_key(view[i], group_idx) for i in blocks]

    def num_full_blocks(self, block_hashes: Sequence[bytes], group_idx: int) -> int:
        """Blocks of group ``group_idx`` that have a hash (full blocks of the request)."""
        return len(block_hashes) * self.hash_block_size // self.groups[group_idx].block_size

    # ---- loads --------------------------------------------------------------------------------

    def required_blocks(self, group_idx: int, num_computed_tokens: int, hit_tokens: int) -> range:
        """Blocks group ``group_idx`` must load so that a request with ``num_computed_tokens``
        computed locally has its KV for ``hit_tokens`` tokens (both multiples of the alignment)."""
        g = self.groups[group_idx]
        first = max(num_computed_tokens, g.skipped_tokens(hit_tokens)) // g.block_size
        return range(first, hit_tokens // g.block_size)

    def find_hit(
        self, num_computed_tokens: int, max_tokens: int, lookup: GroupLookup
    ) -> tuple[int, bool]:
        """``(hit tokens past num_computed_tokens, blocked)``: the largest aligned ``L`` with
        ``num_computed_tokens <= L <= max_tokens`` whose required blocks are HIT in every
        group, minus ``num_computed_tokens``. ``blocked``: some group's answer for a block of
        a longer hit is not known yet (RETRY) or not readable yet (HIT_PENDING)."""
        align = self.alignment
        hit = max_tokens // align * align
        if hit <= num_computed_tokens or not self.can_load:
            return 0, False
        blocked = False
        while True:
            start = hit
            for gid, g in enumerate(self.groups):
                blocks = self.required_blocks(gid, num_computed_tokens, hit)
                if not blocks:
                    continue
                results = lookup(gid, blocks)
                n = next(
                    (i for i, r in enumerate(results) if r is not LookupResult.HIT), len(results)
                )
                if n == len(results):
                    continue
                blocked |= results[n] in (LookupResult.RETRY, LookupResult.HIT_PENDING)
                # A hit that reads block blocks[n] fails; every shorter one that does not
                # read it ends at or before that block's start.
                hit = min(hit, blocks[n] * g.block_size // align * align)
                if hit <= num_computed_tokens:
                    return 0, blocked
            if hit == start:
                return hit - num_computed_tokens, blocked

    # ---- stores -------------------------------------------------------------------------------

    def store_range(self, num_tokens: int) -> int:
        """Tokens whose blocks may be stored once ``num_tokens`` are computed (aligned down)."""
        return num_tokens // self.alignment * self.alignment

    def store_blocks(self, group_idx: int, start_tokens: int, end_tokens: int) -> range | list[int]:
        """Block positions of group ``group_idx`` full in ``[start_tokens, end_tokens)`` that a
        hit could use (a Mamba group with retention ``k``: checkpoints at multiples of ``k``)."""
        g = self.groups[group_idx]
        blocks = range(start_tokens // g.block_size, end_tokens // g.block_size)
        r = self.prefix_cache_retention_interval
        if g.kind == MAMBA and r:
            return [i for i in blocks if (i + 1) * g.block_size % r == 0]
        return blocks
