"""Bamba (IBM's Mamba-2 / attention hybrid, model_type "bamba") over a paged KV cache.

Layers in ``attn_layer_indices`` are GQA attention layers (Llama's, except that RoPE rotates
only the first ``partial_rotary_factor`` of each head: Bamba hard-codes 0.5); every other
layer is a Mamba-2 mixer (``BambaMixer`` in transformers 5.24)::

    in_proj(x) -> [gate | xBC | dt];  xBC = silu(causal_conv1d(xBC));  xBC -> [x | B | C]
    dt = clamp(softplus(dt + dt_bias), time_step_limit);  A = -exp(A_log)
    y = SSD(x, dt, A, B, C) + D·x;  out_proj(gated_rms_norm(y, gate))

Each layer is ``h += mixer_or_attn(input_layernorm(h)); h += feed_forward(pre_ff_layernorm(h))``
with a SwiGLU MLP, then ``final_layernorm`` and an untied (by default) LM head.

**Mamba state in the paged cache.** A mixer layer's cache is ``(conv_states [num_blocks,
conv_dim, d_conv-1], ssm_states [num_blocks, heads, head_dim, d_state])``: views of the raw
pages of its KV-cache layer slot (see ``ops.mamba.mamba_state_views``), one state per block id.
Its KV cache group's block table is position-indexed (``MambaManager``): block ``i`` holds the
state after the last token of ``[i·bs, (i+1)·bs)`` that was computed. For a sequence computing
positions ``[s, e)`` the mixer starts from the state in the block of position ``s - 1`` (zeros
at ``s = 0``; vLLM copies it into the new block first, the "precopy": reading it in place is
the same thing), splits ``[s, e)`` at the end of every block that has a page (a checkpoint the
manager keeps), and stores the state reached at each split into that block. The null block
(id 0) marks a boundary whose state is not kept. One-token steps (decodes) run first, batched;
then the other sequences in batch order, so a checkpoint written in this step (by a decode, or
by a sequence earlier in the batch) is already there when a later sequence that hit it in the
prefix cache reads it: same-step reuse is safe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.distributed.parallel_state import ParallelContext
from pagedkv.models.config import MambaParams, ModelConfig
from pagedkv.models.layers import (
    Linear,
    RMSNorm,
    RotaryEmbedding,
    _param,
    vocab_embedding,
)
from pagedkv.models.llama import KVCache, LlamaForCausalLM, LlamaMLP
from pagedkv.models.tp_sharding import local_model_config, shard_weight
from pagedkv.ops.attention import paged_attention
from pagedkv.ops.cache import reshape_and_cache
from pagedkv.ops.forward_context import save_kv_layer, wait_for_kv_layer_load
from pagedkv.ops.kv_quant import KVQuant, LayerKVQuants
from pagedkv.ops.mamba import (
    causal_conv1d,
    causal_conv1d_update,
    gated_rms_norm,
    selective_state_update,
    ssd_chunk_scan,
)
from pagedkv.ops.metadata import AttentionMetadata


class BambaAttention(nn.Module):
    """GQA attention with partial RoPE (the first ``rotary_dim`` dims of each head; none when
    ``rope`` is False: NoPE) and scale ``scale`` (default head_dim^-0.5)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_name: str = "",
        scale: float | None = None,
        rope: bool = True,
        kv_quant: KVQuant | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.layer_name = layer_name
        self.parallel = parallel  # TP: this rank's heads; o_proj all-reduced
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5 if scale is None else scale
        self.rotary_dim = int(self.head_dim * config.mamba.partial_rotary_factor) if rope else 0  # type: ignore[union-attr]
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
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim)
        rd = self.rotary_dim
        if rd:
            qk = torch.cat([RotaryEmbedding.apply(qk[..., :rd], *rope), qk[..., rd:]], dim=-1)  # type: ignore[misc]
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        wait_for_kv_layer_load(self.layer_name)
        reshape_and_cache(k, v, key_cache, value_cache, md.slot_mapping, self.kv_quant)
        out = paged_attention(q, key_cache, value_cache, md, self.scale, kv_quant=self.kv_quant)
        save_kv_layer(self.layer_name, kv_cache, md)
        out = self.o_proj(out.reshape(t, self.q_size))
        return out if self.parallel is None else self.parallel.tp_group.all_reduce(out)


