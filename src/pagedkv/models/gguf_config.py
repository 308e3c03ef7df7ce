"""GGUF metadata → transformers ``config.json`` keys, for the architectures whose GGUF shape is
more than Llama's: llama.cpp's ``gemma2``, ``gemma3``, ``deepseek2``, ``llama4`` and
``granitehybrid`` (as ``convert_hf_to_gguf.py`` writes them). ``ModelConfig.from_hf_dict`` then
derives everything else (layer types, MLA geometry, ...) exactly as for an HF directory, so a
GGUF and its source checkpoint give the same ``ModelConfig``. Pure Python (no torch).

The HF ``model_type`` (the registry's key) follows from the file: ``gemma2``, ``gemma3_text``;
``deepseek_v3`` for a DeepSeek file with a sigmoid router (``expert_gating_func`` 2, V3's
``noaux_tc``), else ``deepseek_v2``; ``llama4_text``; ``bamba`` for a granitehybrid file using
RoPE without Granite's multipliers, else ``granitemoehybrid``. The vocabulary size is the
embedding table's rows.

Facts GGUF does not store are taken the way llama.cpp takes them: Gemma's
``query_pre_attn_scalar`` is ``hidden/heads`` for the 27B models and ``head_dim`` otherwise
(unless ``attention.scale`` is written); Gemma 3's local RoPE theta defaults to 10000 and its
pattern to five sliding layers per global one; Llama 4's chunk and temperature floor are 8192
(see :func:`_llama4`); Mamba-2's SSD chunk is 256 (see :func:`_granitehybrid`). DeepSeek's YaRN
``mscale`` is taken equal to ``mscale_all_dim`` (only ``0.1·mscale_all_dim`` is stored; the
released checkpoints have them equal).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

Shapes = Mapping[str, tuple[int, ...]]  # tensor name -> shape (torch order)
_GATING_SIGMOID = 2  # gguf.ExpertGatingFuncType.SIGMOID
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp scales q by (hidden/heads)^-0.5 there


class _Meta:
    """``meta[f"{arch}.{key}"]`` lookups with a default; ``need`` raises a ValueError naming the key."""

    __slots__ = ("meta", "arch", "path")

    def __init__(self, meta: Mapping[str, Any], arch: str, path: str) -> None:
        self.meta, self.arch, self.path = meta, arch, path

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{key}", default)

    def need(self, key: str) -> Any:
        v = self.get(key)
        if v is None:
            raise ValueError(f"{self.path}: GGUF metadata lacks {self.arch}.{key}")
        return v


def _common(m: _Meta, shapes: Shapes) -> dict[str, Any]:
    """The keys every architecture shares (Llama's shape)."""
    meta = m.meta
    heads = int(m.need("attention.head_count"))
    kv = m.get("attention.head_count_kv", heads)
    d: dict[str, Any] = dict(
        num_hidden_layers=int(m.need("block_count")), hidden_size=int(m.need("embedding_length")),
        num_attention_heads=heads, num_key_value_heads=kv,
        intermediate_size=int(m.get("feed_forward_length", 0)),
        vocab_size=shapes["token_embd.weight"][0],  # the table's rows (vocabularies may be padded)
        max_position_embeddings=int(m.get("context_length", 2048)),
        rms_norm_eps=float(m.get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(m.get("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in shapes,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        _name_or_path=meta.get("general.name"),
    )  # fmt: skip
    if m.get("attention.key_length") is not None:
        d["head_dim"] = int(m.get("attention.key_length"))
    scaling = m.get("rope.scaling.type")
    if scaling not in (None, "none"):
        rs: dict[str, Any] = {
            "rope_type": scaling,
            "factor": float(m.get("rope.scaling.factor", 1.0)),
        }
        if m.get("rope.scaling.original_context_length") is not None:
            rs["original_max_position_embeddings"] = int(
                m.get("rope.scaling.original_context_length")
            )
        for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if m.get(f"rope.scaling.{key}") is not None:
                rs[hf] = float(m.get(f"rope.scaling.{key}"))
        d["rope_scaling"] = rs
    return d


def _gemma(m: _Meta, shapes: Shapes) -> dict[str, Any]:
    d = _common(m, shapes)
    d["model_type"] = "gemma2" if m.arch == "gemma2" else "gemma3_text"
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    scale = m.get("attention.scale")
    if scale:
        d["query_pre_attn_scalar"] = float(scale) ** -2
    elif d["num_hidden_layers"] == _GEMMA_27B_LAYERS[m.arch]:
        d["query_pre_attn_scalar"] = d["hidden_size"] // d["num_attention_heads"]
    else:
        d["query_pre_attn_scalar"] = head_dim
    d["attn_logit_softcapping"] = m.get("attn_logit_softcapping")
    d["final_logit_softcapping"] = m.get("final_logit_softcapping")
    d["sliding_window"] = m.get("attention.sliding_window")
    if m.arch == "gemma3":
        d["rope_local_base_freq"] = float(m.get("rope.freq_base_swa", 10000.0))
        pattern = m.get("attention.sliding_window_pattern")
        if isinstance(pattern, list):  # per layer: True = sliding
            d["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        elif pattern:
            d["sliding_window_pattern"] = int(pattern)
    return d


def _deepseek2(m: _Meta, shapes: Shapes) -> dict[str, Any]:
    d = _common(m, shapes)
    rope = int(m.need("rope.dimension_count"))
    kv_lora = int(m.need("attention.kv_lora_rank"))
    if m.get("attention.key_length_mla") is not None:  # converters since 2025: MLA stored as MQA
        qk_head, v_head = (
            int(m.get("attention.key_length_mla")),
            int(m.need("attention.value_length_mla")),
        )
    else:  # older files: key/value lengths are the per-head ones
        qk_head, v_head = int(m.need("attention.key_length")), int(m.need("attention.value_length"))
    v3 = m.get("expert_gating_func") == _GATING_SIGMOID
    n_group = int(m.get("expert_group_count", 1) or 1)
    d.pop("head_dim", None)
    d.update(
        model_type="deepseek_v3" if v3 else "deepseek_v2", kv_lora_rank=kv_lora,
        q_lora_rank=m.get("attention.q_lora_rank"), qk_rope_head_dim=rope, qk_nope_head_dim=qk_head - rope,
        v_head_dim=v_head, first_k_dense_replace=int(m.get("leading_dense_block_count", 0)),
        n_routed_experts=m.get("expert_count"), num_experts_per_tok=m.get("expert_used_count"),
        n_shared_experts=m.get("expert_shared_count", 0), moe_intermediate_size=m.get("expert_feed_forward_length"),
        n_group=n_group, topk_group=int(m.get("expert_group_used_count", 1) or 1),
        topk_method="noaux_tc" if v3 else ("group_limited_greedy" if n_group > 1 else "greedy"),
        routed_scaling_factor=float(m.get("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(m.get("expert_weights_norm", False)),
        rope_interleave=True,  # llama.cpp's deepseek2 RoPE rotates adjacent pairs
    )  # fmt: skip
    log_mul = m.get("rope.scaling.yarn_log_multiplier")
    if log_mul and d.get("rope_scaling"):  # the converter writes 0.1 * mscale_all_dim
        d["rope_scaling"].update(mscale=float(log_mul) / 0.1, mscale_all_dim=float(log_mul) / 0.1)
    return d


def _llama4(m: _Meta, shapes: Shapes) -> dict[str, Any]:
    """llama.cpp fixes Llama 4's chunk (8192), NoPE period (4), temperature floor (8192) and
    scale (0.1), and q/k L2 norms unless 128 experts; a ``sliding_window`` of 0 means no chunks
    and RoPE everywhere. A nonzero ``attention.sliding_window`` / ``attention.temperature_length``
    / ``attention.temperature_scale`` is read as the chunk size / floor scale / attn scale
    (llama.cpp's converter writes none of them)."""
    d = _common(m, shapes)
    experts = int(m.need("expert_count"))
    d.update(
        model_type="llama4_text",
        intermediate_size=int(m.need("expert_feed_forward_length")),
        intermediate_size_mlp=d["intermediate_size"],
        num_local_experts=experts,
        num_experts_per_tok=int(m.get("expert_used_count", 1)),
        interleave_moe_layer_step=int(m.get("interleave_moe_layer_step", 1)),
        use_qk_norm=experts != 128,
        floor_scale=float(m.get("attention.temperature_length", 8192)),
        attn_scale=float(m.get("attention.temperature_scale", 0.1)),
    )
    window = m.get("attention.sliding_window")
    if window == 0:  # MobileLLM-style: all layers full attention with RoPE
        d.update(
            attention_chunk_size=None,
            no_rope_layers=[1] * d["num_hidden_layers"],
            attn_temperature_tuning=False,
        )
    else:
        d.update(attention_chunk_size=int(window or 8192), no_rope_layer_interval=4)
    return d


def granite_hybrid_is_bamba(meta: Mapping[str, Any]) -> bool:
    """llama.cpp's ``granitehybrid`` holds Bamba and GraniteMoeHybrid: only Bamba uses RoPE
    (``rope.scaling.finetuned`` true) and has none of Granite's multipliers."""
    a = "granitehybrid"
    scales = ("embedding_scale", "residual_scale", "logit_scale", "attention.scale")
    return bool(meta.get(f"{a}.rope.scaling.finetuned")) and not any(
        f"{a}.{k}" in meta for k in scales
    )


def _granitehybrid(m: _Meta, shapes: Shapes) -> dict[str, Any]:
    """Mamba-2 mixers where ``attention.head_count_kv[i]`` is 0, attention layers elsewhere.
    GGUF has no SSD chunk size (256 is used: the scan's result does not depend on it beyond
    rounding) nor a dt limit (none)."""
    d = _common(m, shapes)
    kv = m.need("attention.head_count_kv")
    kv = list(kv) if isinstance(kv, list) else [int(kv)] * d["num_hidden_layers"]
    attn = [i for i, n in enumerate(kv) if n > 0]
    heads, inner = int(m.need("ssm.time_step_rank")), int(m.need("ssm.inner_size"))
    d.pop("head_dim", None)  # the Granite converter drops head_dim: hidden / heads
    d.update(
        num_key_value_heads=max(kv) if attn else d["num_attention_heads"],
        mamba_n_heads=heads,
        mamba_d_head=inner // heads,
        mamba_expand=inner // d["hidden_size"],
        mamba_n_groups=int(m.get("ssm.group_count", 1)),
        mamba_d_state=int(m.need("ssm.state_size")),
        mamba_d_conv=int(m.need("ssm.conv_kernel")),
        mamba_chunk_size=256,
        mamba_conv_bias=any(n.endswith("ssm_conv1d.bias") for n in shapes),
        mamba_proj_bias=any(n.endswith("ssm_in.bias") for n in shapes),
    )
    if m.get("rope.dimension_count"):
        d["partial_rotary_factor"] = int(m.get("rope.dimension_count")) / (
            d["hidden_size"] // d["num_attention_heads"]
        )
    if granite_hybrid_is_bamba(m.meta):
        d.update(model_type="bamba", attn_layer_indices=attn)
        return d
    experts = int(m.get("expert_count", 0) or 0)
    d.update(
        model_type="granitemoehybrid",
        layer_types=["attention" if i in attn else "mamba" for i in range(len(kv))],
        embedding_multiplier=float(m.get("embedding_scale", 1.0)),
        residual_multiplier=float(m.get("residual_scale", 1.0)),
        attention_multiplier=float(m.get("attention.scale", 1.0)),
        logits_scaling=float(m.get("logit_scale", 1.0)),
        shared_intermediate_size=int(
            m.get("expert_shared_feed_forward_length", d["intermediate_size"])
        ),
        num_local_experts=experts,
        num_experts_per_tok=int(m.get("expert_used_count", 0) or 0) or None,
        position_embedding_type="rope" if m.get("rope.scaling.finetuned") else "nope",
    )
    return d


_BUILDERS: dict[str, Callable[[_Meta, Shapes], dict[str, Any]]] = {
    "gemma2": _gemma, "gemma3": _gemma, "deepseek2": _deepseek2, "llama4": _llama4,
    "granitehybrid": _granitehybrid,
}  # fmt: skip


def is_hf_mapped_arch(arch: str) -> bool:
    """True for a GGUF architecture whose config is read through :func:`hf_config_from_gguf`."""
    return arch in _BUILDERS


def hf_config_from_gguf(meta: Mapping[str, Any], shapes: Shapes, path: str = "") -> dict[str, Any]:
    """transformers config keys for a GGUF file of an :func:`is_hf_mapped_arch` architecture
    (``shapes``: the file's tensor shapes by name: vocabulary rows, tied heads, biases)."""
    if "token_embd.weight" not in shapes:
        raise ValueError(f"{path}: GGUF tensor token_embd.weight is missing")
    arch = str(meta["general.architecture"])
    if arch not in _BUILDERS:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} has no HF mapping; supported: {sorted(_BUILDERS)}"
        )
    return _BUILDERS[arch](_Meta(meta, arch, path), shapes)
