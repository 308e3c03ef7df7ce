"""Offloading API shared by every tier: keys, lookup results, transfer specs, events, stats.

Vocabulary (vLLM v1 ``kv_offload`` names):

* **chunk**: ``blocks_per_chunk`` consecutive device blocks of one request; the unit a tier
  stores. Its bytes are every layer slot of those blocks (with several KV cache groups, the
  layers of the group owning the block: see `kv_groups`).
* **OffloadKey**: ``chunk_hash + group_idx.to_bytes(4, "big")`` where ``chunk_hash`` is the
  chained block hash at the chunk's last block (so the key fingerprints the whole prefix).
  Keys say nothing about the model; tiers that outlive the process (disk, Redis) namespace
  them by the config fingerprint (`fingerprint.py`), so a key never maps to other bytes.
* **OffloadingManager** (scheduler side): bookkeeping only, synchronous and cheap; it never
  touches tensors or does I/O on the caller's thread. **OffloadingWorker** (worker side,
  `worker.py`) moves the bytes the manager's specs describe.

Store protocol: ``prepare_store(keys)`` → the worker copies device blocks into the returned
``store_spec`` → ``complete_store(keys, success)``. Entries are not readable in between
(``HIT_PENDING``). Load protocol: ``lookup(key) is HIT`` → ``prepare_load(keys)`` pins them →
the worker copies → ``complete_load(keys)`` unpins. A pinned entry is never evicted.

Tiers below the CPU tier (disk, Redis) implement `SecondaryTier`; `tiering.py` chains them
behind the CPU tier and `factory.py` builds the chain from an `OffloadConfig`.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

from pagedkv.core.events import MEDIUM_CPU, MEDIUM_GPU, BlockRemoved, BlockStored

if TYPE_CHECKING:
    from pagedkv.offload.dual_queue_pool import DualQueueThreadPool

OffloadKey = bytes
# ``(key, buffer)`` pairs a tier writes from or reads into (a chunk slot of the host buffer).
ChunkItems = Sequence[tuple[OffloadKey, memoryview]]
_GROUP_BYTES = 4


def make_offload_key(chunk_hash: bytes, group_idx: int = 0) -> OffloadKey:
    """The key of the chunk ending at a block with hash ``chunk_hash`` in KV cache group ``group_idx``."""
    return bytes(chunk_hash) + group_idx.to_bytes(_GROUP_BYTES, "big")


def get_offload_block_hash(key: OffloadKey) -> bytes:
    return key[:-_GROUP_BYTES]


def get_offload_group_idx(key: OffloadKey) -> int:
    return int.from_bytes(key[-_GROUP_BYTES:], "big")


class LookupResult(enum.Enum):
    """Answer of `OffloadingManager.lookup` for one key.

    HIT          stored and readable now: ``prepare_load`` may be called.
    MISS         not stored (anywhere this manager can see): compute it.
    HIT_PENDING  stored but not yet readable (a store or a promotion from a lower tier is in
                 flight); it becomes HIT without further action, so a caller may count it as a
                 hit and load it once a later lookup says HIT.
    RETRY        the answer is not known yet (a background existence check is running): ask
                 again next step; never block on it.
    """

    MISS = 0
    HIT = 1
    HIT_PENDING = 2
    RETRY = 3

    @property
    def is_hit(self) -> bool:
        return self is LookupResult.HIT or self is LookupResult.HIT_PENDING


@dataclass(slots=True, frozen=True)
class LoadStoreSpec:
    """Where a transfer reads or writes: ids in the address space of ``medium``."""

    ids: tuple[int, ...]
    medium: ClassVar[str] = ""

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(slots=True, frozen=True)
class CPULoadStoreSpec(LoadStoreSpec):
    """Chunk slots of the host buffer (``HostChunkBuffer``), one id per chunk."""

    medium: ClassVar[str] = MEDIUM_CPU


@dataclass(slots=True, frozen=True)
class GPULoadStoreSpec(LoadStoreSpec):
    """Device KV-cache block ids, ``blocks_per_chunk`` per chunk, in chunk order (the
    "GPU" medium is the engine's KV cache, a CPU tensor on a CPU-only machine)."""

    medium: ClassVar[str] = MEDIUM_GPU


@dataclass(slots=True)
class PrepareStoreOutput:
    """What `prepare_store` decided: ``keys_to_store`` (in offer order, minus already stored or
    not yet admitted keys), where the worker must write them, and what was evicted for room."""

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass(slots=True, frozen=True)
class OffloadingEvent:
    """Keys that became readable in (``removed=False``) or left (``removed=True``) ``medium``.

    The tier-level form of vLLM's KV events; `to_kv_events` converts it to the wire structs
    (`BlockStored` carries no tokens: a tier only knows hashes).
    """

    keys: tuple[OffloadKey, ...]
    medium: str
    removed: bool

    def to_kv_events(self, block_size: int | Sequence[int] = 0) -> list[BlockStored | BlockRemoved]:
        """One event per KV cache group present in ``keys`` (order kept within a group);
        ``block_size``: one for every group, or each group's."""
        groups: dict[int, list[bytes]] = {}
        for key in self.keys:
            groups.setdefault(get_offload_group_idx(key), []).append(get_offload_block_hash(key))
        if self.removed:
            return [
                BlockRemoved(block_hashes=h, medium=self.medium, group_idx=g)
                for g, h in groups.items()
            ]
        sizes = block_size if isinstance(block_size, Sequence) else None
        return [
            BlockStored(
                block_hashes=h,
                parent_block_hash=None,
                token_ids=[],
                block_size=sizes[g] if sizes is not None else block_size,
                lora_id=None,
                medium=self.medium,
                group_idx=g,
            )
            for g, h in groups.items()
        ]


@dataclass(slots=True)
class TierStats:
    """Counters of one tier, for metrics. Bytes are payload bytes (what the KV cache holds)."""

    name: str
    medium: str
    capacity_bytes: int = 0
    # True when the tier has no size limit (a Redis server without ``maxmemory``): then
    # capacity_bytes is 0 and means "unbounded", not "full".
    capacity_unbounded: bool = False
    usage_bytes: int = 0
    hits: int = 0  # lookups / existence checks that found the key
    misses: int = 0
    stores: int = 0  # chunks written and readable
    store_failures: int = 0  # stores dropped: no room, disk full, tier down, backpressure
    evictions: int = 0
    loads: int = 0  # chunks read back successfully
    load_failures: int = 0  # reads that failed (missing, I/O error, tier down, corrupt)
    corrupted: int = 0  # records that failed verification and were deleted
    bytes_read: int = 0
    bytes_written: int = 0
    healthy: bool = True


class OffloadingManager(ABC):
    """Scheduler-side bookkeeping of one offloading target (vLLM ``OffloadingManager``).

    Not thread-safe: call it from one thread (the scheduler's). Every method is non-blocking;
    failures of lower tiers surface as misses and counters, never as exceptions.
    """

    @abstractmethod
    def lookup(self, key: OffloadKey) -> LookupResult:
        """Where ``key`` stands now (see `LookupResult`). Has no side effect on eviction order."""

    def lookup_many(self, keys: Sequence[OffloadKey]) -> list[LookupResult]:
        """`lookup` of a chunk-key prefix, evaluated left to right until the first result that
        is neither HIT nor HIT_PENDING; later entries repeat that result. Tiers with slow
        existence checks override it to ask about all the keys in one batch."""
        out: list[LookupResult] = []
        for key in keys:
            result = out[-1] if out and not out[-1].is_hit else self.lookup(key)
            out.append(result)
        return out

    @abstractmethod
    def prepare_load(self, keys: Sequence[OffloadKey]) -> LoadStoreSpec:
        """Pin ``keys`` (each must be HIT) and return where to read them; ValueError otherwise."""

    @abstractmethod
    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        """Unpin keys pinned by `prepare_load` (once per prepare)."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Mark ``keys`` recently used; the first key ends up the most recent (prefix heads
        outlive tails). Unknown keys are ignored."""

    @abstractmethod
    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        """Filter out stored keys, make room (never evicting a key of this offer or a pinned
        one) and allocate destinations; None (and no change) if room cannot be made."""

    @abstractmethod
    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> list[OffloadKey]:
        """Make prepared keys readable, or drop them if the transfer failed; returns the keys
        that became readable (keys not in flight are ignored)."""

    @abstractmethod
    def take_events(self) -> list[OffloadingEvent]:
        """Events since the last call (empty when events are disabled)."""

    @abstractmethod
    def get_stats(self) -> dict[str, TierStats]:
        """Stats per tier name."""

    def reset_cache(self) -> bool:
        """Drop every entry not in use; True if nothing was left behind."""
        return False

    def on_schedule_end(self) -> None:
        """Called once per scheduler step: a place to collect background completions."""

    def shutdown(self) -> None:
        """Release threads and connections."""


class RateLimitedWarning:
    """Log a warning at most once per ``interval_s`` per topic, counting the suppressed ones:
    a dead tier must not flood the log once per chunk."""

    __slots__ = ("_logger", "_interval_s", "_last", "_suppressed", "_lock")

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, topic: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(topic, -1e18) < self._interval_s:
                self._suppressed[topic] = self._suppressed.get(topic, 0) + 1
                return
            self._last[topic] = now
            suppressed = self._suppressed.pop(topic, 0)
        suffix = f" ({suppressed} similar warnings suppressed)" if suppressed else ""
        self._logger.warning(msg + suffix, *args)


class SecondaryTier(ABC):
    """A tier below the CPU tier (disk, Redis). Its batch methods block (they run on
    ``self.pool``'s threads), are thread-safe, and never raise: a failure is a False entry
    plus counters. A tier that is down reports ``healthy == False`` and answers without I/O."""

    name: str
    medium: str
    pool: DualQueueThreadPool
    max_batch: int = 16  # chunks per load/store job (existence checks take 4x as many)

    def __init__(self, name: str, medium: str, capacity_bytes: int = 0) -> None:
        self.name = name
        self.medium = medium
        self._lock = threading.Lock()  # guards stats and events (and subclass state)
        self.stats = TierStats(name=name, medium=medium, capacity_bytes=capacity_bytes)
        self._events: list[OffloadingEvent] = []

    @property
    def healthy(self) -> bool:
        return True

    @abstractmethod
    def exists_batch(self, keys: Sequence[OffloadKey]) -> list[bool]: ...

    @abstractmethod
    def store_batch(self, items: ChunkItems) -> list[bool]:
        """Write each ``(key, payload)``; True once it is durable and readable."""

    @abstractmethod
    def load_batch(self, items: ChunkItems) -> list[bool]:
        """Fill each ``(key, out)`` with the verified payload; False: ``out`` is garbage."""

    def count_dropped(self, n: int) -> None:
        """Stores refused before reaching the tier (backpressure, tier down)."""
        with self._lock:
            self.stats.store_failures += n

    def _emit(self, keys: Sequence[OffloadKey], removed: bool) -> None:
        if keys:
            with self._lock:
                self._events.append(OffloadingEvent(tuple(keys), self.medium, removed))

    def take_events(self) -> list[OffloadingEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def get_stats(self) -> TierStats:
        with self._lock:
            return replace(self.stats, healthy=self.healthy)

    def shutdown(self, timeout: float = 5.0) -> None:
        self.pool.shutdown(wait=True, timeout=timeout)


def unique(keys: Iterable[OffloadKey]) -> list[OffloadKey]:
    """``keys`` without duplicates, first occurrence order."""
    return list(dict.fromkeys(keys))


__all__ = [
    "CPULoadStoreSpec",
    "ChunkItems",
    "GPULoadStoreSpec",
    "LoadStoreSpec",
    "LookupResult",
    "OffloadKey",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "RateLimitedWarning",
    "SecondaryTier",
    "TierStats",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
    "unique",
]
