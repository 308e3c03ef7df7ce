"""RedisTier: chunks in a shared ``redis-server``, so every instance reuses every prefix.

Keys: ``<namespace>:<fingerprint>:<key hex>`` (bytes; a TP/DCP rank's shard:
``<namespace>:<fingerprint>@tp_rank:R@dcpD:<key hex>``). Values: `fingerprint.RecordHeader`
followed by the payload, verified on every read (a corrupt or foreign value is deleted and is
a miss). Batches are pipelined (one round trip per batch of EXISTS / GET / SET).

Memory and TTL policy (the server's, documented here because this tier depends on it):

* Give the server a ``maxmemory`` and ``maxmemory-policy allkeys-lru`` (or ``volatile-lru``
  with a TTL): Redis then evicts cold chunks by itself, invisibly to this tier, which is why
  lookups always ask the server and there is no local index. With ``noeviction`` a full
  server refuses SETs (OOM): those stores are dropped and counted, the tier stays healthy.
* ``ttl_s`` (``?ttl=`` in the spec) sets ``EX`` on every SET; re-storing a chunk refreshes it.
  No TTL: chunks live until the server evicts them.
* No ``BlockRemoved`` events for server-side eviction or expiry (they are not observable
  without keyspace notifications); only deletes of corrupt values are reported.

Capacity: the tier reports the server's own numbers (``INFO memory``): ``usage_bytes`` is
``used_memory`` (the whole server's, other tenants included) and ``capacity_bytes`` its
``maxmemory``. A server without ``maxmemory`` (0, Redis's default) has no limit of its own:
the stats then say ``capacity_unbounded=True`` with ``capacity_bytes=0``, never "full". The
numbers are read on an I/O thread when the tier starts and then at most every 5 s, when
stores happen or when someone reads the stats (`get_stats` never waits on the network).

Health: a connection error or timeout marks the tier unhealthy. While unhealthy every call
answers at once (misses, dropped stores) without touching the network; after a backoff
(``backoff_base_s`` doubling up to ``backoff_max_s``) one call probes the server again and a
success marks the tier healthy. Socket timeouts are short and redis-py's own retries are off,
so a stopped or frozen server costs at most one timeout per backoff period, on an I/O thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pagedkv.core.events import MEDIUM_REMOTE
from pagedkv.offload.base import (
    ChunkItems,
    OffloadKey,
    RateLimitedWarning,
    SecondaryTier,
    TierStats,
)
from pagedkv.offload.codec import CodecError, KVCodec
from pagedkv.offload.dual_queue_pool import DualQueueThreadPool
from pagedkv.offload.fingerprint import HEADER_SIZE, OffloadFingerprint, RecordError, RecordHeader

logger = logging.getLogger(__name__)
_warn = RateLimitedWarning(logger)
T = TypeVar("T")
_NETWORK_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
_USAGE_REFRESH_S = 5.0


class RedisTier(SecondaryTier):
    """See the module docstring."""

    def __init__(
        self,
        host: str,
        port: int,
        fingerprint: OffloadFingerprint | str,
        chunk_bytes: int,
        *,
        db: int = 0,
        ttl_s: int | None = None,
        password: str | None = None,
        namespace: str = "pagedkv",
        socket_timeout_s: float = 1.0,
        connect_timeout_s: float = 0.5,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
        num_threads: int = 2,
        name: str = "redis",
        rank_namespace: str = "",
        codec: KVCodec | None = None,
    ) -> None:
        """``rank_namespace``: a TP/DCP shard's (``@tp_rank:R@dcpD``), appended to the key
        prefix (MooncakeStore's per-rank key form). ``codec``: what chunks become in Redis
        (`offload.codec`; raw by default), the one the fingerprint names: values are the
        header and the encoded chunk, checksummed as encoded, decoded on the I/O threads."""
        super().__init__(name, MEDIUM_REMOTE)
        self.fingerprint = fingerprint if isinstance(fingerprint, str) else fingerprint.hexdigest
        self.chunk_bytes = chunk_bytes
        self.codec = codec if codec is not None and codec.name != "raw" else None
        self.ttl_s = ttl_s
        self.prefix = f"{namespace}:{self.fingerprint}{rank_namespace}:".encode()
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.client = redis.Redis(
            host=host,
            port=port,
            db=db,
            password=password,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            max_connections=num_threads + 2,
        )
        self._healthy = True
        self._failures = 0
        self._next_attempt = 0.0
        self._usage_refreshed = float("-inf")
        self._refresh_queued = False
        self.pool = DualQueueThreadPool(num_threads, f"{name}-io")
        self._request_usage_refresh()  # capacity known before the first store

    def redis_key(self, key: OffloadKey) -> bytes:
        return self.prefix + key.hex().encode()

    # ---------------------------------------------------------------------------- health
    @property
    def healthy(self) -> bool:
        return self._healthy

    def _may_try(self) -> bool:
        with self._lock:
            if self._healthy:
                return True
            now = time.monotonic()
            if now < self._next_attempt:
                return False
            # This caller probes; the others keep failing fast until it reports back.
            self._next_attempt = now + self._backoff()
            return True

    def _backoff(self) -> float:
        return min(self.backoff_max_s, self.backoff_base_s * 2 ** max(0, self._failures - 1))

    def _call(self, what: str, fn: Callable[[], T]) -> T | None:
        """Run one network operation; None if the tier is (or just went) down."""
        if not self._may_try():
            return None
        try:
            result = fn()
        except _NETWORK_ERRORS as exc:
            with self._lock:
                self._failures += 1
                self._healthy = False
                self._next_attempt = time.monotonic() + self._backoff()
                backoff = self._backoff()
            _warn(
                "down",
                "%s: %s failed (%s); tier marked unhealthy, retrying in %.1f s",
                self.name,
                what,
                exc,
                backoff,
            )
            return None
        with self._lock:
            recovered = not self._healthy
            self._healthy, self._failures = True, 0
        if recovered:
            logger.warning("%s: server reachable again; tier healthy", self.name)
        return result

    def _pipeline(self, what: str, build: Callable[[Any], None]) -> list[Any] | None:
        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            build(pipe)
            return pipe.execute(raise_on_error=False)

        # Connection errors abort the whole pipeline (raised); only server replies such as
        # OOM come back per command, as exception objects in the list.
        return self._call(what, run)

    # ---------------------------------------------------------------------------- batches
    def exists_batch(self, keys: Sequence[OffloadKey]) -> list[bool]:
        results = self._pipeline("EXISTS", lambda p: [p.exists(self.redis_key(k)) for k in keys])
        out = (
            [bool(r) and not isinstance(r, Exception) for r in results]
            if results
            else [False] * len(keys)
        )
        with self._lock:
            self.stats.hits += sum(out)
            self.stats.misses += len(out) - sum(out)
        return out

    def store_batch(self, items: ChunkItems) -> list[bool]:
        good = [(k, d) for k, d in items if d.nbytes == self.chunk_bytes]
        if self.codec is not None:  # encoded here, on an I/O thread
            good = [(k, memoryview(self.codec.encode(d))) for k, d in good]
        values = [
            b"".join((RecordHeader.for_payload(self.fingerprint, k, d).pack(), d)) for k, d in good
        ]  # one copy
        results = (
            self._pipeline(
                "SET",
                lambda p: [
                    p.set(self.redis_key(k), v, ex=self.ttl_s) for (k, _), v in zip(good, values)
                ],
            )
            if good
            else []
        )
        done = {k for (k, _), r in zip(good, results or []) if r is True}
        errors = [r for r in results or [] if isinstance(r, Exception)]
        if (
            errors
        ):  # e.g. OOM under maxmemory-policy noeviction: the server is fine, the store is not
            _warn(
                "set", "%s: %d stores refused by the server (%s)", self.name, len(errors), errors[0]
            )
        out = [k in done for k, _ in items]
        with self._lock:
            self.stats.stores += len(done)
            self.stats.store_failures += len(out) - len(done)
            self.stats.bytes_written += len(done) * self.chunk_bytes
        self._emit([k for k, _ in items if k in done], removed=False)
        if done:
            self._refresh_usage()
        return out

    def load_batch(self, items: ChunkItems) -> list[bool]:
        values = self._pipeline("GET", lambda p: [p.get(self.redis_key(k)) for k, _ in items])
        out = [False] * len(items)
        corrupt: list[OffloadKey] = []
        for i, ((key, dst), value) in enumerate(zip(items, values or [])):
            if not isinstance(value, bytes):
                continue  # expired, evicted, or an error reply
            try:
                payload = memoryview(value)[HEADER_SIZE:]
                RecordHeader.unpack(value).verify(self.fingerprint, key, payload)
                if self.codec is not None:
                    self.codec.decode(payload, dst)
                elif dst.nbytes != payload.nbytes:
                    raise RecordError("destination size mismatch")
                else:
                    dst[:] = payload
            except (RecordError, CodecError) as exc:
                _warn("corrupt", "%s: dropping %s: %s", self.name, key.hex()[:16], exc)
                corrupt.append(key)
                continue
            out[i] = True
        if corrupt:
            self._call("DEL", lambda: self.client.delete(*[self.redis_key(k) for k in corrupt]))
            self._emit(corrupt, removed=True)
        with self._lock:
            self.stats.loads += sum(out)
            self.stats.load_failures += len(out) - sum(out)
            self.stats.corrupted += len(corrupt)
            self.stats.bytes_read += sum(out) * self.chunk_bytes
        return out

    def get_stats(self) -> TierStats:
        """The counters; also queues a background refresh of usage and capacity when the
        last one is older than 5 s (returns at once: the engine thread calls this)."""
        self._request_usage_refresh()
        return super().get_stats()

    def _request_usage_refresh(self) -> None:
        """Queue `_refresh_usage` on an I/O thread unless one is queued or fresh enough."""
        with self._lock:
            if self._refresh_queued or time.monotonic() - self._usage_refreshed < _USAGE_REFRESH_S:
                return
            self._refresh_queued = True
        try:
            self.pool.submit_read(self._run_queued_refresh)
        except RuntimeError:  # the pool is shut down
            with self._lock:
                self._refresh_queued = False

    def _run_queued_refresh(self) -> None:
        try:
            self._refresh_usage()
        finally:
            with self._lock:
                self._refresh_queued = False

    def _refresh_usage(self) -> None:
        """Sample the server's memory use and ``maxmemory`` now and then (an I/O thread:
        never the engine). ``maxmemory`` 0 means the server has no limit (see the module
        docstring)."""
        now = time.monotonic()
        with self._lock:
            if now - self._usage_refreshed < _USAGE_REFRESH_S:
                return
            self._usage_refreshed = now
        info = self._call("INFO", lambda: self.client.info("memory"))
        if info:
            maxmemory = int(info.get("maxmemory", 0))
            with self._lock:
                self.stats.usage_bytes = int(info.get("used_memory", 0))
                self.stats.capacity_bytes = maxmemory
                self.stats.capacity_unbounded = maxmemory == 0

    def shutdown(self, timeout: float = 5.0) -> None:
        super().shutdown(timeout)
        self.client.close()
