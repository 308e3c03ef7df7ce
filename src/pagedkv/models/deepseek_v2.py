"""DeepSeek-V2 / V3 decoders (transformers' ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM``,
model_type "deepseek_v2" / "deepseek_v3") over a paged MLA latent cache.

What differs from Llama (``llama.py``, whose weight loading — gate/up fusion, untied head — this
reuses by subclassing):

* **Multi-head latent attention** (:mod:`pagedkv.ops.mla_attention`): the KV cache holds one
  row per token, ``[kv_c | k_pe]`` (the normed latent and the rotated shared RoPE key; one
  "head" of ``kv_lora_rank + qk_rope_head_dim``, vLLM's ``MLAAttentionSpec``). Prefill expands
  it into per-head K/V with ``kv_b_proj``; decode folds ``kv_b_proj`` into the query and the
  output (absorbed MQA). Queries come from a low-rank ``q_a_proj → q_a_layernorm → q_b_proj``
  (or a plain ``q_proj`` when ``q_lora_rank`` is None, e.g. V2-Lite).
* **RoPE on the rope part only**, in DeepSeek's pair convention (``MLAParams.rope_style``):
  V2 rotates pairs ``(2i, 2i+1)`` as complex numbers; V3 rotates the same pairs on even/odd
  slices and writes them de-interleaved (``rope_interleave``; rotate-half without it). YaRN
  scaling (DeepSeek-V3's published config) changes the frequencies, scales cos/sin by its
  attention factor and the softmax scale by ``mscale²``.
* **DeepSeekMoE** on layers ``>= first_k_dense_replace``: routed SwiGLU experts (V3: sigmoid
  scores, bias-corrected group-limited top-k, renormalised; V2: softmax, greedy or
  group-limited top-k) scaled by ``routed_scaling_factor``, plus always-on shared experts.
  Experts are stored as transformers holds them in memory (``gate_up_proj [E, 2I, H]``,
  ``down_proj [E, H, I]``) and loaded from per-expert checkpoint tensors
  (``experts.{e}.gate_proj/up_proj/down_proj``, what ``save_pretrained`` and the released
  checkpoints write) or the fused ones.

Float32 results follow transformers' order of operations (router in float32, experts added in
expert order, shared experts last), so greedy decoding is token-exact against it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.core.parallel import RankLayout, split_range
from pagedkv.distributed.parallel_state import ParallelContext
from pagedkv.models.config import ModelConfig
from pagedkv.models.layers import Linear, RMSNorm, _param, vocab_embedding
from pagedkv.models.llama import KVCache, LlamaForCausalLM, SwiGLUMLP, _copy
from pagedkv.models.mla_config import MLAParams
from pagedkv.models.tp_sharding import local_model_config, shard_weight
from pagedkv.ops.dcp_attention import dcp_paged_attention
from pagedkv.ops.forward_context import save_kv_layer, wait_for_kv_layer_load
from pagedkv.ops.kv_quant import KVQuant, LayerKVQuants
from pagedkv.ops.metadata import AttentionMetadata
from pagedkv.ops.mla_attention import concat_and_cache_mla, mla_attention, mla_decode_metadata

# transformers' DeepseekV*RMSNorm default: q_a_layernorm / kv_a_layernorm are built without the
# config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def mla_params(config: ModelConfig) -> MLAParams:
    if config.mla is None:
        raise ValueError(
            f"{config.name or config.architecture}: a DeepSeek model needs ModelConfig.mla"
        )
    return config.mla


def yarn_inv_freq(
    dim: int, theta: float, rs: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies ``[dim/2]`` and the cos/sin attention factor, computed as
    transformers' ``_compute_yarn_parameters`` does (float32)."""
    factor = rs.get("factor") or max_positions / rs["original_max_position_embeddings"]
    orig = rs["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attention_factor = (
            float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
        )
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


class DeepseekMLP(SwiGLUMLP):
    """The dense layers and shared experts: a SwiGLU MLP with fused gate/up."""


