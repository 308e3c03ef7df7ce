"""GraniteMoeHybrid (IBM Granite 4.0 hybrids, model_type "granitemoehybrid") over a paged KV
cache: Bamba's Mamba-2 mixer and attention (``bamba.py``, same state rules and weight names)
in a Granite decoder.

What differs from Bamba (transformers 5.24 ``GraniteMoeHybridForCausalLM``):

* embeddings × ``embedding_multiplier``; each residual branch × ``residual_multiplier``;
  attention scale ``attention_multiplier``; logits ÷ ``logits_scaling`` (``config.granite``);
* RoPE only with ``position_embedding_type == "rope"`` (full rotary by default), else NoPE;
* after the mixer: ``post_attention_layernorm``, then a shared SwiGLU MLP (``shared_mlp``,
  fused ``input_linear`` = [gate | up]) plus, with ``num_local_experts > 0``, a MoE
  (``block_sparse_moe``: a linear router, top-k, softmax over the chosen logits; experts with
  fused [gate | up] ``input_linear [E, 2I, H]`` and ``output_linear [E, H, I]``);
* the final norm is ``model.norm``; layer types come from ``layer_types`` ("mamba" /
  "attention", or transformers 5's "linear_attention" / "full_attention").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.models.bamba import BambaAttention, BambaForCausalLM, BambaMixer
from pagedkv.models.config import ModelConfig
from pagedkv.models.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, SiluAndMul, _param
from pagedkv.models.llama import KVCache
from pagedkv.ops.kv_quant import KVQuant, LayerKVQuants
from pagedkv.ops.metadata import AttentionMetadata


class GraniteMoeHybridMLP(nn.Module):
    """``output_linear(silu(gate) * up)`` with ``input_linear`` = [gate | up]."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.input_linear = Linear(hidden, 2 * intermediate)
        self.output_linear = Linear(intermediate, hidden)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_linear(self.act(self.input_linear(x)))


class GraniteMoeHybridMoE(nn.Module):
    """Top-k routed experts (softmax over the k chosen router logits), summed per token in
    expert order as transformers does."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Module()
        self.router.layer = Linear(hidden, num_experts)
        self.input_linear = nn.Module()
        self.input_linear.weight = _param(num_experts, 2 * intermediate, hidden)
        self.output_linear = nn.Module()
        self.output_linear.weight = _param(num_experts, hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router.layer(x).float()
        top, idx = logits.topk(self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1).type_as(x)
        out = torch.zeros_like(x)
        w_in, w_out = self.input_linear.weight, self.output_linear.weight
        for e in idx.unique().tolist():
            tok, pos = torch.where(idx == e)
            gate, up = F.linear(x[tok], w_in[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w_out[e]) * weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


class GraniteMoeHybridDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, kv_quant: KVQuant | None = None
    ) -> None:
        super().__init__()
        g = config.granite
        assert g is not None and config.mamba is not None
        name = config.layer_name(layer_idx)
        self.is_mamba = config.mamba.is_mamba_layer(layer_idx)
        self.residual_multiplier = g.residual_multiplier
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.is_mamba:
            self.mamba = BambaMixer(config, name)
        else:
            self.self_attn = BambaAttention(
                config, name, scale=g.attention_multiplier, rope=g.rope, kv_quant=kv_quant
            )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.shared_mlp = GraniteMoeHybridMLP(config.hidden_size, g.shared_intermediate_size)
        self.block_sparse_moe = (
            GraniteMoeHybridMoE(
                config.hidden_size,
                config.intermediate_size,
                g.num_local_experts,
                g.num_experts_per_tok,
            )
            if g.num_local_experts > 0
            else None
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.mamba(h, kv_cache, md) if self.is_mamba else self.self_attn(h, rope, kv_cache, md)
        x = x + h * self.residual_multiplier
        h = self.post_attention_layernorm(x)
        mlp = self.shared_mlp(h)
        if self.block_sparse_moe is not None:
            mlp = self.block_sparse_moe(h) + mlp
        return x + mlp * self.residual_multiplier


class GraniteMoeHybridModel(nn.Module):
    def __init__(self, config: ModelConfig, kv_quants: LayerKVQuants | None = None) -> None:
        super().__init__()
        g, m = config.granite, config.mamba
        assert g is not None and m is not None
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.embedding_multiplier = g.embedding_multiplier
        quants = kv_quants or {}  # layer name → its cache's KVQuant
        self.layers = nn.ModuleList(
            GraniteMoeHybridDecoderLayer(config, i, quants.get(config.layer_name(i)))
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = (
            RotaryEmbedding(
                int(config.head_dim * m.partial_rotary_factor),
                config.max_position_embeddings,
                config.rope_theta,
                config.rope_scaling,
            )
            if g.rope
            else None
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        md: AttentionMetadata | list[AttentionMetadata],
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * self.embedding_multiplier
        rope = self.rotary_emb.cos_sin(positions) if self.rotary_emb is not None else None
        mds = md if isinstance(md, list) else [md] * len(self.layers)
        for layer, kv_cache, layer_md in zip(self.layers, kv_caches, mds, strict=True):
            x = layer(x, rope, kv_cache, layer_md)
        return self.norm(x)


class GraniteMoeHybridForCausalLM(BambaForCausalLM):
    """GraniteMoeHybrid over a paged KV cache (Bamba's interface and weight loading);
    ``compute_logits`` divides by ``logits_scaling``."""

    def __init__(self, config: ModelConfig, kv_quants: LayerKVQuants | None = None) -> None:
        nn.Module.__init__(self)
        if config.mamba is None or config.granite is None:
            raise ValueError("a GraniteMoeHybrid model needs config.mamba and config.granite")
        self.config = config
        self.model = GraniteMoeHybridModel(config, kv_quants)
        tied = config.tie_word_embeddings
        self.lm_head = (
            self.model.embed_tokens if tied else Embedding(config.vocab_size, config.hidden_size)
        )

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.lm_head.project(hidden) / self.config.granite.logits_scaling).float()  # type: ignore[union-attr]
