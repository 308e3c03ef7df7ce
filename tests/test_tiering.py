"""TieringOffloadingManager end to end: a CPU KV cache, the worker, the CPU tier, a disk tier
in a temp directory and a real redis-server. Every block that comes back to the device is
compared with the bytes that were computed for its key."""

from __future__ import annotations

import hashlib
import random
import time
from pathlib import Path

import pytest
import torch
from redis_server import REDIS_SERVER, SKIP_REASON, RedisServer, redis_server  # noqa: F401 (fixture)

from pagedkv.offload.base import GPULoadStoreSpec, LookupResult, make_offload_key
from pagedkv.offload.cpu_manager import CPUOffloadingManager
from pagedkv.offload.factory import build_offloading
from pagedkv.offload.fingerprint import OffloadFingerprint
from pagedkv.offload.fs_tier import FileSystemTier
from pagedkv.offload.redis_tier import RedisTier
from pagedkv.offload.spec import parse_offload_spec
from pagedkv.offload.tiering import AsyncLookupManager, SecondaryTier, TieringOffloadingManager
from pagedkv.offload.worker import HostChunkBuffer, OffloadingWorker
from pagedkv.ops.kv_cache import allocate_kv_cache

HIT, MISS, PENDING, RETRY = (
    LookupResult.HIT,
    LookupResult.MISS,
    LookupResult.HIT_PENDING,
    LookupResult.RETRY,
)
L, NB, N, H, D = 2, 64, 4, 2, 16
LAYOUT = "LBNHC"
FP = OffloadFingerprint.create("tiny", torch.float32, N, LAYOUT, L, H, D)


def key(i: int) -> bytes:
    return make_offload_key(hashlib.sha256(str(i).encode()).digest())


class Engine:
    """The minimum of an engine: a device KV cache, blocks filled per key, and the manager /
    worker protocol around them."""

    def __init__(self, tiers: list[SecondaryTier], cpu_chunks: int = 8, **kw) -> None:
        self.buf, _ = allocate_kv_cache(LAYOUT, L, NB, N, H, D, torch.float32)
        self.host = HostChunkBuffer.for_kv_cache(
            self.buf, LAYOUT, cpu_chunks * L * N * H * 2 * D * 4
        )
        self.worker = OffloadingWorker(self.buf, LAYOUT, self.host)
        self.cpu = CPUOffloadingManager(self.host.num_chunks, chunk_bytes=self.host.chunk_bytes)
        self.mgr = TieringOffloadingManager(self.cpu, self.host, tiers, **kw)
        self.jobs = 0

    def content(self, k: bytes) -> torch.Tensor:
        g = torch.Generator().manual_seed(int.from_bytes(k[:8], "big") & 0x7FFFFFFF)
        return torch.randn(self.buf[:, 0].shape, generator=g)

    def device_block(self, b: int) -> torch.Tensor:
        return self.buf[:, b]

    def offload(self, keys: list[bytes]) -> list[bytes]:
        blocks = list(range(1, 1 + len(keys)))
        for k, b in zip(keys, blocks):
            self.device_block(b).copy_(self.content(k))
        out = self.mgr.prepare_store(keys)
        if out is None:
            return []
        by_key = dict(zip(keys, blocks))
        self.jobs += 1
        self.worker.submit_store(
            self.jobs, GPULoadStoreSpec(tuple(by_key[k] for k in out.keys_to_store)), out.store_spec
        )
        [res] = self.worker.get_finished()
        return self.mgr.complete_store(out.keys_to_store, res.success)

    def resolve(self, keys: list[bytes], timeout_s: float = 10.0) -> list[LookupResult]:
        """Ask every step until no answer is RETRY or HIT_PENDING (what a scheduler does)."""
        deadline = time.monotonic() + timeout_s
        while True:
            res = self.mgr.lookup_many(keys)
            if not any(r in (RETRY, PENDING) for r in res) or time.monotonic() > deadline:
                return res
            time.sleep(0.002)

    def fetch(self, keys: list[bytes]) -> int:
        """Load the leading HIT run to fresh device blocks and check every byte; returns its length."""
        res = self.resolve(keys)
        n = next((i for i, r in enumerate(res) if r is not HIT), len(keys))
        if n == 0:
            return 0
        spec = self.mgr.prepare_load(keys[:n])
        blocks = tuple(range(NB - n, NB))
        self.buf[:, NB - n :].zero_()
        self.jobs += 1
        self.worker.submit_load(self.jobs, spec, GPULoadStoreSpec(blocks))
        assert all(r.success for r in self.worker.get_finished())
        self.mgr.complete_load(keys[:n])
        for k, b in zip(keys[:n], blocks):
            assert torch.equal(self.device_block(b), self.content(k)), "loaded bytes differ"
        return n

    def evict_cpu(self) -> None:
        """Fill the CPU tier with throwaway keys so everything before is gone from it."""
        assert self.mgr.drain()
        junk = [key(10**6 + i + self.jobs * 1000) for i in range(self.cpu.num_chunks)]
        assert self.offload(junk)
        assert self.mgr.drain()


