"""Llama 4 text decoder (transformers' ``Llama4ForCausalLM``, model_type "llama4_text") over a
paged KV cache.

What differs from Llama (``llama.py``, whose weight loading — fused q/k/v and gate/up, untied
head — this reuses by subclassing):

* **Chunked local attention**: RoPE layers (``no_rope_layers[i] == 1``) attend only within
  their chunk of ``attention_chunk_size`` tokens (``k // c == q // c``): their KV cache group
  is a ``ChunkedLocalAttentionSpec`` whose manager releases the blocks of earlier chunks.
* **NoPE global layers** (every 4th by default): no rotary embedding, full attention, and the
  query scaled by ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1`` (attention
  temperature tuning, for long contexts).
* **L2 q/k norm** (``use_qk_norm``) on RoPE layers, after RoPE, without a weight.
* **RoPE on interleaved pairs** ``(2i, 2i+1)`` as a complex product (Meta's ``freqs_cis``), not
  the rotate-half convention of ``layers.RotaryEmbedding``; computed with the same complex ops
  as transformers so float32 results are bit-equal.
* **MoE** on ``moe_layers``: a sigmoid router picks the top ``num_experts_per_tok`` experts, the
  router score scales the expert's *input*, and a shared expert (a SwiGLU MLP) is always added.
  Other layers use a dense SwiGLU MLP of ``intermediate_size_mlp``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.models.config import CHUNKED_ATTENTION, Llama4Params, ModelConfig
from pagedkv.models.layers import Embedding, Linear, RMSNorm, _param, rope_inv_freq
from pagedkv.models.llama import KVCache, LlamaForCausalLM, SwiGLUMLP
from pagedkv.ops.attention import paged_attention
from pagedkv.ops.cache import reshape_and_cache
from pagedkv.ops.forward_context import save_kv_layer, wait_for_kv_layer_load
from pagedkv.ops.kv_quant import KVQuant, LayerKVQuants
from pagedkv.ops.metadata import AttentionMetadata


def llama4_params(config: ModelConfig) -> Llama4Params:
    if config.llama4 is None:
        raise ValueError(
            f"{config.name or config.architecture}: a Llama 4 model needs ModelConfig.llama4"
        )
    return config.llama4


class Llama4MLP(SwiGLUMLP):
    """The dense layers and the shared expert: a SwiGLU MLP with fused gate/up."""


class Llama4Rotary(nn.Module):
    """Meta-style RoPE: head dims ``(2i, 2i+1)`` form a complex number rotated by
    ``exp(i·pos·inv_freq_i)``. ``freqs_cis(positions)`` is built once per forward."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim, self.theta = config.head_dim, config.rope_theta
        self.set_inv_freq(rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling))

    def set_inv_freq(self, inv_freq: torch.Tensor) -> None:
        """New inverse frequencies (a GGUF's ``rope_freqs`` divisors, see ``load_weights``)."""
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def freqs_cis(self, positions: torch.Tensor) -> torch.Tensor:
        """Complex ``[T, D/2]`` for int64 ``positions [T]`` (transformers' float32 order)."""
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)
        return torch.polar(torch.ones_like(freqs), freqs)

    @staticmethod
    def apply(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, H, D]``; returns a new tensor in x's dtype."""
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs_cis[:, None, :]).flatten(-2).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x·rsqrt(mean(x²) + eps)`` over the last dim, in float32, cast back (no weight)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Attention(nn.Module):
    """GQA self-attention: chunked local with RoPE and L2 q/k norm, or NoPE global with the
    attention temperature on q; paged cache write + read."""

    def __init__(
        self, config: ModelConfig, layer_idx: int, kv_quant: KVQuant | None = None
    ) -> None:
        super().__init__()
        p = llama4_params(config)
        self.layer_name = config.layer_name(layer_idx)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.use_rope = bool(p.no_rope_layers[layer_idx])
        self.qk_norm_eps = config.rms_norm_eps if (p.use_qk_norm and self.use_rope) else None
        # Temperature tuning applies to NoPE layers only.
        self.temperature = (
            (p.floor_scale, p.attn_scale)
            if (p.attn_temperature_tuning and not self.use_rope)
            else None
        )
        chunked = config.layer_type(layer_idx) == CHUNKED_ATTENTION
        self.attention_chunk_size = config.attention_chunk_size if chunked else None
        self.kv_quant = (
            kv_quant  # its cache's quantized/rotated format, given when built (None: plain)
        )
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_bias)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        freqs_cis: torch.Tensor,
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim)
        if self.use_rope:
            qk = Llama4Rotary.apply(qk, freqs_cis)
        if self.qk_norm_eps is not None:
            qk = l2_norm(qk, self.qk_norm_eps)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            scales = (
                torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            )
            q = (q * scales.view(t, 1, 1)).to(q.dtype)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        wait_for_kv_layer_load(self.layer_name)
        reshape_and_cache(k, v, key_cache, value_cache, md.slot_mapping, self.kv_quant)
        out = paged_attention(
            q,
            key_cache,
            value_cache,
            md,
            self.scale,
            kv_quant=self.kv_quant,
            attention_chunk_size=self.attention_chunk_size,
        )
        save_kv_layer(self.layer_name, kv_cache, md)
        return self.o_proj(out.reshape(t, self.q_size))


