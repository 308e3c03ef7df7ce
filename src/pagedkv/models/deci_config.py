"""DeciLM / Nemotron-NAS configs (``model_type`` "nemotron-nas", ``DeciLMForCausalLM``): a Llama
whose layers differ, one ``block_configs`` entry per layer.

Each entry is ``{"attention": {...}, "ffn": {...}}``. Attention: ``n_heads_in_group`` (the GQA
group: ``num_attention_heads // n_heads_in_group`` KV heads), or ``no_op`` (no attention and no
input norm: the stream passes through), or ``replace_with_linear`` (one bias-free
``Linear(hidden, hidden)`` on the normed input, checkpoint name ``self_attn.linear_attn``). FFN:
a SwiGLU MLP of ``_ffn_mult_to_intermediate_size(ffn_mult, hidden)`` (or an explicit
``intermediate_size``), or ``no_op`` (no MLP, no post-attention norm), or ``replace_with_linear``
(``mlp.linear_mlp``). Only layers with attention have a KV cache. Checked against vLLM's
``nemotron_nas.py``, NVIDIA NeMo-Automodel's DeciLM layers (which name the linear checkpoint
keys) and the published Nemotron-Super-49B / Ultra-253B ``config.json`` files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DECI_ARCHITECTURES = frozenset({"nemotron-nas"})
ATTENTION, LINEAR, NO_OP = "attention", "linear", "no_op"  # what a layer's sub-block is
MLP = "mlp"
# Attention options of the NAS search space that change the computation; none is used by the
# released checkpoints, so a config setting one is refused rather than silently misread.
_UNSUPPORTED_ATTENTION = (
    "num_sink_tokens",
    "sparsify",
    "unshifted_sink",
    "window_length",
    "use_prefill_window_in_sink_attention",
)


def ffn_mult_to_intermediate_size(ffn_mult: float, hidden_size: int) -> int:
    """DeciLM's ``_ffn_mult_to_intermediate_size``: ``int(2·ffn_mult·hidden/3)`` rounded up to a
    multiple of 256 (Super-49B: hidden 8192, ffn_mult 5.25 → 28672)."""
    n = int(2 * ffn_mult * hidden_size / 3)
    return n + (-n) % 256


@dataclass(slots=True)
class DeciParams:
    """Per-layer sub-blocks: ``attention[i]`` is "attention", "linear" or "no_op"; ``ffn[i]``
    "mlp", "linear" or "no_op"; ``intermediate_sizes[i]`` the MLP width (0 unless "mlp")."""

    attention: list[str]
    ffn: list[str]
    intermediate_sizes: list[int]

    def validate(self, num_layers: int, layer_kv_heads: list[int]) -> None:
        """Lengths match, kinds are known, and exactly the attention layers have KV heads."""
        for name in ("attention", "ffn", "intermediate_sizes"):
            if len(getattr(self, name)) != num_layers:
                raise ValueError(
                    f"deci.{name} has {len(getattr(self, name))} entries, expected {num_layers}"
                )
        for i, (a, f, size, heads) in enumerate(
            zip(self.attention, self.ffn, self.intermediate_sizes, layer_kv_heads, strict=True)
        ):
            if a not in (ATTENTION, LINEAR, NO_OP) or f not in (MLP, LINEAR, NO_OP):
                raise ValueError(f"layer {i}: unknown sub-blocks attention={a!r}, ffn={f!r}")
            if (heads > 0) != (a == ATTENTION) or (size > 0) != (f == MLP):
                raise ValueError(f"layer {i}: {a} with {heads} KV heads / {f} of width {size}")

    @classmethod
    def from_block_configs(cls, d: dict[str, Any]) -> tuple[DeciParams, list[int]]:
        """``(params, KV heads per layer)`` from an HF config dict with ``block_configs``."""
        blocks, n = d.get("block_configs"), d["num_hidden_layers"]
        if not isinstance(blocks, list) or len(blocks) != n:
            raise ValueError(
                f"nemotron-nas: block_configs must list {n} layers, got {blocks!r:.80}"
            )
        heads, hidden = d["num_attention_heads"], d["hidden_size"]
        attn, ffn, sizes, kv = [], [], [], []
        for i, b in enumerate(blocks):
            a, f = b.get("attention") or {}, b.get("ffn") or {}
            bad = [k for k in _UNSUPPORTED_ATTENTION if a.get(k)]
            if bad:
                raise NotImplementedError(
                    f"nemotron-nas layer {i}: attention options {bad} are not supported"
                )
            if f.get("sparsify") or f.get("hidden_act", "silu") != "silu":
                raise NotImplementedError(
                    f"nemotron-nas layer {i}: only a dense SiLU FFN is supported"
                )
            group = a.get("n_heads_in_group")
            kind = (
                NO_OP if a.get("no_op") else LINEAR if a.get("replace_with_linear") else ATTENTION
            )
            if kind == ATTENTION and (not group or heads % group):
                raise ValueError(
                    f"nemotron-nas layer {i}: n_heads_in_group={group} does not divide {heads} heads"
                )
            attn.append(kind)
            kv.append(heads // group if kind == ATTENTION else 0)
            kind = NO_OP if f.get("no_op") else LINEAR if f.get("replace_with_linear") else MLP
            ffn.append(kind)
            if kind != MLP:
                sizes.append(0)
            elif f.get("ffn_mult") is not None:
                sizes.append(ffn_mult_to_intermediate_size(float(f["ffn_mult"]), hidden))
            else:
                sizes.append(int(f["intermediate_size"]))
        return cls(attn, ffn, sizes), kv


def deci_hf_dict(d: dict[str, Any]) -> dict[str, Any]:
    """Checks, and the model-wide keys the released configs leave null: ``intermediate_size``
    (the widest MLP) and ``num_key_value_heads`` (the most KV heads of any layer; each layer's own
    count is in ``layer_num_kv_heads``)."""
    if d.get("hidden_act", "silu") != "silu" or d.get("mlp_bias") or d.get("attention_bias"):
        raise NotImplementedError(
            "nemotron-nas: only SiLU MLPs without biases and bias-free attention"
        )
    params, kv = DeciParams.from_block_configs(d)
    return {
        **d,
        "intermediate_size": d.get("intermediate_size")
        or max(params.intermediate_sizes, default=0),
        "num_key_value_heads": max(kv, default=0) or d["num_attention_heads"],
    }


def deci_layer_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The ``ModelConfig`` fields of a nemotron-nas config: ``deci`` and ``layer_num_kv_heads``."""
    params, kv = DeciParams.from_block_configs(d)
    return dict(deci=params, layer_num_kv_heads=kv)


def deci_num_params(cfg: Any) -> int:
    """Weights of a DeciLM: per layer its attention (q/k/v/o with the layer's KV heads, or the
    hidden² linear) and input norm unless no-op, its MLP (or linear) and post-attention norm
    unless no-op; embeddings, final norm and untied head."""
    g, h = cfg.deci, cfg.hidden_size
    q = cfg.num_attention_heads * cfg.head_dim
    total = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + h
    for i in range(cfg.num_layers):
        kv = cfg.layer_kv_heads(i) * cfg.head_dim
        total += {ATTENTION: 2 * h * q + 2 * h * kv + h, LINEAR: h * h + h, NO_OP: 0}[
            g.attention[i]
        ]
        total += {MLP: 3 * h * g.intermediate_sizes[i] + h, LINEAR: h * h + h, NO_OP: 0}[g.ffn[i]]
    return total
