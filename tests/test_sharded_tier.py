"""`offload.sharded` on real files and real shared memory: a chunk's parts go to one tier per
shard (each in its rank's namespace), a key is present and loadable only when every part is,
a rank's strided view of the shared host buffer addresses exactly its part, and the
fingerprint of one rank never matches another rank's or a one-process engine's."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import torch
from redis_server import RedisServer, redis_server  # noqa: F401 (fixture)

from pagedkv.offload.base import make_offload_key
from pagedkv.offload.fingerprint import OffloadFingerprint
from pagedkv.offload.fs_tier import FileSystemTier
from pagedkv.offload.sharded import (
    RankShardInfo,
    ShardedTier,
    SharedHostMemory,
    attach_host_memory,
    plan_shards,
    rank_host_buffer,
)

FP = OffloadFingerprint("test-model", "float32", 16, "LBNHC", 2, 3, 64)
PARTS = (4096, 2048)  # rank 0 holds 2 KV heads, rank 1 one


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"))


def _tier(root: Path) -> ShardedTier:
    fps = [replace(FP, tp_rank=r, tp_size=2, num_kv_heads=2 - r) for r in range(2)]
    offsets = (0, PARTS[0])
    return ShardedTier(
        [
            (FileSystemTier(root, fp, 1 << 20, n, rank_namespace=f"@tp_rank:{r}@dcp0"), off, n)
            for r, (fp, off, n) in enumerate(zip(fps, offsets, PARTS))
        ]
    )


def test_parts_round_trip_in_their_namespaces(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    try:
        chunks = [bytearray(random.Random(i).randbytes(sum(PARTS))) for i in range(3)]
        assert (
            tier.store_batch([(key(i), memoryview(c)) for i, c in enumerate(chunks)]) == [True] * 3
        )
        assert tier.exists_batch([key(0), key(1), key(9)]) == [True, True, False]
        out = [bytearray(sum(PARTS)) for _ in range(3)]
        assert tier.load_batch([(key(i), memoryview(o)) for i, o in enumerate(out)]) == [True] * 3
        assert out == chunks
        names = sorted(p.name for p in tmp_path.iterdir())
        assert [n.split("@", 1)[1] for n in names] == ["tp_rank:0@dcp0", "tp_rank:1@dcp0"]
        stats = tier.get_stats()
        assert (stats.stores, stats.loads, stats.hits, stats.misses) == (3, 3, 2, 1)
    finally:
        tier.shutdown()


def test_a_key_missing_from_one_part_is_a_miss(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    try:
        chunk = bytearray(random.Random(5).randbytes(sum(PARTS)))
        assert tier.store_batch([(key(5), memoryview(chunk))]) == [True]
        rank1 = next(p for p in tmp_path.iterdir() if p.name.endswith("@tp_rank:1@dcp0"))
        for f in rank1.rglob("*.kv"):
            f.write_bytes(b"torn")  # rank 1's part corrupted
        out = bytearray(sum(PARTS))
        assert tier.load_batch([(key(5), memoryview(out))]) == [False]
        assert tier.get_stats().load_failures == 1
        assert tier.exists_batch([key(5)]) == [False]  # rank 0's part alone is no chunk
    finally:
        tier.shutdown()


def test_rank_views_address_their_part_of_the_shared_buffer() -> None:
    infos = [
        RankShardInfo(r, w, (2, 8), "float32", 64, 1, 0, 1, f"@tp_rank:{r}@dcp0", "h")
        for r, w in [(0, 0), (1, 0), (2, 2)]  # rank 1 replicates rank 0's head
    ]
    shards = plan_shards(infos)
    assert [(s.rank, s.offset) for s in shards] == [(0, 0), (2, 64)]
    chunk_bytes, num_chunks = 128, 4
    mem = SharedHostMemory(chunk_bytes * num_chunks)
    try:
        other = attach_host_memory(mem.path, mem.nbytes)  # a second mapping, as a rank makes
        part = rank_host_buffer(other, num_chunks, chunk_bytes, 64, (2, 8), torch.float32)
        part.tensor[3] = 7.0
        raw = mem.tensor.view(torch.float32).view(num_chunks, 32)
        assert (raw[3, 16:] == 7).all() and (raw[3, :16] == 0).all() and (raw[:3] == 0).all()
    finally:
        mem.close()


def test_rank_fingerprints_never_match_one_process() -> None:
    one = FP.hexdigest
    ranks = {replace(FP, tp_rank=r, tp_size=2).hexdigest for r in range(2)}
    assert len(ranks) == 2 and one not in ranks
    # DCP fields stay out of the JSON without DCP: one-process digests are unchanged
    assert "dcp_rank" not in json.loads(FP.to_json())
    assert replace(FP, dcp_rank=1, dcp_size=2).hexdigest != FP.hexdigest


def test_redis_parts_live_under_their_rank_namespace(redis_server: RedisServer) -> None:
    import redis

    from pagedkv.offload.redis_tier import RedisTier

    fps = [replace(FP, tp_rank=r, tp_size=2, num_kv_heads=2 - r) for r in range(2)]
    parts = [
        (
            RedisTier("127.0.0.1", redis_server.port, fp, n, rank_namespace=f"@tp_rank:{r}@dcp0"),
            o,
            n,
        )
        for r, (fp, o, n) in enumerate(zip(fps, (0, PARTS[0]), PARTS))
    ]
    tier = ShardedTier(parts)
    try:
        chunk = bytearray(random.Random(1).randbytes(sum(PARTS)))
        assert tier.store_batch([(key(1), memoryview(chunk))]) == [True]
        out = bytearray(sum(PARTS))
        assert tier.load_batch([(key(1), memoryview(out))]) == [True] and out == chunk
        keys = redis.Redis(port=redis_server.port).keys("pagedkv:*")
        spaces = sorted(k.rsplit(b":", 1)[0].split(b"@", 1)[1] for k in keys)
        assert spaces == [b"tp_rank:0@dcp0", b"tp_rank:1@dcp0"]
    finally:
        tier.shutdown()
