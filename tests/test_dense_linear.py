"""Float32 dense linears through MKL, MKL's packed GEMM or oneDNN (``ops/dense_linear.py``,
PAGEDKV_DENSE_LINEAR), and the native small-batch dense GEMV (``native.gemv_dense``).

MKL packed must equal MKL's sgemm bit for bit (same sums, reordered weight); oneDNN must give
``F.linear``'s products up to float32 rounding on the shapes a model's steps have, and the
engine on it must pass the same greedy-exactness bar against HF transformers as MKL (the
suite's pinned path: ``test_exactness.py``'s, near-ties forgiven).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_exactness import QUESTIONS, assert_same, chat_ids, run_engine, tok  # noqa: F401 (fixture)

from pagedkv.ops import dense_linear

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


@pytest.fixture
def backend_env(monkeypatch: pytest.MonkeyPatch):
    """Set PAGEDKV_DENSE_LINEAR for one test; the cached choice is dropped before and after."""

    def set_env(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv("PAGEDKV_DENSE_LINEAR", raising=False)
        else:
            monkeypatch.setenv("PAGEDKV_DENSE_LINEAR", value)
        dense_linear.backend.cache_clear()

    yield set_env
    monkeypatch.undo()
    dense_linear.backend.cache_clear()


def test_default_is_measured_and_unknown_values_are_refused(backend_env) -> None:
    backend_env(None)
    assert dense_linear.backend() in dense_linear.BACKENDS  # auto: the fastest measured here
    backend_env("BLAS")
    assert dense_linear.backend() == "blas"
    backend_env("cublas")
    with pytest.raises(
        ValueError, match="PAGEDKV_DENSE_LINEAR='cublas'.*auto, blas, mkl_packed, onednn"
    ):
        dense_linear.backend()


@needs_onednn
@pytest.mark.parametrize("mode", ["onednn", "mkl_packed", "auto"])
def test_forced_and_auto_pick_a_backend(backend_env, mode: str) -> None:
    backend_env(mode)
    got = dense_linear.backend()
    assert got in dense_linear.BACKENDS
    if mode != "auto":
        assert got == mode


needs_mkl = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL")


@needs_mkl
@pytest.mark.parametrize(
    "rows,k,n,bias", [(17, 576, 960, True), (300, 576, 3072, False), (5, 65, 33, True)]
)
def test_mkl_packed_is_bit_identical_to_sgemm_and_packs_once(
    backend_env, rows: int, k: int, n: int, bias: bool
) -> None:
    backend_env("mkl_packed")
    assert dense_linear.backend() == "mkl_packed"
    gen = torch.Generator().manual_seed(rows + k)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = dense_linear.linear(x, w, b)
    assert torch.equal(got, F.linear(x, w, b))
    packed = dense_linear._PACKED[id(w)][1]
    dense_linear.linear(x[:3], w, b)  # another row count: the same packed copy
    assert dense_linear._PACKED[id(w)][1] is packed
    before = len(dense_linear._PACKED)
    dense_linear.linear(x, w.clone(), b, transient=True)  # a temporary weight is never packed
    assert len(dense_linear._PACKED) == before
    key = id(w)
    del w
    assert key not in dense_linear._PACKED  # dropped with its weight


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows,k,n,bias",
    [(1, 576, 1536, False), (3, 200, 37, True), (16, 64, 8, True), (21, 48, 5, False)],
)
def test_native_gemv_dense_matches_f_linear(
    wdtype: torch.dtype, rows: int, k: int, n: int, bias: bool
) -> None:
    """The small-batch kernel equals the float64 product of the same (bf16-rounded) weights to
    float32 rounding; odd K leaves a tail, odd N a partial column group, 21 rows two row passes."""
    from pagedkv.ops import native

    if not native.available():
        pytest.skip("native kernels unavailable")
    gen = torch.Generator().manual_seed(rows * k + n)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen).to(wdtype)
    b = torch.randn(n, generator=gen) if bias else None
    got = native.gemv_dense(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    bound = k * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double().T) + 1e-6
    assert got.shape == (rows, n) and ((got.double() - ref).abs() <= bound).all()
    with pytest.raises(ValueError, match="float32/bfloat16"):
        native.gemv_dense(x, w.half())
    with pytest.raises(ValueError, match="columns"):
        native.gemv_dense(x[:, :-1].contiguous(), w)


@needs_onednn
@pytest.mark.parametrize(
    "rows,k,n,bias",
    [
        (1, 576, 1536, False),
        (17, 576, 960, True),
        (64, 1536, 576, False),
        (300, 576, 3072, True),
        (5, 65, 33, True),
        (2048, 64, 48, False),
    ],
)
def test_onednn_matches_f_linear_to_float32_rounding(
    backend_env, rows: int, k: int, n: int, bias: bool
) -> None:
    backend_env("onednn")
    gen = torch.Generator().manual_seed(rows + k + n)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = dense_linear.linear(x, w, b)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    # float32 dot products of k terms: error well within k * eps * sum |x_i w_i|
    bound = k * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double().T) + 1e-6
    assert ((got.double() - ref).abs() <= bound).all()
    assert not torch.equal(got, torch.zeros_like(got))


@needs_onednn
def test_other_dtypes_and_shapes_take_f_linear(backend_env) -> None:
    backend_env("onednn")
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(8, 16, generator=gen)
    x3 = torch.randn(2, 3, 16, generator=gen)  # 3-D: F.linear, bit for bit
    assert torch.equal(dense_linear.linear(x3, w), F.linear(x3, w))
    xt = torch.randn(16, 4, generator=gen).T  # not contiguous
    assert torch.equal(dense_linear.linear(xt, w), F.linear(xt, w))
    xb, wb = x3[0].bfloat16(), w.bfloat16()
    assert torch.equal(dense_linear.linear(xb, wb), F.linear(xb, wb))


@pytest.mark.slow
@needs_onednn
def test_engine_on_onednn_matches_hf_greedy(backend_env, tok, hf_greedy) -> None:  # noqa: F811
    backend_env("onednn")
    assert dense_linear.backend() == "onednn"
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    report: list[str] = []
    _, outs = run_engine(prompts, block_size=16)
    assert_same(prompts, outs, hf_greedy, report)
    print("\n".join(report))
