"""GGUF files: a fast header reader and a weight iterator with HF parameter names.

``read_gguf`` parses the header itself (``gguf.GGUFReader`` builds a numpy view per vocabulary
string and takes ~1.7 s on SmolLM2; this takes ~0.1 s) and maps the tensor data without
reading it. ``iter_gguf_weights`` dequantizes tensor by tensor (torch kernels for Q4_0/Q4_1/Q8_0,
``gguf.quants.dequantize`` for everything else), undoes llama.cpp's q/k row permutation, and
yields ``(hf_name, tensor)`` pairs that a model's ``load_weights`` consumes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as np_dequantize

from pagedkv.models.gguf_reader import GGUFFile, GGUFTensor, read_gguf  # noqa: F401  (re-exported)

_FLOAT_TYPES = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16,
                GGMLQuantizationType.BF16: torch.bfloat16}  # fmt: skip
# Architectures whose converter permuted attn_q/attn_k rows for llama.cpp's interleaved RoPE.
_PERMUTED_QK_ARCHS = frozenset({"llama", "mistral"})


def dequantize(t: GGUFTensor) -> torch.Tensor:
    """The tensor as float values with ``t.shape``: a zero-copy view for F32/F16/BF16, float32
    otherwise. Q4_0/Q4_1/Q8_0 use torch (multi-threaded, bit-identical to ``gguf.quants``)."""
    raw = torch.from_numpy(t.raw)
    if t.qtype in _FLOAT_TYPES:
        return raw.view(_FLOAT_TYPES[t.qtype]).view(t.shape)
    kernel = _TORCH_DEQUANT.get(t.qtype)
    if kernel is None:
        rows = t.raw.reshape(-1, t.raw.size // int(np.prod(t.shape[:-1])))
        return torch.from_numpy(np_dequantize(rows, t.qtype)).view(t.shape)
    _, type_size = GGML_QUANT_SIZES[t.qtype]
    return kernel(raw.view(-1, type_size)).view(t.shape)


def _scale(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 field at byte ``at`` of each block, as float32 [nblocks, 1]."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    # ggml packs element j in the low nibble of byte j and element j+16 in its high nibble.
    return torch.cat([qs & 0xF, qs >> 4], dim=1).float()


def _dequant_q4_0(b: torch.Tensor) -> torch.Tensor:
    return _scale(b, 0) * (_nibbles(b[:, 2:]) - 8.0)


def _dequant_q4_1(b: torch.Tensor) -> torch.Tensor:
    return _scale(b, 0) * _nibbles(b[:, 4:]) + _scale(b, 2)


def _dequant_q8_0(b: torch.Tensor) -> torch.Tensor:
    return _scale(b, 0) * b[:, 2:].view(torch.int8).float()


_TORCH_DEQUANT = {
    GGMLQuantizationType.Q4_0: _dequant_q4_0,
    GGMLQuantizationType.Q4_1: _dequant_q4_1,
    GGMLQuantizationType.Q8_0: _dequant_q8_0,
}


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved -> half-split RoPE pairs) on a weight
    [rows, cols] or bias [rows]."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "model.rotary_emb.freq_factors",  # llama 3.x: rope divisors per frequency
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}  # fmt: skip
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name for a GGUF tensor name, or None for tensors a model does not load."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _loadable(gguf: GGUFFile) -> Iterator[tuple[str, GGUFTensor, Callable[[torch.Tensor], torch.Tensor]]]:
    """``(hf_name, tensor, fix_rows)`` for every tensor a model loads; ``fix_rows`` undoes
    llama.cpp's q/k row permutation on anything with the tensor's rows (identity elsewhere)."""
    meta, arch = gguf.metadata, gguf.architecture
    permuted = arch in _PERMUTED_QK_ARCHS
    n_head = int(meta.get(f"{arch}.attention.head_count", 0))
    n_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_head))
    for name, t in gguf.tensors.items():
        target = hf_name(name)
        if target is None:
            continue
        heads = (n_head if ".q_proj." in target else n_kv if ".k_proj." in target else 0) if permuted else 0
        yield target, t, (lambda w, h=heads: unpermute_qk(w, h)) if heads else (lambda w: w)


def iter_gguf_weights(gguf: GGUFFile) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every loadable tensor, dequantized, q/k un-permuted.

    Tensors are float32 (or the file's own float dtype); the consumer converts while copying into
    its parameters, so each weight is materialized once at the model's dtype.
    """
    for target, t, fix_rows in _loadable(gguf):
        yield target, fix_rows(dequantize(t))


def iter_gguf_quantized(gguf: GGUFFile, qtypes: frozenset[int]) -> Iterator[tuple[str, int, torch.Tensor]]:
    """Yield ``(hf_name, qtype, rows)`` for every 2-D loadable tensor stored in one of ``qtypes``:
    ``rows`` is a uint8 ``[out_features, bytes_per_row]`` copy of the file's ggml blocks, with
    q/k rows un-permuted exactly like :func:`iter_gguf_weights` (the permutation moves whole
    rows), so row ``i`` dequantizes to row ``i`` of the float weight.
    """
    for target, t, fix_rows in _loadable(gguf):
        if len(t.shape) == 2 and int(t.qtype) in qtypes:
            yield target, int(t.qtype), fix_rows(torch.from_numpy(t.raw).view(t.shape[0], -1)).contiguous()
