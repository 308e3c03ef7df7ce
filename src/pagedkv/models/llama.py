"""Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2) over a paged KV cache.

The model sees one flat batch of ``T`` tokens from many sequences (prefill chunks and decode
tokens mixed) and touches the KV cache only through ``pagedkv.ops``: each attention layer
writes its new K/V with ``reshape_and_cache`` at ``attn_metadata.slot_mapping`` and reads all
K/V through the block table with ``paged_attention``.

For CPU speed q/k/v are one fused linear (``qkv_proj``) and gate/up another (``gate_up_proj``),
filled shard by shard by ``load_weights``; rope cos/sin rows are gathered once per forward.
Qwen2 is this model with ``attention_bias=True`` (q/k/v biases) and its own rope theta.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedkv.distributed.parallel_state import GroupCoordinator, ParallelContext
from pagedkv.models import layers as _layers
from pagedkv.models.config import SLIDING_ATTENTION, ModelConfig
from pagedkv.models.layers import (
    Linear,
    QSegment,
    QuantizedRows,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    rope_inv_freq,
    vocab_embedding,
)
from pagedkv.models.tp_sharding import local_model_config, shard_quantized, shard_weight
from pagedkv.ops import native, native_step
from pagedkv.ops.attention import paged_attention
from pagedkv.ops.cache import reshape_and_cache
from pagedkv.ops.dcp_attention import dcp_paged_attention
from pagedkv.ops.forward_context import save_kv_layer, wait_for_kv_layer_load
from pagedkv.ops.kv_quant import KVQuant, LayerKVQuants
from pagedkv.ops.metadata import AttentionMetadata
from pagedkv.ops.step_description import DecoderLayerDesc, DecoderStackDesc

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    """GQA self-attention: fused qkv, rope on q/k, paged cache write + read, output projection."""

    def __init__(
        self,
        config: ModelConfig,
        sliding_window: int | None,
        layer_name: str = "",
        kv_quant: KVQuant | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.layer_name = layer_name  # the KV cache groups' name for it (KV connector hooks)
        # Tensor parallelism: ``config`` is this rank's (its heads); o_proj is row-parallel, so
        # its partial sums are all-reduced over the TP group.
        self.parallel = parallel
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.sliding_window = sliding_window
        self.kv_quant = (
            kv_quant  # its cache's quantized/rotated format, given when built (None: plain)
        )
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k heads sit side by side in qkv: rotate them in one pass.
        qk = RotaryEmbedding.apply(
            qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim), *rope
        )
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        wait_for_kv_layer_load(self.layer_name)
        reshape_and_cache(k, v, key_cache, value_cache, md.slot_mapping, self.kv_quant)
        p = self.parallel
        if p is not None and p.dcp_size > 1:  # this rank holds 1/dcp of the tokens
            out = dcp_paged_attention(
                q,
                k,
                v,
                key_cache,
                value_cache,
                md,
                self.scale,
                p.dcp_group,
                p.layout.dcp_head_counts,
                self.kv_quant,
            )
        else:
            out = paged_attention(
                q,
                key_cache,
                value_cache,
                md,
                self.scale,
                sliding_window=self.sliding_window,
                kv_quant=self.kv_quant,
            )
        save_kv_layer(self.layer_name, kv_cache, md)
        out = self.o_proj(out.reshape(t, self.q_size))
        return out if p is None else p.tp_group.all_reduce(out)


class SwiGLUMLP(nn.Module):
    """SwiGLU MLP with fused gate/up: ``down(silu(gate(x)) * up(x))`` (Llama's MLP; also the
    dense layers and shared experts of DeepSeek and Llama 4)."""

    def __init__(
        self, hidden: int, intermediate: int, tp_group: GroupCoordinator | None = None
    ) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate)
        self.down_proj = Linear(intermediate, hidden)
        self.act = SiluAndMul()
        # Tensor parallelism: ``intermediate`` is this rank's rows; down_proj is row-parallel.
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act(self.gate_up_proj(x)))
        return out if self.tp_group is None else self.tp_group.all_reduce(out)


class LlamaMLP(SwiGLUMLP):
    """The MLP of a Llama-family layer, sized by the config."""

    def __init__(self, config: ModelConfig, tp_group: GroupCoordinator | None = None) -> None:
        super().__init__(config.hidden_size, config.intermediate_size, tp_group)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        kv_quant: KVQuant | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        window = (
            config.sliding_window if config.layer_type(layer_idx) == SLIDING_ATTENTION else None
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(
            config, window, config.layer_name(layer_idx), kv_quant, parallel
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, parallel.tp_group if parallel is not None else None)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block. ``x`` is the previous layer's output and ``residual`` the stream
        before it (None for the first layer); returns the same pair for the next layer."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, kv_cache, md)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def step_description(self) -> DecoderLayerDesc:
        """This layer for the native decode step (``ops/step_description.py``)."""
        attn, mlp = self.self_attn, self.mlp
        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        return DecoderLayerDesc(
            input_norm=n1.weight,
            input_eps=n1.eps,
            post_norm=n2.weight,
            post_eps=n2.eps,
            qkv=attn.qkv_proj.step_description(),
            o=attn.o_proj.step_description(),
            gate_up=mlp.gate_up_proj.step_description(),
            down=mlp.down_proj.step_description(),
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            scale=attn.scale,
            sliding_window=attn.sliding_window,
            kv_quant=attn.kv_quant,
        )


class LlamaModel(nn.Module):
    parallel: ParallelContext | None = None
    q8_activations: bool = False  # the GGUF q8 mode (LlamaForCausalLM.set_q8_activations)

    def __init__(
        self,
        config: ModelConfig,
        kv_quants: LayerKVQuants | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, parallel)
        quants = kv_quants or {}  # layer name → its cache's KVQuant
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, quants.get(config.layer_name(i)), parallel)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        md: AttentionMetadata | list[AttentionMetadata],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``inputs_embeds`` ([T, hidden], a vision-language model's: image rows placed):
        used instead of embedding ``input_ids``."""
        if (
            inputs_embeds is None
            and input_ids.shape[0] <= native_step.CHUNKED_ROWS
            and type(self) is LlamaModel
            and self.parallel is None  # the native step has no all-reduce between layers
        ):
            # A small decode-only step: every layer in one native call where it applies.
            hidden = native_step.decode_step(
                self,
                input_ids,
                positions,
                kv_caches,
                md,
                _layers.NATIVE_GEMV_MAX_ROWS,
                _layers.NATIVE_GEMV_MAX_ROWS_KQUANT,
            )
            if hidden is not None:
                return hidden
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary_emb.cos_sin(positions)
        residual = None
        mds = md if isinstance(md, list) else [md] * len(self.layers)
        for layer, kv_cache, layer_md in zip(self.layers, kv_caches, mds, strict=True):
            x, residual = layer(x, residual, rope, kv_cache, layer_md)
        x, _ = self.norm(x, residual)
        return x

    def native_step_description(self) -> DecoderStackDesc:
        """The stack for the native decode step (``ops.step_description.NativeStepModel``): the
        model's own tensors, read by ``native_step.decode_step`` in ``forward``."""
        return DecoderStackDesc(
            embed=self.embed_tokens.weight,
            rope_cos_sin=self.rotary_emb.cos_sin_cache,
            layers=[layer.step_description() for layer in self.layers],
            final_norm=self.norm.weight,
            final_eps=self.norm.eps,
            q8_activations=self.q8_activations,
        )


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over a paged KV cache.

    ``forward(input_ids [T] int64, positions [T] int64, kv_caches, attn_metadata) -> [T, hidden]``
    where ``attn_metadata`` is one ``AttentionMetadata`` for all layers or a list with one per
    layer (hybrid models: each layer gets its KV cache group's block tables), and
    ``kv_caches[i] = (key_cache, value_cache)`` of layer ``i``, each
    ``[num_blocks, block_size, num_kv_heads, head_dim]``; ``compute_logits(hidden [N, hidden])``
    returns float32 ``[N, vocab]``. Both run under ``torch.inference_mode``.

    ``kv_quants`` (every model class takes it): the quantized/rotated format of each attention
    layer's cache by layer name (``ops.kv_quant.LayerKVQuants``; absent: a plain cache), which
    the layer keeps for its cache writes and reads. The engine builds it from the KV cache specs.
    """

    # Token eviction (`engine.kv_eviction`): every attention layer goes through
    # `paged_attention`, where SnapKV observes the queries.
    supports_kv_eviction = True

    # Tensor parallelism (``parallel``): this class's own flag, not inherited by subclasses
    # (``registry.tensor_parallel_architectures``).
    supports_tensor_parallel = True
    parallel: ParallelContext | None = None  # subclasses that build their own layers: none

    # (fused parameter, checkpoint parameter, shard id) as in vLLM's stacked_params_mapping.
    _STACKED = (
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", 0),
        (".gate_up_proj.", ".up_proj.", 1),
    )

    def __init__(
        self,
        config: ModelConfig,
        kv_quants: LayerKVQuants | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        # Tensor parallelism: the layers are built for this rank's heads and MLP rows; the
        # embedding and LM head hold its vocabulary rows (``parallel.layout``).
        self.parallel = parallel
        local = config if parallel is None else local_model_config(config, parallel.layout)
        self.model = LlamaModel(local, kv_quants, parallel)
        tied = config.tie_word_embeddings
        self.lm_head = (
            self.model.embed_tokens
            if tied
            else vocab_embedding(config.vocab_size, config.hidden_size, parallel)
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata | list[AttentionMetadata],
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.project(hidden).float()
        # Tensor parallelism: this rank's vocabulary columns, then every rank's.
        return logits if self.parallel is None else self.lm_head.gather_logits(logits)

    # ---- weights -------------------------------------------------------------------------
    def _shard(self, shard: str | int, rows: int) -> tuple[int, int]:
        """Row range ``(start, size)`` of one checkpoint tensor inside its fused parameter."""
        if isinstance(shard, int):  # gate (0) / up (1): halves of gate_up_proj
            return shard * rows, rows
        a = self.model.layers[0].self_attn
        return {
            "q": (0, a.q_size),
            "k": (a.q_size, a.kv_size),
            "v": (a.q_size + a.kv_size, a.kv_size),
        }[shard]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy ``(hf_name, tensor)`` pairs into the parameters (casting to their dtype), fusing
        q/k/v and gate/up. Returns the names of the parameters now fully written (a fused one
        counts once all its shards arrived); raises ``ValueError`` for a name the model does not
        have or a shape mismatch.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        rows_written: dict[str, int] = {}
        for name, w in weights:
            if self.parallel is not None:
                w = self._shard_checkpoint_tensor(name, w)
            if name == "model.rotary_emb.freq_factors":  # llama.cpp's per-frequency rope divisors
                rope = self.model.rotary_emb
                rope.set_inv_freq(rope_inv_freq(rope.head_dim, rope.theta, None) / w.float())
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some checkpoints store the tied copy too
            size = w.shape[0] if w.dim() else 1
            target, start = self._target(name, size)
            param = _param_of(params, target, name)
            _copy(param.narrow(0, start, size) if target != name else param, w, name)
            rows_written[target] = rows_written.get(target, 0) + size
        loaded = {
            n
            for n, rows in rows_written.items()
            if rows == (params[n].shape[0] if params[n].dim() else 1)
        }
        if self.config.tie_word_embeddings and "model.embed_tokens.weight" in loaded:
            loaded.add("lm_head.weight")
        return loaded

    def _shard_checkpoint_tensor(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name`` (`models.tp_sharding` rules); model
        classes with other projections override it."""
        assert self.parallel is not None
        head_dim = self.model.layers[0].self_attn.head_dim
        return shard_weight(name, w, self.parallel.layout, head_dim)

    def _target(self, name: str, rows: int) -> tuple[str, int]:
        """``(parameter name, first row)`` where checkpoint tensor ``name`` lands."""
        for fused, part, shard in self._STACKED:
            if part in name:
                return name.replace(part, fused), self._shard(shard, rows)[0]
        return name, 0

    def load_quantized(self, qweights: Iterable[tuple[str, int, torch.Tensor]]) -> int:
        """Attach ggml rows ``(hf_name, qtype, rows [out, bytes])`` (see ``iter_gguf_quantized``)
        to the matching Linear/Embedding layers for the native GEMV, placing shards like
        :meth:`load_weights`. A layer gets them only when every one of its rows arrived (in any
        mix of kernel types: each run of one type becomes a segment); otherwise it keeps BLAS.
        Returns the layers equipped.
        """
        shards: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
        parallel = getattr(self, "parallel", None)
        layout = parallel.layout if parallel is not None else None
        for name, qtype, rows in qweights:
            if layout is not None:
                bw = native.block_weights(qtype)
                head_dim = self.model.layers[0].self_attn.head_dim
                rows = shard_quantized(
                    name, rows, layout, head_dim, bw, native.row_bytes(qtype, bw)
                )
                if rows is None:
                    continue  # a column split would cut a ggml block: the layer keeps BLAS
            target, start = self._target(name, rows.shape[0])
            shards.setdefault(target, []).append((start, qtype, rows))
        modules = dict(self.named_modules())
        equipped = 0
        for target, parts in shards.items():
            mod = modules.get(target.removesuffix(".weight"))
            if not isinstance(mod, QuantizedRows) or not target.endswith(".weight"):
                continue
            parts.sort(key=lambda p: p[0])
            segments: list[QSegment] = []
            end = 0
            for start, qtype, rows in parts:
                if start != end:
                    break  # a gap: some rows are in a type the kernel lacks
                if (
                    segments
                    and segments[-1][2] == qtype
                    and segments[-1][3].shape[1] == rows.shape[1]
                ):
                    s0, _, _, prev = segments.pop()
                    segments.append((s0, start + rows.shape[0], qtype, torch.cat([prev, rows])))
                else:
                    segments.append((start, start + rows.shape[0], qtype, rows))
                end = start + rows.shape[0]
            if end == mod.weight.shape[0] and segments:
                mod.set_qsegments(segments)
                equipped += 1
        return equipped

    def set_q8_activations(self, on: bool) -> int:
        """The GGUF q8 mode (``gguf_activations="q8"``): small-batch steps quantize each
        linear's input to 8-bit blocks for the layers holding ggml rows (see
        ``ops/csrc/gemv_q8.c``), the native step included. Returns the layers it reaches."""
        reached = 0
        for mod in self.modules():
            if isinstance(mod, QuantizedRows) and mod.qsegments:
                mod.q8_activations = on
                reached += 1
        self.model.q8_activations = on
        return reached

    def param_names(self) -> set[str]:
        """Every parameter name ``load_weights`` must write for the model to be complete."""
        return {n for n, _ in self.named_parameters(remove_duplicate=False)}


def _param_of(params: dict[str, nn.Parameter], target: str, name: str) -> nn.Parameter:
    if target not in params:
        raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
    return params[target]


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"{name}: checkpoint shape {tuple(src.shape)} != parameter shape {tuple(dst.shape)}"
        )
    dst.copy_(src)
