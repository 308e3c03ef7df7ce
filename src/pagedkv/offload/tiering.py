"""TieringOffloadingManager: the CPU tier as gateway to slower tiers (disk, Redis).

::

    device KV ──store──▶ CPU (primary) ──cascade──▶ disk, Redis, ...   (every secondary tier)
    device KV ◀──load─── CPU (primary) ◀──promote── first tier that has the key

* Only the primary (`CPUOffloadingManager` + the host buffer) exchanges bytes with the device.
* ``complete_store`` cascades each newly readable chunk to every secondary tier: the chunk is
  pinned in CPU (so its slot cannot be reused) until the tier's write finishes.
* A lookup that misses in CPU asks the `AsyncLookupManager`: existence checks run on the tiers'
  I/O threads and the answer is RETRY until they come back (or time out, which counts as a
  miss). A hit starts a *promotion*: a CPU slot is prepared (HIT_PENDING) and filled by the
  tier; when the read is verified the slot becomes HIT and the engine loads it as usual.
* Answers expire (``answer_ttl_s``), promoted chunks do not: so the manager acts on an answer
  when it arrives, not when the prefix is next asked about. A prefix whose lookup said RETRY
  is *watched*; when its checks come back, the hits it completes are promoted at once. A
  request that then waits for a batch slot (not asking) finds its prefix in CPU however long
  it waited; an answer that went stale before anyone acted on it is asked again.
* Tiers implement `base.SecondaryTier`; `factory.build_offloading` builds this manager from
  the ``--kv-offload`` spec.
* All bookkeeping happens on the caller's (scheduler's) thread: I/O threads only post
  completions to a queue that every public method drains first. So no lock guards manager
  state, and nothing the scheduler calls waits for I/O.

Failure policy: a tier error is a miss (lookups, promotions) or a dropped store, counted in
that tier's `TierStats` and logged (rate-limited); nothing raises into the engine.
Backpressure: write-backs wait in a per-tier backlog (unpinned, at most ``max_backlog`` keys)
and are pinned and submitted only while cascades pin less than ``max_cascade_fraction`` of
the CPU slots and the tier has fewer than ``max_pending_write_batches`` writes queued. A key
evicted from CPU before its turn, a backlog overflow, or a tier that is down drops the store
(counted in the tier's ``store_failures``): write-back never starves promotions or device
stores of CPU room (the CPU-pool exhaustion that blocks disk loads in other systems).
"""

from __future__ import annotations

import logging
import queue
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from pagedkv.offload.base import (
    ChunkItems,
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    RateLimitedWarning,
    SecondaryTier,
    TierStats,
)
from pagedkv.offload.cpu_manager import CPUOffloadingManager

__all__ = [
    "AsyncLookupManager",
    "ChunkBuffer",
    "ChunkItems",
    "SecondaryTier",
    "TieringOffloadingManager",
]

logger = logging.getLogger(__name__)
_warn = RateLimitedWarning(logger)


class ChunkBuffer(Protocol):
    """The host buffer as lower tiers see it (`worker.HostChunkBuffer`)."""

    chunk_bytes: int

    def chunk_view(self, chunk_id: int) -> memoryview: ...


