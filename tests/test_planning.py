"""Capacity planning: blocks from bytes, concurrency (null block excluded), max-len search."""

from __future__ import annotations

import pytest

from pagedkv.core import planning
from pagedkv.core.layout import KVCacheLayout
from pagedkv.core.specs import FullAttentionSpec, SlidingWindowSpec, cdiv, get_kv_cache_groups

GiB = 1 << 30


def full_specs(n: int = 4, bs: int = 16, h: int = 2, hs: int = 64) -> dict:
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=h, head_size=hs, dtype="float16")
    return {f"model.layers.{i}.self_attn": spec for i in range(n)}


def hybrid_specs(sw: int = 64) -> dict:
    f = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16")
    s = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype="float16", sliding_window=sw
    )
    return {f"l{i}": (f if i % 3 == 0 else s) for i in range(6)}  # 2 full + 4 SWA


PAGE = 2 * 16 * 2 * 64 * 2  # 8192 bytes per layer-block


def test_bytes_per_block_and_per_token() -> None:
    assert planning.bytes_per_block(full_specs(4)) == 4 * PAGE
    assert planning.kv_bytes_per_token(full_specs(4)) == 4 * PAGE // 16
    groups = get_kv_cache_groups(hybrid_specs())
    assert [len(g.layer_names) for g in groups] == [2, 2, 2]
    assert planning.bytes_per_block(groups) == 2 * PAGE  # groups alias: the max, not the sum
    assert planning.bytes_per_block([]) == 0


def test_num_blocks_from_memory_floors() -> None:
    bpb = 4 * PAGE
    assert planning.num_blocks_from_memory(10 * bpb, full_specs()) == 10
    assert planning.num_blocks_from_memory(10 * bpb - 1, full_specs()) == 9
    assert planning.num_blocks_from_memory(0, full_specs()) == 0
    assert planning.num_blocks_from_memory(123, {}) == 1  # attention-free: just the null block


def test_concurrency_excludes_null_block() -> None:
    specs = full_specs()
    per_req = cdiv(1000, 16)
    assert planning.blocks_per_request(specs, 1000) == per_req
    assert planning.get_max_concurrency(1 + 3 * per_req, specs, 1000) == 3.0
    assert planning.get_max_concurrency(3 * per_req, specs, 1000) < 3.0
    assert planning.max_num_tokens(101, specs, 1000) == 100 * 16
    tokens, conc = planning.get_kv_cache_capacity(1 + 3 * per_req, specs, 1000)
    assert (tokens, conc) == (3000, 3.0)


def test_hybrid_blocks_per_request_sums_groups() -> None:
    groups = get_kv_cache_groups(hybrid_specs(sw=64))
    full_blocks = cdiv(4096, 16)
    swa_blocks = cdiv(min(63 + 32, 4096), 16) + 1
    assert planning.blocks_per_request(groups, 4096, 32) == full_blocks + 2 * swa_blocks


def brute_force_max_len(groups, available: int, max_len: int, mnbt: int = 0) -> int:
    usable = available // planning.bytes_per_block(groups) - 1
    best = 0
    for n in range(1, max_len + 1):
        if planning.blocks_per_request(groups, n, mnbt) <= usable:
            best = n
    return best


@pytest.mark.parametrize("available_blocks", [0, 1, 2, 3, 7, 20, 64, 500])
@pytest.mark.parametrize("make", [full_specs, hybrid_specs])
def test_estimate_max_model_len_matches_brute_force(available_blocks: int, make) -> None:
    groups = get_kv_cache_groups(make())
    available = available_blocks * planning.bytes_per_block(groups) + 17
    got = planning.estimate_max_model_len(groups, available, 700, 8)
    assert got == brute_force_max_len(groups, available, 700, 8)
    if available_blocks <= 1:
        assert got == 0  # only the null block (or nothing): not even one token fits


def test_check_enough_memory_boundary() -> None:
    specs = full_specs()
    bpb = planning.bytes_per_block(specs)
    need_blocks = cdiv(1024, 16) + 1  # request blocks + the null block
    planning.check_enough_kv_cache_memory(specs, need_blocks * bpb, 1024)  # exactly enough
    with pytest.raises(ValueError) as e:
        planning.check_enough_kv_cache_memory(specs, need_blocks * bpb - 1, 1024)
    msg = str(e.value)
    assert f"{need_blocks * bpb / GiB:.2f} GiB" in msg
    assert f"estimated maximum model length is {(need_blocks - 2) * 16}" in msg


def test_check_enough_memory_none_available() -> None:
    for avail in (0, -5):
        with pytest.raises(ValueError, match="No available memory for the cache blocks"):
            planning.check_enough_kv_cache_memory(full_specs(), avail, 16)


def test_make_kv_cache_config() -> None:
    cfg = planning.make_kv_cache_config(
        full_specs(), 50 * 4 * PAGE, max_model_len=256, layout="BLHNC"
    )
    assert cfg.num_blocks == 50 and cfg.num_usable_blocks == 49
    assert cfg.bytes_per_block == 4 * PAGE and cfg.layout is KVCacheLayout.BLHNC
    with pytest.raises(ValueError):
        planning.make_kv_cache_config(full_specs(), 5 * 4 * PAGE, max_model_len=256)
    assert planning.make_kv_cache_config(full_specs(), 0, num_blocks_override=7).num_blocks == 7


def test_plan_device_memory_terms() -> None:
    mb = planning.plan_device_memory(
        24 * GiB,
        num_params=8_000_000_000,
        weight_dtype_bytes=2,
        runtime_bytes=2 * GiB,
        headroom_fraction=0.1,
    )
    assert mb.weights == 16_000_000_000
    assert mb.headroom == int(2.4 * GiB)
    assert mb.kv_cache == 24 * GiB - 16_000_000_000 - 2 * GiB - int(2.4 * GiB)
    assert mb.terms()[-1] == ("= KV cache", mb.kv_cache)
    assert mb.c_tokens(131072) == mb.kv_cache // 131072
    small = planning.plan_device_memory(GiB, 8_000_000_000, 2, 0, 0.0)
    assert small.kv_cache < 0 and small.c_tokens(1000) == 0
    with pytest.raises(ValueError):
        planning.plan_device_memory(GiB, 1, 2, 0, 1.5)


def test_runtime_estimate_is_linear_in_batched_tokens() -> None:
    kw = dict(
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_kv_heads=3,
        head_dim=64,
        vocab_size=49152,
        max_num_seqs=8,
        activation_dtype_bytes=2,
    )
    f = lambda t: planning.estimate_runtime_bytes(max_num_batched_tokens=t, **kw)  # noqa: E731
    step = f(2048) - f(1024)
    assert step > 0 and f(3072) - f(2048) == step
    assert f(0) == 2 * 4 * 49152 * 8 + planning.DEFAULT_RUNTIME_OVERHEAD_BYTES
