"""UniformTypeKVCacheSpecs: layers of one attention type whose head geometry differs form ONE
KV cache group (vLLM's rule) instead of the hybrid path, with a page that is the sum of the
layers' pages; the planner sizes the pool from that sum and the block managers run the type's
own rules on it (pure Python, no torch).

These tests cover the core and the planner; the engine runs such a group on a real
architecture in ``tests/test_nemotron_nas.py`` (and its byte layout in
``tests/test_kv_cache_binding.py``)."""

from __future__ import annotations

import pytest
from core_utils import admit, make_request

from pagedkv.core import planning
from pagedkv.core.kv_cache_manager import KVCacheManager
from pagedkv.core.single_type_kv_cache_manager import SlidingWindowManager
from pagedkv.core.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    get_kv_cache_groups,
    iter_layer_specs,
    unify_kv_cache_spec_page_size,
)

BS = 16


def full(heads: int, head: int, dtype: str = "bfloat16", bs: int = BS) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=head, dtype=dtype)


def swa(heads: int, head: int, window: int = 64, bs: int = BS) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=bs, num_kv_heads=heads, head_size=head, dtype="bfloat16", sliding_window=window
    )


def layers(*specs) -> dict:
    return {f"model.layers.{i}.self_attn": s for i, s in enumerate(specs)}


def test_different_head_sizes_form_one_group_with_the_summed_page() -> None:
    specs = layers(full(8, 128), full(8, 64), full(4, 128), full(8, 128))
    (group,) = get_kv_cache_groups(specs)
    spec = group.kv_cache_spec
    assert isinstance(spec, UniformTypeKVCacheSpecs) and spec.block_size == BS
    assert group.layer_names == list(specs)
    pages = [2 * BS * 8 * 128 * 2, 2 * BS * 8 * 64 * 2, 2 * BS * 4 * 128 * 2, 2 * BS * 8 * 128 * 2]
    assert [s.page_size_bytes for s in specs.values()] == pages
    assert spec.page_size_bytes == group.page_size_bytes == sum(pages)
    assert spec.kind == "full_attention" and spec.representative == full(8, 128)
    # Planner: a block holds one page of every layer; bytes per token is the plain sum.
    assert planning.bytes_per_block([group]) == sum(pages)
    assert planning.kv_bytes_per_token(specs) == sum(pages) // BS
    assert planning.blocks_per_request([group], 1000) == -(-1000 // BS)
    cfg = planning.make_kv_cache_config(specs, 100 * sum(pages) + 5, max_model_len=1000)
    assert (cfg.num_blocks, cfg.bytes_per_block, len(cfg.kv_cache_groups)) == (100, sum(pages), 1)
    # Each layer keeps its own spec for the runner.
    assert dict(iter_layer_specs([group])) == specs


def test_without_it_the_hybrid_path_would_rescale_block_sizes() -> None:
    """What the hybrid path does to the same layers (why vLLM added the uniform group): the
    smaller pages get a larger block size, and the layers split into several groups."""
    specs = layers(full(8, 128), full(8, 64), full(4, 128), full(8, 128))
    unified = unify_kv_cache_spec_page_size(specs)
    assert sorted({s.block_size for s in unified.values()}) == [BS, 2 * BS]


def test_equal_specs_still_merge_into_their_own_spec() -> None:
    (group,) = get_kv_cache_groups(layers(full(8, 128), full(8, 128)))
    assert group.kv_cache_spec == full(8, 128)
    assert group.page_size_bytes == 2 * full(8, 128).page_size_bytes


@pytest.mark.parametrize(
    "specs",
    [
        layers(full(8, 128), swa(8, 64)),  # two types
        layers(swa(8, 128, window=64), swa(8, 64, window=128)),  # different windows
        layers(full(8, 128), full(8, 64, bs=32)),  # different block sizes
    ],
    ids=["types", "windows", "block-sizes"],
)
def test_not_uniform(specs: dict) -> None:
    assert UniformTypeKVCacheSpecs.from_specs(specs) is None
    assert not any(
        isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs) for g in get_kv_cache_groups(specs)
    )


