"""Micro-benchmarks of the pure-Python core (no torch). Prints a table and JSON.

Figures (µs, best of several repeats; this machine is noisy):
  * get_new_blocks(1) + free_blocks cycle, caching off / on (and on with a hashed block that
    must be evicted on reuse);
  * touch of a cached free block (revived out of the middle of the free queue);
  * chained hash of one 16-token block, per hash function;
  * get_computed_blocks + allocate_slots + free of a 2,048-token request with a 50% prefix hit
    (block size 16).

Baselines measured in the same run, for ratios: a nano-vllm-style pool (deque of free ids,
``deque.remove`` to revive) for the cycle and touch, and the bare serialise+digest call for the
hashes (the floor any implementation pays). The issue's targets (vLLM 0.33 on this machine
class) are printed beside them.

Usage: python benchmarks/bench_core.py [--json-only] [--repeat N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import sys
import timeit
from collections import deque

import cbor2
import xxhash

from pagedkv.core.block_pool import BlockPool
from pagedkv.core.hashing import HASH_FUNCTIONS, hash_block_tokens
from pagedkv.core.kv_cache_manager import KVCacheManager
from pagedkv.core.request import KVCacheRequest, get_request_block_hasher
from pagedkv.core.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

TARGETS = {  # µs; from the issue (vLLM 0.33 measured on this machine class)
    "cycle_caching_off": 0.92,
    "cycle_caching_on": 0.9,
    "hash_sha256": 1.24,
    "hash_sha256_cbor": 2.37,
    "allocate_free_2048_50pct_hit": 120.0,
}


def best_us(fn, number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


class NaivePool:
    """nano-vllm's block manager shape: a deque of free ids, a dict of hashes."""

    def __init__(self, n: int) -> None:
        self.free = deque(range(n))
        self.ref = [0] * n
        self.hash_of = [-1] * n
        self.hash_to_id: dict[int, int] = {}

    def get(self) -> int:
        bid = self.free.popleft()
        h = self.hash_of[bid]
        if h != -1 and self.hash_to_id.get(h) == bid:
            del self.hash_to_id[h]
        self.ref[bid] = 1
        return bid

    def release(self, bid: int) -> None:
        self.ref[bid] -= 1
        if self.ref[bid] == 0:
            self.free.append(bid)

    def touch(self, bid: int) -> None:
        if self.ref[bid] == 0:
            self.free.remove(bid)  # O(n)
        self.ref[bid] += 1


def bench_cycles(repeat: int) -> dict[str, float]:
    out = {}
    n = 200_000
    for caching in (False, True):
        pool = BlockPool(10_000, enable_caching=caching)
        get, free = pool.get_new_blocks, pool.free_blocks
        out[f"cycle_caching_{'on' if caching else 'off'}"] = best_us(
            lambda: free(get(1)), n, repeat
        )
    # Reuse of a cached block: every get evicts a hash (the steady state of a full cache).
    pool = BlockPool(3)
    index = pool.cached_block_hash_to_block

    def evicting_cycle() -> None:
        (blk,) = pool.get_new_blocks(1)
        blk._block_hash = b"0123456789abcdef0123456789abcdef\x00\x00\x00\x00"
        index.insert(blk._block_hash, blk)
        pool.free_blocks((blk,))

    out["cycle_caching_on_evict"] = best_us(evicting_cycle, n, repeat)
    naive = NaivePool(10_000)
    out["baseline_naive_cycle"] = best_us(lambda: naive.release(naive.get()), n, repeat)
    return out