def disk(tmp_path: Path, name: str = "disk", **kw) -> FileSystemTier:
    return FileSystemTier(
        tmp_path / name,
        FP,
        kw.pop("capacity", 10**8),
        L * N * H * 2 * D * 4,
        num_threads=2,
        name=name,
        **kw,
    )


def redis_tier(server: RedisServer, **kw) -> RedisTier:
    kw.setdefault("socket_timeout_s", 0.3)
    kw.setdefault("backoff_base_s", 0.2)
    return RedisTier("127.0.0.1", server.port, FP, L * N * H * 2 * D * 4, **kw)


def test_store_cascades_and_a_disk_hit_is_promoted_then_loaded(tmp_path: Path):
    eng = Engine([disk(tmp_path)])
    keys = [key(i) for i in range(4)]
    assert eng.offload(keys) == keys
    assert eng.mgr.drain()
    assert eng.mgr.get_stats()["disk"].stores == 4
    eng.evict_cpu()
    assert all(eng.cpu.peek(k) is MISS for k in keys)
    assert eng.mgr.lookup_many(keys) == [RETRY] * 4  # existence check in flight
    assert eng.resolve(keys) == [HIT] * 4  # found on disk, promoted, verified
    assert eng.fetch(keys) == 4
    stats = eng.mgr.get_stats()
    assert stats["disk"].loads == 4 and stats["cpu"].stores >= 4 + eng.cpu.num_chunks
    events = eng.mgr.take_events()
    assert any(e.medium == "STORAGE" and not e.removed and set(keys) <= set(e.keys) for e in events)
    assert any(e.medium == "CPU" and e.removed for e in events)
    eng.cpu.check_invariants()
    eng.mgr.shutdown()


def test_prefix_lookup_stops_at_the_first_gap(tmp_path: Path):
    eng = Engine([disk(tmp_path)])
    a, b, c = key(1), key(2), key(3)
    eng.offload([b])
    eng.evict_cpu()
    eng.offload([a])
    assert eng.mgr.lookup_many([a, b, c]) == [HIT, RETRY, RETRY]
    assert eng.resolve([a, b, c]) == [HIT, HIT, MISS]
    assert eng.mgr.lookup(c) is MISS  # the negative answer is remembered for a while: no I/O
    eng.mgr.shutdown()


@pytest.mark.parametrize("tier_kind", ["disk", "redis"])
def test_a_prefix_found_while_nobody_asks_is_promoted_and_outlives_its_answers(
    tmp_path: Path, tier_kind: str, request: pytest.FixtureRequest
):
    # Issue 9, item 3: a request asks once (RETRY), then waits for a batch slot and does not
    # ask again while its answers come back and expire. Its prefix must be in CPU when it
    # asks next, not an expired answer that starts the check over.
    tier = (
        disk(tmp_path)
        if tier_kind == "disk"
        else redis_tier(request.getfixturevalue("redis_server"))
    )
    eng = Engine([tier], answer_ttl_s=0.05)
    keys = [key(i) for i in range(4)]
    assert eng.offload(keys) == keys
    eng.evict_cpu()
    assert all(eng.cpu.peek(k) is MISS for k in keys)
    assert eng.mgr.lookup_many(keys) == [RETRY] * 4
    assert eng.mgr.drain()  # the engine steps on (polls), never asking about these keys
    time.sleep(0.1)  # every existence answer has expired by now
    assert all(eng.cpu.peek(k) is HIT for k in keys)  # promoted when the answers came back
    assert eng.mgr.lookup_many(keys) == [HIT] * 4  # no new check, no wait
    assert eng.fetch(keys) == 4  # and the bytes are the ones stored
    assert eng.mgr.get_stats()[tier.name].loads == 4
    eng.cpu.check_invariants()
    eng.mgr.shutdown()


