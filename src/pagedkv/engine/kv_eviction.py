"""Which requests may evict tokens, and with which policy (`core.token_eviction`).

A request's policy is its own (``SamplingParams.kv_eviction``) or the engine's
(``EngineConfig.kv_eviction``). The engine refuses one, with a ValueError naming the reason
and nothing queued, where the parts it relies on are missing: one full-attention KV cache
group (no sliding-window, chunked, Mamba or MLA layers), a model whose every attention layer
goes through ``ops.attention.paged_attention`` (``supports_kv_eviction``: SnapKV scores the
queries there), no KV connector (tiers and transfers address blocks by token position), no
decode context parallelism, one sample per request; ``positions="cache"`` also needs an
unquantized, unrotated cache and the model's rotary embedding (keys are re-rotated in place).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedkv.core.specs import FullAttentionSpec, KVQuantMode, MLAAttentionSpec
from pagedkv.core.token_eviction import KVEvictionConfig


def unsupported_reason(engine: Any) -> str | None:
    """Why this engine cannot evict tokens at all, or None."""
    groups = engine.kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec
    if (
        len(groups) != 1
        or not isinstance(spec, FullAttentionSpec)
        or isinstance(spec, MLAAttentionSpec)
    ):
        return "token eviction needs a model whose layers are all full (non-MLA) attention"
    if not getattr(engine.model, "supports_kv_eviction", False):
        return f"token eviction is not supported for {type(engine.model).__name__}"
    if engine.connector is not None:
        return "token eviction cannot be combined with a KV connector or offload tiers"
    if engine.config.decode_context_parallel_size > 1:
        return "token eviction cannot be combined with decode context parallelism"
    if getattr(spec, "kv_quant_mode", KVQuantMode.NONE).is_kivi:
        return "token eviction cannot be combined with a KIVI cache (its residual is per position)"
    return None


def resolve(engine: Any, params: Any) -> KVEvictionConfig | None:
    """The policy of a request with sampling ``params`` on ``engine`` (None: keeps every
    token). Raises ValueError when the engine cannot run it."""
    value = params.kv_eviction if params.kv_eviction is not None else engine.config.kv_eviction
    ev = KVEvictionConfig.from_value(value)
    if ev is None:
        return None
    mc = engine.model_config
    layers = sum(1 for i in range(mc.num_layers) if mc.owns_kv_cache(i))
    ev = dataclasses.replace(ev, num_layers=layers)
    why = unsupported_reason(engine)
    if why is None and params.n > 1:
        why = "token eviction supports one sample per request (n=1)"
    if why is None and ev.positions == "cache":
        spec = engine.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        quantized = getattr(spec, "kv_quant_mode", KVQuantMode.NONE) is not KVQuantMode.NONE
        if quantized or getattr(spec, "kv_rotation", None) is not None:
            why = "positions='cache' re-rotates keys in place: it needs an unquantized cache"
        elif engine.runner.rotary_embedding() is None:
            why = f"positions='cache' needs a RoPE model; {type(engine.model).__name__} is not"
    if why is not None:
        raise ValueError(f"kv_eviction {ev.policy}: {why}")
    return ev
