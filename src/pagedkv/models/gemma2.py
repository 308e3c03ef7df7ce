"""Gemma 2 and Gemma 3 (text) decoders over a paged KV cache: interleaved sliding-window and
global layers.

What differs from Llama (``llama.py``, whose weight loading — fused q/k/v and gate/up, tied
head — this reuses by subclassing):

* attention scale ``query_pre_attn_scalar**-0.5`` (not ``head_dim**-0.5``) and a tanh soft cap
  ``c·tanh(s/c)`` on the scores (``attn_logit_softcapping``), passed to ``paged_attention``;
* even layers use a sliding window, odd layers are global (``layer_types`` from the config),
  so the engine runs two KV cache groups and frees blocks that left the window;
* RMSNorm scales by ``1 + weight``, with norms after attention and around the MLP as well as
  before attention (four per layer);
* GELU-tanh gated MLP, embeddings multiplied by ``sqrt(hidden_size)`` (rounded to the weight
  dtype, as transformers does), and a tanh soft cap on the LM head's logits
  (``final_logit_softcapping``).

Gemma 3 (``Gemma3ForCausalLM``, model_type "gemma3_text") is the same model plus an RMSNorm on
each q and k head before RoPE (``config.qk_norm``), RoPE theta ``rope_local_theta`` on the
sliding layers (the global theta and scaling elsewhere), one global layer in six by default,
and no attention soft cap (transformers 5.24 never applies one to Gemma 3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.models.config import SLIDING_ATTENTION, ModelConfig
from pagedkv.models.layers import Embedding, Linear, RotaryEmbedding, _param
from pagedkv.models.llama import KVCache, LlamaForCausalLM
from pagedkv.ops.attention import paged_attention
from pagedkv.ops.cache import reshape_and_cache
from pagedkv.ops.forward_context import save_kv_layer, wait_for_kv_layer_load
from pagedkv.ops.kv_quant import KVQuant, LayerKVQuants
from pagedkv.ops.metadata import AttentionMetadata


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap·tanh(x/cap)`` (in x's dtype, in transformers' order of operations); x if no cap."""
    return x if cap is None else torch.tanh(x / cap) * cap


class GemmaRMSNorm(nn.Module):
    """``x·rsqrt(mean(x²)+eps)·(1 + w)`` computed in float32, cast back (HF Gemma semantics:
    the stored weight is the offset from 1, zero-initialised)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = _param(hidden_size)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class Gemma2Attention(nn.Module):
    """GQA self-attention with Gemma's scale and score soft cap; paged cache write + read."""

    def __init__(
        self,
        config: ModelConfig,
        sliding_window: int | None,
        layer_name: str = "",
        kv_quant: KVQuant | None = None,
    ) -> None:
        super().__init__()
        self.layer_name = layer_name
        self.qk_norm = config.qk_norm
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.soft_cap = None if config.qk_norm else config.attn_logit_softcapping  # Gemma 3: none
        self.sliding_window = sliding_window
        self.kv_quant = (
            kv_quant  # its cache's quantized/rotated format, given when built (None: plain)
        )
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        if config.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim)
        if self.qk_norm:
            qk = torch.cat(
                [self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])], dim=1
            )
        qk = RotaryEmbedding.apply(qk, *rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
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
            sliding_window=self.sliding_window,
            logits_soft_cap=self.soft_cap,
            kv_quant=self.kv_quant,
        )
        save_kv_layer(self.layer_name, kv_cache, md)
        return self.o_proj(out.reshape(t, self.q_size))


class Gemma2MLP(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))`` with gate/up fused into one projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma2DecoderLayer(nn.Module):
    """Sandwich-norm block: ``h += post_attn(attn(in(h)))``; ``h += post_ff(mlp(pre_ff(h)))``."""

    def __init__(
        self, config: ModelConfig, layer_idx: int, kv_quant: KVQuant | None = None
    ) -> None:
        super().__init__()
        window = (
            config.sliding_window if config.layer_type(layer_idx) == SLIDING_ATTENTION else None
        )
        self.local_rope = window is not None and config.rope_local_theta is not None
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = Gemma2Attention(config, window, config.layer_name(layer_idx), kv_quant)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = Gemma2MLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), rope, kv_cache, md)
        )
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma2Model(nn.Module):
    def __init__(self, config: ModelConfig, kv_quants: LayerKVQuants | None = None) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        quants = kv_quants or {}  # layer name → its cache's KVQuant
        self.layers = nn.ModuleList(
            Gemma2DecoderLayer(config, i, quants.get(config.layer_name(i)))
            for i in range(config.num_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        # Gemma 3's sliding layers rotate with their own (unscaled) theta.
        self.rotary_emb_local = (
            None
            if config.rope_local_theta is None
            else RotaryEmbedding(
                config.head_dim, config.max_position_embeddings, config.rope_local_theta, None
            )
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        md: AttentionMetadata | list[AttentionMetadata],
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # HF rounds the scale to the dtype
        rope = self.rotary_emb.cos_sin(positions)
        local = rope if self.rotary_emb_local is None else self.rotary_emb_local.cos_sin(positions)
        mds = md if isinstance(md, list) else [md] * len(self.layers)
        for layer, kv_cache, layer_md in zip(self.layers, kv_caches, mds, strict=True):
            x = layer(x, local if layer.local_rope else rope, kv_cache, layer_md)
        return self.norm(x)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """A Gemma 2 or Gemma 3 (text) causal LM over a paged KV cache; same interface as ``LlamaForCausalLM``.

    ``compute_logits`` applies ``final_logit_softcapping`` to the head's float32 logits.
    The embeddings are tied to the head in every Gemma 2 checkpoint (``tie_word_embeddings``).
    """

    def __init__(self, config: ModelConfig, kv_quants: LayerKVQuants | None = None) -> None:
        nn.Module.__init__(self)  # not LlamaForCausalLM.__init__: a different body
        self.config = config
        self.model = Gemma2Model(config, kv_quants)
        tied = config.tie_word_embeddings
        self.lm_head = (
            self.model.embed_tokens if tied else Embedding(config.vocab_size, config.hidden_size)
        )

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(self.lm_head.project(hidden), self.config.final_logit_softcapping).float()
