"""What the native decode step (:mod:`pagedkv.ops.native_step`) knows of a model: an explicit
description of a plain Llama-family decoder stack, filled in by the model (``models/llama.py``).

The native step runs the whole layer stack in one C call from a table of pointers into the
model's tensors. It used to find those tensors by walking the model's attributes by name; now
the model hands it this description instead, so ``ops`` imports nothing from ``models`` and the
contract between them is these types. A model that offers the native step implements
:class:`NativeStepModel`; everything the kernel does not cover (shapes, dtypes, a quantized or
rotated cache) is still checked by the native step, which then declines (the model runs its
torch path).

The description holds the model's own tensors (no copies): weights never move after loading, so
the pointer tables built from it stay valid. ``kv_quant`` is read whenever the native step is
pointed at a new KV cache list (it asks for a fresh description then).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

# (first row, end row, ggml type, rows [end - first, bytes] uint8): models/layers.py's QSegment.
Segment = tuple[int, int, int, torch.Tensor]


@dataclass(slots=True)
class LinearDesc:
    """``y = x @ weight.T (+ bias)``: ``weight [N, K]`` (float32 rows the kernel reads, or a
    bfloat16/float16 weight whose every row is in ``segments``), ``bias [N]`` or None.
    ``segments``: the same rows as ggml blocks, in row order covering ``[0, N)`` (empty: none);
    ``kquant``: some segment is a K-quant (the lower K-quant row limit applies)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    segments: Sequence[Segment]
    kquant: bool


@dataclass(slots=True)
class DecoderLayerDesc:
    """One pre-norm decoder layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` with a
    SwiGLU MLP. ``qkv``'s rows are ``[q | k | v]`` heads, ``gate_up``'s ``[gate | up]``; RoPE is
    rotate-half on q and k; ``scale`` multiplies the logits; ``sliding_window`` (tokens, or None)
    limits the keys. ``kv_quant``: the layer's quantized/rotated cache format, None for a plain
    cache (the only kind the native step runs)."""

    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    qkv: LinearDesc
    o: LinearDesc
    gate_up: LinearDesc
    down: LinearDesc
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None
    kv_quant: object | None


@dataclass(slots=True)
class DecoderStackDesc:
    """The whole stack: token embedding ``embed [vocab, hidden]``, the RoPE table
    ``rope_cos_sin [max_pos, head_dim]`` (cos | sin halves, one row per position), the layers,
    and the final RMSNorm (``final_norm [hidden]``, ``final_eps``). The stack's output is the
    final-normed hidden states, in ``embed``'s dtype. ``q8_activations``: the projections'
    32-weight ggml segments take their input quantized to 8-bit blocks (the GGUF q8 mode)."""

    embed: torch.Tensor
    rope_cos_sin: torch.Tensor
    layers: list[DecoderLayerDesc]
    final_norm: torch.Tensor
    final_eps: float
    q8_activations: bool = False


class NativeStepModel(Protocol):
    """A model the native decode step can run: it describes its decoder stack."""

    def native_step_description(self) -> DecoderStackDesc:
        """The stack as it is now (the model's own tensors; cheap: called once per model and
        once per new KV cache list)."""
        ...
