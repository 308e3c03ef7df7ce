"""The GGUF q8 mode's GEMV (ops/csrc/gemv_q8.c): activations quantized to 8-bit blocks, integer
dot products against the ggml rows (llama.cpp's arithmetic), on every SIMD build.

The contract is the arithmetic in the C file's header, modelled here in numpy: the quantized
activations must equal the model's exactly (same rounding, same scales), the GEMV must equal the
model's integer sums scaled in float64 up to float32 rounding, and a row's result must not
depend on which other rows share its call (the batch-1 and many-row paths add in one order).
The engine-level tests check the mode is wired through ``gguf_activations`` and stays close to
the exact float32 path on the default model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from test_native import kernels, random_rows  # noqa: F401 (kernels: a fixture)

from pagedkv.ops import native

pytestmark = pytest.mark.skipif(
    not native.available(), reason="no C compiler: native kernels unavailable"
)

TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


def model_quantize(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The C file's activation quantization in numpy float32: d = max|x| / 127 per 32 values,
    q = nearest-even(x * (1 / d)) (0 where d = 0), s = d * sum(q)."""
    m, k = x.shape
    xb = x.numpy().astype(np.float32).reshape(m, k // 32, 32)
    d = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    safe = np.where(d != 0, d, np.float32(1))
    inv = np.where(d != 0, np.float32(1) / safe, np.float32(0)).astype(np.float32)
    q = np.rint((xb * inv[..., None]).astype(np.float32)).astype(np.int8)
    s = (d * q.astype(np.int32).sum(-1).astype(np.float32)).astype(np.float32)
    return q.reshape(m, k), d, s


def model_gemv(x: torch.Tensor, rows: torch.Tensor, qtype: int) -> tuple[np.ndarray, np.ndarray]:
    """y [M, N] per the C file's header (exact integer block sums, scales applied in float64),
    and the sum of its terms' magnitudes (the scale of float32 rounding error)."""
    q, d, s = model_quantize(x)
    n, k = rows.shape[0], x.shape[1]
    bb = native.row_bytes(qtype, 32)
    blocks = rows.numpy().reshape(n, k // 32, bb)
    dw = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    if qtype == GGMLQuantizationType.Q8_0:
        u = blocks[:, :, 2:].view(np.int8).astype(np.int64)
    else:
        qs = blocks[:, :, 4:] if qtype == GGMLQuantizationType.Q4_1 else blocks[:, :, 2:]
        u = np.concatenate([qs & 15, qs >> 4], -1).astype(np.int64)
        if qtype == GGMLQuantizationType.Q4_0:
            u -= 8
    sums = np.einsum("nbi,mbi->mnb", u, q.reshape(-1, k // 32, 32).astype(np.int64))
    terms = dw[None] * d.astype(np.float64)[:, None, :] * sums
    if qtype == GGMLQuantizationType.Q4_1:
        mw = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        terms = np.concatenate([terms, mw[None] * s.astype(np.float64)[:, None, :]], -1)
    return terms.sum(-1), np.abs(terms).sum(-1)


def test_quantize_matches_the_model_exactly(kernels: str) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 32 * 7, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1.0])[:, None]
    x[3, 32:64] = 0.0  # an all-zero block: scale 0, quants 0
    x[4, :32] = torch.arange(32) - 15.5  # ties: x * (1/d) lands on halves
    q, d, s = native.quantize_q8(x)
    mq, md, ms = model_quantize(x)
    assert np.array_equal(q.numpy(), mq)
    assert np.array_equal(d.numpy(), md) and np.array_equal(s.numpy(), ms)
    assert (d[3, 1] == 0) and (q[3, 32:64] == 0).all()
    assert q.abs().max() == 127  # each block's largest value maps to +-127


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m,n,blocks", [(1, 4, 1), (1, 23, 18), (3, 9, 5), (16, 37, 48)])
def test_gemv_q8_matches_the_integer_model(
    qtype: GGMLQuantizationType, m: int, n: int, blocks: int, kernels: str
) -> None:
    k = 32 * blocks
    rows = random_rows(qtype, n, k, seed=m * n + blocks)
    gen = torch.Generator().manual_seed(blocks)
    x, b = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    y = native.gemv_q(x, rows, int(qtype), b, q8_activations=True)
    ref, scale = model_gemv(x, rows, int(qtype))
    # Only float32 rounding of the block scalings and their sum separates the two.
    err = np.abs(y.double().numpy() - (ref + b.double().numpy()))
    assert (err <= 1e-5 * (scale + np.abs(b.double().numpy())) + 1e-6).all()


@pytest.mark.parametrize("qtype", TYPES)
def test_a_rows_result_does_not_depend_on_its_batch(
    qtype: GGMLQuantizationType, kernels: str
) -> None:
    """Batch 1 (four weight rows a pass) and many rows (four x rows a pass) add a row's blocks
    in the same order: bit-identical rows, so greedy outputs do not change with the batch."""
    rows = random_rows(qtype, 30, 576, seed=int(qtype))
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(1))
    many = native.gemv_q(x, rows, int(qtype), q8_activations=True)
    for i in range(7):
        assert torch.equal(
            native.gemv_q(x[i : i + 1], rows, int(qtype), q8_activations=True)[0], many[i]
        )


def test_q8_differs_from_the_exact_path_by_the_activation_rounding() -> None:
    """The mode is real (not the float32 path under another name) and its error is the
    activations' rounding: well under 1% of the output scale on a Q4_1 layer."""
    qtype = GGMLQuantizationType.Q4_1
    rows = random_rows(qtype, 64, 576, seed=5)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(2))
    exact = native.gemv_q(x, rows, int(qtype))
    q8 = native.gemv_q(x, rows, int(qtype), q8_activations=True)
    err = (q8 - exact).abs().max() / exact.abs().max()
    assert 0 < err < 1e-2


