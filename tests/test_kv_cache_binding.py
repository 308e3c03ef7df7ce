"""`bind_kv_cache`: every layer reads and writes its own pages, whatever its geometry.

* a UniformTypeKVCacheSpecs group (layers with different KV heads, DeciLM-style): the buffer is
  block-major, each layer's pages sit at their own offset inside every block, layers never
  overlap, and together they fill the block exactly;
* groups with different block sizes (Gemma 4-style global layers with a larger head, so the
  planner scales the sliding group's block size): a layer's view of block ``b`` lies inside its
  layer slot's page ``b`` and fills it;
* a KV-sharing layer gets its target's views and group; a layer without attention gets none.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.core.planning import make_kv_cache_config
from pagedkv.core.specs import UniformTypeKVCacheSpecs, get_kv_cache_groups
from pagedkv.engine.kv_cache_binding import bind_kv_cache
from pagedkv.models.config import ModelConfig
from pagedkv.ops.kv_cache import kv_combined_view

BASE = dict(
    architecture="llama",
    hidden_size=64,
    num_attention_heads=8,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=128,
    vocab_size=100,
    max_position_embeddings=256,
    dtype="float32",
)


def plan(mc: ModelConfig, layout: str = "LBNHC", num_blocks: int = 6):
    groups = get_kv_cache_groups(mc.kv_cache_specs(4, torch_dtype="float32"))
    return make_kv_cache_config(groups, 0, num_blocks_override=num_blocks, layout=layout)


def byte_range(t: torch.Tensor, base: torch.Tensor) -> tuple[int, int]:
    """[first, last+1) byte offsets of ``t`` inside ``base``'s storage."""
    start = t.data_ptr() - base.data_ptr()
    span = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
    return start, start + span * t.element_size()


@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC", "LBHNC"])
def test_uniform_type_group_is_block_major_and_layers_tile_each_block(layout):
    heads = [2, 1, 4, 0, 2]  # layer 3 has no attention (a DeciLM no-op layer)
    mc = ModelConfig(**BASE, num_layers=5, layer_num_kv_heads=heads)
    cfg = plan(mc, layout)
    (group,) = cfg.kv_cache_groups
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
    b = bind_kv_cache(cfg, mc, torch.float32, torch.device("cpu"))
    page = group.page_size_bytes
    assert b.buffer.numel() * 4 == cfg.num_blocks * page
    assert b.kv_caches[3][0].numel() == 0
    for blk in range(cfg.num_blocks):
        covered = []
        for i, h in enumerate(heads):
            if not h:
                continue
            k, v = b.kv_caches[i]
            assert k.shape == (cfg.num_blocks, 4, h, 8) and v.shape == k.shape
            kv = kv_combined_view(k, v)
            assert kv is not None  # K|V interleave: one gather moves both
            covered.append(byte_range(kv[blk], b.buffer))
        covered.sort()
        assert covered[0][0] == blk * page and covered[-1][1] == (blk + 1) * page
        assert all(a[1] == c[0] for a, c in zip(covered, covered[1:]))  # disjoint, no gaps


def test_uniform_type_writes_land_in_their_layer_only():
    mc = ModelConfig(**BASE, num_layers=3, layer_num_kv_heads=[2, 1, 4])
    b = bind_kv_cache(plan(mc), mc, torch.float32, torch.device("cpu"))
    k1, v1 = b.kv_caches[1]
    k1[2].fill_(1.0)
    v1[2].fill_(2.0)
    assert float(b.buffer.sum()) == k1[2].numel() * 3.0
    assert float(b.kv_caches[0][0].abs().sum() + b.kv_caches[2][1].abs().sum()) == 0.0


def gemma4_like(layout: str = "LBNHC"):
    """Sliding layers 2 heads x 8, global layers 1 head x 32: the global page is twice as big,
    so the sliding group's block size doubles."""
    types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    mc = ModelConfig(
        **BASE,
        num_layers=6,
        layer_types=types,
        sliding_window=8,
        layer_num_kv_heads=[2 if t == "sliding_attention" else 1 for t in types],
        layer_head_dims=[8 if t == "sliding_attention" else 32 for t in types],
    )
    return mc, plan(mc, layout)


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_groups_with_different_block_sizes_read_whole_pages_of_their_slot(layout):
    mc, cfg = gemma4_like(layout)
    sizes = sorted({g.kv_cache_spec.block_size for g in cfg.kv_cache_groups})
    assert sizes == [4, 8]
    b = bind_kv_cache(cfg, mc, torch.float32, torch.device("cpu"))
    page = cfg.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    where = {
        name: (g, j)
        for g, grp in enumerate(cfg.kv_cache_groups)
        for j, name in enumerate(grp.layer_names)
    }
    slot_pages = {}
    for i in range(mc.num_layers):
        g, j = where[mc.layer_name(i)]
        assert b.layer_groups[i] == g
        k, v = b.kv_caches[i]
        assert k.shape[1:] == (
            cfg.kv_cache_groups[g].kv_cache_spec.block_size,
            mc.layer_kv_heads(i),
            mc.layer_head_dim(i),
        )
        rng = byte_range(kv_combined_view(k, v)[3], b.buffer)
        assert rng[1] - rng[0] == page  # the layer's block 3 is exactly one page
        slot_pages.setdefault(j, set()).add(rng)
    assert all(len(r) == 1 for r in slot_pages.values())  # groups alias the same slot pages


def test_kv_sharing_layer_reads_its_target():
    mc = ModelConfig(**BASE, num_layers=4, kv_sharing_targets=[None, None, 0, 1])
    cfg = plan(mc)
    assert set(cfg.kv_cache_groups[0].layer_names) == {mc.layer_name(0), mc.layer_name(1)}
    b = bind_kv_cache(cfg, mc, torch.float32, torch.device("cpu"))
    assert b.kv_caches[2][0].data_ptr() == b.kv_caches[0][0].data_ptr()
    assert b.kv_caches[3][1].data_ptr() == b.kv_caches[1][1].data_ptr()
    assert len(b.distinct) == 2


def test_a_layout_without_contiguous_pages_is_refused_for_mixed_geometry():
    mc, cfg = gemma4_like("LHBNC")
    with pytest.raises(NotImplementedError, match="contiguous page"):
        bind_kv_cache(cfg, mc, torch.float32, torch.device("cpu"))


def test_bad_kv_sharing_target_is_refused():
    with pytest.raises(ValueError, match="earlier layer"):
        ModelConfig(**BASE, num_layers=3, kv_sharing_targets=[None, 2, None])
    with pytest.raises(ValueError, match="entries"):
        ModelConfig(**BASE, num_layers=3, layer_num_kv_heads=[2, 2])