def test_other_types_and_bounds() -> None:
    """Sliding, chunked-local and Mamba layers group too; a request's bound is the largest
    per-layer block count times the summed page."""
    s = UniformTypeKVCacheSpecs.from_specs(layers(swa(8, 128, window=100), swa(2, 64, window=100)))
    assert s is not None and s.kind == "sliding_window"
    blocks = -(-(100 - 1 + 32) // BS) + 1  # SlidingWindowSpec's own formula, per layer
    assert s.max_memory_usage_bytes(4096, 32) == blocks * s.page_size_bytes
    c = UniformTypeKVCacheSpecs.from_specs(
        layers(
            ChunkedLocalAttentionSpec(
                block_size=BS,
                num_kv_heads=8,
                head_size=128,
                dtype="bfloat16",
                attention_chunk_size=8192,
            ),
            ChunkedLocalAttentionSpec(
                block_size=BS,
                num_kv_heads=4,
                head_size=128,
                dtype="bfloat16",
                attention_chunk_size=8192,
            ),
        )
    )
    assert c is not None and c.max_memory_usage_bytes(100_000, 0) == 8192 // BS * c.page_size_bytes
    m = UniformTypeKVCacheSpecs.from_specs(
        layers(
            MambaSpec(block_size=BS, shapes=((3, 64), (8, 16, 16)), dtypes=("float32", "float32")),
            MambaSpec(block_size=BS, shapes=((3, 32), (4, 16, 16)), dtypes=("float32", "float32")),
        )
    )
    assert m is not None and m.page_size_bytes == 4 * (3 * 64 + 8 * 256 + 3 * 32 + 4 * 256)
    assert m.max_memory_usage_bytes(10**6) == m.page_size_bytes and m.bytes_per_token == 0


def test_bad_construction_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="at least one"):
        UniformTypeKVCacheSpecs(block_size=BS)
    with pytest.raises(ValueError, match="one attention type"):
        UniformTypeKVCacheSpecs(block_size=BS, kv_cache_specs=layers(full(8, 128), swa(8, 128)))
    with pytest.raises(ValueError, match="block_size"):
        UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs=layers(full(8, 128), full(8, 64)))


def test_hashable_and_equal_by_content() -> None:
    a = UniformTypeKVCacheSpecs.from_specs(layers(full(8, 128), full(8, 64)))
    b = UniformTypeKVCacheSpecs.from_specs(layers(full(8, 128), full(8, 64)))
    c = UniformTypeKVCacheSpecs.from_specs(layers(full(8, 128), full(4, 64)))
    assert a == b and hash(a) == hash(b) and a != c
    assert len({a: 1, b: 2, c: 3}) == 2


def test_manager_runs_the_types_rules_on_a_uniform_group() -> None:
    """A uniform sliding-window group is managed by the sliding-window rules of its
    representative: blocks that leave the window are released, a prefix hit works, and the
    pool is clean after free."""
    spec = UniformTypeKVCacheSpecs.from_specs(layers(swa(8, 128, window=32), swa(2, 64, window=32)))
    group = KVCacheGroupSpec(list(spec.kv_cache_specs), spec)
    mgr = KVCacheManager(
        KVCacheConfig(num_blocks=40, kv_cache_groups=[group], bytes_per_block=spec.page_size_bytes),
        max_model_len=1024,
    )
    assert isinstance(mgr.coordinator.single_type_managers[0], SlidingWindowManager)
    tokens = list(range(200))
    req = make_request(tokens[:100], mgr)
    admit(mgr, req)
    # Decode one more token: blocks wholly before the window (position 100 - 32 + 1) are null.
    req.append_output_token_ids(7)
    assert mgr.allocate_slots(req, 1) is not None
    table = mgr.get_block_ids(req.request_id)[0]
    assert table[: (100 - 32 + 1) // BS] == [0] * ((100 - 32 + 1) // BS)
    assert all(b != 0 for b in table[(100 - 32 + 1) // BS :])
    mgr.free(req)
    # The same prompt again: a hit (the window's blocks are still cached).
    again = make_request(tokens[:100], mgr)
    _, hit = mgr.get_computed_blocks(again)
    assert hit == 96
    mgr.check_invariants()