class DeepseekRotary(nn.Module):
    """RoPE of the ``qk_rope_head_dim`` part in DeepSeek's conventions (see module docstring).

    ``cos_sin(positions)`` gathers ``(cos, sin)`` rows ``[T, 1, R/2]`` (float32, times YaRN's
    attention factor) once per forward; ``apply(x [T, H, R], cos, sin)`` rotates."""

    def __init__(self, config: ModelConfig, p: MLAParams) -> None:
        super().__init__()
        dim, rs = p.qk_rope_head_dim, config.rope_scaling or {}
        kind = rs.get("rope_type", rs.get("type", "default"))
        if kind == "default":
            inv_freq, factor = (
                1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)),
                1.0,
            )
        elif kind == "yarn":
            inv_freq, factor = yarn_inv_freq(
                dim, config.rope_theta, rs, config.max_position_embeddings
            )
        else:
            raise NotImplementedError(
                f"rope scaling type {kind!r} is not supported for DeepSeek models"
            )
        self.style = p.rope_style
        self.attention_factor = factor
        freqs = torch.outer(
            torch.arange(config.max_position_embeddings, dtype=torch.float32), inv_freq
        )
        self.register_buffer("freqs", freqs, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.freqs[positions].unsqueeze(1)
        if (
            self.style == "complex"
        ):  # transformers: polar(1, f) * factor, as real and imaginary parts
            c = torch.polar(torch.ones_like(f), f) * self.attention_factor
            return c.real, c.imag
        return f.cos() * self.attention_factor, f.sin() * self.attention_factor

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.style == "complex":  # (x0 + i·x1)(cos + i·sin), pairs stay interleaved
            xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(xc * torch.complex(cos, sin)).flatten(-2).to(x.dtype)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if self.style == "interleave":
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DeepseekMLAAttention(nn.Module):
    """MLA: low-rank q (or q_proj), the latent + rope key written to the paged cache, expanded
    prefill / absorbed decode (:func:`~pagedkv.ops.mla_attention.mla_attention`), o_proj.
    ``kv_quant`` must be None: a ValueError otherwise (the latent cache is always plain)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        kv_quant: KVQuant | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        if kv_quant is not None:
            raise ValueError(
                "kv_cache_dtype: the MLA latent cache is not quantized or rotated yet; "
                "use 'auto', 'float32', 'bfloat16' or 'float16'"
            )
        super().__init__()
        # Tensor parallelism: ``config`` holds this rank's heads (the latent cache is the same
        # on every rank); o_proj is row-parallel and all-reduced.
        self.parallel = parallel
        p = mla_params(config)
        h, hidden = config.num_attention_heads, config.hidden_size
        self.layer_name = config.layer_name(layer_idx)  # the KV cache groups' name for it
        self.num_heads, self.p = h, p
        self.scale = p.softmax_scale(config.rope_scaling)
        bias = config.attention_bias
        if p.q_lora_rank is None:
            self.q_proj = Linear(hidden, h * p.qk_head_dim)
        else:
            self.q_a_proj = Linear(hidden, p.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(p.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(p.q_lora_rank, h * p.qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(hidden, p.latent_size, bias=bias)
        self.kv_a_layernorm = RMSNorm(p.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(p.kv_lora_rank, h * (p.qk_nope_head_dim + p.v_head_dim))
        self.o_proj = Linear(h * p.v_head_dim, hidden, bias=bias)

    @property
    def kv_quant(self) -> None:
        """Always None: the latent cache is plain (a format is refused when the layer is built)."""
        return None

    def forward(
        self,
        x: torch.Tensor,
        rotary: DeepseekRotary,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        md: AttentionMetadata,
        decode_md: AttentionMetadata | None,
    ) -> torch.Tensor:
        t, h, p = x.shape[0], self.num_heads, self.p
        q = (
            self.q_proj(x)
            if p.q_lora_rank is None
            else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        )
        q = q.view(t, h, p.qk_head_dim)
        q_nope, q_pe = q[..., : p.qk_nope_head_dim], q[..., p.qk_nope_head_dim :]
        kv = self.kv_a_proj_with_mqa(x)
        kv_c = self.kv_a_layernorm(kv[:, : p.kv_lora_rank])
        # q's rope part and the one shared rope key rotate together: [T, H + 1, R].
        qk_pe = rotary.apply(torch.cat([q_pe, kv[:, None, p.kv_lora_rank :]], dim=1), *rope)
        latent_cache = kv_cache[0]  # [NB, BS, 1, L + R]; kv_cache[1] is an empty V view
        wait_for_kv_layer_load(self.layer_name)
        concat_and_cache_mla(kv_c, qk_pe[:, h], latent_cache, md.slot_mapping)
        par = self.parallel
        if par is not None and par.dcp_size > 1:
            out = self._dcp_attention(q_nope, qk_pe, kv_c, latent_cache, md)
        else:
            out = mla_attention(
                q_nope, qk_pe[:, :h], latent_cache, md, self.kv_b_proj.weight, self.scale, decode_md
            )
        save_kv_layer(self.layer_name, kv_cache, md)
        out = self.o_proj(out.reshape(t, h * p.v_head_dim))
        return out if par is None else par.tp_group.all_reduce(out)

    def _dcp_attention(
        self,
        q_nope: torch.Tensor,
        qk_pe: torch.Tensor,
        kv_c: torch.Tensor,
        latent_cache: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        """Decode context parallelism over the latent cache, absorbed for every token: queries
        ``[q_nope·W_UK | q_pe]`` attend the latent rows (one KV head, values their ``kv_c``
        columns) of this rank's share of the tokens, merged across the DCP group by LSE
        (`dcp_paged_attention`), then ``W_UV`` per head. Returns ``[T, H, V]``."""
        p, h = self.p, self.num_heads
        assert self.parallel is not None
        w = self.kv_b_proj.weight.view(h, p.qk_nope_head_dim + p.v_head_dim, p.kv_lora_rank)
        w_uk, w_uv = w[:, : p.qk_nope_head_dim].float(), w[:, p.qk_nope_head_dim :].float()
        ql = torch.einsum("thp,hpl->thl", q_nope.float(), w_uk)
        query = torch.cat([ql, qk_pe[:, :h].float()], dim=-1).to(q_nope.dtype)
        key = torch.cat([kv_c, qk_pe[:, h]], dim=-1)[:, None]
        out = dcp_paged_attention(
            query,
            key,
            kv_c[:, None],
            latent_cache,
            latent_cache[..., : p.kv_lora_rank],
            md,
            self.scale,
            self.parallel.dcp_group,
            self.parallel.layout.dcp_head_counts,
        )
        return torch.einsum("thl,hvl->thv", out.float(), w_uv).to(q_nope.dtype)


class DeepseekRouter(nn.Module):
    """Top-k expert choice (transformers' ``DeepseekV3TopkRouter`` / ``DeepseekV2TopkRouter``),
    in float32 whatever the model dtype. Returns ``(weights [T, k] float32, experts [T, k])``."""

    def __init__(self, hidden: int, p: MLAParams) -> None:
        super().__init__()
        self.p = p
        self.weight = nn.Parameter(
            torch.empty(p.n_routed_experts, hidden, dtype=torch.float32), requires_grad=False
        )
        if p.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(p.n_routed_experts, dtype=torch.float32), requires_grad=False
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p, e = self.p, self.p.n_routed_experts
        logits = F.linear(x.float(), self.weight.float())
        if p.topk_method == "noaux_tc":
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            group_scores = choice.view(-1, p.n_group, e // p.n_group).topk(2, dim=-1)[0].sum(dim=-1)
            choice = choice.masked_fill(~self._group_mask(group_scores), float("-inf"))
            experts = torch.topk(choice, k=p.num_experts_per_tok, dim=-1, sorted=False)[1]
            weights = scores.gather(1, experts)
            if p.norm_topk_prob:
                weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        else:  # V2 (transformers applies no renormalisation here)
            scores = logits.softmax(dim=-1, dtype=torch.float32)
            if p.topk_method == "group_limited_greedy":
                group_scores = scores.view(-1, p.n_group, e // p.n_group).max(dim=-1).values
                scores = scores.masked_fill(~self._group_mask(group_scores), 0.0)
            weights, experts = torch.topk(scores, k=p.num_experts_per_tok, dim=-1, sorted=False)
        return weights * p.routed_scaling_factor, experts

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """``[T, E]`` bool: the experts of each token's best ``topk_group`` groups."""
        p = self.p
        group_idx = torch.topk(group_scores, k=p.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        return mask.repeat_interleave(p.n_routed_experts // p.n_group, dim=1)


class DeepseekMoE(nn.Module):
    """Routed experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``: only experts with
    routed tokens run, added in expert order) plus the shared experts."""

    def __init__(self, hidden: int, p: MLAParams, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        # Tensor parallelism: every expert (and the shared experts) keeps this rank's rows of its
        # intermediate; routed and shared outputs are partial sums, all-reduced once.
        self.tp_group = parallel.tp_group if parallel is not None else None
        i0, i1 = _moe_range(p, parallel.layout if parallel is not None else None)
        s0, s1 = _shared_range(p, parallel.layout if parallel is not None else None)
        self.gate = DeepseekRouter(hidden, p)
        self.gate_up_proj = _param(p.n_routed_experts, 2 * (i1 - i0), hidden)
        self.down_proj = _param(p.n_routed_experts, hidden, i1 - i0)
        self.shared_experts = DeepseekMLP(hidden, s1 - s0) if p.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():  # ascending, as transformers' loop
            tok, pos = (experts == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[tok, pos, None]
            out[tok] += y.to(out.dtype)  # a token picks an expert once: no repeated index
        out = out if self.shared_experts is None else out + self.shared_experts(x)
        return out if self.tp_group is None else self.tp_group.all_reduce(out)


def _moe_range(p: MLAParams, layout: RankLayout | None) -> tuple[int, int]:
    """This rank's rows of each routed expert's intermediate (all of them without TP)."""
    n = p.moe_intermediate_size
    return (0, n) if layout is None else split_range(n, layout.tp_size, layout.rank)


def _shared_range(p: MLAParams, layout: RankLayout | None) -> tuple[int, int]:
    """This rank's rows of the shared experts' fused intermediate."""
    n = p.moe_intermediate_size * p.n_shared_experts
    return (0, n) if layout is None else split_range(n, layout.tp_size, layout.rank)


class DeepseekDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        kv_quant: KVQuant | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        p = mla_params(config)
        tp_group = parallel.tp_group if parallel is not None else None
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DeepseekMLAAttention(config, layer_idx, kv_quant, parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = (
            DeepseekMoE(config.hidden_size, p, parallel)
            if p.is_moe_layer(layer_idx)
            else DeepseekMLP(config.hidden_size, config.intermediate_size, tp_group)
        )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: DeepseekRotary,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        md: AttentionMetadata,
        decode_md: AttentionMetadata | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block, residual fused into the norms as in ``LlamaDecoderLayer``."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rotary, rope, kv_cache, md, decode_md)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DeepseekV2Model(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        kv_quants: LayerKVQuants | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, parallel)
        quants = kv_quants or {}  # layer name → its cache's KVQuant
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, i, quants.get(config.layer_name(i)), parallel)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = DeepseekRotary(config, mla_params(config))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        md: AttentionMetadata | list[AttentionMetadata],
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb.cos_sin(positions)
        mds = md if isinstance(md, list) else [md] * len(self.layers)
        decode_mds = {
            id(m): mla_decode_metadata(m) for m in mds
        }  # once per step, shared by the layers
        residual = None
        for layer, kv_cache, layer_md in zip(self.layers, kv_caches, mds, strict=True):
            x, residual = layer(
                x, residual, self.rotary_emb, rope, kv_cache, layer_md, decode_mds[id(layer_md)]
            )
        x, _ = self.norm(x, residual)
        return x


_EXPERT = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_EXPERTS = re.compile(r"(.*\.mlp)\.experts\.(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """A DeepSeek-V2/V3 causal LM over a paged MLA cache; same interface as ``LlamaForCausalLM``.

    ``kv_caches[i] = (latent_cache [NB, BS, 1, L + R], empty V view)`` of layer ``i``.
    ``load_weights`` fuses gate/up of dense MLPs and shared experts, stacks per-expert tensors
    into the ``[E, ...]`` expert parameters, and skips layers past ``num_layers`` (the
    multi-token-prediction layer of the released checkpoints, which transformers ignores too).
    """

    supports_kv_eviction = False  # its attention does not all go through paged_attention

    _STACKED = ((".gate_up_proj.", ".gate_proj.", 0), (".gate_up_proj.", ".up_proj.", 1))
    # Tensor parallelism (``parallel``): heads split as Llama's, the latent cache replicated on
    # every rank (one "KV head"), so decode context parallelism can shard its tokens.
    supports_tensor_parallel = True

    def __init__(
        self,
        config: ModelConfig,
        kv_quants: LayerKVQuants | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        nn.Module.__init__(self)  # not LlamaForCausalLM.__init__: a different body
        self.config = config
        self.parallel = parallel
        local = config if parallel is None else local_model_config(config, parallel.layout)
        self.model = DeepseekV2Model(local, kv_quants, parallel)
        tied = config.tie_word_embeddings
        self.lm_head = (
            self.model.embed_tokens
            if tied
            else vocab_embedding(config.vocab_size, config.hidden_size, parallel)
        )

    def _shard_checkpoint_tensor(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """This rank's part of a non-expert tensor: MLA's per-head rows (``q_proj``/
        ``q_b_proj`` by ``qk_head_dim``, ``kv_b_proj`` by ``qk_nope + v``, ``o_proj`` columns
        by ``v_head_dim``), the shared experts' intermediate, else Llama's rules."""
        assert self.parallel is not None
        lay, p = self.parallel.layout, mla_params(self.config)
        q0, q1 = lay.heads.q_start, lay.heads.q_end
        per_head = {
            "q_proj": (0, p.qk_head_dim),
            "q_b_proj": (0, p.qk_head_dim),
            "kv_b_proj": (0, p.qk_nope_head_dim + p.v_head_dim),
        }
        leaf = name.split(".")
        proj = leaf[-2] if len(leaf) >= 2 else ""
        if ".self_attn." in name and proj in per_head:
            _, size = per_head[proj]
            return w.narrow(0, q0 * size, (q1 - q0) * size)
        if ".self_attn.o_proj." in name:
            if leaf[-1] == "bias":
                return w if lay.rank == 0 else torch.zeros_like(w)
            return w.narrow(1, q0 * p.v_head_dim, (q1 - q0) * p.v_head_dim)
        if ".self_attn." in name:
            return w  # q_a_proj, kv_a_proj_with_mqa, the latent norms: replicated
        if ".shared_experts." in name:
            s0, s1 = _shared_range(p, lay)
            if proj == "down_proj":
                return w.narrow(1, s0, s1 - s0)
            return w.narrow(0, s0, s1 - s0)
        if name.endswith((".mlp.gate.weight", ".e_score_correction_bias")):
            return w  # the router: replicated, every rank routes alike
        return shard_weight(name, w, lay, 0)

    def _shard_expert(self, part: str, fused: bool, w: torch.Tensor) -> torch.Tensor:
        """This rank's rows (gate/up) or columns (down) of routed expert weights."""
        if self.parallel is None:
            return w
        i0, i1 = _moe_range(mla_params(self.config), self.parallel.layout)
        n = mla_params(self.config).moe_intermediate_size
        if part == "down_proj":
            return w.narrow(-1, i0, i1 - i0)
        if fused:  # [E, 2I, H]: this rank's gate rows, then its up rows
            return torch.cat([w[:, i0:i1], w[:, n + i0 : n + i1]], dim=1)
        return w.narrow(0, i0, i1 - i0)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        written: dict[str, int] = {}  # expert parameter -> elements written so far

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            """Everything but experts (and skipped layers), for Llama's loader; experts land here."""
            for name, w in weights:
                layer = _LAYER.match(name)
                if layer is not None and int(layer.group(1)) >= self.config.num_layers:
                    continue
                one, fused = _EXPERT.match(name), _FUSED_EXPERTS.match(name)
                if one is None and fused is None:
                    yield name, w
                    continue
                m = one or fused
                part = m.group(3) if one else m.group(2)
                target = f"{m.group(1)}.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}"
                if target not in params or (
                    one is not None and int(m.group(2)) >= params[target].shape[0]
                ):
                    raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
                dst = params[target]
                w = self._shard_expert(part, one is None, w)
                if (
                    one is not None
                ):  # one expert's gate, up or down: its slice of the stacked tensor
                    dst = dst[int(m.group(2))]
                    if part != "down_proj":
                        dst = dst.chunk(2)[part == "up_proj"]
                _copy(dst, w, name)
                written[target] = written.get(target, 0) + dst.numel()

        loaded = super().load_weights(others())
        return loaded | {t for t, n in written.items() if n == params[t].numel()}