class BambaMixer(nn.Module):
    """The Mamba-2 mixer over paged states (see the module docstring for the state rules)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_name: str = "",
        parallel: ParallelContext | None = None,
        full: MambaParams | None = None,
    ) -> None:
        """``config.mamba`` holds this rank's heads and groups under tensor parallelism
        (``parallel``; ``full``: the whole model's mixer), whose out_proj is all-reduced. The
        gated norm normalises each of the model's ``n_groups`` groups: where a group's channels
        span several ranks (groups replicated past ``n_groups`` ranks), its sum of squares is
        all-reduced first."""
        super().__init__()
        m = config.mamba
        assert m is not None
        full = full or m
        self.parallel = parallel
        self.norm_group_size = full.intermediate_size // full.n_groups
        # The model-wide index of this rank's (one) group when it holds only part of it.
        self.split_group: int | None = None
        if parallel is not None and parallel.layout.mamba is not None:
            lay = parallel.layout.mamba
            if m.intermediate_size < m.n_groups * self.norm_group_size:
                self.split_group = lay.kv_start
        self.num_groups_total = full.n_groups
        self.layer_name = layer_name
        self.num_heads, self.head_dim = m.n_heads, m.d_head
        self.n_groups, self.d_state = m.n_groups, m.d_state
        self.intermediate_size, self.conv_dim = m.intermediate_size, m.conv_dim
        self.chunk_size = m.chunk_size
        self.time_step_limit = m.time_step_limit
        self.eps = config.rms_norm_eps
        self.in_proj = Linear(
            config.hidden_size,
            self.intermediate_size + self.conv_dim + self.num_heads,
            bias=m.proj_bias,
        )
        self.conv1d = nn.Module()
        self.conv1d.weight = _param(self.conv_dim, 1, m.d_conv)
        self.conv1d.bias = _param(self.conv_dim) if m.conv_bias else None
        self.dt_bias = _param(self.num_heads)
        self.A_log = _param(self.num_heads)
        self.D = _param(self.num_heads)
        self.norm = nn.Module()
        self.norm.weight = _param(self.intermediate_size)
        self.out_proj = Linear(self.intermediate_size, config.hidden_size, bias=m.proj_bias)

    def _dt(self, dt: torch.Tensor) -> torch.Tensor:
        lo, hi = self.time_step_limit
        return torch.clamp(F.softplus(dt.float() + self.dt_bias.float()), min=lo, max=hi)

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gn = self.n_groups * self.d_state
        x, B, C = xbc.split([self.intermediate_size, gn, gn], dim=-1)
        t = xbc.shape[0]
        return (
            x.reshape(t, self.num_heads, self.head_dim),
            B.reshape(t, self.n_groups, self.d_state),
            C.reshape(t, self.n_groups, self.d_state),
        )

    def forward(
        self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], md: AttentionMetadata
    ) -> torch.Tensor:
        conv_states, ssm_states = cache
        proj = self.in_proj(x)
        gate, xbc_all, dt_all = proj.split(
            [self.intermediate_size, self.conv_dim, self.num_heads], dim=-1
        )
        A = -torch.exp(self.A_log.float())
        w = self.conv1d.weight[:, 0]
        y = torch.empty(x.shape[0], self.intermediate_size, dtype=torch.float32, device=x.device)
        bs, qsl = md.block_size, md.query_start_loc_cpu
        table = md.block_table.tolist()
        decode: list[tuple[int, int, int]] = []  # (token, source block, destination block)
        prefill: list[int] = []
        for r, end in enumerate(md.seq_lens_cpu):
            if qsl[r + 1] - qsl[r] == 1 and end > 1:
                decode.append((qsl[r], table[r][(end - 2) // bs], table[r][(end - 1) // bs]))
            else:
                prefill.append(r)
        if decode:  # first: a prefill later in the batch may read a checkpoint a decode completes
            self._decode(decode, xbc_all, dt_all, A, w, conv_states, ssm_states, y)
        for r in prefill:
            a, b, end = qsl[r], qsl[r + 1], md.seq_lens_cpu[r]
            start = end - (b - a)
            row = table[r]
            conv = ssm = None
            if start > 0:  # resume from the state after position start - 1
                src = row[(start - 1) // bs]
                conv, ssm = conv_states[src].clone(), ssm_states[src].clone()
            # Split at the end of every block that keeps a state, and at the end.
            cuts = [p for p in range((start // bs + 1) * bs, end, bs) if row[p // bs - 1] != 0] + [
                end
            ]
            u = start
            for v in cuts:
                i, j = a + u - start, a + v - start
                xbc, conv = causal_conv1d(xbc_all[i:j], conv, w, self.conv1d.bias)
                xs, B, C = self._split(F.silu(xbc))
                out, ssm = ssd_chunk_scan(
                    xs, self._dt(dt_all[i:j]), A, B, C, self.chunk_size, self.D, ssm
                )
                y[i:j] = out.reshape(v - u, -1)
                dst = row[(v - 1) // bs]
                if dst != 0:
                    conv_states[dst].copy_(conv)
                    ssm_states[dst].copy_(ssm)
                u = v
        if self.split_group is None:
            y = gated_rms_norm(y, gate, self.norm.weight, self.norm_group_size, self.eps)
        else:
            y = self._split_group_norm(y, gate)
        out = self.out_proj(y.to(x.dtype))
        return out if self.parallel is None else self.parallel.tp_group.all_reduce(out)

    def _split_group_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """`gated_rms_norm` of a group whose channels other ranks hold part of: its sum of
        squares is summed over the TP group (each rank adds its part in its group's column)."""
        assert self.parallel is not None and self.split_group is not None
        h = y.float() * F.silu(gate.float())
        ss = torch.zeros(h.shape[0], self.num_groups_total, dtype=torch.float32, device=h.device)
        ss[:, self.split_group] = h.pow(2).sum(-1)
        total = self.parallel.tp_group.all_reduce(ss)[:, self.split_group : self.split_group + 1]
        h = h * torch.rsqrt(total / self.norm_group_size + self.eps)
        return self.norm.weight * h.to(y.dtype)

    def _decode(
        self,
        decode: list[tuple[int, int, int]],
        xbc_all: torch.Tensor,
        dt_all: torch.Tensor,
        A: torch.Tensor,
        w: torch.Tensor,
        conv_states: torch.Tensor,
        ssm_states: torch.Tensor,
        y: torch.Tensor,
    ) -> None:
        """One token for each of ``decode``'s sequences, batched: gather their states from the
        source blocks, run the conv and the recurrent step, store into the destination blocks
        (the same block while inside it, the next one when crossing a boundary)."""
        dev = y.device
        tok, src, dst = (torch.tensor(v, dtype=torch.long, device=dev) for v in zip(*decode))
        xbc, conv = causal_conv1d_update(xbc_all[tok], conv_states[src], w, self.conv1d.bias)
        xs, B, C = self._split(F.silu(xbc))
        ssm = ssm_states[src]  # a gathered copy, updated in place
        y[tok] = selective_state_update(ssm, xs, self._dt(dt_all[tok]), A, B, C, self.D).reshape(
            len(decode), -1
        )
        conv_states.index_copy_(0, dst, conv.to(conv_states.dtype))
        ssm_states.index_copy_(0, dst, ssm)


class BambaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        kv_quant: KVQuant | None = None,
        parallel: ParallelContext | None = None,
        full: MambaParams | None = None,
    ) -> None:
        super().__init__()
        name = config.layer_name(layer_idx)
        self.is_mamba = config.mamba.is_mamba_layer(layer_idx)  # type: ignore[union-attr]
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.is_mamba:
            self.mamba = BambaMixer(config, name, parallel, full)
        else:
            self.self_attn = BambaAttention(config, name, kv_quant=kv_quant, parallel=parallel)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = LlamaMLP(config, parallel.tp_group if parallel is not None else None)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.mamba(h, kv_cache, md) if self.is_mamba else self.self_attn(h, rope, kv_cache, md)
        x = x + h
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class BambaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        kv_quants: LayerKVQuants | None = None,
        parallel: ParallelContext | None = None,
        full: MambaParams | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, parallel)
        quants = kv_quants or {}  # layer name → its cache's KVQuant
        self.layers = nn.ModuleList(
            BambaDecoderLayer(config, i, quants.get(config.layer_name(i)), parallel, full)
            for i in range(config.num_layers)
        )
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        rotary_dim = int(config.head_dim * config.mamba.partial_rotary_factor)  # type: ignore[union-attr]
        self.rotary_emb = RotaryEmbedding(
            rotary_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )

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
        for layer, kv_cache, layer_md in zip(self.layers, kv_caches, mds, strict=True):
            x = layer(x, rope, kv_cache, layer_md)
        return self.final_layernorm(x)


