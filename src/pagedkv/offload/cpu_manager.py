"""CPUOffloadingManager: bookkeeping of the host-memory tier's pool of chunk slots.

The host buffer (`worker.HostChunkBuffer`) has ``num_chunks`` slots. Slot ids are handed out
fresh first (0, 1, 2, ...) and then reused LIFO from the free list, so a lightly used pool
touches few pages. Each stored key owns one slot and a `ChunkStatus`:

    ref_cnt == -1   store in flight (prepared, not readable: HIT_PENDING)
    ref_cnt ==  0   readable, evictable
    ref_cnt  >  0   readable, pinned by that many loads (or lower-tier writes): not evictable

Invariants (`check_invariants`): slot ids of entries are distinct; no entry's slot is on the
free list; ``entries + free list + never-used == num_chunks``; the policy holds exactly the
entries. With ``store_threshold >= 2`` a key is admitted only on its N-th offer (offers are
counted in a bounded LRU tracker), which keeps one-off prefixes from churning the pool.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from pagedkv.core.events import MEDIUM_CPU
from pagedkv.offload.base import (
    CPULoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    TierStats,
    unique,
)
from pagedkv.offload.policies import make_cache_policy


@dataclass(slots=True)
class ChunkStatus:
    chunk_id: int
    ref_cnt: int = -1  # -1: store in flight

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


class CPUOffloadingManager(OffloadingManager):
    """The primary (host memory) tier: the only one whose slots the device cache reads/writes."""

    def __init__(
        self,
        num_chunks: int,
        cache_policy: str = "lru",
        *,
        chunk_bytes: int = 0,
        enable_events: bool = True,
        store_threshold: int = 0,
        max_tracker_size: int | None = None,
        name: str = "cpu",
    ) -> None:
        if num_chunks <= 0:
            raise ValueError(f"num_chunks must be positive, got {num_chunks}")
        self.num_chunks = num_chunks
        self.chunk_bytes = chunk_bytes
        self.enable_events = enable_events
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size or max(1024, 4 * num_chunks)
        self.policy = make_cache_policy(cache_policy, num_chunks)
        self._entries: dict[OffloadKey, ChunkStatus] = {}
        self._num_fresh = 0  # slots [0, _num_fresh) have been handed out
        self._free_list: list[int] = []  # returned slots, reused LIFO
        self._offer_counts: OrderedDict[OffloadKey, int] = OrderedDict()
        self._events: list[OffloadingEvent] = []
        self.stats = TierStats(
            name=name, medium=MEDIUM_CPU, capacity_bytes=num_chunks * chunk_bytes
        )

    # ----------------------------------------------------------------------------- queries
    @property
    def num_free_chunks(self) -> int:
        return self.num_chunks - self._num_fresh + len(self._free_list)

    @property
    def num_stored(self) -> int:
        return len(self._entries)

    def peek(self, key: OffloadKey) -> LookupResult:
        """`lookup` without counting it in the stats."""
        status = self._entries.get(key)
        if status is None:
            return LookupResult.MISS
        return LookupResult.HIT if status.is_ready else LookupResult.HIT_PENDING

    def lookup(self, key: OffloadKey) -> LookupResult:
        result = self.peek(key)
        if result is LookupResult.HIT:
            self.stats.hits += 1
        elif result is LookupResult.MISS:
            self.stats.misses += 1
        return result

    def chunk_id(self, key: OffloadKey) -> int | None:
        status = self._entries.get(key)
        return None if status is None else status.chunk_id

    # ------------------------------------------------------------------------------- loads
    def pin(self, keys: Sequence[OffloadKey]) -> list[int]:
        """ref_cnt++ on ready keys (all or nothing) and return their slots: a pinned slot is
        neither evicted nor reused until `unpin`."""
        statuses = [self._entries.get(k) for k in keys]
        for key, status in zip(keys, statuses):
            if status is None or not status.is_ready:
                raise ValueError(f"key {key.hex()[:16]}… is not readable in the CPU tier")
        for status in statuses:
            status.ref_cnt += 1  # type: ignore[union-attr]
        return [s.chunk_id for s in statuses]  # type: ignore[union-attr]

    def unpin(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            status = self._entries.get(key)
            if status is None or status.ref_cnt <= 0:
                raise ValueError(f"key {key.hex()[:16]}… is not pinned")
            status.ref_cnt -= 1

    def prepare_load(self, keys: Sequence[OffloadKey]) -> CPULoadStoreSpec:
        spec = CPULoadStoreSpec(tuple(self.pin(keys)))
        self.stats.loads += len(keys)
        self.stats.bytes_read += len(keys) * self.chunk_bytes
        return spec

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        self.unpin(keys)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        # Reversed so that keys[0] (the prefix head) ends up most recent; only ready chunks,
        # so an in-flight store cannot be promoted to ARC's frequent list.
        ready = [
            k for k in reversed(keys) if (s := self._entries.get(k)) is not None and s.is_ready
        ]
        self.policy.touch(ready)

    # ------------------------------------------------------------------------------ stores
    def prepare_store(
        self,
        keys: Sequence[OffloadKey],
        *,
        protected: Collection[OffloadKey] = (),
        admit_all: bool = False,
    ) -> PrepareStoreOutput | None:
        """See `OffloadingManager.prepare_store`. ``protected`` keys are never evicted either
        (a request's other chunks); ``admit_all`` skips the store threshold (promotions)."""
        offer = unique(keys)
        new = [k for k in offer if k not in self._entries]
        if not admit_all and self.store_threshold >= 2:
            new = [k for k in new if self._admit(k)]
        if len(new) > self.num_chunks:
            return None
        need = len(new) - self.num_free_chunks
        evicted: list[OffloadKey] = []
        if need > 0:
            offered = set(offer)
            victims = self.policy.evict(
                need,
                lambda k: self._entries[k].ref_cnt == 0 and k not in offered and k not in protected,
            )
            if victims is None:
                return None
            for key in victims:
                self._free_list.append(self._entries.pop(key).chunk_id)
            evicted = victims
            self.stats.evictions += len(victims)
            self._emit(victims, removed=True)
        chunk_ids = [self._allocate_chunk() for _ in new]
        for key, chunk_id in zip(new, chunk_ids):
            self._entries[key] = ChunkStatus(chunk_id)
            self._offer_counts.pop(key, None)
        for key in reversed(new):  # the prefix head becomes the most recent
            self.policy.insert(key)
        return PrepareStoreOutput(new, CPULoadStoreSpec(tuple(chunk_ids)), evicted)

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> list[OffloadKey]:
        """Keys not in flight are ignored (a caller may pass its whole offer). Returns the keys
        that became readable."""
        done: list[OffloadKey] = []
        for key in unique(keys):
            status = self._entries.get(key)
            if status is None or status.is_ready:
                continue
            if success:
                status.ref_cnt = 0
                done.append(key)
            else:
                del self._entries[key]
                self.policy.remove(key)
                self._free_list.append(status.chunk_id)
                self.stats.store_failures += 1
        self.stats.stores += len(done)
        self.stats.bytes_written += len(done) * self.chunk_bytes
        self._emit(done, removed=False)
        return done

    def _admit(self, key: OffloadKey) -> bool:
        count = self._offer_counts.pop(key, 0) + 1
        self._offer_counts[key] = count  # re-insert: most recently offered
        if len(self._offer_counts) > self.max_tracker_size:
            self._offer_counts.popitem(last=False)
        return count >= self.store_threshold

    def _allocate_chunk(self) -> int:
        if self._num_fresh < self.num_chunks:
            self._num_fresh += 1
            return self._num_fresh - 1
        return self._free_list.pop()

    # --------------------------------------------------------------------------- lifecycle
    def _emit(self, keys: Sequence[OffloadKey], removed: bool) -> None:
        if self.enable_events and keys:
            self._events.append(OffloadingEvent(tuple(keys), MEDIUM_CPU, removed))

    def take_events(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def get_stats(self) -> dict[str, TierStats]:
        self.stats.usage_bytes = len(self._entries) * self.chunk_bytes
        return {self.stats.name: self.stats}

    def reset_cache(self) -> bool:
        """Drop every ready, unpinned entry (in-flight and pinned ones stay)."""
        victims = [k for k, s in self._entries.items() if s.ref_cnt == 0]
        for key in victims:
            self._free_list.append(self._entries.pop(key).chunk_id)
            self.policy.remove(key)
        self._emit(victims, removed=True)
        self._offer_counts.clear()
        return not self._entries

    def check_invariants(self) -> None:
        ids = [s.chunk_id for s in self._entries.values()]
        assert len(set(ids)) == len(ids), "two entries share a slot"
        assert all(0 <= i < self._num_fresh for i in ids), "entry slot was never handed out"
        assert not set(ids) & set(self._free_list), "an entry's slot is on the free list"
        assert len(set(self._free_list)) == len(self._free_list), "free list has duplicates"
        assert len(ids) + len(self._free_list) == self._num_fresh, "a slot leaked"
        assert all(s.ref_cnt >= -1 for s in self._entries.values())
        assert len(self.policy) == len(self._entries) and all(
            k in self.policy for k in self._entries
        )