def test_a_watched_promotion_never_evicts_chunks_about_to_be_loaded(tmp_path: Path):
    # The CPU tier is full of HIT chunks a request is about to load, and the answers of a
    # watched prefix arrive just then: its promotion must not take their slots.
    eng = Engine([disk(tmp_path)], cpu_chunks=4)
    watched = [key(i) for i in range(2)]
    eng.offload(watched)
    eng.evict_cpu()
    hits = list(eng.cpu._entries)
    assert len(hits) == 4 and all(eng.cpu.peek(k) is HIT for k in hits)
    assert eng.mgr.lookup_many(watched) == [RETRY, RETRY]
    deadline = time.monotonic() + 10
    while eng.mgr.lookups._done.qsize() == 0 and time.monotonic() < deadline:
        time.sleep(0.005)  # the disk answered; nobody has polled yet
    eng.mgr.prepare_load(hits)  # pins all four, then folds the answers in
    assert all(eng.cpu.peek(k) is HIT for k in hits)
    eng.mgr.complete_load(hits)
    assert eng.resolve(watched) == [HIT, HIT]  # promoted once room came back
    eng.cpu.check_invariants()
    eng.mgr.shutdown()


def test_restarted_engine_reuses_the_disk(tmp_path: Path):
    first = Engine([disk(tmp_path)])
    keys = [key(i) for i in range(6)]
    first.offload(keys)
    first.mgr.shutdown()  # drains the write-back
    second = Engine([disk(tmp_path)])
    assert second.fetch(keys) == 6
    assert second.mgr.get_stats()["disk"].loads == 6
    second.mgr.shutdown()


def test_corrupt_disk_copy_is_a_miss_never_wrong_bytes(tmp_path: Path):
    tier = disk(tmp_path)
    eng = Engine([tier])
    keys = [key(i) for i in range(3)]
    eng.offload(keys)
    eng.evict_cpu()
    path = tier.path_for(keys[1])
    data = bytearray(path.read_bytes())
    data[5000] ^= 0xFF
    path.write_bytes(bytes(data))
    assert eng.resolve(keys) == [HIT, MISS, MISS]
    assert eng.fetch(keys) == 1
    assert eng.mgr.get_stats()["disk"].corrupted == 1 and not path.exists()
    assert eng.cpu.peek(keys[1]) is MISS  # the failed promotion gave its slot back
    eng.cpu.check_invariants()
    eng.mgr.shutdown()


def test_promotion_without_cpu_room_is_a_miss(tmp_path: Path):
    eng = Engine([disk(tmp_path)], cpu_chunks=4)
    keys = [key(i) for i in range(2)]
    eng.offload(keys)
    eng.evict_cpu()
    pinned = [k for k in eng.cpu._entries]
    eng.mgr.prepare_load(pinned)  # every slot is being read by the device
    assert eng.resolve(keys) == [MISS, MISS]
    eng.mgr.complete_load(pinned)
    eng.mgr.lookups.forget(keys)
    assert eng.resolve(keys) == [HIT, HIT]
    eng.mgr.shutdown()


