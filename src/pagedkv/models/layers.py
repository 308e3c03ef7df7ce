"""Building blocks shared by decoder models: linear, RMSNorm, rotary embedding, SwiGLU.

Parameters are created with ``torch.empty`` (no random init: weights are always loaded), in the
default dtype/device the loader sets. Every ``forward`` takes flat token batches ``[T, ...]``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.core.parallel import split_range
from pagedkv.distributed.parallel_state import ParallelContext
from pagedkv.ops import dense_linear, native
from pagedkv.ops.step_description import LinearDesc

# At most this many rows (tokens) go through the native quantized GEMV; more rows reuse each
# weight enough that BLAS on the dense copy wins (measured: benchmarks/bench_native.py). The
# K-quants' dearer dequantization moves the crossover down.
NATIVE_GEMV_MAX_ROWS = 16
NATIVE_GEMV_MAX_ROWS_KQUANT = 8


@functools.cache
def _emulated_half_dtypes() -> frozenset[torch.dtype]:
    """The 16-bit dtypes whose matmuls this CPU lacks (see ``native.cpu_has_half_matmul``)."""
    return frozenset(
        d for d in (torch.bfloat16, torch.float16) if not native.cpu_has_half_matmul(d)
    )


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


QSegment = tuple[int, int, int, torch.Tensor]  # (first row, end row, ggml type, rows [n, bytes])


class QuantizedRows:
    """Mixin: an optional copy of ``weight`` as GGUF ggml blocks for the native small-batch GEMV.

    ``qsegments`` covers the output rows in order, one segment per run of rows stored in one
    ggml type (a fused qkv whose v came as Q6_K and q/k as Q4_K has two); each segment's rows
    dequantize exactly to the file's float32 weights (``weight`` itself in a float32 model,
    their rounding in a bf16/fp16 one). It is a plain attribute, not state. :meth:`project`
    uses it for at most :data:`NATIVE_GEMV_MAX_ROWS` rows of input and BLAS on ``weight``
    otherwise (float32: :func:`pagedkv.ops.dense_linear.linear`); low-precision inputs are
    computed in float32 and rounded once.
    """

    weight: nn.Parameter
    qsegments: list[QSegment] | None = None
    qkquant: bool = False  # some segment is a K-quant (a lower row limit)
    # The GGUF q8 mode: the 32-weight segments take x quantized to 8-bit blocks (llama.cpp's
    # arithmetic, ops/csrc/gemv_q8.c) instead of float32 math on the exact weights.
    q8_activations: bool = False

    def set_qsegments(self, segments: list[QSegment] | None) -> None:
        self.qsegments = segments
        self.qkquant = bool(segments) and any(
            native.block_weights(t) > 32 for _, _, t, _ in segments
        )

    def _small_dense(self, x: torch.Tensor, limit: int) -> bool:
        """True when ``x``'s few rows go to the native dense GEMV: 2-D CPU input of at most
        ``limit`` rows, a float32/bfloat16 weight with unit column stride, and the start-up
        measurement found it faster than the BLAS library here."""
        w = self.weight
        return (
            x.dim() == 2
            and x.shape[0] <= limit
            and x.device.type == "cpu"
            and w.device.type == "cpu"
            and w.dtype in (torch.float32, torch.bfloat16)
            and w.dim() == 2
            and w.stride(1) == 1
            and dense_linear.small_batch_native()
        )

    def project(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        segs = self.qsegments
        limit = NATIVE_GEMV_MAX_ROWS_KQUANT if self.qkquant else NATIVE_GEMV_MAX_ROWS
        if segs is None and self._small_dense(x, limit):
            # A decode step's rows on a dense float32/bf16 weight (an HF model's LM head): the
            # layer step's GEMV, bf16 read in place (see dense_linear.small_batch_native).
            bf = None if bias is None else bias.float().contiguous()
            y = native.gemv_dense(x.float(), self.weight, bf)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        if segs is None or x.dim() != 2 or x.shape[0] > limit:
            if x.dtype in _emulated_half_dtypes() and x.device.type == "cpu":
                # torch emulates this dtype's matmul on this CPU: the float32 product of the same
                # values (casts included) is 1.4x (17 rows) to 5.6x (512 rows) faster, and rounds
                # once, as a native bf16 matmul with float32 accumulation does.
                b = None if bias is None else bias.float()
                return dense_linear.linear(x.float(), self.weight.float(), b, transient=True).to(
                    x.dtype
                )
            # float32: the library measured fastest on this CPU (ops/dense_linear.py)
            return dense_linear.linear(x, self.weight, bias)
        xf = x.float()
        bf = None if bias is None else bias.float()
        q8 = self.q8_activations
        if len(segs) == 1:
            y = native.gemv_q(xf, segs[0][3], segs[0][2], bf, q8_activations=q8)
        else:
            y = torch.empty(x.shape[0], self.weight.shape[0], dtype=torch.float32)
            for start, stop, qtype, rows in segs:
                native.gemv_q(
                    xf,
                    rows,
                    qtype,
                    None if bf is None else bf[start:stop],
                    out=y[:, start:stop],
                    q8_activations=q8,
                )
        return y if x.dtype == torch.float32 else y.to(x.dtype)


class Linear(QuantizedRows, nn.Module):
    """``y = x @ W.T + b`` with ``W [out, in]``; fused projections are one such layer whose rows
    are filled shard by shard at load time (see ``LlamaForCausalLM.load_weights``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)

    def step_description(self) -> LinearDesc:
        """This layer for the native decode step: its own weight, bias and ggml segments."""
        return LinearDesc(self.weight, self.bias, self.qsegments or (), self.qkquant)