class Llama4Experts(nn.Module):
    """``num_local_experts`` SwiGLU experts stored as transformers does: ``gate_up_proj [E, H,
    2I]`` and ``down_proj [E, I, H]`` (right-multiplied). Only experts with routed tokens run."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = _param(num_experts, hidden, 2 * intermediate)
        self.down_proj = _param(num_experts, intermediate, hidden)

    def forward(
        self, x: torch.Tensor, scores: torch.Tensor, selected: torch.Tensor
    ) -> torch.Tensor:
        """Sum over each token's selected experts of ``expert(x · score)`` (the score scales the
        input, as in transformers), added in expert order. ``scores [T, E]``, ``selected [T, k]``."""
        out = torch.zeros_like(x)
        for e in selected.unique().tolist():
            rows = (selected == e).any(dim=1).nonzero().squeeze(1)
            h = x[rows] * scores[rows, e : e + 1]
            gate, up = (h @ self.gate_up_proj[e]).chunk(2, dim=-1)
            out.index_add_(0, rows, (up * F.silu(gate)) @ self.down_proj[e])
        return out


class Llama4MoE(nn.Module):
    """Routed experts (sigmoid of the top-k router logits) plus an always-on shared expert."""

    def __init__(self, config: ModelConfig, p: Llama4Params) -> None:
        super().__init__()
        self.top_k = p.num_experts_per_tok
        self.experts = Llama4Experts(
            p.num_local_experts, config.hidden_size, config.intermediate_size
        )
        self.router = Linear(config.hidden_size, p.num_local_experts)
        self.shared_expert = Llama4MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        top, selected = torch.topk(logits, self.top_k, dim=1)
        scores = torch.full_like(logits, float("-inf")).scatter_(1, selected, top)
        scores = torch.sigmoid(scores.float()).to(x.dtype)  # 0 for experts not selected
        return self.shared_expert(x).add_(self.experts(x, scores, selected))


class Llama4DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, kv_quant: KVQuant | None = None
    ) -> None:
        super().__init__()
        p = llama4_params(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Llama4Attention(config, layer_idx, kv_quant)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward: nn.Module = (
            Llama4MoE(config, p)
            if layer_idx in p.moe_layers
            else Llama4MLP(config.hidden_size, p.intermediate_size_mlp)
        )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        freqs_cis: torch.Tensor,
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block, residual fused into the norms as in ``LlamaDecoderLayer``."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, freqs_cis, kv_cache, md)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.feed_forward(x), residual


class Llama4Model(nn.Module):
    def __init__(self, config: ModelConfig, kv_quants: LayerKVQuants | None = None) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        quants = kv_quants or {}  # layer name → its cache's KVQuant
        self.layers = nn.ModuleList(
            Llama4DecoderLayer(config, i, quants.get(config.layer_name(i)))
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Llama4Rotary(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        md: AttentionMetadata | list[AttentionMetadata],
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        freqs_cis = self.rotary_emb.freqs_cis(positions)
        residual = None
        mds = md if isinstance(md, list) else [md] * len(self.layers)
        for layer, kv_cache, layer_md in zip(self.layers, kv_caches, mds, strict=True):
            x, residual = layer(x, residual, positions, freqs_cis, kv_cache, layer_md)
        x, _ = self.norm(x, residual)
        return x


class Llama4ForCausalLM(LlamaForCausalLM):
    """A Llama 4 text causal LM over a paged KV cache; same interface as ``LlamaForCausalLM``
    (its ``load_weights`` fuses q/k/v and the gate/up of dense layers and shared experts; the
    experts' ``[E, ...]`` tensors and the router load as they are)."""

    supports_kv_eviction = False  # its attention does not all go through paged_attention

    def __init__(self, config: ModelConfig, kv_quants: LayerKVQuants | None = None) -> None:
        nn.Module.__init__(self)  # not LlamaForCausalLM.__init__: a different body
        self.config = config
        self.model = Llama4Model(config, kv_quants)
        tied = config.tie_word_embeddings
        self.lm_head = (
            self.model.embed_tokens if tied else Embedding(config.vocab_size, config.hidden_size)
        )