class BambaForCausalLM(LlamaForCausalLM):
    """Bamba over a paged KV cache; the interface and weight loading of ``LlamaForCausalLM``
    (q/k/v and gate/up fused; the mixer's tensors load under their HF names).
    ``kv_caches[i]`` is a (K, V) pair for an attention layer and a (conv, ssm) state pair for
    a mixer layer."""

    supports_kv_eviction = False  # its attention does not all go through paged_attention

    # Tensor parallelism: attention and MLP as Llama's; each mixer keeps its rank's SSM heads
    # (in_proj's gate/x/dt rows, conv channels, dt_bias/A_log/D, norm) and B/C groups.
    supports_tensor_parallel = True

    def __init__(
        self,
        config: ModelConfig,
        kv_quants: LayerKVQuants | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        nn.Module.__init__(self)
        if config.mamba is None:
            raise ValueError("a Bamba model needs its Mamba parameters (config.mamba)")
        self.config = config
        self.parallel = parallel
        local = config if parallel is None else local_model_config(config, parallel.layout)
        self.model = BambaModel(local, kv_quants, parallel, config.mamba)
        tied = config.tie_word_embeddings
        self.lm_head = (
            self.model.embed_tokens
            if tied
            else vocab_embedding(config.vocab_size, config.hidden_size, parallel)
        )

    def _shard_checkpoint_tensor(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint tensor: the mixers' by SSM heads and B/C groups,
        the rest by Llama's rules."""
        assert self.parallel is not None
        lay = self.parallel.layout
        if ".mamba." not in name:
            return shard_weight(name, w, lay, self.config.head_dim)
        m, ms = self.config.mamba, lay.mamba
        assert m is not None and ms is not None
        dh, ds, inner, g = m.d_head, m.d_state, m.intermediate_size, m.n_groups
        heads = (ms.q_start * dh, ms.q_end * dh)
        groups = (ms.kv_start * ds, ms.kv_end * ds)
        leaf = name.rsplit(".", 2)[-2:]

        def rows(*spans: tuple[int, int]) -> torch.Tensor:
            return torch.cat([w[a:b] for a, b in spans])

        if leaf[0] == "in_proj":  # [gate | x | B | C | dt]
            x0, b0, c0, t0 = inner, 2 * inner, 2 * inner + g * ds, 2 * inner + 2 * g * ds
            return rows(
                heads,
                (x0 + heads[0], x0 + heads[1]),
                (b0 + groups[0], b0 + groups[1]),
                (c0 + groups[0], c0 + groups[1]),
                (t0 + ms.q_start, t0 + ms.q_end),
            )
        if leaf[0] == "conv1d":  # channels [x | B | C]
            b0, c0 = inner, inner + g * ds
            return rows(heads, (b0 + groups[0], b0 + groups[1]), (c0 + groups[0], c0 + groups[1]))
        if leaf[1] in ("dt_bias", "A_log", "D"):
            return w[ms.q_start : ms.q_end]
        if leaf[0] == "norm":
            return w[heads[0] : heads[1]]
        if leaf[0] == "out_proj":
            if leaf[1] == "bias":
                return w if lay.rank == 0 else torch.zeros_like(w)
            return w[:, heads[0] : heads[1]]
        return w

    def _shard(self, shard: str | int, rows: int) -> tuple[int, int]:
        if isinstance(shard, int):
            return shard * rows, rows
        a = next(layer.self_attn for layer in self.model.layers if not layer.is_mamba)
        return {
            "q": (0, a.q_size),
            "k": (a.q_size, a.kv_size),
            "v": (a.q_size + a.kv_size, a.kv_size),
        }[shard]
