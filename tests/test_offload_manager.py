"""Scheduler-side offloading: CPUOffloadingManager, LRU/ARC policies, keys, events,
fingerprint and record header, and the ``--kv-offload`` spec parser. Pure bookkeeping: no I/O."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv.core.events import MEDIUM_CPU, BlockRemoved, BlockStored
from pagedkv.offload.base import (
    CPULoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    RateLimitedWarning,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from pagedkv.offload.cpu_manager import CPUOffloadingManager
from pagedkv.offload.fingerprint import OffloadFingerprint, RecordError, RecordHeader
from pagedkv.offload.policies import ARCCachePolicy, LRUCachePolicy, make_cache_policy
from pagedkv.offload.spec import (
    CPUTierConfig,
    DiskTierConfig,
    OffloadConfig,
    RedisTierConfig,
    parse_offload_spec,
    parse_size,
)

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def k(i: int, group: int = 0) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), group)


def stored(mgr: CPUOffloadingManager, keys: list[bytes]) -> list[int]:
    out = mgr.prepare_store(keys)
    assert out is not None
    mgr.complete_store(out.keys_to_store)
    return list(out.store_spec.ids)


# ------------------------------------------------------------------------------------ keys
def test_offload_key_roundtrip():
    h = bytes(range(32))
    key = make_offload_key(h, 7)
    assert len(key) == 36 and get_offload_block_hash(key) == h and get_offload_group_idx(key) == 7
    assert make_offload_key(h) != key


# ------------------------------------------------------------------------- CPU manager
def test_store_lifecycle_and_lookup_states():
    mgr = CPUOffloadingManager(4)
    assert mgr.lookup(k(1)) is MISS
    out = mgr.prepare_store([k(1), k(2)])
    assert out.keys_to_store == [k(1), k(2)] and out.store_spec == CPULoadStoreSpec((0, 1))
    assert out.evicted_keys == []
    assert mgr.lookup(k(1)) is PENDING  # not readable while the copy is in flight
    with pytest.raises(ValueError):
        mgr.prepare_load([k(1)])
    assert mgr.complete_store([k(1), k(2)]) == [k(1), k(2)]
    assert mgr.lookup(k(1)) is HIT and mgr.lookup(k(2)) is HIT
    assert mgr.complete_store([k(1)]) == []  # already ready: ignored
    mgr.check_invariants()


def test_fresh_ids_first_then_lifo_reuse():
    mgr = CPUOffloadingManager(4)
    assert stored(mgr, [k(1), k(2)]) == [0, 1]
    out = mgr.prepare_store([k(3)])
    assert out.store_spec.ids == (2,)
    mgr.complete_store([k(3)], success=False)  # slot 2 returns to the free list
    assert mgr.lookup(k(3)) is MISS and mgr.num_free_chunks == 2
    assert stored(mgr, [k(4)]) == [3]  # fresh ids are used up first
    assert stored(mgr, [k(5)]) == [2]  # then the free list
    mgr.check_invariants()
    # a full pool: evict LRU (k1, k2), and the freed slots are reused last-freed-first
    ids = stored(mgr, [k(6), k(7)])
    assert sorted(ids) == [0, 1] and mgr.lookup(k(1)) is MISS and mgr.lookup(k(2)) is MISS
    mgr.check_invariants()


def test_prepare_store_filters_stored_inflight_and_duplicate_keys():
    mgr = CPUOffloadingManager(8)
    stored(mgr, [k(1)])
    mgr.prepare_store([k(2)])  # in flight
    out = mgr.prepare_store([k(1), k(2), k(3), k(3), k(4)])
    assert out.keys_to_store == [k(3), k(4)] and len(out.store_spec) == 2
    mgr.check_invariants()


def test_eviction_spares_offer_and_pinned_keys_and_none_changes_nothing():
    mgr = CPUOffloadingManager(3)
    stored(mgr, [k(1), k(2), k(3)])
    mgr.prepare_load([k(1)])  # pinned
    # offering k2 again plus two new keys: k2 must not be evicted to make room for them
    assert mgr.prepare_store([k(2), k(4), k(5)]) is None
    assert all(mgr.lookup(x) is HIT for x in (k(1), k(2), k(3)))  # None → nothing changed
    mgr.check_invariants()
    out = mgr.prepare_store([k(2), k(4)])
    assert out.keys_to_store == [k(4)] and out.evicted_keys == [k(3)]
    mgr.complete_load([k(1)])
    out = mgr.prepare_store([k(5)])
    assert out.evicted_keys == [k(2)]  # LRU among ready: the chain stored head-last, k2 < k1
    assert mgr.prepare_store([k(6)]).evicted_keys == [k(1)]  # unpinned now: evictable
    with pytest.raises(ValueError):
        mgr.complete_load([k(2)])  # not pinned
    mgr.check_invariants()


def test_protected_keys_are_not_evicted():
    mgr = CPUOffloadingManager(2)
    stored(mgr, [k(1), k(2)])
    assert mgr.prepare_store([k(3)], protected={k(1), k(2)}) is None
    out = mgr.prepare_store([k(3)], protected={k(2)})
    assert out.evicted_keys == [k(1)]


def test_inflight_store_is_not_evictable():
    mgr = CPUOffloadingManager(2)
    mgr.prepare_store([k(1), k(2)])
    assert mgr.prepare_store([k(3)]) is None
    mgr.complete_store([k(1)])
    assert mgr.prepare_store([k(3)]).evicted_keys == [k(1)]


def test_store_threshold_admits_on_nth_offer():
    mgr = CPUOffloadingManager(4, store_threshold=3)
    for _ in range(2):
        assert mgr.prepare_store([k(1)]).keys_to_store == []
    assert mgr.lookup(k(1)) is MISS
    assert mgr.prepare_store([k(1), k(2)]).keys_to_store == [k(1)]
    assert mgr.prepare_store([k(5)], admit_all=True).keys_to_store == [k(5)]


def test_store_threshold_tracker_is_bounded():
    mgr = CPUOffloadingManager(4, store_threshold=2, max_tracker_size=2)
    mgr.prepare_store([k(1)])
    mgr.prepare_store([k(2)])
    mgr.prepare_store([k(3)])  # pushes k1's count out of the tracker
    assert mgr.prepare_store([k(1)]).keys_to_store == []
    assert mgr.prepare_store([k(3)]).keys_to_store == [k(3)]


def test_events_and_kv_event_conversion():
    mgr = CPUOffloadingManager(2)
    stored(mgr, [k(1), k(2, group=1)])
    mgr.prepare_store([k(9)], protected=())  # evicts the LRU key (k(2,1): k(1) is the head)
    mgr.complete_store([k(9)], success=False)  # a failed store announces nothing
    events = mgr.take_events()
    assert events == [
        OffloadingEvent((k(1), k(2, 1)), MEDIUM_CPU, False),
        OffloadingEvent((k(2, 1),), MEDIUM_CPU, True),
    ]
    assert mgr.take_events() == []
    kv = events[0].to_kv_events(block_size=16)
    assert [type(e) for e in kv] == [BlockStored, BlockStored]
    assert kv[0].block_hashes == [(1).to_bytes(32, "big")] and kv[0].group_idx == 0
    assert kv[1].group_idx == 1 and kv[1].medium == MEDIUM_CPU and kv[1].block_size == 16
    removed = events[1].to_kv_events()
    assert isinstance(removed[0], BlockRemoved) and removed[0].group_idx == 1
    quiet = CPUOffloadingManager(2, enable_events=False)
    stored(quiet, [k(1)])
    assert quiet.take_events() == []


def test_stats_and_reset_cache():
    mgr = CPUOffloadingManager(4, chunk_bytes=100)
    stored(mgr, [k(1), k(2), k(3)])
    mgr.lookup(k(1))
    mgr.lookup(k(7))
    mgr.prepare_load([k(2)])
    s = mgr.get_stats()["cpu"]
    assert (s.hits, s.misses, s.stores, s.loads) == (1, 1, 3, 1)
    assert s.usage_bytes == 300 and s.capacity_bytes == 400 and s.bytes_read == 100
    assert mgr.reset_cache() is False  # k2 is pinned and stays
    assert mgr.num_stored == 1 and mgr.lookup(k(2)) is HIT
    mgr.check_invariants()


def test_lru_evicts_chain_tails_before_heads():
    mgr = CPUOffloadingManager(4)
    stored(mgr, [k(1), k(2), k(3)])  # one request's chain: k1 is the head
    out = mgr.prepare_store([k(10)])
    out = mgr.prepare_store([k(11), k(12)])
    assert out.evicted_keys == [k(3), k(2)]  # tails first
    mgr2 = CPUOffloadingManager(3)
    stored(mgr2, [k(1), k(2), k(3)])
    mgr2.touch([k(3), k(2)])  # touch makes keys[0] the most recent: order k1 < k2 < k3
    assert mgr2.prepare_store([k(4)]).evicted_keys == [k(1)]


def test_lru_policy_unit():
    p = LRUCachePolicy()
    for key in (k(1), k(2), k(3)):
        p.insert(key)
    p.touch([k(1)])
    assert list(p) == [k(2), k(3), k(1)]
    assert p.evict(4, lambda _: True) is None and len(p) == 3
    assert p.evict(1, lambda x: x != k(2)) == [k(3)]
    assert p.evict(0, lambda _: True) == []


def test_arc_resists_scans_that_flush_lru():
    hot = [k(i) for i in range(4)]
    scan = [k(100 + i) for i in range(32)]

    def survivors(policy: str) -> int:
        mgr = CPUOffloadingManager(8, policy)
        stored(mgr, hot)
        mgr.touch(hot)  # used twice: frequent
        for key in scan:  # one-off keys stream through
            stored(mgr, [key])
        mgr.check_invariants()
        return sum(mgr.lookup(key) is HIT for key in hot)

    assert survivors("lru") == 0
    assert survivors("arc") == len(hot)


def test_arc_ghost_hits_adapt_target():
    p = ARCCachePolicy(4)
    for i in range(4):
        p.insert(k(i))
    assert p.evict(2, lambda _: True) == [k(0), k(1)]  # from t1 → ghosts in b1
    assert list(p.b1) == [k(0), k(1)] and p.target_t1_size == 0
    p.insert(k(0))  # a b1 ghost hit: t1 was too small
    assert p.target_t1_size == 1 and k(0) in p.t2 and k(0) not in p.b1
    p.touch([k(2)])  # t1 → t2
    assert list(p.t1) == [k(3)] and list(p.t2) == [k(0), k(2)]
    assert p.evict(1, lambda _: True) == [k(3)]  # |t1| >= target: t1 first
    assert p.evict(1, lambda _: True) == [k(0)]  # t1 is empty: falls back to t2 → ghost in b2
    assert list(p.b1) == [k(1), k(3)] and list(p.b2) == [k(0)]
    p.insert(k(0))  # a b2 ghost hit: t2 was too small, the target shrinks by |b1|/|b2| = 2
    assert p.target_t1_size == 0 and k(0) in p.t2
    p.remove(k(3))
    p.clear()
    assert len(p) == 0 and not p.b1 and not p.b2
    with pytest.raises(ValueError):
        make_cache_policy("fifo", 4)


def test_arc_evict_is_atomic_and_ghosts_are_bounded():
    p = ARCCachePolicy(2)
    p.insert(k(1))
    p.insert(k(2))
    assert p.evict(2, lambda x: x != k(2)) is None and len(p) == 2 and not p.b1
    for i in range(10, 20):
        p.insert(k(i))
        p.evict(1, lambda _: True)
    assert len(p.b1) <= 2 and len(p.b2) <= 2


class CPUManagerMachine(RuleBasedStateMachine):
    """Random store/load/evict sequences against a model of what must be readable."""

    def __init__(self) -> None:
        super().__init__()
        self.mgr = CPUOffloadingManager(6, "arc" if id(self) % 2 else "lru")
        self.ready: set[bytes] = set()
        self.inflight: list[list[bytes]] = []
        self.pins: list[list[bytes]] = []

    @rule(ids=st.lists(st.integers(0, 15), min_size=1, max_size=4))
    def store(self, ids: list[int]) -> None:
        keys = [k(i) for i in ids]
        before = set(self.ready)
        out = self.mgr.prepare_store(keys)
        if out is None:
            assert self.ready == before
            return
        assert not set(out.evicted_keys) & set(keys)
        pinned = {x for group in self.pins for x in group}
        assert not set(out.evicted_keys) & pinned
        self.ready -= set(out.evicted_keys)
        assert all(x not in before for x in out.keys_to_store)
        if out.keys_to_store:
            self.inflight.append(out.keys_to_store)

    @precondition(lambda self: self.inflight)
    @rule(success=st.booleans())
    def finish_store(self, success: bool) -> None:
        keys = self.inflight.pop(0)
        self.mgr.complete_store(keys, success)
        if success:
            self.ready |= set(keys)

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.ready)))
        self.mgr.prepare_load([key])
        self.pins.append([key])

    @precondition(lambda self: self.pins)
    @rule()
    def finish_load(self) -> None:
        self.mgr.complete_load(self.pins.pop())

    @rule(ids=st.lists(st.integers(0, 15), max_size=4))
    def touch(self, ids: list[int]) -> None:
        self.mgr.touch([k(i) for i in ids])

    @invariant()
    def consistent(self) -> None:
        self.mgr.check_invariants()
        for i in range(16):
            expected = HIT if k(i) in self.ready else MISS
            if any(k(i) in g for g in self.inflight):
                expected = PENDING
            assert self.mgr.peek(k(i)) is expected


TestCPUManagerStateful = CPUManagerMachine.TestCase
TestCPUManagerStateful.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestCPUManagerStateful = pytest.mark.slow(TestCPUManagerStateful)


# ------------------------------------------------------------------- fingerprint, header
def fp(**kw: object) -> OffloadFingerprint:
    base = dict(
        model="SmolLM2-135M-Instruct-Q4_1.gguf",
        dtype="float32",
        block_size=16,
        layout="LBNHC",
        num_layers=30,
        num_kv_heads=3,
        head_size=64,
    )
    base.update(kw)
    return OffloadFingerprint(**base)  # type: ignore[arg-type]


def test_fingerprint_is_stable_across_processes_and_sensitive_to_every_field():
    import torch

    a = fp()
    assert OffloadFingerprint.create(a.model, torch.float32, 16, "lbnhc", 30, 3, 64) == a
    code = (
        "from pagedkv.offload.fingerprint import OffloadFingerprint as F;"
        "print(F('SmolLM2-135M-Instruct-Q4_1.gguf','float32',16,'LBNHC',30,3,64).hexdigest)"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == a.hexdigest and len(a.hexdigest) == 32
    variants = [
        fp(dtype="bfloat16"),
        fp(kv_quant="int8"),
        fp(block_size=32),
        fp(layout="BLNHC"),
        fp(tp_rank=1, tp_size=2),
        fp(blocks_per_chunk=2),
        fp(model="other"),
        fp(format_version=99),
        fp(pp_size=2),
    ]
    digests = {v.hexdigest for v in variants} | {a.hexdigest}
    assert len(digests) == len(variants) + 1


def test_record_header_detects_every_kind_of_damage():
    digest = fp().hexdigest
    payload = bytes(range(256)) * 16
    head = RecordHeader.for_payload(digest, k(1), payload).pack()
    RecordHeader.unpack(head).verify(digest, k(1), payload)
    with pytest.raises(RecordError, match="checksum"):
        RecordHeader.unpack(head).verify(digest, k(1), payload[:-1] + b"\x00")
    with pytest.raises(RecordError, match="length"):
        RecordHeader.unpack(head).verify(digest, k(1), payload[:-16])
    with pytest.raises(RecordError, match="configuration"):
        RecordHeader.unpack(head).verify(fp(dtype="bfloat16").hexdigest, k(1), payload)
    with pytest.raises(RecordError, match="key"):
        RecordHeader.unpack(head).verify(digest, k(2), payload)
    flipped = bytearray(head)
    flipped[40] ^= 0x01
    with pytest.raises(RecordError, match="header"):
        RecordHeader.unpack(flipped)
    with pytest.raises(RecordError):
        RecordHeader.unpack(head[:20])
    with pytest.raises(RecordError):
        RecordHeader.unpack(bytes(len(head)))


# ---------------------------------------------------------------------------------- spec
def test_parse_documented_spec():
    cfg = parse_offload_spec(
        "cpu:4GiB,disk:/var/cache/pagedkv:20GiB,redis://127.0.0.1:6379/2?ttl=3600"
    )
    assert cfg == OffloadConfig(
        CPUTierConfig(4 * 2**30),
        DiskTierConfig("/var/cache/pagedkv", 20 * 2**30),
        RedisTierConfig("127.0.0.1", 6379, 2, 3600),
    )
    assert parse_offload_spec(cfg.to_spec()) == cfg
    assert parse_offload_spec("cpu:512MiB") == OffloadConfig(CPUTierConfig(512 * 2**20))
    r = parse_offload_spec("redis://:s3cret@cache.local,cpu:1GB").redis
    assert r == RedisTierConfig("cache.local", 6379, 0, None, "s3cret")
    assert parse_offload_spec("cpu:1g".replace("g", "GB")).cpu.capacity_bytes == 10**9
    assert parse_offload_spec("cpu:1GiB,disk:C:/x:y:1MiB").disk == DiskTierConfig("C:/x:y", 2**20)


def test_parse_p2p_codec():
    cfg = parse_offload_spec("cpu:1GiB,p2p:10.0.0.2:7000:zstd,p2p-listen:0.0.0.0:7001:1GiB:zstd")
    assert cfg.p2p.codec == "zstd" and cfg.p2p.peers == (("10.0.0.2", 7000),)
    assert (cfg.p2p.listen_host, cfg.p2p.listen_port) == ("0.0.0.0", 7001)
    assert parse_offload_spec(cfg.to_spec()) == cfg
    assert parse_offload_spec("cpu:1GiB,p2p:h:7000").p2p.codec == "raw"
    with pytest.raises(ValueError, match="one codec"):
        parse_offload_spec("cpu:1GiB,p2p:h:7000:zstd,p2p-listen:7001:1GiB:lz4")
    with pytest.raises(ValueError, match="unknown codec"):
        parse_offload_spec("cpu:1GiB,p2p:h:7000:gzip")


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "disk:/x:1GiB",
        "cpu:1GiB,cpu:2GiB",
        "cpu:lots",
        "cpu:1GiB,nvme:/x:1GiB",
        "cpu:1GiB,disk:1GiB",
        "cpu:1GiB,redis://h:1/x",
        "cpu:1GiB,redis://h?ttl=0",
        "cpu:1GiB,redis://h?tls=1",
        "cpu:1GiB,redis://",
    ],
)
def test_parse_spec_rejects(bad: str):
    with pytest.raises(ValueError):
        parse_offload_spec(bad)


def test_parse_size_units():
    assert parse_size("1.5KiB") == 1536 and parse_size("7") == 7 and parse_size("2 mb") == 2 * 10**6
    with pytest.raises(ValueError):
        parse_size("1 parsec")


def test_rate_limited_warning(caplog: pytest.LogCaptureFixture):
    warn = RateLimitedWarning(logging.getLogger("t"), interval_s=60)
    with caplog.at_level(logging.WARNING):
        for i in range(5):
            warn("topic", "failure %d", i)
        warn("other", "different")
    assert [r.getMessage() for r in caplog.records] == ["failure 0", "different"]