def test_cascade_backpressure_bounds_pins_and_never_blocks_the_cpu_tier(tmp_path: Path):
    class SlowTier(FileSystemTier):
        def store_batch(self, items):
            time.sleep(0.1)
            return super().store_batch(items)

    slow = SlowTier(tmp_path / "slow", FP, 10**8, L * N * H * 2 * D * 4, num_threads=1)
    slow.max_batch = 2
    eng = Engine([slow], cpu_chunks=8, max_cascade_fraction=0.25)  # at most 2 pinned slots
    first = [key(i) for i in range(6)]
    assert eng.offload(first) == first
    assert eng.mgr._cascade_pins == 2 and len(eng.mgr._backlog[0]) == 4  # the rest waits, unpinned
    # 6 more chunks need 4 evictions: the 4 unpinned, not-yet-written ones go (the CPU tier is
    # never blocked by write-back), and their write-backs are dropped and counted
    second = [key(50 + i) for i in range(6)]
    assert eng.offload(second) == second
    assert eng.mgr.drain()
    assert eng.mgr._cascade_pins == 0
    stats = slow.get_stats()
    assert stats.stores == 8 and stats.store_failures == 4
    assert slow.exists_batch(first[:2] + second) == [True] * 8
    eng.mgr.shutdown()


def test_instances_share_prefixes_through_redis(tmp_path: Path, redis_server: RedisServer):
    a = Engine([disk(tmp_path, "a"), redis_tier(redis_server)])
    b_disk = disk(tmp_path, "b")
    b = Engine([b_disk, redis_tier(redis_server)])
    keys = [key(i) for i in range(5)]
    a.offload(keys)
    assert a.mgr.drain()
    assert b.fetch(keys) == 5  # computed by a, loaded by b
    assert b.mgr.get_stats()["redis"].loads == 5
    assert b.mgr.drain() and all(b_disk.exists_batch(keys))  # promoted chunks go down to b's disk
    a.mgr.shutdown()
    b.mgr.shutdown()


def test_redis_outage_mid_run_degrades_to_misses_and_recovers(
    tmp_path: Path, redis_server: RedisServer
):
    writer = Engine([redis_tier(redis_server)])
    early = [key(i) for i in range(4)]
    writer.offload(early)  # only Redis will have these
    assert writer.mgr.drain()
    remote = redis_tier(redis_server)
    eng = Engine([disk(tmp_path), remote], lookup_timeout_s=1.0)
    redis_server.stop()
    t0 = time.monotonic()
    later = [key(100 + i) for i in range(4)]
    assert eng.offload(later) == later  # stores go on: CPU + disk
    eng.evict_cpu()
    assert eng.fetch(early) == 0  # Redis is down: a miss, not an error or a hang
    assert eng.fetch(later) == 4  # the disk still serves
    stats = eng.mgr.get_stats()
    assert not stats["redis"].healthy and stats["redis"].store_failures > 0
    assert stats["disk"].corrupted == 0 and time.monotonic() - t0 < 8
    redis_server.start()  # same port; empty: it kept nothing in memory
    fresh = [key(200 + i) for i in range(2)]
    deadline = time.monotonic() + 10
    while not remote.healthy and time.monotonic() < deadline:
        eng.mgr.lookups.forget(early)
        eng.resolve(early)  # existence checks probe the server after each backoff
        time.sleep(0.05)
    assert remote.healthy
    eng.offload(fresh)
    assert eng.mgr.drain() and remote.exists_batch(fresh) == [True, True]
    reader = Engine(
        [redis_tier(redis_server)]
    )  # a third instance sees what was stored after recovery
    assert reader.fetch(fresh) == 2
    for e in (writer, eng, reader):
        e.mgr.shutdown()


def test_frozen_redis_never_blocks_the_scheduler(tmp_path: Path, redis_server: RedisServer):
    eng = Engine([redis_tier(redis_server, socket_timeout_s=1.0)], lookup_timeout_s=0.3)
    keys = [key(i) for i in range(3)]
    redis_server.pause()
    try:
        worst = 0.0
        results = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            results = eng.mgr.lookup_many(keys)
            worst = max(worst, time.perf_counter() - t0)
            if results[0] is not RETRY:
                break
            time.sleep(0.005)
        assert results == [MISS] * 3  # the check timed out: a miss, not a wait
        assert worst < 0.05 and eng.mgr.lookups.num_timeouts >= 3
        t0 = time.perf_counter()
        eng.offload([key(9)])  # the cascade is queued on an I/O thread
        assert time.perf_counter() - t0 < 0.05
    finally:
        redis_server.resume()
    assert eng.mgr.drain()
    eng.mgr.shutdown()


