"""`EventFeed`: one replica's KV events mirrored into the router's shared `PrefixIndex`.

Protocol (`pagedkv.core.event_transport`, vLLM's wire format): a SUB socket on the replica's
PUB endpoint, opened *before* asking the ROUTER replay endpoint for every buffered batch, so
nothing falls between the two. Then live batches, each numbered ``seq = previous + 1``:

* ``seq <= last`` before any newer live batch: a live copy of a replayed batch; skipped.
* ``seq <= last`` after that: the publisher restarted (numbering from 0 again): resync.
* ``seq > last + 1``: batches were lost (a slow subscriber hits the PUB high-water mark): the
  missing ones are replayed; if the replica's buffer no longer has them, resync.

Resync = drop every entry of this replica, then apply everything the replay buffer holds. So
the index never silently keeps a stale view: after a loss it forgets (the router then
under-predicts this replica, never over-predicts). Without a replay endpoint a resync can only
forget. All index changes happen under the caller's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from pagedkv.core.event_transport import KVEventSubscriber
from pagedkv.router.index import PrefixIndex

logger = logging.getLogger(__name__)

# on_batch(replica, lag_seconds or None (replayed), number of events)
BatchHook = Callable[[str, float | None, int], None]
# on_resync(replica, why): "connect", "gap", "restart", "lost"
ResyncHook = Callable[[str, str], None]


class EventFeed:
    """Runs on a daemon thread from `start` until `stop`. ``synced`` is set once the first
    replay (or, without one, the first subscription) is applied: `wait_synced` lets a caller
    route only on a complete view."""

    def __init__(
        self,
        replica: str,
        endpoint: str,
        replay_endpoint: str | None,
        index: PrefixIndex,
        lock: threading.Lock,
        *,
        topic: str = "",
        on_batch: BatchHook | None = None,
        on_resync: ResyncHook | None = None,
        replay_timeout: float = 5.0,
    ) -> None:
        self.replica = replica
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.index, self.lock = index, lock
        self.on_batch, self.on_resync = on_batch, on_resync
        self.replay_timeout = replay_timeout
        self.last_seq = -1
        self._beyond_replay = False  # a live batch newer than the last replay came
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"router-feed-{replica}", daemon=True
        )

    def start(self) -> EventFeed:
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def wait_synced(self, timeout: float) -> bool:
        return self.synced.wait(timeout)

    # ---- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            sub = KVEventSubscriber(self.endpoint, self.replay_endpoint, self.topic)
        except zmq.ZMQError as e:
            logger.error("replica %s: cannot subscribe to %s: %s", self.replica, self.endpoint, e)
            return
        try:
            time.sleep(0.1)  # let the SUB connect before the replay (as `pagedkv events` does)
            while not self._stop.is_set() and not self._resync(sub, "connect"):
                self._stop.wait(1.0)
            self._live(sub)
        finally:
            sub.close()

    def _live(self, sub: KVEventSubscriber) -> None:
        while not self._stop.is_set():
            got = sub.recv(timeout=0.2)
            if got is None:
                continue
            seq, batch = got
            if seq <= self.last_seq:
                if self._beyond_replay:
                    self._resync(sub, "restart")
                continue
            if seq != self.last_seq + 1:
                self._fill_gap(sub, seq)
                continue
            self._beyond_replay = True
            with self.lock:
                self.index.apply_batch(self.replica, batch.events)
            self.last_seq = seq
            if self.on_batch:
                self.on_batch(self.replica, max(0.0, time.time() - batch.ts), len(batch.events))

    def _fill_gap(self, sub: KVEventSubscriber, seq: int) -> None:
        """Batches ``last_seq + 1 .. seq`` from the replay buffer, else a resync."""
        start = self.last_seq + 1
        logger.warning("replica %s: missed KV event batches %d..%d", self.replica, start, seq - 1)
        if self.replay_endpoint is None:
            self._resync(sub, "gap")
            return
        try:
            batches = sub.replay(start, self.replay_timeout)
        except TimeoutError:
            self._resync(sub, "gap")
            return
        if not batches or batches[0][0] != start:
            self._resync(sub, "lost")
            return
        with self.lock:
            for s, b in batches:
                if s > self.last_seq:
                    self.index.apply_batch(self.replica, b.events)
                    self.last_seq = s
        self._beyond_replay = False  # live copies of the replayed batches may follow
        if self.on_resync:
            self.on_resync(self.replica, "gap")

    def _resync(self, sub: KVEventSubscriber, why: str) -> bool:
        """Forget the replica, then apply its whole replay buffer. False when the replay did
        not answer (the replica is probably down; the caller retries or gives up)."""
        batches = []
        if self.replay_endpoint is not None:
            try:
                batches = sub.replay(0, self.replay_timeout)
            except TimeoutError:
                logger.warning(
                    "replica %s: no KV event replay from %s", self.replica, self.replay_endpoint
                )
                with self.lock:
                    self.index.remove_replica(self.replica)
                return False
        with self.lock:
            self.index.remove_replica(self.replica)
            for _, b in batches:
                self.index.apply_batch(self.replica, b.events)
        self.last_seq = batches[-1][0] if batches else -1
        self._beyond_replay = False
        if batches and batches[0][0] > 0:
            logger.info(
                "replica %s: replay starts at batch %d (older ones left its buffer): blocks "
                "cached before it are not indexed",
                self.replica,
                batches[0][0],
            )
        if self.on_resync:
            self.on_resync(self.replica, why)
        if self.on_batch and batches:
            self.on_batch(self.replica, None, sum(len(b.events) for _, b in batches))
        self.synced.set()
        return True


def describe(feed: Any) -> dict[str, Any]:
    """JSON-ready state of a feed (for ``/router/state``)."""
    if feed is None:
        return {"subscribed": False}
    return {
        "subscribed": True,
        "endpoint": feed.endpoint,
        "replay_endpoint": feed.replay_endpoint,
        "last_seq": feed.last_seq,
        "synced": feed.synced.is_set(),
    }
