"""RedisTier against a real redis-server: pipelined batches, fingerprint namespaces, TTL,
corruption, a server that dies, freezes, comes back, or runs out of memory."""

from __future__ import annotations

import random
import time

import redis
from redis_server import RedisServer, redis_server  # noqa: F401 (fixture)

from pagedkv.offload.base import make_offload_key
from pagedkv.offload.fingerprint import HEADER_SIZE
from pagedkv.offload.redis_tier import RedisTier

CHUNK = 48 * 1024 + 7
FP = "0123456789abcdef" * 2


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"))


def payload(i: int) -> bytes:
    return random.Random(i).randbytes(CHUNK)


def make_tier(server: RedisServer, fp: str = FP, **kw) -> RedisTier:
    kw.setdefault("socket_timeout_s", 0.3)
    kw.setdefault("backoff_base_s", 0.2)
    return RedisTier("127.0.0.1", server.port, fp, CHUNK, **kw)


def store(tier: RedisTier, ids: list[int]) -> list[bool]:
    return tier.store_batch([(key(i), memoryview(payload(i))) for i in ids])


def load(tier: RedisTier, ids: list[int]) -> list[bytes | None]:
    outs = [bytearray(CHUNK) for _ in ids]
    ok = tier.load_batch([(key(i), memoryview(o)) for i, o in zip(ids, outs)])
    return [bytes(o) if good else None for o, good in zip(outs, ok)]


def test_batch_roundtrip_namespaces_and_ttl(redis_server: RedisServer):
    tier = make_tier(redis_server, ttl_s=600)
    other = make_tier(redis_server, fp="f" * 32)
    try:
        assert tier.exists_batch([key(1), key(2)]) == [False, False]
        assert store(tier, [1, 2, 3]) == [True, True, True]
        assert tier.exists_batch([key(1), key(9), key(3)]) == [True, False, True]
        assert load(tier, [3, 9, 1]) == [payload(3), None, payload(1)]
        assert other.exists_batch([key(1)]) == [False]  # another configuration sees nothing
        raw = redis.Redis(port=redis_server.port)
        rk = f"pagedkv:{FP}:{key(1).hex()}".encode()
        assert tier.redis_key(key(1)) == rk and raw.strlen(rk) == HEADER_SIZE + CHUNK
        assert 0 < raw.ttl(rk) <= 600
        assert store(other, [1]) == [True] and raw.ttl(other.redis_key(key(1))) == -1  # no TTL
        s = tier.get_stats()
        assert (s.stores, s.loads, s.load_failures, s.hits, s.misses) == (3, 2, 1, 2, 3)
        assert s.bytes_written == 3 * CHUNK and s.healthy and s.usage_bytes > 3 * CHUNK
        assert s.medium == "REMOTE" and [e.removed for e in tier.take_events()] == [False]
    finally:
        tier.shutdown()
        other.shutdown()


def test_corrupt_and_foreign_values_are_dropped(redis_server: RedisServer):
    tier = make_tier(redis_server)
    raw = redis.Redis(port=redis_server.port)
    store(tier, [1, 2, 3])
    raw.setrange(tier.redis_key(key(1)), HEADER_SIZE + 100, b"\xff\xfe")  # flipped payload bytes
    raw.set(tier.redis_key(key(2)), raw.get(tier.redis_key(key(3))))  # another key's record
    raw.set(tier.redis_key(key(4)), b"garbage")  # not a record at all
    assert load(tier, [1, 2, 3, 4]) == [None, None, payload(3), None]
    assert raw.exists(tier.redis_key(key(1)), tier.redis_key(key(2)), tier.redis_key(key(4))) == 0
    s = tier.get_stats()
    assert s.corrupted == 3 and s.load_failures == 3
    assert {k for e in tier.take_events() if e.removed for k in e.keys} == {key(1), key(2), key(4)}
    tier.shutdown()


def test_stopped_server_gives_misses_then_recovers(redis_server: RedisServer):
    tier = make_tier(redis_server)
    assert store(tier, [1]) == [True]
    redis_server.stop()
    t0 = time.monotonic()
    assert tier.exists_batch([key(1)]) == [False]  # refused connection: a quick miss
    assert not tier.healthy
    assert store(tier, [2]) == [False] and load(tier, [1]) == [None]  # fail fast in backoff
    assert tier.get_stats().healthy is False and time.monotonic() - t0 < 2.0
    redis_server.start()  # same port, empty (no persistence)
    deadline = time.monotonic() + 10
    while not tier.healthy and time.monotonic() < deadline:
        tier.exists_batch([key(1)])  # probes once each backoff period
        time.sleep(0.05)
    assert tier.healthy
    assert store(tier, [3]) == [True] and load(tier, [3]) == [payload(3)]
    s = tier.get_stats()
    assert s.store_failures == 1 and s.load_failures == 1 and s.healthy
    tier.shutdown()


def test_frozen_server_costs_one_timeout_per_backoff(redis_server: RedisServer):
    tier = make_tier(redis_server, socket_timeout_s=0.2, backoff_base_s=5.0)
    assert store(tier, [1]) == [True]
    redis_server.pause()  # accepts connections, never answers
    try:
        t0 = time.monotonic()
        assert load(tier, [1]) == [None]
        first = time.monotonic() - t0
        t0 = time.monotonic()
        for _ in range(20):
            assert tier.exists_batch([key(1)]) == [False]
        rest = time.monotonic() - t0
        assert first < 1.5 and rest < 0.2 and not tier.healthy
    finally:
        redis_server.resume()
    tier.shutdown()


def test_server_out_of_memory_drops_stores_but_stays_healthy():
    server = RedisServer(maxmemory="3mb", policy="noeviction").start()
    try:
        tier = make_tier(server)
        results = [store(tier, [i])[0] for i in range(200)]
        assert results[0] and not all(results)  # it filled up at some point
        assert tier.healthy and tier.get_stats().store_failures == results.count(False)
        first_ok = [i for i, ok in enumerate(results) if ok][:3]
        assert load(tier, first_ok) == [payload(i) for i in first_ok]
        tier.shutdown()
    finally:
        server.close()
