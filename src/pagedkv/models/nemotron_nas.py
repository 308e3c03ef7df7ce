"""DeciLM / Nemotron-NAS (``DeciLMForCausalLM``, model_type "nemotron-nas": Llama-3.3-Nemotron-
Super-49B, Llama-3.1-Nemotron-51B / Ultra-253B) over a paged KV cache: a Llama whose layers differ.

Per layer (``config.deci``, ``config.layer_num_kv_heads``; see ``deci_config.py``): attention
with the layer's own KV head count, or a bias-free ``Linear(hidden, hidden)`` on the normed
input (``self_attn.linear_attn``), or nothing (no input norm either); then a SwiGLU MLP of the
layer's width, or a linear (``mlp.linear_mlp``), or nothing. Only attention layers read or write
a KV cache; the others get empty views from the runner and never touch them. Layers of different
KV heads form one ``UniformTypeKVCacheSpecs`` group. Weight loading is Llama's (fused q/k/v and
gate/up), with q/k/v offsets of the tensor's own layer.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.models.config import ModelConfig
from pagedkv.models.deci_config import ATTENTION, MLP, NO_OP
from pagedkv.models.layers import Embedding, Linear, RMSNorm, RotaryEmbedding
from pagedkv.models.llama import KVCache, LlamaAttention, LlamaForCausalLM, LlamaModel, SwiGLUMLP
from pagedkv.ops.kv_quant import KVQuant, LayerKVQuants
from pagedkv.ops.metadata import AttentionMetadata


class DeciAttention(LlamaAttention):
    """Llama attention with layer ``i``'s own KV head count."""

    def __init__(
        self, config: ModelConfig, layer_idx: int, kv_quant: KVQuant | None = None
    ) -> None:
        super().__init__(config, None, config.layer_name(layer_idx), kv_quant)
        self.num_kv_heads = config.layer_kv_heads(layer_idx)
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size)


class LinearAttention(nn.Module):
    """``replace_with_linear`` attention: one linear map of the normed input, no KV cache."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear_attn = Linear(hidden, hidden)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        return self.linear_attn(x)


class LinearMLP(nn.Module):
    """``replace_with_linear`` FFN."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear_mlp = Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_mlp(x)


class DeciDecoderLayer(nn.Module):
    """A pre-norm Llama block whose sub-blocks may be absent (no-op: neither it nor its norm
    exists, the stream passes through) or linear."""

    def __init__(
        self, config: ModelConfig, layer_idx: int, kv_quant: KVQuant | None = None
    ) -> None:
        super().__init__()
        g, h, eps = config.deci, config.hidden_size, config.rms_norm_eps
        self.has_attn, self.has_ffn = g.attention[layer_idx] != NO_OP, g.ffn[layer_idx] != NO_OP
        if self.has_attn:
            self.input_layernorm = RMSNorm(h, eps)
            linear = g.attention[layer_idx] != ATTENTION
            self.self_attn = (
                LinearAttention(h) if linear else DeciAttention(config, layer_idx, kv_quant)
            )
        if self.has_ffn:
            self.post_attention_layernorm = RMSNorm(h, eps)
            self.mlp = (
                SwiGLUMLP(h, g.intermediate_sizes[layer_idx])
                if g.ffn[layer_idx] == MLP
                else LinearMLP(h)
            )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Same contract as ``LlamaDecoderLayer``: ``(x, residual)`` in and out, the stream being
        ``x + residual`` (just ``x`` while ``residual`` is None: only no-op layers so far)."""
        if self.has_attn:
            x, residual = _add_norm(self.input_layernorm, x, residual)
            x = self.self_attn(x, rope, kv_cache, md)
        if self.has_ffn:
            x, residual = _add_norm(self.post_attention_layernorm, x, residual)
            x = self.mlp(x)
        return x, residual


def _add_norm(
    norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(stream), stream)`` with the stream ``x + residual`` (or ``x``)."""
    return (norm(x), x) if residual is None else norm(x, residual)


class DeciModel(LlamaModel):
    """Llama's model (embedding, shared RoPE table, final norm, forward loop) over Deci layers."""

    def __init__(self, config: ModelConfig, kv_quants: LayerKVQuants | None = None) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        quants = kv_quants or {}  # layer name → its cache's KVQuant
        self.layers = nn.ModuleList(
            DeciDecoderLayer(config, i, quants.get(config.layer_name(i)))
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )


class DeciLMForCausalLM(LlamaForCausalLM):
    """A DeciLM causal LM over a paged KV cache; same interface as ``LlamaForCausalLM``."""

    def __init__(self, config: ModelConfig, kv_quants: LayerKVQuants | None = None) -> None:
        if config.deci is None:
            raise ValueError("DeciLMForCausalLM needs a nemotron-nas config (config.deci)")
        if not any(a == ATTENTION for a in config.deci.attention):
            raise ValueError(
                "nemotron-nas: a model without any attention layer has no KV cache to page"
            )
        nn.Module.__init__(self)
        self.config = config
        self.model = DeciModel(config, kv_quants)
        tied = config.tie_word_embeddings
        self.lm_head = (
            self.model.embed_tokens if tied else Embedding(config.vocab_size, config.hidden_size)
        )

    def _target(self, name: str, rows: int) -> tuple[str, int]:
        """Like Llama's, but q/k/v offsets are those of the tensor's own layer (KV heads differ)."""
        for fused, part, shard in self._STACKED:
            if part in name:
                if isinstance(shard, int):
                    return name.replace(part, fused), shard * rows
                a = getattr(self.model.layers[int(name.split(".")[2])], "self_attn", None)
                if not isinstance(a, DeciAttention):  # q/k/v for a layer without attention
                    return name, 0  # load_weights reports the stray tensor
                return name.replace(part, fused), {
                    "q": 0,
                    "k": a.q_size,
                    "v": a.q_size + a.kv_size,
                }[shard]
        return name, 0