def test_random_workload_never_loads_wrong_bytes(tmp_path: Path):
    rng = random.Random(7)
    eng = Engine([disk(tmp_path, capacity=20 * 8192 * 2)], cpu_chunks=6)
    loaded = 0
    for _ in range(40):
        prefix = [key(rng.randrange(3) * 100 + i) for i in range(rng.randint(1, 5))]
        if rng.random() < 0.5:
            eng.offload(prefix)
            assert eng.mgr.drain()  # write-back done before the next request (time passes)
        else:
            loaded += eng.fetch(prefix)
        eng.mgr.on_schedule_end()
        eng.cpu.check_invariants()
    stats = eng.mgr.get_stats()
    assert loaded > 0 and stats["disk"].loads > 0 and stats["disk"].corrupted == 0
    eng.mgr.shutdown()


def test_async_lookup_manager_batches_and_times_out():
    class Tier(SecondaryTier):
        def __init__(self, present: set[bytes], delay: float) -> None:
            super().__init__("t", "STORAGE")
            from pagedkv.offload.dual_queue_pool import DualQueueThreadPool

            self.present, self.delay, self.calls = present, delay, []
            self.pool = DualQueueThreadPool(1)

        def exists_batch(self, keys):
            self.calls.append(list(keys))
            time.sleep(self.delay)
            return [k in self.present for k in keys]

        def store_batch(self, items):
            return [False] * len(items)

        def load_batch(self, items):
            return [False] * len(items)

    fast, slow = Tier({key(1)}, 0.0), Tier({key(2)}, 0.5)
    lookups = AsyncLookupManager([fast, slow], timeout_s=0.2)
    lookups.request([key(1), key(2), key(3), key(1)])
    assert fast.calls == [] or fast.calls == [[key(1), key(2), key(3)]]
    time.sleep(0.05)
    lookups.poll()
    assert fast.calls == [[key(1), key(2), key(3)]]  # one batch, no duplicates
    assert lookups.get(key(1)) is None  # the slow tier has not answered yet
    time.sleep(0.25)
    lookups.poll()  # deadline passed: resolve with what we have
    assert (lookups.get(key(1)), lookups.get(key(2)), lookups.get(key(3))) == (0, -1, -1)
    lookups.request([key(1)])  # fresh answer: no new check
    time.sleep(0.3)
    assert len(fast.calls) == 1
    fast.shutdown()
    slow.shutdown()


def test_build_offloading_from_the_spec(tmp_path: Path):
    buf, _ = allocate_kv_cache(LAYOUT, L, NB, N, H, D, torch.float32)
    mgr, worker = build_offloading(parse_offload_spec("cpu:64KiB"), FP, buf, LAYOUT)
    assert isinstance(mgr, CPUOffloadingManager) and mgr.num_chunks == 64 * 1024 // (
        L * N * H * 2 * D * 4
    )
    assert worker.host.num_chunks == mgr.num_chunks
    spec = parse_offload_spec(f"cpu:64KiB,disk:{tmp_path}:1MiB")
    mgr2, _ = build_offloading(spec, FP, buf, LAYOUT, cache_policy="arc", store_threshold=2)
    assert isinstance(mgr2, TieringOffloadingManager) and [t.name for t in mgr2.tiers] == ["disk"]
    assert (tmp_path / f"pagedkv-{FP.hexdigest}" / "config.json").exists()
    mgr2.shutdown()


@pytest.mark.skipif(REDIS_SERVER is None, reason=SKIP_REASON)
def test_build_offloading_with_redis(tmp_path: Path, redis_server: RedisServer):
    buf, _ = allocate_kv_cache(LAYOUT, L, NB, N, H, D, torch.float32)
    spec = parse_offload_spec(f"cpu:64KiB,disk:{tmp_path}:1MiB,{redis_server.url}/1?ttl=60")
    mgr, _ = build_offloading(spec, FP, buf, LAYOUT)
    assert [t.name for t in mgr.tiers] == ["disk", "redis"] and mgr.tiers[1].ttl_s == 60
    mgr.shutdown()
