"""Float32 dense linears (``y = x @ W.T + b``) through MKL (the default) or oneDNN.

torch's ``F.linear`` on a float32 CPU tensor calls MKL's sgemm. torch also ships oneDNN, and
its ``mkldnn::_linear_pointwise`` op takes the same plain ``[out, in]`` weight. The two differ a
lot on the shapes a small model's steps have. Measured on a 2-core AMD EPYC with AVX-512, 2
threads, GFLOP/s:

| shape (rows x in -> out) | MKL | oneDNN |
|---|---|---|
| 17 x 576 -> 1536 | 87 | 143 |
| 64 x 576 -> 3072 | 127 | 169 |
| 64 x 576 -> 49152 (LM head) | 106 | 172 |
| 1024 x 1024 -> 1024 | 177 | 198 |

The reason is likely that MKL takes a slower code path on AMD CPUs, but that is not confirmed.
In the offline throughput benchmark the oneDNN path made pagedkv 1.08-1.25x faster there.

The default stays MKL (``PAGEDKV_DENSE_LINEAR=blas``), because HF transformers computes with
the same MKL. pagedkv's float32 logits then stay within 6e-5 of HF's on SmolLM2, which is the
exactness tests' 1e-4 bar. oneDNN's different order of additions gives up to 1.7e-4, with the
same greedy tokens in those tests. ``PAGEDKV_DENSE_LINEAR=onednn`` uses oneDNN.
``PAGEDKV_DENSE_LINEAR=auto`` measures both once per process on a small-batch shape and keeps
the faster one. oneDNN is refused, falling back to MKL, where the op is missing or disagrees
with ``F.linear`` beyond float32 rounding. Both compute float32 products with float32
accumulation.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

from pagedkv import envs

BACKENDS = ("blas", "onednn")


def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` on oneDNN (2-D contiguous float32 ``x``, plain ``[out, in]`` weight ``w``)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _best_seconds(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@functools.cache
def backend() -> str:
    """``"onednn"`` or ``"blas"`` as ``PAGEDKV_DENSE_LINEAR`` says (default ``blas``; ``auto``:
    the faster here, measured once), cached for the process. Raises ``ValueError`` for an
    unknown value."""
    env = envs.PAGEDKV_DENSE_LINEAR
    if env not in (*BACKENDS, "auto"):
        raise ValueError(
            f"PAGEDKV_DENSE_LINEAR={env!r}: expected one of auto, {', '.join(BACKENDS)}"
        )
    if env == "blas" or not torch.backends.mkldnn.is_available():
        return "blas"
    gen = torch.Generator().manual_seed(0)
    # A decode-sized step of a small model (64 rows, 576 -> 1536), the regime where they differ.
    x, w = torch.randn(64, 576, generator=gen), torch.randn(1536, 576, generator=gen)
    b = torch.randn(1536, generator=gen)
    try:
        got = onednn_linear(x, w, b)
    except (RuntimeError, AttributeError):  # op missing from this torch build
        return "blas"
    if not torch.allclose(got, F.linear(x, w, b), rtol=1e-4, atol=1e-4):
        return "blas"
    if env == "onednn":
        return "onednn"
    for _ in range(2):  # warm-up: first-call setup of both libraries
        F.linear(x, w, b), onednn_linear(x, w, b)
    blas = _best_seconds(lambda: F.linear(x, w, b), 7)
    dnn = _best_seconds(lambda: onednn_linear(x, w, b), 7)
    return "onednn" if dnn < blas else "blas"


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)`` for float32 CPU tensors, through :func:`backend`'s library; other
    dtypes, devices and shapes (oneDNN's op wants a 2-D contiguous input) take ``F.linear``."""
    if (
        backend() != "onednn"
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or x.dim() != 2
        or w.dtype != torch.float32
        or not x.is_contiguous()
        or not w.is_contiguous()
    ):
        return F.linear(x, w, b)
    return onednn_linear(x, w, b)
