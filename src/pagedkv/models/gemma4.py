"""Gemma 4 (text) decoder over a paged KV cache: ``Gemma4ForCausalLM`` (model_type "gemma4_text").

Built on Gemma 2/3 (``gemma2.py``: sandwich norms, GELU-tanh MLP, scaled embeddings, final
logit soft cap, Llama's fused-weight loading). What Gemma 4 changes (transformers 5.24,
``models/gemma4/modeling_gemma4.py``):

* per-layer attention geometry: "full_attention" layers have heads of ``global_head_dim`` and,
  with ``attention_k_eq_v``, their own KV head count and no ``v_proj`` (V is the raw ``k_proj``
  output, taken before k_norm/RoPE). ``config.layer_head_dims`` / ``layer_num_kv_heads``;
* q, k and v RMS-normed per head (v without a weight); RMSNorm scales by ``w`` (not ``1 + w``)
  and normalises by ``pow(mean(x²) + eps, -0.5)`` as transformers does; attention scale 1.0;
* RoPE per layer type: sliding layers default RoPE at ``rope_local_theta``; full layers
  "proportional" RoPE, which rotates the first ``partial_rotary_factor·D/2`` frequency pairs
  of a ``D``-wide head (the other frequencies are 0: cos 1, sin 0);
* every layer's output is multiplied by its ``layer_scalar`` (a checkpoint buffer);
* per-layer embeddings (PLE, ``hidden_size_per_layer_input > 0``): a second token table and a
  projection of the embeddings give each layer a small input, gated into its residual stream;
* KV sharing (``num_kv_shared_layers``): the last layers read the KV cache of an earlier layer
  of their type (``config.kv_sharing_targets``) and write none; the runner hands such a layer
  its target's cache views and attention metadata. With ``use_double_wide_mlp`` their MLPs are
  twice as wide;
* MoE (``enable_moe_block``, gemma-4-26B-A4B): beside every layer's dense MLP a softmax-routed
  top-k MoE of GELU-tanh experts, fed the attention block's output (not the MLP's input norm).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.models.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from pagedkv.models.gemma2 import Gemma2ForCausalLM
from pagedkv.models.layers import Embedding, Linear, RotaryEmbedding, _param
from pagedkv.models.llama import KVCache
from pagedkv.ops.attention import paged_attention
from pagedkv.ops.cache import reshape_and_cache
from pagedkv.ops.forward_context import save_kv_layer, wait_for_kv_layer_load
from pagedkv.ops.kv_quant import KVQuant, LayerKVQuants
from pagedkv.ops.metadata import AttentionMetadata

# Multimodal checkpoints' towers and their projections into the text model.
_NOT_TEXT = (
    "model.vision_tower.",
    "model.audio_tower.",
    "model.embed_vision.",
    "model.embed_audio.",
)


def proportional_inv_freq(
    head_dim: int, theta: float, partial_rotary_factor: float
) -> torch.Tensor:
    """transformers' "proportional" RoPE frequencies ``[head_dim/2]``: the first
    ``int(factor·head_dim//2)`` as default RoPE over the whole ``head_dim``, then zeros."""
    angles = int(partial_rotary_factor * head_dim // 2)
    rotated = 1.0 / (
        theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim)
    )
    return torch.cat([rotated, torch.zeros(head_dim // 2 - angles)])


class Gemma4RMSNorm(nn.Module):
    """``x·pow(mean(x²)+eps, -0.5)·w`` in float32, cast back; ``scale=False``: no weight."""

    def __init__(self, dim: int, eps: float, scale: bool = True) -> None:
        super().__init__()
        self.weight = _param(dim) if scale else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (out if self.weight is None else out * self.weight.float()).to(x.dtype)


class Gemma4Attention(nn.Module):
    """Layer ``i``'s attention: its own head size and KV heads; q/k/v norms; scale 1.0. A KV-
    sharing layer has only q (and o) and attends over its target's cache without writing it
    (``kv_quant``: then its target's format, which it reads)."""

    def __init__(
        self, config: ModelConfig, layer_idx: int, kv_quant: KVQuant | None = None
    ) -> None:
        super().__init__()
        g = config.gemma4
        self.layer_name = config.layer_name(layer_idx)
        full = config.layer_type(layer_idx) == FULL_ATTENTION
        self.sliding_window = None if full else config.sliding_window
        self.shared = config.kv_sharing_target(layer_idx) is not None
        self.k_eq_v = g.attention_k_eq_v and full
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.layer_kv_heads(layer_idx)
        self.head_dim = config.layer_head_dim(layer_idx)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        n_kv = 0 if self.shared else (1 if self.k_eq_v else 2)
        self.kv_quant = (
            kv_quant  # its cache's quantized/rotated format, given when built (None: plain)
        )
        self.qkv_proj = Linear(config.hidden_size, self.q_size + n_kv * self.kv_size)
        self.o_proj = Linear(self.q_size, config.hidden_size)
        eps = config.rms_norm_eps
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps)
        if not self.shared:
            self.k_norm = Gemma4RMSNorm(self.head_dim, eps)
            self.v_norm = Gemma4RMSNorm(self.head_dim, eps, scale=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q = RotaryEmbedding.apply(
            self.q_norm(qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)), *rope
        )
        key_cache, value_cache = kv_cache
        if not self.shared:  # a sharing layer's K/V are already in its target's cache
            k_raw = qkv[:, self.q_size : self.q_size + self.kv_size].view(
                t, self.num_kv_heads, self.head_dim
            )
            v = (
                k_raw
                if self.k_eq_v
                else qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
            )
            k = RotaryEmbedding.apply(self.k_norm(k_raw), *rope)
            wait_for_kv_layer_load(self.layer_name)
            reshape_and_cache(
                k, self.v_norm(v), key_cache, value_cache, md.slot_mapping, self.kv_quant
            )
        out = paged_attention(
            q,
            key_cache,
            value_cache,
            md,
            1.0,
            sliding_window=self.sliding_window,
            kv_quant=self.kv_quant,
        )
        if not self.shared:
            save_kv_layer(self.layer_name, kv_cache, md)
        return self.o_proj(out.reshape(t, self.q_size))


class Gemma4MLP(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))``, gate/up fused, of the layer's width."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma4Router(nn.Module):
    """Softmax router over ``norm(x)·scale·h^-0.5`` (norm without weight); the top-k
    probabilities are renormalised to sum to 1, then scaled by ``per_expert_scale``."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float) -> None:
        super().__init__()
        self.norm = Gemma4RMSNorm(hidden, eps, scale=False)
        self.proj = Linear(hidden, num_experts)
        self.scale = _param(hidden)
        self.per_expert_scale = _param(num_experts)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k], experts [T, k])``."""
        h = self.norm(x) * self.scale * x.shape[-1] ** -0.5
        probs = torch.softmax(self.proj(h), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts


class Gemma4Experts(nn.Module):
    """GELU-tanh gated experts stored as transformers does (left-multiplied, like ``nn.Linear``):
    ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``. Only experts with routed tokens run;
    each output is scaled by its routing weight and added in expert order."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = _param(num_experts, 2 * intermediate, hidden)
        self.down_proj = _param(num_experts, hidden, intermediate)

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            rows, slot = (experts == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.gelu(gate, approximate="tanh") * up, self.down_proj[e])
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(out.dtype))
        return out


class Gemma4DecoderLayer(nn.Module):
    """Gemma 2's sandwich-norm block (with MoE: the dense MLP's and the experts' outputs each
    normed, summed, then post-normed), then the PLE gate (when configured), times ``layer_scalar``."""

    def __init__(
        self, config: ModelConfig, layer_idx: int, kv_quant: KVQuant | None = None
    ) -> None:
        super().__init__()
        g, h, eps = config.gemma4, config.hidden_size, config.rms_norm_eps
        self.layer_type = config.layer_type(layer_idx)
        self.input_layernorm = Gemma4RMSNorm(h, eps)
        self.self_attn = Gemma4Attention(config, layer_idx, kv_quant)
        self.post_attention_layernorm = Gemma4RMSNorm(h, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.mlp = Gemma4MLP(h, g.mlp_size(config.intermediate_size, self.self_attn.shared))
        self.post_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.moe = g.enable_moe_block
        if self.moe:  # a routed MoE beside the dense MLP, fed the residual stream
            self.router = Gemma4Router(h, g.num_experts, g.top_k_experts, eps)
            self.experts = Gemma4Experts(g.num_experts, h, g.moe_intermediate_size)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(h, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(h, eps)
        # A checkpoint buffer in transformers (initialised to 1): loaded when present.
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.ple = g.hidden_size_per_layer_input
        if self.ple:
            self.per_layer_input_gate = Linear(h, self.ple)
            self.per_layer_projection = Linear(self.ple, h)
            self.post_per_layer_input_norm = Gemma4RMSNorm(h, eps)

    def forward(
        self,
        x: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), rope, kv_cache, md)
        )
        ff = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe:
            moe = self.experts(self.pre_feedforward_layernorm_2(x), *self.router(x))
            ff = self.post_feedforward_layernorm_1(ff) + self.post_feedforward_layernorm_2(moe)
        x = x + self.post_feedforward_layernorm(ff)
        if self.ple:
            gate = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return x * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, config: ModelConfig, kv_quants: LayerKVQuants | None = None) -> None:
        super().__init__()
        g, h, n = config.gemma4, config.hidden_size, config.num_layers
        self.embed_tokens = Embedding(config.vocab_size, h)
        self.embed_scale = h**0.5
        quants = kv_quants or {}  # layer name → its cache's KVQuant
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(config, i, quants.get(config.layer_name(i))) for i in range(n)
        )
        self.norm = Gemma4RMSNorm(h, config.rms_norm_eps)
        self.ple = g.hidden_size_per_layer_input
        if self.ple:
            self.embed_tokens_per_layer = Embedding(g.vocab_size_per_layer_input, n * self.ple)
            self.per_layer_model_projection = Linear(h, n * self.ple)
            self.per_layer_projection_norm = Gemma4RMSNorm(self.ple, config.rms_norm_eps)
        # One table per layer type, each at that type's head size.
        self.rotary = nn.ModuleDict()
        for i in range(n):
            kind = config.layer_type(i)
            if kind in self.rotary:
                continue
            dim = config.layer_head_dim(i)
            if kind == SLIDING_ATTENTION:
                self.rotary[kind] = RotaryEmbedding(
                    dim, config.max_position_embeddings, config.rope_local_theta or 10_000.0, None
                )
            else:
                rope = RotaryEmbedding(dim, config.max_position_embeddings, config.rope_theta, None)
                if (config.rope_scaling or {}).get("rope_type") == "proportional":
                    rope.set_inv_freq(
                        proportional_inv_freq(dim, config.rope_theta, g.partial_rotary_factor)
                        / float(config.rope_scaling.get("factor", 1.0))
                    )
                self.rotary[kind] = rope

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """PLE ``[T, layers, ple]``: (norm(project(x)·h^-0.5) + table(ids)·sqrt(ple))·2^-0.5."""
        t, n = x.shape[0], len(self.layers)
        table = self.embed_tokens_per_layer(input_ids)
        table = (table * torch.tensor(self.ple**0.5, dtype=table.dtype)).view(t, n, self.ple)
        proj = self.per_layer_model_projection(x) * x.shape[-1] ** -0.5
        return (self.per_layer_projection_norm(proj.view(t, n, self.ple)) + table) * 2.0**-0.5

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        md: AttentionMetadata | list[AttentionMetadata],
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # HF rounds the scale to the dtype
        ple = self.per_layer_inputs(input_ids, x) if self.ple else None
        ropes = {kind: rope.cos_sin(positions) for kind, rope in self.rotary.items()}
        mds = md if isinstance(md, list) else [md] * len(self.layers)
        for i, (layer, kv_cache, layer_md) in enumerate(
            zip(self.layers, kv_caches, mds, strict=True)
        ):
            x = layer(
                x, None if ple is None else ple[:, i], ropes[layer.layer_type], kv_cache, layer_md
            )
        return self.norm(x)


class Gemma4ForCausalLM(Gemma2ForCausalLM):
    """A Gemma 4 text causal LM over a paged KV cache; same interface as ``LlamaForCausalLM``.

    Loads ``Gemma4ForCausalLM`` checkpoints and the language model of ``Gemma4ForConditionalGeneration``
    ones (``model.language_model.*``; vision/audio towers skipped). A KV-sharing layer's k/v
    weights, which released checkpoints may carry, are skipped as transformers does.
    """

    def __init__(self, config: ModelConfig, kv_quants: LayerKVQuants | None = None) -> None:
        if config.gemma4 is None:
            raise ValueError("Gemma4ForCausalLM needs a Gemma 4 config (config.gemma4)")
        g = config.gemma4
        if g.enable_moe_block and not (
            0 < g.top_k_experts <= g.num_experts and g.moe_intermediate_size > 0
        ):
            raise ValueError(
                f"Gemma 4 MoE needs 0 < top_k_experts ({g.top_k_experts}) <= num_experts "
                f"({g.num_experts}) and moe_intermediate_size > 0"
            )
        if config.attention_bias:
            raise NotImplementedError("Gemma 4 attention_bias=True is not supported")
        nn.Module.__init__(self)
        self.config = config
        self.model = Gemma4Model(config, kv_quants)
        tied = config.tie_word_embeddings
        self.lm_head = (
            self.model.embed_tokens if tied else Embedding(config.vocab_size, config.hidden_size)
        )

    # compute_logits: Gemma 2's (final soft cap), inherited.

    def _target(self, name: str, rows: int) -> tuple[str, int]:
        """Like Llama's, but q/k/v offsets are those of the tensor's own layer (layers differ)."""
        for fused, part, shard in self._STACKED:
            if part in name:
                if isinstance(shard, int):
                    return name.replace(part, fused), shard * rows
                a = self.model.layers[int(name.split(".")[2])].self_attn
                return name.replace(part, fused), {
                    "q": 0,
                    "k": a.q_size,
                    "v": a.q_size + a.kv_size,
                }[shard]
        return name, 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._text_weights(weights))

    def _text_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        shared_kv = {
            f"model.layers.{i}.self_attn.{p}."
            for i, layer in enumerate(self.model.layers)
            if layer.self_attn.shared
            for p in ("k_proj", "v_proj", "k_norm", "v_norm")
        }
        for name, w in weights:
            if name.startswith("model.language_model."):
                name = "model." + name.removeprefix("model.language_model.")
            elif name.startswith(_NOT_TEXT):
                continue
            if name.rpartition(".")[0] + "." in shared_kv:
                continue
            yield name, w

    def param_names(self) -> set[str]:
        """All parameters except ``layer_scalar`` (a buffer some checkpoints may omit: then 1)."""
        return {n for n in super().param_names() if not n.endswith(".layer_scalar")}
