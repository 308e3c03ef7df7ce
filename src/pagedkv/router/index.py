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

Invariants: ``_replicas_of[h]`` contains ``r`` iff ``h in _blocks_of[r]``; every holding in the
index holds at least one copy (empty holdings are deleted at once); ``_device_of[h]`` is exactly
the replicas whose holding of ``h`` has a device group (no empty sets are kept). The device sets
let `match` run as C-level set intersections, one per prompt block, instead of a Python loop
over replicas per block (a shared system prompt is held by every replica of a large fleet).
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
        self._device_of: dict[int, set[str]] = {}

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
                key = to_external(h)
                holding = self._holding(replica, key)
                if device:
                    holding.device_groups.add(group)
                    self._device_of.setdefault(key, set()).add(replica)
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
            self._drop_device(replica, h)
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
            if not holding.device_groups:
                self._drop_device(replica, h)
        else:
            holding.tier_media.discard(medium)
        if holding.empty:
            del holders[replica]  # type: ignore[index]
            self._blocks_of[replica].discard(h)
            if not holders:
                del self._replicas_of[h]

    def _drop_device(self, replica: str, h: int) -> None:
        on_device = self._device_of.get(h)
        if on_device is not None:
            on_device.discard(replica)
            if not on_device:
                del self._device_of[h]

    # ---- queries -----------------------------------------------------------------------------------

    def match(self, block_hashes: Sequence[int]) -> dict[str, PrefixMatch]:
        """For every replica holding block 0 of ``block_hashes`` (anywhere): its longest device
        prefix, then how many further consecutive blocks it holds (device or tier; counted as
        tier blocks, since the device prefix ended).

        One set intersection per block over the replicas still matching (C speed), and each
        replica is recorded once, when its run ends: O(blocks * matching replicas) in C plus
        O(matching replicas) in Python."""
        first = self._replicas_of.get(block_hashes[0]) if block_hashes else None
        return self._match_from(block_hashes, set(first)) if first else {}

    def match_replicas(
        self, block_hashes: Sequence[int], replicas: Iterable[str]
    ) -> dict[str, PrefixMatch]:
        """`match` restricted to ``replicas``: the same PrefixMatch for each of them that holds
        block 0 (the others are absent), at a cost in the number of ``replicas``, not of all the
        replicas holding the prompt's first blocks."""
        first = self._replicas_of.get(block_hashes[0]) if block_hashes else None
        return self._match_from(block_hashes, first.keys() & set(replicas)) if first else {}

    def _match_from(self, block_hashes: Sequence[int], alive: set[str]) -> dict[str, PrefixMatch]:
        """The drop-out walk behind `match`: ``alive`` (a subset of block 0's holders) shrinks
        block by block; a replica's total/device run length is recorded when it leaves."""
        total: dict[str, int] = {}  # replica -> consecutive blocks held anywhere
        device: dict[str, int] = {}  # replica -> consecutive blocks held on its device
        empty: frozenset[str] = frozenset()
        get, get_device = self._replicas_of.get, self._device_of.get
        dev = alive & get_device(block_hashes[0], empty)  # ... held on the device
        i = 0
        for i, h in enumerate(block_hashes):
            if i:
                holders = get(h)
                nxt = holders.keys() & alive if holders else set()  # iterates the smaller side
                if len(nxt) != len(alive):
                    for r in alive - nxt:
                        total[r] = i
                    alive = nxt
                if dev:
                    dnxt = dev & get_device(h, empty)
                    if len(dnxt) != len(dev):
                        for r in dev - dnxt:
                            device[r] = i
                        dev = dnxt
            if not alive:
                break
        else:
            i = len(block_hashes)
        for r in alive:
            total[r] = i
        for r in dev:
            device[r] = i
        return {r: PrefixMatch(device.get(r, 0), n - device.get(r, 0)) for r, n in total.items()}

    def deepest_holders(
        self, block_hashes: Sequence[int], k: int, exclude: frozenset[str] | set[str] = frozenset()
    ) -> list[str]:
        """Up to ``k`` replicas (not in ``exclude``) holding the deepest blocks of the prompt,
        deepest first: the candidates for the longest prefix match, found without touching the
        replicas that only hold a short common prefix (a shared system prompt held by the whole
        fleet). A replica's block at depth i does not prove blocks 0..i-1: `match_replicas`
        gives the exact prefix. O(blocks + k) dict lookups."""
        out: list[str] = []
        seen: set[str] = set()
        for i in range(len(block_hashes) - 1, -1, -1):
            holders = self._replicas_of.get(block_hashes[i])
            if not holders:
                continue
            for r in holders:
                if r not in seen and r not in exclude:
                    seen.add(r)
                    out.append(r)
                    if len(out) >= k:
                        return out
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
