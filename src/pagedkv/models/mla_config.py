"""MLAParams: the DeepSeek-V2/V3 facts beyond the Llama shape (multi-head latent attention and
the DeepSeekMoE feed-forward), read from a transformers ``config.json``. Pure Python (the
planner reads it without torch).

MLA caches one row per token and layer, ``[kv_c (kv_lora_rank) | k_pe (qk_rope_head_dim)]``:
the RMS-normed KV latent and the shared RoPE key. So a ``ModelConfig`` with ``mla`` set reports
``num_kv_heads = 1`` and ``head_dim = kv_lora_rank + qk_rope_head_dim`` (the cache's geometry,
vLLM's ``MLAAttentionSpec``: one head of 576 for DeepSeek-V3, no separate V), not transformers'
``num_key_value_heads`` (the heads the latent is expanded into).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MLA_ARCHITECTURES = frozenset({"deepseek_v2", "deepseek_v3"})


@dataclass(slots=True)
class MLAParams:
    """Attention: ``q = q_b_proj(q_a_layernorm(q_a_proj(h)))`` (or ``q_proj(h)`` when
    ``q_lora_rank`` is None) split per head into ``[nope | rope]``; ``kv_a_proj_with_mqa(h) =
    [kv_c | k_pe]``; ``kv_b_proj(kv_a_layernorm(kv_c))`` gives each head's ``[k_nope | v]``.
    ``rope_style``: "complex" (DeepSeek-V2: pairs ``(2i, 2i+1)`` as complex numbers),
    "interleave" (V3 with ``rope_interleave``: the same pairs, output de-interleaved) or "neox"
    (rotate-half). The softmax scale is ``qk_head_dim**-0.5``, times ``mscale²`` under YaRN.

    Feed-forward: layers ``>= first_k_dense_replace`` run a routed MoE (``n_routed_experts``
    SwiGLU experts of ``moe_intermediate_size``, top ``num_experts_per_tok``) plus
    ``n_shared_experts`` always-on experts; earlier layers a dense SwiGLU MLP. Router
    ``topk_method``: "noaux_tc" (V3: sigmoid scores, a bias-corrected choice within the best
    ``topk_group`` of ``n_group`` groups, optional renormalisation) or "greedy" /
    "group_limited_greedy" (V2: softmax scores); weights are scaled by ``routed_scaling_factor``.
    """

    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_style: str = "interleave"
    first_k_dense_replace: int = 0
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "noaux_tc"
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False

    def __post_init__(self) -> None:
        if self.rope_style not in ("complex", "interleave", "neox"):
            raise ValueError(
                f"mla.rope_style must be 'complex', 'interleave' or 'neox', got {self.rope_style!r}"
            )
        if self.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise ValueError(f"mla.topk_method {self.topk_method!r} is not supported")
        for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"mla.{name} must be positive, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"mla.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.n_routed_experts:
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise ValueError(
                    f"mla.num_experts_per_tok={self.num_experts_per_tok} must be in "
                    f"[1, n_routed_experts={self.n_routed_experts}]"
                )
            if self.n_routed_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
                raise ValueError(
                    f"mla.n_group={self.n_group} must divide n_routed_experts="
                    f"{self.n_routed_experts} and topk_group={self.topk_group} lie in [1, n_group]"
                )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_size(self) -> int:
        """Elements of one cached row: ``kv_lora_rank + qk_rope_head_dim`` (576 for V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return self.n_routed_experts > 0 and i >= self.first_k_dense_replace

    def softmax_scale(self, rope_scaling: dict[str, Any] | None) -> float:
        """``qk_head_dim**-0.5``, times ``mscale(factor, mscale_all_dim)²`` when a scaled RoPE
        sets ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
        scale = self.qk_head_dim**-0.5
        rs = rope_scaling or {}
        if rs.get("rope_type", rs.get("type", "default")) != "default" and rs.get("mscale_all_dim"):
            m = yarn_get_mscale(rs["factor"], rs["mscale_all_dim"])
            scale = scale * m * m
        return scale

    def num_params(
        self,
        hidden: int,
        heads: int,
        intermediate: int,
        vocab: int,
        num_layers: int,
        tied: bool,
        bias: bool,
    ) -> int:
        """Every weight element: embeddings, per layer (MLA projections and norms, MLP or MoE
        with router and shared experts, two norms), the final norm and the untied head."""
        h, n = hidden, heads
        q = (
            (
                h * self.q_lora_rank
                + self.q_lora_rank
                + self.q_lora_rank * n * self.qk_head_dim
                + (self.q_lora_rank if bias else 0)
            )
            if self.q_lora_rank
            else h * n * self.qk_head_dim
        )
        kv = (
            h * self.latent_size
            + self.kv_lora_rank
            + self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
        )
        attn = q + kv + n * self.v_head_dim * h + ((self.latent_size + h) if bias else 0)
        dense = 3 * h * intermediate
        moe = (
            3 * h * self.moe_intermediate_size * (self.n_routed_experts + self.n_shared_experts)
            + self.n_routed_experts * h
            + (self.n_routed_experts if self.topk_method == "noaux_tc" else 0)
        )
        mlps = sum(moe if self.is_moe_layer(i) else dense for i in range(num_layers))
        return vocab * h * (1 if tied else 2) + num_layers * (attn + 2 * h) + mlps + h

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> MLAParams:
        """transformers' ``DeepseekV2Config`` / ``DeepseekV3Config`` keys and defaults."""
        v3 = d.get("model_type") == "deepseek_v3"
        experts = d.get("n_routed_experts") or 0
        if v3:
            style = "interleave" if d.get("rope_interleave", True) else "neox"
        else:
            style = "complex"
        return cls(
            kv_lora_rank=d.get("kv_lora_rank", 512),
            q_lora_rank=d.get("q_lora_rank", 1536),
            qk_nope_head_dim=d.get("qk_nope_head_dim", 128),
            qk_rope_head_dim=d.get("qk_rope_head_dim", 64),
            v_head_dim=d.get("v_head_dim") or 128,
            rope_style=style,
            first_k_dense_replace=d.get("first_k_dense_replace") or 0,
            n_routed_experts=experts,
            num_experts_per_tok=d.get("num_experts_per_tok") or 0,
            n_shared_experts=d.get("n_shared_experts") or 0,
            moe_intermediate_size=d.get("moe_intermediate_size") or 0,
            n_group=d.get("n_group") or 1,
            topk_group=d.get("topk_group") or 1,
            topk_method="noaux_tc" if v3 else (d.get("topk_method") or "greedy"),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
            norm_topk_prob=bool(d.get("norm_topk_prob", v3)),
        )


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention magnitude correction ``0.1·mscale·ln(scale) + 1`` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
