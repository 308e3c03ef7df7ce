"""Slot mapping, cache writes, KV cache layouts and whole-block copies (ops/cache, ops/kv_cache)."""

from __future__ import annotations

import enum
import itertools

import pytest
import torch

from pagedkv.ops.cache import compute_slot_mapping, reshape_and_cache
from pagedkv.ops.kv_cache import (
    allocate_kv_cache,
    copy_blocks,
    kv_combined_view,
    layout_name,
    swap_blocks,
)

ALL_LAYOUTS = ["".join(p) + "C" for p in itertools.permutations("LBHN")]
NL, NB, BS, H, D, DV = 3, 7, 4, 2, 5, 3


def buffer_row(
    buffer: torch.Tensor, layout: str, layer: int, block: int, token: int, head: int
) -> torch.Tensor:
    """The C = [K | V] vector of one (layer, block, token, head), addressed in the flat buffer
    by the layout's own dim order: independent of the views under test."""
    pos = {"L": layer, "B": block, "N": token, "H": head}
    return buffer[tuple(pos[d] for d in layout[:-1])]


def test_compute_slot_mapping_matches_formula() -> None:
    table = torch.tensor([[3, 9, 4], [7, 1, 0]], dtype=torch.int32)
    req = torch.tensor([0, 0, 0, 1, 1, 0], dtype=torch.int64)
    pos = torch.tensor([0, 5, 11, 2, 4, 8], dtype=torch.int64)
    slots = compute_slot_mapping(table, req, pos, block_size=4)
    assert slots.dtype == torch.int64
    assert slots.tolist() == [3 * 4 + 0, 9 * 4 + 1, 4 * 4 + 3, 7 * 4 + 2, 1 * 4 + 0, 4 * 4 + 0]


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_reshape_and_cache_writes_the_right_bytes_of_every_layout(layout: str) -> None:
    buffer, views = allocate_kv_cache(layout, NL, NB, BS, H, D, torch.float32, head_size_v=DV)
    assert buffer.shape == tuple(
        {"L": NL, "B": NB, "H": H, "N": BS, "C": D + DV}[d] for d in layout
    )
    layer = 1
    key_cache, value_cache = views[layer]
    assert key_cache.shape == (NB, BS, H, D) and value_cache.shape == (NB, BS, H, DV)
    slots = torch.tensor([5, -1, 17, 0, -3, 27])  # 27 = block 6, token 3
    key, value = torch.randn(6, H, D), torch.randn(6, H, DV)
    reshape_and_cache(key, value, key_cache, value_cache, slots)

    written = 0
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for h in range(H):
            row = buffer_row(buffer, layout, layer, slot // BS, slot % BS, h)
            assert torch.equal(row[:D], key[t, h]) and torch.equal(row[D:], value[t, h])
            written += 1
    # Nothing else changed: exactly the written (token, head) rows are non-zero.
    assert int((buffer != 0).any(dim=-1).sum()) == written == 4 * H


def test_reshape_and_cache_all_negative_is_a_no_op_and_casts_dtype() -> None:
    buffer, views = allocate_kv_cache("LBNHC", 1, NB, BS, H, D, torch.bfloat16)
    k, v = views[0]
    reshape_and_cache(torch.randn(3, H, D), torch.randn(3, H, D), k, v, torch.tensor([-1] * 3))
    assert not buffer.any()
    key = torch.randn(2, H, D)
    reshape_and_cache(key, key * 2, k, v, torch.tensor([1, 9]))
    assert k.dtype == torch.bfloat16
    assert torch.equal(k[2, 1], key[1].to(torch.bfloat16))
    assert torch.equal(v[0, 1], (key[0] * 2).to(torch.bfloat16))


def test_reshape_and_cache_separate_contiguous_caches() -> None:
    k_cache, v_cache = torch.zeros(NB, BS, H, D), torch.zeros(NB, BS, H, DV)
    key, value = torch.randn(3, H, D), torch.randn(3, H, DV)
    reshape_and_cache(key, value, k_cache, v_cache, torch.tensor([6, -1, 13]))
    assert torch.equal(k_cache[1, 2], key[0]) and torch.equal(v_cache[3, 1], value[2])
    assert int((k_cache != 0).any(-1).sum()) == 2 * H


def test_layout_validation_and_enum_names() -> None:
    class KVCacheLayout(enum.Enum):  # stands in for core/layout.py's enum
        LBNHC = 0
        BLNHC = 1

    assert layout_name(KVCacheLayout.BLNHC) == "BLNHC"
    assert layout_name("lbhnc") == "LBHNC"
    buffer, _ = allocate_kv_cache(KVCacheLayout.BLNHC, 2, NB, BS, H, D, torch.float32)
    assert buffer.shape == (NB, 2, BS, H, 2 * D)
    with pytest.raises(ValueError, match="innermost"):
        layout_name("LBCNH")
    with pytest.raises(ValueError, match="permutation"):
        layout_name("LBNHH")
    with pytest.raises(TypeError):
        layout_name(42)


def test_views_share_the_buffer_and_fuse() -> None:
    buffer, views = allocate_kv_cache("BLNHC", NL, NB, BS, H, D, torch.float32, head_size_v=DV)
    for k, v in views:
        kv = kv_combined_view(k, v)
        assert kv is not None and kv.shape == (NB, BS, H, D + DV)
        assert torch.equal(kv[..., :D], k) and torch.equal(kv[..., D:], v)
        kv.fill_(1.0)  # writes through the fused view land in the buffer
    assert bool((buffer == 1).all())
    assert kv_combined_view(torch.zeros(NB, BS, H, D), torch.zeros(NB, BS, H, D)) is None


def _filled(layout: str, seed: int) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    buffer, views = allocate_kv_cache(layout, NL, NB, BS, H, D, torch.float32, head_size_v=DV)
    buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(seed)))
    return buffer, views


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC", "LBHNC", "HNBLC"])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_copy_blocks_every_layer(layout: str, as_tensor: bool) -> None:
    _, views = _filled(layout, 0)
    before = [(k.clone(), v.clone()) for k, v in views]
    # A chain: block 2 is read (→5) and written (1→2) in the same call: reads come first.
    mapping = [(1, 2), (2, 5), (6, 0)]
    copy_blocks(views, torch.tensor(mapping) if as_tensor else mapping)
    for (k, v), (k0, v0) in zip(views, before, strict=True):
        expected_k, expected_v = k0.clone(), v0.clone()
        for s, d in mapping:
            expected_k[d], expected_v[d] = k0[s], v0[s]
        assert torch.equal(k, expected_k) and torch.equal(v, expected_v)
        assert not torch.equal(k, k0)  # something really moved


