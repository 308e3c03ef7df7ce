"""GGUF files: a fast header reader and a weight iterator with HF parameter names.

``read_gguf`` parses the header itself (``gguf.GGUFReader`` builds a numpy view per vocabulary
string and takes ~1.7 s on SmolLM2; this takes ~0.1 s) and maps the tensor data without
reading it. ``iter_gguf_weights`` dequantizes tensor by tensor (torch kernels for Q4_0/Q4_1/Q8_0,
``gguf.quants.dequantize`` for everything else), undoes what llama.cpp's
``convert_hf_to_gguf.py`` did to each architecture's tensors, and yields ``(hf_name, tensor)``
pairs that a model's ``load_weights`` consumes:

* llama / mistral / granitehybrid: q/k rows permuted for interleaved RoPE (un-permuted);
* gemma2 / gemma3: RMSNorm weights stored as ``w + 1`` (``-1`` here);
* deepseek2: stacked experts (``ffn_*_exps [E, ...]``) and, from newer converters, ``kv_b_proj``
  split into ``attn_k_b`` (transposed) and ``attn_v_b`` (joined again);
* llama4: experts stored ``[E, out, in]`` (transposed back to transformers' ``[E, in, out]``);
* granitehybrid (Bamba or GraniteMoeHybrid): Mamba-2 ``A = -exp(A_log)`` and reshaped D, conv and
  norm; Granite's fused ``[gate | up]`` MLPs split (joined again).

Config metadata for these families is read by :mod:`pagedkv.models.gguf_config`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as np_dequantize

from pagedkv.models.gguf_config import granite_hybrid_is_bamba
from pagedkv.models.gguf_reader import GGUFFile, GGUFTensor, read_gguf  # noqa: F401  (re-exported)
from pagedkv.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_FLOAT_TYPES = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16,
                GGMLQuantizationType.BF16: torch.bfloat16}  # fmt: skip
# Architectures whose converter permuted attn_q/attn_k rows for llama.cpp's interleaved RoPE.
_PERMUTED_QK_ARCHS = frozenset({"llama", "mistral", "granitehybrid"})


def gguf_tokenizer(gguf: GGUFFile) -> Tokenizer | None:
    """The file's tokenizer; None (prompt token ids still work) when it has no vocabulary or one
    of a kind we cannot build yet (sentencepiece-style ``llama`` vocabularies: Gemma's), with a
    warning naming the kind."""
    meta = gguf.metadata
    if "tokenizer.ggml.tokens" not in meta:
        return None
    try:
        return Tokenizer.from_gguf_metadata(meta)
    except NotImplementedError as e:
        logger.warning("%s: no tokenizer (%s); pass prompt token ids", gguf.path, e)
        return None


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
_GEMMA_NAMES = _LAYER_NAMES | {
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",  # gemma3
}  # fmt: skip
_DEEPSEEK2_NAMES = _LAYER_NAMES | {
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",  # converters before the k_b/v_b split
    "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj",
}  # fmt: skip
_LLAMA4_NAMES = _LAYER_NAMES | {
    "ffn_gate": "feed_forward.gate_proj", "ffn_up": "feed_forward.up_proj", "ffn_down": "feed_forward.down_proj",
    "ffn_gate_inp": "feed_forward.router", "ffn_gate_shexp": "feed_forward.shared_expert.gate_proj",
    "ffn_up_shexp": "feed_forward.shared_expert.up_proj", "ffn_down_shexp": "feed_forward.shared_expert.down_proj",
}  # fmt: skip
_SSM_NAMES = {
    "ssm_in": "mamba.in_proj", "ssm_out": "mamba.out_proj", "ssm_conv1d": "mamba.conv1d", "ssm_norm": "mamba.norm",
}  # fmt: skip
_BAMBA_NAMES = _LAYER_NAMES | _SSM_NAMES | {
    "ffn_norm": "pre_ff_layernorm",
    "ffn_gate": "feed_forward.gate_proj", "ffn_up": "feed_forward.up_proj", "ffn_down": "feed_forward.down_proj",
}  # fmt: skip
_GRANITE_HYBRID_NAMES = _LAYER_NAMES | _SSM_NAMES | {
    "ffn_down": "shared_mlp.output_linear", "ffn_down_shexp": "shared_mlp.output_linear",
    "ffn_gate_inp": "block_sparse_moe.router.layer",
}  # fmt: skip
_SSM_SPECIAL = {"ssm_a": "mamba.A_log", "ssm_d": "mamba.D", "ssm_dt.bias": "mamba.dt_bias"}
# Per GGUF architecture: layer tensor names that differ from Llama's, and whole-name exceptions.
# Keys: GGUF general.architecture, except "bamba" for a granitehybrid file holding Bamba (_arch_key).
_ARCH_LAYER_NAMES = {
    "gemma2": _GEMMA_NAMES,
    "gemma3": _GEMMA_NAMES,
    "deepseek2": _DEEPSEEK2_NAMES,
    "llama4": _LLAMA4_NAMES,
    "bamba": _BAMBA_NAMES,
    "granitehybrid": _GRANITE_HYBRID_NAMES,
}
_ARCH_SPECIAL = {
    "deepseek2": {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"},
    "bamba": _SSM_SPECIAL,
    "granitehybrid": _SSM_SPECIAL,
}
_ARCH_GLOBAL_NAMES = {"bamba": {"output_norm.weight": "model.final_layernorm.weight"}}
# Layer tensors several of which make one HF tensor (see _grouped): GGUF leaf -> (HF leaf, part).
_GROUPED = {
    "deepseek2": {"attn_k_b.weight": ("self_attn.kv_b_proj.weight", "k_b"),
                  "attn_v_b.weight": ("self_attn.kv_b_proj.weight", "v_b"),
                  "ffn_gate_exps.weight": ("mlp.experts.gate_up_proj", "gate"),
                  "ffn_up_exps.weight": ("mlp.experts.gate_up_proj", "up"),
                  "ffn_down_exps.weight": ("mlp.experts.down_proj", "down")},
    "granitehybrid": {"ffn_gate.weight": ("shared_mlp.input_linear.weight", "gate"),
                      "ffn_up.weight": ("shared_mlp.input_linear.weight", "up"),
                      "ffn_gate_shexp.weight": ("shared_mlp.input_linear.weight", "gate"),
                      "ffn_up_shexp.weight": ("shared_mlp.input_linear.weight", "up"),
                      "ffn_gate_exps.weight": ("block_sparse_moe.input_linear.weight", "gate"),
                      "ffn_up_exps.weight": ("block_sparse_moe.input_linear.weight", "up"),
                      "ffn_down_exps.weight": ("block_sparse_moe.output_linear.weight", "down")},
    "llama4": {"ffn_gate_exps.weight": ("feed_forward.experts.gate_up_proj", "gate"),
               "ffn_up_exps.weight": ("feed_forward.experts.gate_up_proj", "up"),
               "ffn_down_exps.weight": ("feed_forward.experts.down_proj", "down")},
}  # fmt: skip
_LAYER_RE = re.compile(
    r"blk\.(\d+)\.(\w+?)(?:\.(weight|bias))?"
)  # Mamba's ssm_a / ssm_d have no suffix
# Gemma stores RMSNorm weights as w with the norm computing x·(1 + w); the converter wrote w + 1.
_NORM_PLUS_ONE_ARCHS = frozenset({"gemma2", "gemma3"})
# Mamba-2 tensors the converter reshaped (A also stored as -exp(A_log)): HF leaf -> inverse.
_SSM_FIXES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "mamba.A_log": lambda w: torch.log(-w.float()).reshape(-1), "mamba.D": lambda w: w.reshape(-1),
    "mamba.norm.weight": lambda w: w.reshape(-1), "mamba.conv1d.weight": lambda w: w.unsqueeze(1),
}  # fmt: skip


def _arch_key(gguf: GGUFFile) -> str:
    """The naming table's key: the architecture, or "bamba" for a granitehybrid Bamba file."""
    arch = gguf.architecture
    return "bamba" if arch == "granitehybrid" and granite_hybrid_is_bamba(gguf.metadata) else arch


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF parameter name for a GGUF tensor name of ``arch``, or None for tensors a model
    does not load (or that only load combined with others: :data:`_GROUPED`)."""
    glob = _ARCH_GLOBAL_NAMES.get(arch, {}).get(gguf_name) or _GLOBAL_NAMES.get(gguf_name)
    if glob is not None:
        return glob
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None:
        return None
    layer, leaf, kind = m.groups()
    if f"{leaf}.{kind}" in _GROUPED.get(arch, {}):
        return None
    special = _ARCH_SPECIAL.get(arch, {}).get(f"{leaf}.{kind}" if kind else leaf)
    if special is not None:
        return f"model.layers.{layer}.{special}"
    names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    return f"model.layers.{layer}.{names[leaf]}.{kind}" if kind and leaf in names else None


def _loadable(
    gguf: GGUFFile,
) -> Iterator[tuple[str, GGUFTensor, Callable[[torch.Tensor], torch.Tensor]]]:
    """``(hf_name, tensor, fix)`` for every tensor a model loads on its own; ``fix`` undoes
    llama.cpp's q/k row permutation on anything with the tensor's rows and Gemma's ``+1`` on
    norms (identity elsewhere)."""
    meta, arch, key = gguf.metadata, gguf.architecture, _arch_key(gguf)
    permuted = arch in _PERMUTED_QK_ARCHS
    n_head = int(meta.get(f"{arch}.attention.head_count", 0))
    n_kv = meta.get(f"{arch}.attention.head_count_kv", n_head)
    n_kv = max(n_kv) if isinstance(n_kv, list) else int(n_kv)  # hybrids: 0 on their mixer layers
    for name, t in gguf.tensors.items():
        target = hf_name(name, key)
        if target is None:
            continue
        heads = (
            (n_head if ".q_proj." in target else n_kv if ".k_proj." in target else 0)
            if permuted
            else 0
        )
        ssm_fix = _SSM_FIXES.get(target.split(".", 3)[-1])
        if heads:
            yield target, t, lambda w, h=heads: unpermute_qk(w, h)
        elif arch in _NORM_PLUS_ONE_ARCHS and target.endswith("norm.weight"):
            yield target, t, lambda w: w.float() - 1.0
        elif ssm_fix is not None:
            yield target, t, ssm_fix
        else:
            yield target, t, lambda w: w


def _combine(arch: str, hf_leaf: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """One HF tensor from its GGUF parts (all present)."""
    if hf_leaf == "self_attn.kv_b_proj.weight":
        # The converter split kv_b [H·(nope+v), R] into k_b [H, R, nope] (transposed, for the
        # absorbed decode) and v_b [H, v, R].
        k_b, v_b = parts["k_b"], parts["v_b"]
        return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1])
    if hf_leaf == "mlp.experts.gate_up_proj":  # [E, I, H] each -> [E, 2I, H], gate first
        return torch.cat([parts["gate"], parts["up"]], dim=1)
    if hf_leaf.endswith("input_linear.weight"):  # Granite's fused [gate | up] rows (stacked or not)
        return torch.cat([parts["gate"], parts["up"]], dim=-2)
    if arch == "llama4":  # transformers' Llama 4 experts are right-multiplied: [E, in, out]
        if hf_leaf.endswith("gate_up_proj"):
            return torch.cat([parts["gate"], parts["up"]], dim=1).transpose(1, 2)
        return parts["down"].transpose(1, 2)
    return parts["down"]


def _grouped(gguf: GGUFFile) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors built from several GGUF tensors (:data:`_GROUPED`), one group dequantized at a
    time (a big MoE's stacked experts never all sit in memory); ``ValueError`` naming the
    missing part when a group is incomplete."""
    arch = _arch_key(gguf)
    table = _GROUPED.get(arch)
    if not table:
        return
    needed: dict[str, dict[str, str]] = {}  # HF leaf -> part -> GGUF leaf
    for leaf, (hf_leaf, part) in table.items():
        needed.setdefault(hf_leaf, {})[part] = leaf
    groups: dict[tuple[int, str], dict[str, GGUFTensor]] = {}
    for name, t in gguf.tensors.items():
        m = _LAYER_RE.fullmatch(name)
        if m is not None and f"{m.group(2)}.{m.group(3)}" in table:
            hf_leaf, part = table[f"{m.group(2)}.{m.group(3)}"]
            groups.setdefault((int(m.group(1)), hf_leaf), {})[part] = t
    for (layer, hf_leaf), parts in sorted(groups.items()):
        missing = [leaf for part, leaf in needed[hf_leaf].items() if part not in parts]
        if missing:
            raise ValueError(
                f"{gguf.path}: GGUF tensor blk.{layer}.{missing[0]} is missing "
                f"(needed with {sorted(needed[hf_leaf][p] for p in parts)} for {hf_leaf})"
            )
        tensors = {part: dequantize(t) for part, t in parts.items()}
        yield f"model.layers.{layer}.{hf_leaf}", _combine(arch, hf_leaf, tensors)


def iter_gguf_weights(gguf: GGUFFile) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every loadable tensor, dequantized, with llama.cpp's
    conversions undone (q/k row permutation, Gemma's norm ``+1``, DeepSeek2's k_b/v_b split
    and stacked experts).

    Tensors are float32 (or the file's own float dtype); the consumer converts while copying into
    its parameters, so each weight is materialized once at the model's dtype.
    """
    for target, t, fix in _loadable(gguf):
        yield target, fix(dequantize(t))
    yield from _grouped(gguf)


def iter_gguf_quantized(
    gguf: GGUFFile, qtypes: frozenset[int]
) -> Iterator[tuple[str, int, torch.Tensor]]:
    """Yield ``(hf_name, qtype, rows)`` for every 2-D loadable tensor stored in one of ``qtypes``:
    ``rows`` is a uint8 ``[out_features, bytes_per_row]`` copy of the file's ggml blocks, with
    q/k rows un-permuted exactly like :func:`iter_gguf_weights` (the permutation moves whole
    rows), so row ``i`` dequantizes to row ``i`` of the float weight.
    """
    if (
        gguf.architecture in _ARCH_LAYER_NAMES
    ):  # Gemma, DeepSeek2, ...: their models run dense weights
        return
    for target, t, fix_rows in _loadable(gguf):
        if len(t.shape) == 2 and int(t.qtype) in qtypes:
            yield (
                target,
                int(t.qtype),
                fix_rows(torch.from_numpy(t.raw).view(t.shape[0], -1)).contiguous(),
            )