def test_kquant_rows_ignore_the_flag() -> None:
    """K-quant rows have no q8 kernel: the flag leaves them on the exact float32 path."""
    qtype = GGMLQuantizationType.Q4_K
    rows = random_rows(qtype, 8, 512, seed=7)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(3))
    assert torch.equal(
        native.gemv_q(x, rows, int(qtype), q8_activations=True), native.gemv_q(x, rows, int(qtype))
    )


def test_quantize_refuses_a_bad_shape() -> None:
    with pytest.raises(ValueError, match="32-value blocks"):
        native.quantize_q8(torch.randn(2, 33))
    with pytest.raises(ValueError, match="32-value blocks"):
        native.quantize_q8(torch.randn(2, 64, dtype=torch.float64))


# --------------------------------------------------------------------------- the engine's mode


PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three primary colors:",
    "def fibonacci(n):",
]


def test_engine_q8_mode_stays_close_to_the_exact_path(gguf_path: object) -> None:
    """``LLM(gguf_activations="q8")`` on the default Q4_1 model: every ggml-row layer and the
    native step take the mode, and greedy decoding follows the exact float32 path's first
    tokens (the 8-bit activations move the logits by far less than a typical top-2 margin)."""
    from pagedkv import LLM, SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    exact = [o.outputs[0].token_ids for o in LLM(gguf_activations="float32").generate(PROMPTS, sp)]
    llm = LLM(gguf_activations="q8")
    model = llm.llm_engine.executor.driver.loaded.model
    assert model.model.q8_activations
    reached = [m for m in model.modules() if getattr(m, "qsegments", None)]
    assert reached and all(m.q8_activations for m in reached)
    q8 = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
    assert sum(a[:4] == b[:4] for a, b in zip(exact, q8)) >= 3, (exact, q8)


def test_q8_mode_refuses_bad_values_and_non_gguf_models(tmp_path: object) -> None:
    from pagedkv.engine.config import EngineConfig
    from pagedkv.models.loader import get_model

    with pytest.raises(ValueError, match="gguf_activations.*'float32' or 'q8'"):
        EngineConfig(gguf_activations="q4")
    hf_dir = tmp_path / "hf"  # type: ignore[operator]
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    (hf_dir / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="is not a .gguf file"):
        get_model(hf_dir, gguf_activations="q8")