def test_copy_blocks_separate_caches_and_empty_mapping() -> None:
    caches = [(torch.randn(NB, BS, H, D), torch.randn(NB, BS, H, DV)) for _ in range(2)]
    snapshot = [(k.clone(), v.clone()) for k, v in caches]
    copy_blocks(caches, [])
    assert all(torch.equal(k, k0) for (k, _), (k0, _) in zip(caches, snapshot, strict=True))
    copy_blocks(caches, [(3, 4)])
    for (k, v), (k0, v0) in zip(caches, snapshot, strict=True):
        assert torch.equal(k[4], k0[3]) and torch.equal(v[4], v0[3])
        assert torch.equal(k[:4], k0[:4]) and torch.equal(v[5:], v0[5:])


@pytest.mark.parametrize("dst_layout", ["BLNHC", None])
def test_swap_blocks_between_layouts(dst_layout: str | None) -> None:
    _, src = _filled("LBNHC", 1)
    if dst_layout is None:  # separately allocated destination: K and V copied one by one
        dst = [(torch.zeros(NB, BS, H, D), torch.zeros(NB, BS, H, DV)) for _ in range(NL)]
    else:
        dst = allocate_kv_cache(dst_layout, NL, NB, BS, H, D, torch.float32, head_size_v=DV)[1]
    swap_blocks(src, dst, [(1, 6), (4, 2)])
    for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
        assert torch.equal(dk[6], sk[1]) and torch.equal(dv[2], sv[4])
        assert not dk[0].any() and not dv[5].any()
