"""Eviction policies of the CPU tier: LRU and ARC (vLLM ``kv_offload/cpu/policies``).

A policy only orders keys; the manager owns their state. ``evict(n, evictable)`` is atomic:
it returns ``n`` victims (already removed from the policy) or None and changes nothing.
``evictable(key)`` lets the manager veto pinned, in-flight and protected keys.

Keys are inserted and touched in *reversed* chain order by the manager, so the head of a
prefix is the most recent: every longer prefix needs the head, so tails must go first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from pagedkv.offload.base import OffloadKey

Evictable = Callable[[OffloadKey], bool]


class CachePolicy(ABC):
    """Recency/frequency order over resident keys."""

    @abstractmethod
    def insert(self, key: OffloadKey) -> None:
        """Add a new resident key as the most recent."""

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Forget a resident key (failed store): no ghost entry, no-op if absent."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Mark resident keys used, in order (the last one ends up the most recent)."""

    @abstractmethod
    def evict(self, n: int, evictable: Evictable) -> list[OffloadKey] | None:
        """Remove and return ``n`` evictable keys in eviction order, or None (no change)."""

    @abstractmethod
    def clear(self) -> None: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[OffloadKey]:
        """Resident keys, least recent (next to evict) first."""


class LRUCachePolicy(CachePolicy):
    """Least recently used first: an OrderedDict whose front is the LRU end."""

    def __init__(self, capacity: int = 0) -> None:
        del capacity  # LRU keeps no history beyond the residents
        self._order: OrderedDict[OffloadKey, None] = OrderedDict()

    def insert(self, key: OffloadKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: OffloadKey) -> None:
        self._order.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            if key in self._order:
                self._order.move_to_end(key)

    def evict(self, n: int, evictable: Evictable) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        victims: list[OffloadKey] = []
        for key in self._order:
            if evictable(key):
                victims.append(key)
                if len(victims) == n:
                    break
        if len(victims) < n:
            return None
        for key in victims:
            del self._order[key]
        return victims

    def clear(self) -> None:
        self._order.clear()

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter(list(self._order))


class ARCCachePolicy(CachePolicy):
    """Adaptive Replacement Cache (Megiddo & Modha): scan-resistant LRU/LFU blend.

    ``t1`` holds keys seen once, ``t2`` keys used again; ``b1``/``b2`` remember (keys only) what
    was evicted from each. Re-inserting a ``b1`` ghost means t1 was too small: the target size
    ``target_t1_size`` grows by ``max(1, |b2|/|b1|)``; a ``b2`` ghost shrinks it by
    ``max(1, |b1|/|b2|)``. Eviction takes t1's LRU while ``|t1| >= target`` else t2's, falling
    back to the other list when one has nothing evictable. Ghost lists hold at most
    ``capacity`` keys each.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("ARC needs a positive capacity")
        self.capacity = capacity
        self.target_t1_size = 0.0
        self.t1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def insert(self, key: OffloadKey) -> None:
        if key in self.b1:
            delta = max(1.0, len(self.b2) / len(self.b1))
            self.target_t1_size = min(float(self.capacity), self.target_t1_size + delta)
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            delta = max(1.0, len(self.b1) / len(self.b2))
            self.target_t1_size = max(0.0, self.target_t1_size - delta)
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None

    def remove(self, key: OffloadKey) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            if key in self.t1:
                del self.t1[key]
                self.t2[key] = None
            elif key in self.t2:
                self.t2.move_to_end(key)

    def evict(self, n: int, evictable: Evictable) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        # Plan on counters first so a failure leaves everything untouched.
        it1 = (k for k in self.t1 if evictable(k))
        it2 = (k for k in self.t2 if evictable(k))
        size1, size2 = len(self.t1), len(self.t2)
        plan: list[tuple[OffloadKey, bool]] = []  # (key, came from t1)
        for _ in range(n):
            first_t1 = size1 >= max(1.0, self.target_t1_size)
            order = ((it1, True), (it2, False)) if first_t1 else ((it2, False), (it1, True))
            for it, from_t1 in order:
                key = next(it, None)
                if key is not None:
                    plan.append((key, from_t1))
                    size1, size2 = (size1 - 1, size2) if from_t1 else (size1, size2 - 1)
                    break
            else:
                return None
        for key, from_t1 in plan:
            src, ghost = (self.t1, self.b1) if from_t1 else (self.t2, self.b2)
            del src[key]
            ghost[key] = None
            if len(ghost) > self.capacity:
                ghost.popitem(last=False)
        return [key for key, _ in plan]

    def clear(self) -> None:
        for d in (self.t1, self.t2, self.b1, self.b2):
            d.clear()
        self.target_t1_size = 0.0

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter([*self.t1, *self.t2])


CACHE_POLICIES: dict[str, type[CachePolicy]] = {"lru": LRUCachePolicy, "arc": ARCCachePolicy}


def make_cache_policy(name: str, capacity: int) -> CachePolicy:
    """The policy called ``name`` ("lru" or "arc") sized for ``capacity`` resident keys."""
    try:
        return CACHE_POLICIES[name.lower()](capacity)
    except KeyError:
        raise ValueError(
            f"unknown cache policy {name!r}; choose from {sorted(CACHE_POLICIES)}"
        ) from None
