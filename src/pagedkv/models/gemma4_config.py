"""Gemma4Params: the Gemma 4 text-decoder facts beyond the Gemma 3 shape, read from a transformers
``config.json`` (``Gemma4TextConfig``, model_type "gemma4_text", or the "gemma4" multimodal
wrapper's ``text_config``). Pure Python (the planner reads it without torch).

Per-layer attention geometry: every "full_attention" layer has heads of ``global_head_dim`` and,
when ``attention_k_eq_v``, ``num_global_key_value_heads`` KV heads (transformers 5.24 writes both
as a ``per_layer_config`` ``{layer: {"head_dim": .., "num_key_value_heads": ..}}``; released
checkpoints as the two top-level keys). ``ModelConfig.layer_head_dims`` / ``layer_num_kv_heads``
carry them, so each layer's ``KVCacheSpec`` has its own page size.

KV sharing (``num_kv_shared_layers = n``): the last ``n`` layers own no K/V; layer ``i`` among
them reads the cache of the last earlier non-shared layer of its own type
(``ModelConfig.kv_sharing_targets``), as transformers' ``kv_sharing_modes`` "reuse"/"store".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GEMMA4_ARCHITECTURES = frozenset({"gemma4", "gemma4_text"})
_FULL, _SLIDING = "full_attention", "sliding_attention"

# transformers' Gemma4TextConfig defaults for keys a config.json may leave out.
_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262_144,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=30,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    max_position_embeddings=131_072,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    sliding_window=512,
    eos_token_id=1,
    bos_token_id=2,
)
_DEFAULT_ROPE = {
    _SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    _FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


@dataclass(slots=True)
class Gemma4Params:
    """``attention_k_eq_v``: full layers have no ``v_proj``; V is the raw ``k_proj`` output (before
    k_norm and RoPE), then v-normed like every layer's V. ``partial_rotary_factor``: the fraction
    of a full layer's head RoPE rotates ("proportional" RoPE; the rest of the frequencies are 0).
    ``hidden_size_per_layer_input > 0``: per-layer embeddings (PLE) of that width, from a table of
    ``vocab_size_per_layer_input`` rows. ``use_double_wide_mlp``: KV-shared layers' MLPs are twice
    ``intermediate_size``. ``enable_moe_block``: every layer adds a routed MoE of ``num_experts``
    experts of ``moe_intermediate_size`` (top ``top_k_experts``) to its dense MLP."""

    attention_k_eq_v: bool = False
    partial_rotary_factor: float = 1.0
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    enable_moe_block: bool = False
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Gemma4Params:
        full_rope = (d.get("rope_parameters") or _DEFAULT_ROPE).get(_FULL) or {}
        return cls(
            attention_k_eq_v=bool(d.get("attention_k_eq_v", False)),
            partial_rotary_factor=float(full_rope.get("partial_rotary_factor", 1.0)),
            hidden_size_per_layer_input=int(d.get("hidden_size_per_layer_input", 256) or 0),
            vocab_size_per_layer_input=int(d.get("vocab_size_per_layer_input", 262_144) or 0),
            num_kv_shared_layers=int(d.get("num_kv_shared_layers") or 0),
            use_double_wide_mlp=bool(d.get("use_double_wide_mlp", False)),
            enable_moe_block=bool(d.get("enable_moe_block", False)),
            num_experts=int(d.get("num_experts") or 0),
            top_k_experts=int(d.get("top_k_experts") or 0),
            moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
        )

    def mlp_size(self, intermediate: int, shared: bool) -> int:
        """The dense MLP width of a layer (``shared``: it reads another layer's KV)."""
        return intermediate * (2 if self.use_double_wide_mlp and shared else 1)


def gemma4_hf_dict(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with transformers' Gemma4TextConfig defaults filled in (layer pattern: every 6th layer
    full, the last always full; per-layer-type RoPE) and model_type "gemma4_text". Raises
    ``NotImplementedError`` naming the field for what no pagedkv model can run."""
    d = {**_DEFAULTS, **d, "model_type": "gemma4_text"}
    n = d["num_hidden_layers"]
    types = list(d.get("layer_types") or [_SLIDING if (i + 1) % 6 else _FULL for i in range(n)])
    types[-1] = _FULL  # transformers forces it
    d["layer_types"] = types
    d["rope_parameters"] = d.get("rope_parameters") or _DEFAULT_ROPE
    if d.get("use_bidirectional_attention") == "all":
        raise NotImplementedError(
            "Gemma 4: use_bidirectional_attention='all' (non-causal text attention)"
        )
    if d.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise NotImplementedError(f"Gemma 4: hidden_activation {d['hidden_activation']!r}")
    sliding_rope = d["rope_parameters"].get(_SLIDING) or {}
    if sliding_rope.get("rope_type", "default") != "default":
        raise NotImplementedError(
            f"Gemma 4: rope_parameters.sliding_attention.rope_type {sliding_rope['rope_type']!r}"
        )
    full_rope = d["rope_parameters"].get(_FULL) or {}
    if full_rope.get("rope_type", "default") not in ("default", "proportional"):
        raise NotImplementedError(
            f"Gemma 4: rope_parameters.full_attention.rope_type {full_rope['rope_type']!r}"
        )
    return d


def gemma4_layer_fields(d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of a ``gemma4_hf_dict`` output: ``gemma4``, ``layer_head_dims``,
    ``layer_num_kv_heads``, ``kv_sharing_targets``."""
    n, types = d["num_hidden_layers"], d["layer_types"]
    heads = [d["num_key_value_heads"]] * n
    dims = [d["head_dim"]] * n
    per_layer = d.get("per_layer_config")
    if per_layer is None:  # released config.json: global_head_dim / num_global_key_value_heads
        override: dict[str, Any] = {"head_dim": d.get("global_head_dim", 512)}
        if d.get("attention_k_eq_v", False) and d.get("num_global_key_value_heads") is not None:
            override["num_key_value_heads"] = d["num_global_key_value_heads"]
        per_layer = {i: override for i, t in enumerate(types) if t == _FULL}
    for key, over in per_layer.items():
        layers = (
            [i for i, t in enumerate(types) if t == key] if key in (_FULL, _SLIDING) else [int(key)]
        )
        for field in set(over or {}) - {"head_dim", "num_key_value_heads"}:
            raise NotImplementedError(f"Gemma 4: per_layer_config override of {field!r}")
        for i in layers:
            dims[i] = int(over.get("head_dim", dims[i]))
            heads[i] = int(over.get("num_key_value_heads", heads[i]))
    params = Gemma4Params.from_hf_dict(d)
    return dict(
        gemma4=params,
        layer_head_dims=dims,
        layer_num_kv_heads=heads,
        kv_sharing_targets=kv_sharing_targets(types, params.num_kv_shared_layers),
    )


def kv_sharing_targets(types: list[str], num_shared: int) -> list[int | None] | None:
    """transformers' ``kv_sharing_modes``: the last ``num_shared`` layers reuse the K/V of the last
    earlier layer of their own type. None without sharing."""
    n = len(types)
    if not num_shared:
        return None
    first = n - num_shared
    if first <= 0:
        raise NotImplementedError(
            f"Gemma 4: num_kv_shared_layers={num_shared} leaves no layer owning a KV cache"
        )
    last_of = {t: i for i, t in enumerate(types[:first])}
    if set(last_of) != set(types):
        raise ValueError(
            "Gemma 4: a layer type that shares KV has no earlier layer of its type owning one"
        )
    return [None if i < first else last_of[types[i]] for i in range(n)]


def gemma4_num_params(cfg: Any) -> int:
    """Every weight element of a ``Gemma4ForCausalLM`` (``cfg`` a ModelConfig with ``gemma4``)."""
    g: Gemma4Params = cfg.gemma4
    h, heads, n, p = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_layers,
        g.hidden_size_per_layer_input,
    )
    total = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + h
    if p:  # PLE table, context projection, its norm
        total += g.vocab_size_per_layer_input * n * p + h * n * p + p
    for i in range(n):
        hd, kv, shared = (
            cfg.layer_head_dim(i),
            cfg.layer_kv_heads(i),
            cfg.kv_sharing_target(i) is not None,
        )
        k_eq_v = g.attention_k_eq_v and cfg.layer_type(i) == _FULL
        total += 2 * h * heads * hd + hd  # q, o, q_norm
        if not shared:
            total += h * kv * hd * (1 if k_eq_v else 2) + hd  # k (v), k_norm
        total += (
            3 * h * g.mlp_size(cfg.intermediate_size, shared) + 4 * h + 1
        )  # MLP, 4 norms, layer_scalar
        if p:
            total += 2 * h * p + h
        if g.enable_moe_block:  # router (proj, scale, per-expert scale), experts, 3 norms
            total += (
                h * g.num_experts
                + h
                + g.num_experts
                + 3 * g.num_experts * h * g.moe_intermediate_size
                + 3 * h
            )
    return total
