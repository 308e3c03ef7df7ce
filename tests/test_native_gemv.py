"""The batch-1 GEMV paths of ops/csrc/gemv_quant.c (four weight rows a step, nibbles looked up
in a per-block table, float16 scales converted 16 blocks at a time, prefetching) and the
many-row path, on both builds.

Exactness: with a one-hot x every product is w*1 or w*0 and every sum adds zeros to one weight,
so y must equal the dequantized weights bit for bit: a weight rebuilt with other float32
arithmetic (an FMA in the dequantization, a different table) would show here, whatever the
summation order. Shapes cover row-group tails (N % 4), scale-chunk tails (blocks % 16) and
output column slices.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as np_dequantize
from test_native import QTYPES, kernels, random_rows  # noqa: F401 (kernels: a fixture)

from pagedkv.ops import native

pytestmark = pytest.mark.skipif(
    not native.available(), reason="no C compiler: native kernels unavailable"
)

SIMPLE = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


def k_for(qtype: GGMLQuantizationType, blocks: int) -> int:
    return (256 if qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K) else 32) * blocks


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n", [1, 7, 23])
def test_one_hot_x_returns_the_dequantized_weights_exactly(
    qtype: GGMLQuantizationType, n: int, kernels: str
) -> None:
    blocks = (
        2 if qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K) else 19
    )  # 16 + a tail
    k = k_for(qtype, blocks)
    rows = random_rows(qtype, n, k, seed=n + int(qtype))
    w = torch.from_numpy(np_dequantize(rows.numpy(), qtype))
    cols = sorted({0, 1, 15, 16, 31, 33, k // 2, k - 17, k - 1})
    for j in cols:  # batch 1: the four-rows-a-step path (and its single-row tail)
        x = torch.zeros(1, k)
        x[0, j] = 1.0
        assert torch.equal(native.gemv_q(x, rows, int(qtype))[0], w[:, j]), f"column {j}"
    x = torch.eye(k)[
        cols
    ]  # many rows: the path that shares each dequantized block across rows of x
    assert torch.equal(native.gemv_q(x, rows, int(qtype)), w.T[cols])


@pytest.mark.parametrize("qtype", SIMPLE)
@pytest.mark.parametrize("n,blocks", [(4, 1), (5, 16), (30, 17), (130, 48), (3, 37)])
def test_batch1_matches_float64_with_bias_into_a_column_slice(
    qtype: GGMLQuantizationType, n: int, blocks: int, kernels: str
) -> None:
    k = k_for(qtype, blocks)
    rows = random_rows(qtype, n, k, seed=n * blocks)
    w = torch.from_numpy(np_dequantize(rows.numpy(), qtype)).double()
    gen = torch.Generator().manual_seed(blocks)
    x, b = torch.randn(1, k, generator=gen), torch.randn(n, generator=gen)
    wide = torch.full((1, n + 9), 7.0)
    y = native.gemv_q(x, rows, int(qtype), b, out=wide[:, 5 : 5 + n])
    ref = x.double() @ w.T + b.double()
    bound = 1e-5 * (x.double().abs() @ w.abs().T) + 1e-6
    assert ((y.double() - ref).abs() <= bound).all()
    assert (wide[:, :5] == 7.0).all() and (
        wide[:, 5 + n :] == 7.0
    ).all()  # nothing outside the slice


def test_batch1_equals_the_many_row_path_up_to_summation_order() -> None:
    """The batch-1 kernel and row 0 of a many-row call multiply the same weights by the same x."""
    qtype = GGMLQuantizationType.Q4_1
    rows = random_rows(qtype, 64, 576, seed=3)
    x = torch.randn(5, 576)
    one = native.gemv_q(x[:1], rows, int(qtype))
    many = native.gemv_q(x, rows, int(qtype))
    torch.testing.assert_close(one[0], many[0], rtol=1e-5, atol=1e-5)
