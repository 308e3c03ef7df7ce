"""Float32 dense linears (``y = x @ W.T + b``): which library computes them, measured on this CPU.

torch's ``F.linear`` on a float32 CPU tensor calls MKL's sgemm. torch also ships two other
routes for the same product: MKL's *packed* GEMM (``mkl::_mkl_linear`` over a weight reordered
once by ``_mkl_reorder_linear_weight``: what torch.compile's freezing and IPEX use on CPU; the
same summation as sgemm, bit-identical to it) and oneDNN (``mkldnn::_linear_pointwise`` on the
plain ``[out, in]`` weight: what vLLM's CPU backend uses). They differ a lot on the shapes a small
model's steps have. GFLOP/s, 2 threads:

| shape (rows x in -> out) | MKL | MKL packed | oneDNN | CPU |
|---|---|---|---|---|
| 17 x 576 -> 1536 | 87 | | 143 | EPYC, AVX-512 |
| 64 x 576 -> 49152 (LM head) | 106 | | 172 | EPYC, AVX-512 |
| 17 x 576 -> 1536 | 26 | 35 | 26 | EPYC (Zen 1), AVX2 |
| 64 x 576 -> 3072 | 39 | 49 | 58 | EPYC (Zen 1), AVX2 |
| 256 x 576 -> 3072 | 55 | 59 | 70 | EPYC (Zen 1), AVX2 |
| 64 x 576 -> 49152 (LM head) | 33 | 37 | 61 | EPYC (Zen 1), AVX2 |

No one library wins on every CPU, so ``PAGEDKV_DENSE_LINEAR=auto`` (the default) times the three
once per process on two step-sized shapes and keeps the fastest (:func:`backend`). ``blas``,
``mkl_packed`` or ``onednn`` force one. A library is refused (falling back to MKL) where its op is
missing or disagrees with ``F.linear`` beyond float32 rounding. All compute float32 products with
float32 accumulation; MKL and MKL packed are bit-identical to HF transformers' own float32
matmuls, oneDNN's different order of additions moves logits by up to ~2e-4 (greedy tokens equal
HF's in the exactness tests). The packed route keeps a second, reordered copy of each weight it
has been used on (the plain weight stays: the small-batch kernel and the GGUF paths read it).

Up to 16 rows (a decode step's), :func:`small_batch_native` decides, by a measurement too,
whether pagedkv's own GEMV (``native.gemv_dense``: the layer step's kernel, bf16 read in place)
beats the library: on the Zen 1 EPYC the LM head at 1 row takes 7 ms there against MKL's 13.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedkv import envs

BACKENDS = ("blas", "mkl_packed", "onednn")
PACK_BATCH = 256  # the batch size MKL's packing is told to expect (any row count works after)


def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` on oneDNN (2-D contiguous float32 ``x``, plain ``[out, in]`` weight ``w``)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


# id(weight) -> (a weak reference to it, its MKL-packed copy). The reference tells a live entry
# from one whose id was reused; a finalizer drops the entry with the weight.
_PACKED: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}


def _packed(w: torch.Tensor) -> torch.Tensor:
    key = id(w)
    hit = _PACKED.get(key)
    if hit is not None and hit[0]() is w:
        return hit[1]
    packed = torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_BATCH)
    _PACKED[key] = (weakref.ref(w), packed)
    weakref.finalize(w, _PACKED.pop, key, None)
    return packed


def mkl_packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` on MKL's packed GEMM (``w`` reordered once, on first use, and kept)."""
    return torch.ops.mkl._mkl_linear(x, _packed(w), w, b, PACK_BATCH)


_FNS: dict[str, Callable[..., torch.Tensor]] = {
    "blas": F.linear,
    "mkl_packed": mkl_packed_linear,
    "onednn": onednn_linear,
}


def best_seconds(fn: Callable[[], object], reps: int) -> float:
    """The fastest of ``reps`` timed calls of ``fn``."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _works(name: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``name``'s op exists in this torch build and gives F.linear's products."""
    if name == "onednn" and not torch.backends.mkldnn.is_available():
        return False
    if name == "mkl_packed" and not torch.backends.mkl.is_available():
        return False
    try:
        got = _FNS[name](x, w, b)
    except (RuntimeError, AttributeError, NotImplementedError):  # op missing from this build
        return False
    return torch.allclose(got, F.linear(x, w, b), rtol=1e-4, atol=1e-4)


@functools.cache
def backend() -> str:
    """One of :data:`BACKENDS`, as ``PAGEDKV_DENSE_LINEAR`` says (default ``auto``: the fastest
    here, measured once), cached for the process. Raises ``ValueError`` for an unknown value."""
    env = envs.PAGEDKV_DENSE_LINEAR
    if env not in (*BACKENDS, "auto"):
        raise ValueError(
            f"PAGEDKV_DENSE_LINEAR={env!r}: expected one of auto, {', '.join(BACKENDS)}"
        )
    if env == "blas":
        return "blas"
    gen = torch.Generator().manual_seed(0)
    # Step-sized shapes of a small model: a 64-row decode batch and a 256-token prefill chunk.
    w, b = torch.randn(1536, 576, generator=gen), torch.randn(1536, generator=gen)
    xs = [torch.randn(m, 576, generator=gen) for m in (64, 256)]
    names = [n for n in BACKENDS if n == "blas" or _works(n, xs[0], w, b)]
    if env != "auto":
        return env if env in names else "blas"
    for _ in range(2):  # warm-up: first-call setup of every library
        for n in names:
            _FNS[n](xs[0], w, b)
    secs = {n: sum(best_seconds(lambda x=x: _FNS[n](x, w, b), 5) for x in xs) for n in names}
    return min(names, key=secs.__getitem__)


def linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *, transient: bool = False
) -> torch.Tensor:
    """``F.linear(x, w, b)`` for float32 CPU tensors, through :func:`backend`'s library; other
    dtypes, devices and shapes (the other libraries want a 2-D contiguous input) take
    ``F.linear``. ``transient``: ``w`` is a temporary (a widened bf16 weight), never packed."""
    name = backend()
    if transient and name == "mkl_packed":
        name = "blas"  # packing costs more than one product: only weights that live pay back
    if (
        name == "blas"
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or x.dim() != 2
        or w.dtype != torch.float32
        or not x.is_contiguous()
        or not w.is_contiguous()
    ):
        return F.linear(x, w, b)
    return _FNS[name](x, w, b)


@functools.cache
def small_batch_native() -> bool:
    """True when pagedkv's dense GEMV (``native.gemv_dense``) is available and, timed once per
    process at 1 and 8 rows on a float32 weight larger than the caches, beats :func:`linear`."""
    from pagedkv.ops import native  # native imports nothing from here; keep start-up lazy

    if not native.available():
        return False
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 1024, generator=gen)  # 16 MiB: streamed from memory, as a step's are
    xs = [torch.randn(m, 1024, generator=gen) for m in (1, 8)]
    if not torch.allclose(native.gemv_dense(xs[1], w), F.linear(xs[1], w), rtol=1e-4, atol=1e-3):
        return False
    for _ in range(2):
        for x in xs:
            native.gemv_dense(x, w), linear(x, w)
    ours = sum(best_seconds(lambda x=x: native.gemv_dense(x, w), 5) for x in xs)
    lib = sum(best_seconds(lambda x=x: linear(x, w), 5) for x in xs)
    return ours < lib
