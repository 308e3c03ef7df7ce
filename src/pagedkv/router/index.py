"""The router's global prefix index: block hash -> the replicas holding that block, and where.

Fed by the replicas' KV events (`pagedkv.core.events`), one replica at a time (`apply`):

* ``BlockStored`` with token ids is the engine's KV pool storing blocks: a *device* copy (medium
  "GPU", or "CPU" on a CPU-only engine). ``BlockStored`` with ``token_ids == []`` comes from an
  offload tier (`pagedkv.offload.base.OffloadingEvent.to_kv_events`: a tier only knows hashes):
  a *tier* copy under its medium ("CPU", "STORAGE", "P2P", ...). This is the device/tier rule;
  the medium string alone cannot decide it, since a CPU engine's pool and the CPU offload tier
  both say "CPU".
* ``BlockRemoved`` for medium M drops one copy: the device copy when M is a device medium and
  the replica holds one, else the tier copy of M. (When a CPU engine's pool and its CPU tier
  both hold a block, a "CPU" removal is taken as the pool's eviction, the common case; if it was
  the tier's, the router under-predicts, never over-predicts where the block lives.)
* ``AllBlocksCleared`` drops every entry of the replica (device and tier).
* Medium "REMOTE" records a transfer, not residency: ignored.

Hashes are keyed by their 64-bit external int (`hashing.to_external`). Hybrid models (several
KV cache groups) count a block as held on the device while any group holds it.

Invariant: ``_replicas_of[h]`` contains ``r`` iff ``h in _blocks_of[r]``, and every holding in
the index holds at least one copy (empty holdings are deleted at once).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pagedkv.core.events import MEDIUM_REMOTE, AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv.router.hashing import to_external

DEFAULT_MEDIUM = "GPU"  # vLLM: a BlockStored/BlockRemoved without medium is the GPU cache


@dataclass(slots=True)
class PrefixMatch:
    """How much of a prompt's prefix one replica holds, in blocks from block 0."""

    device_blocks: int  # consecutive blocks from block 0 held on the replica's device medium
    tier_blocks: int  # further consecutive blocks (after device_blocks) held only in a tier

    @property
    def total_blocks(self) -> int:
        return self.device_blocks + self.tier_blocks


@dataclass(slots=True)
class _Holding:
    """One replica's copies of one block: device groups holding it, tier media holding it."""

    device_groups: set[int] = field(default_factory=set)
    tier_media: set[str] = field(default_factory=set)

    @property
    def empty(self) -> bool:
        return not self.device_groups and not self.tier_media


class PrefixIndex:
    """Global index: block hash (int, as in the replicas' KV events) -> replicas holding it, with
    medium. See the module docstring for how events change it."""

    def __init__(self, device_media: frozenset[str] = frozenset({"GPU", "CPU"})) -> None:
        self.device_media = device_media
        self._replicas_of: dict[int, dict[str, _Holding]] = {}
        self._blocks_of: dict[str, set[int]] = {}

    # ---- events ------------------------------------------------------------------------------------

    def apply(self, replica: str, event: object) -> None:
        """Apply one KV event of ``replica``. Unknown event types are ignored."""
        if isinstance(event, BlockStored):
            medium = event.medium or DEFAULT_MEDIUM
            if medium == MEDIUM_REMOTE:
                return
            device = bool(event.token_ids) and medium in self.device_media
            group = event.group_idx or 0
            for h in event.block_hashes:
                holding = self._holding(replica, to_external(h))
                if device:
                    holding.device_groups.add(group)
                else:
                    holding.tier_media.add(medium)
        elif isinstance(event, BlockRemoved):
            medium = event.medium or DEFAULT_MEDIUM
            if medium == MEDIUM_REMOTE:
                return
            group = event.group_idx or 0
            for h in event.block_hashes:
                self._remove_copy(replica, to_external(h), medium, group)
        elif isinstance(event, AllBlocksCleared):
            self.remove_replica(replica)

    def apply_batch(self, replica: str, events: Iterable[object]) -> None:
        for event in events:
            self.apply(replica, event)

    def remove_replica(self, replica: str) -> None:
        """Forget everything ``replica`` holds (it died, or cleared its cache)."""
        for h in self._blocks_of.pop(replica, ()):
            holders = self._replicas_of.get(h)
            if holders is not None:
                holders.pop(replica, None)
                if not holders:
                    del self._replicas_of[h]

    def _holding(self, replica: str, h: int) -> _Holding:
        holders = self._replicas_of.setdefault(h, {})
        holding = holders.get(replica)
        if holding is None:
            holding = holders[replica] = _Holding()
            self._blocks_of.setdefault(replica, set()).add(h)
        return holding

    def _remove_copy(self, replica: str, h: int, medium: str, group: int) -> None:
        holders = self._replicas_of.get(h)
        holding = holders.get(replica) if holders else None
        if holding is None:
            return
        if medium in self.device_media and holding.device_groups:
            holding.device_groups.discard(group)
        else:
            holding.tier_media.discard(medium)
        if holding.empty:
            del holders[replica]  # type: ignore[index]
            self._blocks_of[replica].discard(h)
            if not holders:
                del self._replicas_of[h]

    # ---- queries -----------------------------------------------------------------------------------

    def match(self, block_hashes: Sequence[int]) -> dict[str, PrefixMatch]:
        """For every replica holding block 0 of ``block_hashes`` (anywhere): its longest device
        prefix, then how many further consecutive blocks it holds (device or tier; counted as
        tier blocks, since the device prefix ended). O(len(block_hashes) * replicas)."""
        out: dict[str, PrefixMatch] = {}
        if not block_hashes:
            return out
        first = self._replicas_of.get(block_hashes[0])
        if not first:
            return out
        active: dict[str, PrefixMatch] = {r: PrefixMatch(0, 0) for r in first}
        on_device = {r for r, hold in first.items() if hold.device_groups}
        out.update(active)
        for h in block_hashes:
            holders = self._replicas_of.get(h)
            if not holders:
                break
            for r in list(active):
                hold = holders.get(r)
                if hold is None:
                    del active[r]
                    continue
                m = active[r]
                if r in on_device and hold.device_groups:
                    m.device_blocks += 1
                else:
                    on_device.discard(r)
                    m.tier_blocks += 1
            if not active:
                break
        return out

    def num_blocks(self, replica: str) -> int:
        """Distinct blocks ``replica`` holds (any medium)."""
        return len(self._blocks_of.get(replica, ()))

    def replicas(self) -> list[str]:
        return [r for r, blocks in self._blocks_of.items() if blocks]

    def __len__(self) -> int:
        return len(self._replicas_of)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._replicas_of
