"""KV cache layouts: strides, offsets and contiguity claims, checked by enumerating offsets."""

from __future__ import annotations

import itertools
import pickle

import pytest

from pagedkv.core.layout import (
    DEFAULT_KV_CACHE_LAYOUT,
    DIMS,
    KERNEL_USABLE_LAYOUTS,
    KVCacheLayout,
    logical_shape,
)

SHAPE = (2, 3, 2, 3, 4)  # L, B, H, N, C: every dim > 1 so contiguity is not accidental
ALL = list(KVCacheLayout)


def all_offsets(layout: KVCacheLayout, shape=SHAPE) -> dict[tuple[int, ...], int]:
    return {
        idx: layout.offset(*idx, shape=shape)
        for idx in itertools.product(*(range(s) for s in shape))
    }


def is_one_range(offsets: list[int]) -> bool:
    return max(offsets) - min(offsets) + 1 == len(offsets) == len(set(offsets))


def test_members() -> None:
    assert len(ALL) == 120
    for name in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC"):
        assert KVCacheLayout[name].order == name
    assert len(KERNEL_USABLE_LAYOUTS) == 24
    assert all(m.order.endswith("C") for m in KERNEL_USABLE_LAYOUTS)
    assert (
        DEFAULT_KV_CACHE_LAYOUT is KVCacheLayout.LBHNC and DEFAULT_KV_CACHE_LAYOUT.is_kernel_usable
    )


def test_manual_strides() -> None:
    L, B, H, N, C = SHAPE
    assert KVCacheLayout.LBHNC.strides(SHAPE) == (B * H * N * C, H * N * C, N * C, C, 1)
    assert KVCacheLayout.LBNHC.strides(SHAPE) == (B * N * H * C, N * H * C, C, H * C, 1)
    assert KVCacheLayout.BLHNC.strides(SHAPE) == (H * N * C, L * H * N * C, N * C, C, 1)
    assert KVCacheLayout.LHBNC.strides(SHAPE) == (H * B * N * C, N * C, B * N * C, C, 1)
    assert KVCacheLayout.BLNHC.strides(SHAPE) == (N * H * C, L * N * H * C, C, H * C, 1)


@pytest.mark.parametrize("layout", ALL, ids=lambda m: m.order)
def test_offsets_are_a_dense_bijection(layout: KVCacheLayout) -> None:
    offs = all_offsets(layout)
    assert sorted(offs.values()) == list(range(KVCacheLayout.num_bytes(SHAPE)))


@pytest.mark.parametrize("layout", ALL, ids=lambda m: m.order)
def test_innermost_dim_has_stride_one_and_physical_shape(layout: KVCacheLayout) -> None:
    strides = layout.strides(SHAPE)
    assert strides[DIMS.index(layout.order[-1])] == 1
    # Each dim's stride is the product of the sizes of the dims inside it.
    phys = layout.physical_shape(SHAPE)
    for pos, d in enumerate(layout.order):
        inner = 1
        for s in phys[pos + 1 :]:
            inner *= s
        assert strides[DIMS.index(d)] == inner


@pytest.mark.parametrize("layout", ALL, ids=lambda m: m.order)
def test_contiguity_predicates_match_enumeration(layout: KVCacheLayout) -> None:
    offs = all_offsets(layout)
    L, B = SHAPE[0], SHAPE[1]
    layer_ok = all(is_one_range([o for i, o in offs.items() if i[0] == l]) for l in range(L))
    block_ok = all(is_one_range([o for i, o in offs.items() if i[1] == b]) for b in range(B))
    page_ok = all(
        is_one_range([o for i, o in offs.items() if i[:2] == (l, b)])
        for l in range(L)
        for b in range(B)
    )
    token_head_ok = all(
        is_one_range([o for i, o in offs.items() if i[:4] == k[:4]]) for k in offs if k[4] == 0
    )
    assert layout.is_layer_compact == layer_ok
    assert layout.is_block_contiguous == block_ok
    assert layout.is_page_contiguous == page_ok
    assert layout.is_kernel_usable == token_head_ok


def test_offset_bounds_checked() -> None:
    with pytest.raises(IndexError):
        KVCacheLayout.LBHNC.offset(0, 3, 0, 0, 0, SHAPE)
    with pytest.raises(ValueError):
        KVCacheLayout.LBHNC.strides((1, 2, 3, 4))  # type: ignore[arg-type]


def test_parse_and_pickle() -> None:
    assert KVCacheLayout.parse("blnhc") is KVCacheLayout.BLNHC
    assert KVCacheLayout.parse(KVCacheLayout.LBHNC) is KVCacheLayout.LBHNC
    with pytest.raises(ValueError):
        KVCacheLayout.parse("LBHN")
    assert pickle.loads(pickle.dumps(KVCacheLayout.BLHNC)) is KVCacheLayout.BLHNC


def test_logical_shape() -> None:
    assert logical_shape(30, 100, 3, 16, 256) == (30, 100, 3, 16, 256)
    with pytest.raises(ValueError):
        logical_shape(30, 0, 3, 16, 256)
