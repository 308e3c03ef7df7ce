"""`MambaManager` (core, no torch): which positions of the position-indexed block table get a
page under each ``prefix_cache_retention_interval``, which of them are cached as checkpoints,
the release of blocks behind the live state, the right-to-left hit, and the hybrid hit as the
minimum over the attention and Mamba groups."""

from __future__ import annotations

import pytest
from core_utils import admit, full_spec, make_kv_cache_config, make_request

from pagedkv.core.kv_cache_manager import KVCacheManager
from pagedkv.core.request import RequestStatus
from pagedkv.core.single_type_kv_cache_manager import MambaManager
from pagedkv.core.specs import MambaSpec
from pagedkv.core.units import cdiv

BS = 4


def mamba_spec() -> MambaSpec:
    return MambaSpec(block_size=BS, shapes=((2, 3),), dtypes=("float32",), mamba_cache_mode="align")


def make(
    retention: int | None = None, caching: bool = True, num_blocks: int = 60
) -> KVCacheManager:
    config = make_kv_cache_config(num_blocks, [full_spec(BS), mamba_spec()])
    config.prefix_cache_retention_interval = retention
    return KVCacheManager(config, max_model_len=8192, enable_caching=caching)


def table(m: KVCacheManager, req) -> list[bool]:
    """The Mamba group's block table: True where a position has a page."""
    return [not b.is_null for b in m.get_blocks(req.request_id).blocks[1]]


def mamba_cached(m: KVCacheManager, req) -> list[int]:
    """Positions of the request's Mamba blocks that are registered checkpoints."""
    return [
        i for i, b in enumerate(m.get_blocks(req.request_id).blocks[1]) if b.block_hash is not None
    ]


@pytest.mark.parametrize(
    "retention, n, pages, cached",
    [
        (None, 18, [True] * 5, [0, 1, 2, 3]),  # dense: every boundary crossed, and the live block
        (0, 18, [False] * 4 + [True], []),  # the step end only (not full: not cached)
        (0, 16, [False] * 3 + [True], [3]),  # a chunk ending on a boundary: that state is cached
        (8, 18, [False, True, False, True, True], [1, 3]),  # every 8 tokens
        (8, 12, [False, True, True], [1]),  # the step end at 12 has a page, but is not cached
    ],
)
def test_pages_and_checkpoints_per_retention(retention, n, pages, cached) -> None:
    m = make(retention)
    req = make_request(list(range(18)), m)
    free = m.num_free_blocks
    need = m.coordinator.get_num_blocks_to_allocate(req.request_id, n, ((), ()), 0)
    admit(m, req, n)
    assert table(m, req) == pages
    assert free - m.num_free_blocks == need == cdiv(n, BS) + sum(pages)  # counted = taken
    assert mamba_cached(m, req) == cached
    m.check_invariants()
    m.free(req)
    m.check_invariants()


def test_blocks_behind_the_live_state_are_released() -> None:
    m = make(None)
    req = make_request(list(range(18)), m)
    admit(m, req)
    before = m.num_free_blocks
    req.append_output_token_ids(5)
    assert m.allocate_slots(req, 1) is not None  # decode token 18: reads block 4, writes block 4
    # blocks 0..3 (checkpoints) went back to the pool (still cached, evictable)
    assert table(m, req) == [False] * 4 + [True] and m.num_free_blocks == before + 4
    assert len(m.get_blocks(req.request_id).blocks[0]) == 5  # attention keeps every block
    m.check_invariants()
    m.free(req)
    assert m.num_free_blocks == m.block_pool.num_gpu_blocks - 1


def test_without_caching_only_the_live_block() -> None:
    m = make(None, caching=False)
    req = make_request(list(range(18)), m)
    admit(m, req)
    assert table(m, req) == [False] * 4 + [True]
    m.free(req)
    m.check_invariants()


def test_hit_is_last_checkpoint_and_hybrid_minimum() -> None:
    m = make(None)
    a = make_request(list(range(18)), m)
    admit(m, a)
    m.free(a)
    b = make_request(list(range(16)) + [99, 98], m)
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 16
    full, mamba = hits.blocks
    assert len(full) == 4 and [x.is_null for x in mamba] == [True, True, True, False]
    pool = m.block_pool
    # Without the Mamba checkpoint at 16 the scan falls back to the one at 12, and attention
    # is cut to the same length (the hybrid hit is the minimum).
    pool.evict_blocks([pool.get_cached_block(a.block_hashes[3], [1])[0].block_id])
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 12 and len(hits.blocks[0]) == 3 and len(hits.blocks[1]) == 3
    # An attention miss at block 1 caps the Mamba hit at 4 tokens.
    pool.evict_blocks([pool.get_cached_block(a.block_hashes[1], [0])[0].block_id])
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 4 and [x.is_null for x in hits.blocks[1]] == [False]
    # Adopting the hit: the checkpoint is shared, the step's blocks are new.
    new = m.allocate_slots(b, b.num_tokens - 4, 4, hits)
    assert new is not None and table(m, b) == [True] * 5
    b.status = RequestStatus.RUNNING
    m.check_invariants()
    m.free(b)
    m.check_invariants()


def test_retention_must_be_a_block_multiple() -> None:
    with pytest.raises(ValueError, match="prefix_cache_retention_interval"):
        make(6)
    with pytest.raises(ValueError, match="prefix_cache_retention_interval"):
        make(-4)
    m = make(8)
    assert isinstance(m.coordinator.single_type_managers[1], MambaManager)