def _batches(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


@dataclass(slots=True)
class _Check:
    answers: list[bool | None]  # per tier; None: not answered yet
    deadline: float


class AsyncLookupManager:
    """Existence checks of keys in every secondary tier, run in the background.

    ``request(keys)`` submits one batched check per tier (reads queue) for keys that have no
    pending check and no fresh answer; ``poll()`` (caller's thread) folds completed checks in;
    ``get(key)`` is the index of the first tier that has the key, -1 if none, or None while
    unknown. A check that outlives ``timeout_s`` resolves with what it has (an unanswered tier
    counts as "no"). Answers live ``answer_ttl_s`` (a negative answer may go stale when another
    instance stores the key) and at most ``max_answers`` are kept.
    """

    def __init__(
        self,
        tiers: Sequence[SecondaryTier],
        timeout_s: float = 2.0,
        answer_ttl_s: float = 1.0,
        max_answers: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tiers = list(tiers)
        self.timeout_s = timeout_s
        self.answer_ttl_s = answer_ttl_s
        self.max_answers = max_answers
        self._clock = clock
        self._pending: OrderedDict[OffloadKey, _Check] = OrderedDict()  # deadline order
        self._answers: OrderedDict[OffloadKey, tuple[int, float]] = OrderedDict()
        self._done: queue.SimpleQueue[tuple[int, Sequence[OffloadKey], list[bool] | None]] = (
            queue.SimpleQueue()
        )
        self.num_timeouts = 0

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def request(self, keys: Sequence[OffloadKey]) -> None:
        now = self._clock()
        new = [
            k for k in dict.fromkeys(keys) if k not in self._pending and self._fresh(k, now) is None
        ]
        if not new:
            return
        for key in new:
            self._pending[key] = _Check([None] * len(self.tiers), now + self.timeout_s)
        for i, tier in enumerate(self.tiers):
            for batch in _batches(new, tier.max_batch * 4):
                try:
                    fut = tier.pool.submit_read(tier.exists_batch, batch)
                except RuntimeError:  # pool shut down
                    self._done.put((i, batch, None))
                    continue
                fut.add_done_callback(
                    lambda f, i=i, b=batch: self._done.put(
                        (i, b, None if f.cancelled() or f.exception() else f.result())
                    )
                )

    def poll(self) -> int:
        """Fold completed checks in and time out late ones; returns how many keys resolved."""
        resolved = 0
        while True:
            try:
                tier_idx, batch, found = self._done.get_nowait()
            except queue.Empty:
                break
            for j, key in enumerate(batch):
                check = self._pending.get(key)
                if check is not None:
                    check.answers[tier_idx] = bool(found[j]) if found is not None else False
                    if all(a is not None for a in check.answers):
                        self._resolve(key)
                        resolved += 1
        now = self._clock()
        while self._pending:
            key, check = next(iter(self._pending.items()))
            if check.deadline > now:
                break
            self.num_timeouts += 1
            self._resolve(key)
            resolved += 1
        return resolved

    def _resolve(self, key: OffloadKey) -> None:
        check = self._pending.pop(key)
        tier = next((i for i, a in enumerate(check.answers) if a), -1)
        self.set_answer(key, tier)

    def set_answer(self, key: OffloadKey, tier: int) -> None:
        self._answers.pop(key, None)
        self._answers[key] = (tier, self._clock() + self.answer_ttl_s)
        while len(self._answers) > self.max_answers:
            self._answers.popitem(last=False)

    def _fresh(self, key: OffloadKey, now: float) -> int | None:
        answer = self._answers.get(key)
        if answer is None:
            return None
        if answer[1] <= now:
            del self._answers[key]
            return None
        return answer[0]

    def get(self, key: OffloadKey) -> int | None:
        return self._fresh(key, self._clock())

    def forget(self, keys: Collection[OffloadKey]) -> None:
        """Drop answers (the key was just stored or promoted: they may be stale)."""
        for key in keys:
            self._answers.pop(key, None)


class TieringOffloadingManager(OffloadingManager):
    """See the module docstring.

    ``primary`` and ``host`` are the CPU tier (bookkeeping and its slots); ``tiers`` are in
    preference order (fastest first: a key found in several is read from the first). A
    lookup's existence check resolves within ``lookup_timeout_s``; its answer is reused for
    ``answer_ttl_s``. Not thread-safe: the scheduler's thread calls it, I/O threads never do.
    """

    def __init__(
        self,
        primary: CPUOffloadingManager,
        host: ChunkBuffer,
        tiers: Sequence[SecondaryTier],
        *,
        lookup_timeout_s: float = 2.0,
        answer_ttl_s: float = 1.0,
        max_cascade_fraction: float = 0.5,
        max_pending_write_batches: int = 64,
        max_backlog: int | None = None,
        max_watched: int = 1024,
    ) -> None:
        self.primary = primary
        self.host = host
        self.tiers = list(tiers)
        self.lookups = AsyncLookupManager(self.tiers, lookup_timeout_s, answer_ttl_s)
        self.max_cascade_pins = max(1, int(primary.num_chunks * max_cascade_fraction))
        self.max_pending_write_batches = max_pending_write_batches
        self._completions: queue.SimpleQueue[tuple[str, int, list[OffloadKey], list[bool]]] = (
            queue.SimpleQueue()
        )
        self._cascade_pins = 0
        self._jobs_in_flight = 0
        self.max_backlog = max_backlog or 4 * primary.num_chunks
        self._backlog: list[deque[OffloadKey]] = [deque() for _ in self.tiers]  # write-back queues
        # Prefixes whose lookup said RETRY -> when to stop watching (see the module docstring).
        self._watched: OrderedDict[tuple[OffloadKey, ...], float] = OrderedDict()
        self.max_watched = max_watched

    # ------------------------------------------------------------------------ completions
    def _submit(self, kind: str, tier_idx: int, items: ChunkItems) -> None:
        tier = self.tiers[tier_idx]
        keys = [k for k, _ in items]
        self._jobs_in_flight += 1
        try:
            submit = tier.pool.submit_write if kind == "store" else tier.pool.submit_read
            fut = submit(tier.store_batch if kind == "store" else tier.load_batch, items)
        except RuntimeError:
            self._completions.put((kind, tier_idx, keys, [False] * len(keys)))
            return

        def done(f: Future[list[bool]]) -> None:
            failed = f.cancelled() or f.exception() is not None
            if failed and not f.cancelled():  # a tier broke its never-raise contract: a bug
                _warn(f"{tier.name}-{kind}", "%s: %s job raised %r", tier.name, kind, f.exception())
            self._completions.put(
                (kind, tier_idx, keys, [False] * len(keys) if failed else f.result())
            )

        fut.add_done_callback(done)

    def _poll(self) -> None:
        if self.lookups.poll() and self._watched:
            self._promote_watched()
        while True:
            try:
                kind, tier_idx, keys, ok = self._completions.get_nowait()
            except queue.Empty:
                break
            self._jobs_in_flight -= 1
            if kind == "store":
                self.primary.unpin(keys)
                self._cascade_pins -= len(keys)
                self.lookups.forget(keys)
            else:
                self._finish_promotions(tier_idx, keys, ok)
        self._pump()

    def _finish_promotions(self, tier_idx: int, keys: list[OffloadKey], ok: list[bool]) -> None:
        loaded = [k for k, good in zip(keys, ok) if good]
        failed = [k for k, good in zip(keys, ok) if not good]
        self.primary.complete_store(failed, success=False)
        for key in failed:  # a corrupt or vanished copy: say MISS for a while, do not loop
            self.lookups.set_answer(key, -1)
        ready = self.primary.complete_store(loaded, success=True)
        self._cascade(ready, range(tier_idx))  # copy down into the faster tiers only

    def _cascade(self, keys: Sequence[OffloadKey], tier_ids: Sequence[int] | range) -> None:
        """Queue ``keys`` for write-back to each tier; `_pump` submits them as budget allows."""
        if not keys:
            return
        for ti in tier_ids:
            tier, backlog = self.tiers[ti], self._backlog[ti]
            if not tier.healthy:
                tier.count_dropped(len(keys))
                continue
            backlog.extend(keys)
            overflow = len(backlog) - self.max_backlog
            for _ in range(max(0, overflow)):
                backlog.popleft()
            if overflow > 0:
                tier.count_dropped(overflow)
        self._pump()

    def _pump(self) -> None:
        """Pin and submit backlogged write-backs while the pin budget and the tier's write
        queue allow. A key evicted from CPU before its turn is dropped (counted): the backlog
        never holds CPU room, so promotions and device stores always find some."""
        for ti, tier in enumerate(self.tiers):
            backlog = self._backlog[ti]
            if backlog and not tier.healthy:
                tier.count_dropped(len(backlog))
                backlog.clear()
            while (
                backlog
                and self._cascade_pins < self.max_cascade_pins
                and tier.pool.num_pending_writes < self.max_pending_write_batches
            ):
                take: list[OffloadKey] = []
                while (
                    backlog
                    and len(take) < tier.max_batch
                    and self._cascade_pins + len(take) < self.max_cascade_pins
                ):
                    key = backlog.popleft()
                    if self.primary.peek(key) is LookupResult.HIT:
                        take.append(key)
                    else:
                        tier.count_dropped(1)
                if not take:
                    continue
                chunk_ids = self.primary.pin(take)
                self._cascade_pins += len(take)
                self._submit(
                    "store", ti, [(k, self.host.chunk_view(c)) for k, c in zip(take, chunk_ids)]
                )

    # ------------------------------------------------------------------------------ lookup
    def lookup(self, key: OffloadKey) -> LookupResult:
        return self.lookup_many([key])[0]

    def lookup_many(self, keys: Sequence[OffloadKey]) -> list[LookupResult]:
        """Prefix lookup (see `OffloadingManager.lookup_many`). Keys missing from CPU are
        checked in every secondary tier in one background batch; found ones are promoted, now
        or (RETRY: the prefix is watched) as soon as their checks come back."""
        self._poll()
        if not keys:
            return []
        if self.tiers:
            self.lookups.request([k for k in keys if self.primary.peek(k) is LookupResult.MISS])
        results = self._resolve_prefix(keys)
        if results[-1] is LookupResult.RETRY:  # a RETRY repeats to the end of the list
            self._watch(tuple(keys))
        return results

    def _watch(self, keys: tuple[OffloadKey, ...]) -> None:
        """Promote ``keys``' hits when their checks come back, even if nobody asks again."""
        self._watched.pop(keys, None)
        # Checks resolve within the lookup timeout; the margin covers a late poll.
        self._watched[keys] = time.monotonic() + self.lookups.timeout_s + 1.0
        while len(self._watched) > self.max_watched:
            self._watched.popitem(last=False)

    def _promote_watched(self) -> None:
        """Answers came back: promote what each watched prefix can now use; stop watching a
        prefix once none of its answers is outstanding (or its time is up)."""
        now = time.monotonic()
        for keys, until in list(self._watched.items()):
            if (
                self._resolve_prefix(keys, count=False)[-1] is not LookupResult.RETRY
                or until <= now
            ):
                del self._watched[keys]

    def _resolve_prefix(self, keys: Sequence[OffloadKey], count: bool = True) -> list[LookupResult]:
        """The prefix lookup proper, on the answers known now; starts the promotion of the
        hits that continue the CPU prefix (a miss if the CPU tier has no room for them).
        ``count``: count CPU hits and misses in the stats (not for the manager's own looks)."""
        results: list[LookupResult] = []
        to_promote: list[tuple[OffloadKey, int]] = []
        first_promoted = -1
        cpu_lookup = self.primary.lookup if count else self.primary.peek
        for i, key in enumerate(keys):
            result = cpu_lookup(key)
            if result is LookupResult.MISS and self.tiers:
                tier = self.lookups.get(key)
                if tier is None:
                    result = LookupResult.RETRY
                elif tier >= 0:
                    result = LookupResult.HIT_PENDING
                    first_promoted = i if first_promoted < 0 else first_promoted
                    to_promote.append((key, tier))
            results.append(result)
            if not result.is_hit:
                break
        if to_promote and not self._promote(to_promote, protected=keys):
            results = results[:first_promoted] + [LookupResult.MISS]  # no CPU room: a miss
        results.extend([results[-1]] * (len(keys) - len(results)))
        return results

    def _promote(
        self, run: list[tuple[OffloadKey, int]], protected: Collection[OffloadKey]
    ) -> bool:
        """Prepare CPU slots for ``run`` and read them from their tiers; False if no room."""
        out = self.primary.prepare_store(
            [k for k, _ in run], protected=set(protected), admit_all=True
        )
        if out is None:
            return False
        slot = dict(zip(out.keys_to_store, out.store_spec.ids))
        by_tier: dict[int, list[tuple[OffloadKey, memoryview]]] = {}
        for key, ti in run:
            if key in slot:
                by_tier.setdefault(ti, []).append((key, self.host.chunk_view(slot[key])))
        self.lookups.forget(slot)
        for ti, items in by_tier.items():
            for batch in _batches(items, self.tiers[ti].max_batch):
                self._submit("load", ti, batch)
        return True

    # -------------------------------------------------------------------- primary delegates
    def prepare_load(self, keys: Sequence[OffloadKey]) -> LoadStoreSpec:
        # Pin before polling: a poll may start promotions for watched prefixes, which evict
        # unpinned chunks, and ``keys`` are chunks the caller just saw as HIT.
        spec = self.primary.prepare_load(keys)
        self._poll()
        return spec

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        self.primary.complete_load(keys)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self.primary.touch(keys)

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        self._poll()
        return self.primary.prepare_store(keys)

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> list[OffloadKey]:
        self._poll()
        ready = self.primary.complete_store(keys, success)
        self._cascade(ready, range(len(self.tiers)))
        return ready

    def take_events(self) -> list[OffloadingEvent]:
        self._poll()
        events = self.primary.take_events()
        for tier in self.tiers:
            events.extend(tier.take_events())
        return events

    def get_stats(self) -> dict[str, TierStats]:
        self._poll()
        stats = self.primary.get_stats()
        for tier in self.tiers:
            stats[tier.name] = tier.get_stats()
        return stats

    def on_schedule_end(self) -> None:
        self._poll()

    def reset_cache(self) -> bool:
        """Resets the CPU tier only: secondary tiers are persistent and may be shared."""
        self._poll()
        return self.primary.reset_cache()

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait (polling) until no cascade, promotion or existence check is in flight. For
        tests and shutdown only: the engine never calls a blocking method."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._poll()
            if (
                self._jobs_in_flight == 0
                and self.lookups.num_pending == 0
                and not any(self._backlog)
            ):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self.drain(timeout_s)
        for tier in self.tiers:
            tier.shutdown(timeout_s)