def bench_touch(repeat: int) -> dict[str, float]:
    num = 10_000
    pool = BlockPool(num + 1)
    blocks = pool.get_new_blocks(num)
    for i, blk in enumerate(blocks):
        blk._block_hash = i.to_bytes(32, "big") + b"\x00\x00\x00\x00"
        pool.cached_block_hash_to_block.insert(blk._block_hash, blk)
    pool.free_blocks(blocks)
    middle = blocks[::2]  # revive every other block: removals from the middle of the queue
    times = []
    for _ in range(repeat):
        t = timeit.timeit(lambda: pool.touch(middle), number=1)
        times.append(t / len(middle) * 1e6)
        pool.free_blocks(middle)
    naive = NaivePool(num)
    ids = list(range(0, num, 2))
    naive_times = []
    for _ in range(max(1, repeat // 2)):
        t = timeit.timeit(lambda: [naive.touch(i) for i in ids[:500]], number=1)
        naive_times.append(t / 500 * 1e6)
        for i in ids[:500]:
            naive.release(i)
    return {"touch_cached_block": min(times), "baseline_naive_touch": min(naive_times)}


def bench_hashes(repeat: int) -> dict[str, float]:
    parent = hashlib.sha256(b"parent").digest()
    tokens = list(range(1000, 1016))
    out = {}
    n = 100_000
    for name, fn in HASH_FUNCTIONS.items():
        out[f"hash_{name}"] = best_us(
            lambda fn=fn: hash_block_tokens(fn, parent, tokens), n, repeat
        )
    obj = (parent, tuple(tokens), None)
    proto = pickle.HIGHEST_PROTOCOL
    floors = {
        "sha256": lambda: hashlib.sha256(pickle.dumps(obj, protocol=proto)).digest(),
        "sha256_cbor": lambda: hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest(),
        "xxhash": lambda: xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=proto)),
        "xxhash_cbor": lambda: xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True)),
    }
    for name, fn in floors.items():
        out[f"baseline_floor_{name}"] = best_us(fn, n, repeat)
    return out


def bench_allocate(repeat: int) -> dict[str, float]:
    bs = 16
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=3, head_size=64, dtype="float32")
    config = KVCacheConfig(
        num_blocks=1024,
        kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
        bytes_per_block=spec.page_size_bytes,
    )
    manager = KVCacheManager(config, max_model_len=4096)
    hasher = get_request_block_hasher(bs, HASH_FUNCTIONS["sha256_cbor"])
    prefix = list(range(1024))
    warm = KVCacheRequest("warm", prefix + [1], block_hasher=hasher)
    hits, n = manager.get_computed_blocks(warm)
    manager.allocate_slots(warm, warm.num_tokens, n, hits)
    manager.free(warm)
    number = 200
    results = []
    for r in range(repeat):
        reqs = [
            KVCacheRequest(
                f"r{r}-{i}",
                prefix + [50_000 + i * 1024 + j for j in range(1024)],
                block_hasher=hasher,
            )
            for i in range(number)
        ]
        it = iter(reqs)

        def one() -> None:
            req = next(it)
            hits, num_hit = manager.get_computed_blocks(req)
            assert num_hit == 1024
            manager.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits)
            manager.free(req)

        results.append(timeit.timeit(one, number=number) / number * 1e6)
    manager.check_invariants()
    return {"allocate_free_2048_50pct_hit": min(results)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json-only", action="store_true")
    args = ap.parse_args(argv)
    res: dict[str, float] = {}
    for part in (bench_cycles, bench_touch, bench_hashes, bench_allocate):
        res.update(part(args.repeat))
    ratios = {
        "cycle_vs_naive": res["cycle_caching_on"] / res["baseline_naive_cycle"],
        "touch_vs_naive": res["touch_cached_block"] / res["baseline_naive_touch"],
        **{
            f"hash_{k}_vs_floor": res[f"hash_{k}"] / res[f"baseline_floor_{k}"]
            for k in HASH_FUNCTIONS
        },
    }
    report = {
        "us": res,
        "ratios": ratios,
        "targets_us": TARGETS,
        "meets_targets": {k: res[k] <= v for k, v in TARGETS.items()},
    }
    if not args.json_only:
        print(f"{'figure':36s} {'µs':>9s} {'target µs':>10s}")
        for k, v in res.items():
            t = TARGETS.get(k)
            print(f"{k:36s} {v:9.3f} {'' if t is None else f'{t:10.2f}'}")
        print()
        for k, v in ratios.items():
            print(f"{k:36s} {v:9.3f}x")
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0