class Embedding(QuantizedRows, nn.Module):
    """Token embedding table ``[vocab, hidden]``; also serves as the (possibly tied) LM head
    (:meth:`QuantizedRows.project` computes the logits)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = _param(num_embeddings, embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class VocabParallelEmbedding(Embedding):
    """The embedding (and LM head) rows ``[vocab_start, vocab_end)`` of one tensor-parallel
    rank (vLLM's VocabParallelEmbedding): a lookup zeroes the tokens other ranks hold and
    all-reduces, so every rank gets every token's full row; ``project`` gives this rank's
    logits columns (the model all-gathers them)."""

    def __init__(self, vocab_size: int, embedding_dim: int, parallel: ParallelContext) -> None:
        self.vocab_start, self.vocab_end = parallel.layout.vocab
        super().__init__(self.vocab_end - self.vocab_start, embedding_dim)
        self.tp_group = parallel.tp_group
        # Every rank's row count, in rank order: the sizes `gather_logits` reassembles.
        tp = parallel.tp_size
        self.vocab_sizes = [e - b for b, e in (split_range(vocab_size, tp, r) for r in range(tp))]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_end - self.vocab_start)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        rows.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp_group.all_reduce(rows)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's logits columns ``[N, rows]``, concatenated: ``[N, vocab]``."""
        return self.tp_group.all_gather_uneven(logits, self.vocab_sizes, -1)


def vocab_embedding(
    vocab_size: int, embedding_dim: int, parallel: ParallelContext | None = None
) -> Embedding:
    """The token embedding (or an untied LM head): whole, or this tensor-parallel rank's rows."""
    if parallel is None:
        return Embedding(vocab_size, embedding_dim)
    return VocabParallelEmbedding(vocab_size, embedding_dim, parallel)


class RMSNorm(nn.Module):
    """RMSNorm (HF Llama semantics: normalize in float32, cast back, then scale by the weight).

    ``forward(x, residual)`` fuses the residual add: returns ``(norm(x + residual), x + residual)``
    so a decoder layer never materializes the sum twice.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = _param(hidden_size)
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        if x.dtype == torch.float32:
            return torch.rms_norm(x, shape, self.weight, self.eps)
        return torch.rms_norm(x.float(), shape, None, self.eps).to(x.dtype) * self.weight

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (float32), computed exactly as transformers does.

    ``scaling`` is an HF ``rope_scaling`` dict: ``None``/"default", "linear" (positions / factor)
    or "llama3" (frequency-dependent smoothing). Other types raise ``NotImplementedError``.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / hi) & ~(wavelen > old_ctx / lo)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(f"rope scaling type {kind!r} is not supported")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, neox/HF "rotate_half" convention (pairs ``i`` and ``i + D/2``).

    The cos/sin table for every position up to ``max_positions`` is computed once in float32.
    ``cos_sin(positions)`` gathers rows once per forward; ``apply`` rotates q/k heads with them.
    """

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self.set_inv_freq(rope_inv_freq(head_dim, theta, scaling))

    def set_inv_freq(self, inv_freq: torch.Tensor) -> None:
        """Rebuild the table from new inverse frequencies (e.g. a GGUF's ``rope_freqs`` factors)."""
        old = getattr(self, "cos_sin_cache", None)
        device = old.device if old is not None else inv_freq.device  # stay where the model lives
        t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq.to(device=device, dtype=torch.float32))
        self.register_buffer(
            "cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False
        )

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[T, 1, D/2]`` float32, for int64 ``positions [T]``."""
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return cos, sin

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, H, D]`` (any strides); returns a new contiguous tensor in x's dtype.

        ``[x1, x2] -> [x1·cos - x2·sin, x2·cos + x1·sin]`` computed in float32 straight into the
        two halves of one output (a ``cat`` of temporaries is ~20x slower on CPU). Products and
        sums are rounded separately (no fused multiply-add) so float32 results equal HF's.
        """
        half = x.shape[-1] // 2
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.empty(xf.shape, dtype=torch.float32, device=x.device)
        tmp = torch.empty(x1.shape, dtype=torch.float32, device=x.device)
        o1, o2 = out[..., :half], out[..., half:]
        torch.mul(x1, cos, out=o1).sub_(torch.mul(x2, sin, out=tmp))
        torch.mul(x2, cos, out=o2).add_(torch.mul(x1, sin, out=tmp))
        return out.to(x.dtype)


class SiluAndMul(nn.Module):
    """SwiGLU activation on a fused ``[gate | up]`` projection: ``silu(gate) * up``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
