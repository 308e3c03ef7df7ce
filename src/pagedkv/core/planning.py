"""Capacity planning: bytes → blocks → tokens → concurrent requests (pure functions).

The seed's estimate (§10.1):

    C_tokens ≈ (M_HBM − M_weights − M_runtime − M_headroom) / M_KV/token

``plan_device_memory`` reports each term; the block-level functions then turn the KV budget
into an exact pool size.

Null block accounting (explicit everywhere): a pool of ``num_blocks`` blocks reserves block 0
as the null block, so ``num_blocks − 1`` are usable. ``num_blocks_from_memory`` returns the
pool size (null block included); every capacity number here (max tokens, concurrency, "fits")
counts usable blocks only. So "a request fits" means ``blocks_per_request ≤ num_blocks − 1``,
which equals vLLM's rule of planning against memory minus one block.

Functions take the KV cache groups (``list[KVCacheGroupSpec]``) or, for convenience, the
per-layer specs (``dict[layer_name, KVCacheSpec]``), which are grouped first.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.core.layout import DEFAULT_KV_CACHE_LAYOUT, KVCacheLayout
from pagedkv.core.specs import (
    KIVI_SINK_ENTRIES,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    UniformTypeKVCacheSpecs,
    get_kv_cache_groups,
)
from pagedkv.core.units import GiB, MiB, cdiv

GroupsOrSpecs = list[KVCacheGroupSpec] | dict[str, KVCacheSpec]


def as_groups(x: GroupsOrSpecs) -> list[KVCacheGroupSpec]:
    """Groups as given, or grouped from per-layer specs."""
    return get_kv_cache_groups(x) if isinstance(x, dict) else list(x)


def bytes_per_block(groups: GroupsOrSpecs) -> int:
    """Bytes of one pool block: the largest group's ``layers × page`` (groups alias bytes; a
    uniform-type group's page is already the sum over its layers)."""
    gs = as_groups(groups)
    return max((g.page_size_bytes for g in gs), default=0)


def kv_bytes_per_token(groups: GroupsOrSpecs) -> int:
    """KV bytes one token writes, summed over all attention layers (unpadded, no window)."""
    return sum(g.bytes_per_token for g in as_groups(groups))


def kivi_residual_bytes(groups: GroupsOrSpecs) -> int:
    """Bytes one request's KIVI residual takes over every layer (0 without KIVI layers): the
    engine reserves this much per ``max_num_seqs`` row outside the pool."""
    return sum(
        getattr(g.kv_cache_spec, "kivi_residual_bytes", 0) * len(g.layer_names)
        for g in as_groups(groups)
    )


def kivi_sink_store_bytes(groups: GroupsOrSpecs) -> int:
    """Bytes of the runner's KIVI sink store over every layer (0 without KIVI layers):
    ``KIVI_SINK_ENTRIES`` first blocks' sinks, reserved outside the pool once."""
    per = sum(
        getattr(g.kv_cache_spec, "kivi_sink_bytes", 0) * len(g.layer_names)
        for g in as_groups(groups)
    )
    return KIVI_SINK_ENTRIES * per


def kivi_unsupported(groups: GroupsOrSpecs) -> str | None:
    """Why these groups cannot hold a KIVI cache (None: they can, or none is KIVI): the
    residual and the block coding assume one group of plain causal attention layers."""
    gs = as_groups(groups)
    specs = [s for g in gs for s in _layer_specs(g.kv_cache_spec)]
    modes = [getattr(s, "kv_quant_mode", None) for s in specs]
    if not any(m is not None and m.is_kivi for m in modes):
        return None
    spec = gs[0].kv_cache_spec
    plain = (
        len(gs) == 1
        and isinstance(spec, FullAttentionSpec)
        and not isinstance(spec, MLAAttentionSpec)
        and spec.sliding_window is None
        and spec.attention_chunk_size is None
    )
    return None if plain else "a KIVI cache needs a model whose layers are all plain full attention"


def _layer_specs(spec: KVCacheSpec) -> list[KVCacheSpec]:
    return (
        list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
    )


def num_blocks_from_memory(available_bytes: int, groups: GroupsOrSpecs) -> int:
    """Pool size (null block included) that ``available_bytes`` holds.

    An attention-free model (no groups) still gets 1 block: the null block.
    """
    bpb = bytes_per_block(groups)
    if bpb == 0:
        return 1
    return max(int(available_bytes) // bpb, 0)


def blocks_per_request(
    groups: GroupsOrSpecs, max_model_len: int, max_num_batched_tokens: int = 0
) -> int:
    """Pool blocks one request of ``max_model_len`` tokens can hold at once, over all groups."""
    return sum(
        cdiv(
            g.kv_cache_spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens),
            g.kv_cache_spec.page_size_bytes,
        )
        for g in as_groups(groups)
    )


def get_max_concurrency(
    num_blocks: int, groups: GroupsOrSpecs, max_model_len: int, max_num_batched_tokens: int = 0
) -> float:
    """How many max-length requests the usable blocks (``num_blocks − 1``) hold at once."""
    need = blocks_per_request(groups, max_model_len, max_num_batched_tokens)
    usable = max(num_blocks - 1, 0)
    return usable / need if need else float("inf")


def get_kv_cache_capacity(
    num_blocks: int, groups: GroupsOrSpecs, max_model_len: int, max_num_batched_tokens: int = 0
) -> tuple[int, float]:
    """(tokens, concurrency) as vLLM reports them: ``int(concurrency × max_model_len)``."""
    conc = get_max_concurrency(num_blocks, groups, max_model_len, max_num_batched_tokens)
    return int(conc * max_model_len), conc


def max_num_tokens(
    num_blocks: int, groups: GroupsOrSpecs, max_model_len: int, max_num_batched_tokens: int = 0
) -> int:
    """Token slots in the cache.

    One full-attention group: exactly ``(num_blocks − 1) × block_size``. Hybrid/windowed
    models have no single answer; we report vLLM's ``concurrency × max_model_len``.
    """
    gs = as_groups(groups)
    if len(gs) == 1 and type(gs[0].kv_cache_spec) is FullAttentionSpec:
        return max(num_blocks - 1, 0) * gs[0].kv_cache_spec.block_size
    return get_kv_cache_capacity(num_blocks, gs, max_model_len, max_num_batched_tokens)[0]


def _fits(
    groups: list[KVCacheGroupSpec], usable_blocks: int, max_model_len: int, mnbt: int
) -> bool:
    return blocks_per_request(groups, max_model_len, mnbt) <= usable_blocks


def estimate_max_model_len(
    groups: GroupsOrSpecs, available_bytes: int, max_model_len: int, max_num_batched_tokens: int = 0
) -> int:
    """Largest length in ``[1, max_model_len]`` whose one request fits; 0 if even 1 doesn't.

    Binary search; valid because blocks per request never decrease with length.
    """
    gs = as_groups(groups)
    usable = num_blocks_from_memory(available_bytes, gs) - 1
    if not _fits(gs, usable, 1, max_num_batched_tokens):
        return 0
    lo, hi = 1, max_model_len  # invariant: lo fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits(gs, usable, mid, max_num_batched_tokens):
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_enough_kv_cache_memory(
    groups: GroupsOrSpecs, available_bytes: int, max_model_len: int, max_num_batched_tokens: int = 0
) -> None:
    """Raise ValueError unless one request of ``max_model_len`` tokens fits in the pool.

    The message names the GiB needed (request blocks + the null block) and the estimated
    maximum model length that would fit.
    """
    if available_bytes <= 0:
        raise ValueError(
            "No available memory for the cache blocks. Try increasing the memory budget "
            "(--memory / --device-memory) or lowering --headroom / weight memory."
        )
    gs = as_groups(groups)
    usable = num_blocks_from_memory(available_bytes, gs) - 1
    if _fits(gs, usable, max_model_len, max_num_batched_tokens):
        return
    need = (blocks_per_request(gs, max_model_len, max_num_batched_tokens) + 1) * bytes_per_block(gs)
    est = estimate_max_model_len(gs, available_bytes, max_model_len, max_num_batched_tokens)
    raise ValueError(
        f"To serve at least one request with the model's max seq len ({max_model_len}), "
        f"{need / GiB:.2f} GiB KV cache is needed, which is larger than the available KV cache "
        f"memory ({available_bytes / GiB:.2f} GiB). Based on the available memory, the "
        f"estimated maximum model length is {est}. Try increasing the memory budget or "
        f"decreasing max_model_len (--context)."
    )


def make_kv_cache_config(
    groups: GroupsOrSpecs,
    available_bytes: int,
    max_model_len: int | None = None,
    max_num_batched_tokens: int = 0,
    num_blocks_override: int | None = None,
    layout: KVCacheLayout | str = DEFAULT_KV_CACHE_LAYOUT,
) -> KVCacheConfig:
    """Plan the pool: ``num_blocks = available // bytes_per_block`` (or the override).

    With ``max_model_len`` it first checks that one max-length request fits (ValueError).
    """
    gs = as_groups(groups)
    if max_model_len is not None and num_blocks_override is None:
        check_enough_kv_cache_memory(gs, available_bytes, max_model_len, max_num_batched_tokens)
    n = (
        num_blocks_override
        if num_blocks_override is not None
        else num_blocks_from_memory(available_bytes, gs)
    )
    return KVCacheConfig(
        num_blocks=n,
        kv_cache_groups=gs,
        bytes_per_block=bytes_per_block(gs),
        layout=KVCacheLayout.parse(layout),
    )


# ---------------------------------------------------------------- device memory (C_tokens)


DEFAULT_RUNTIME_OVERHEAD_BYTES = 512 * MiB


def estimate_runtime_bytes(
    *,
    hidden_size: int,
    intermediate_size: int,
    num_attention_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
    activation_dtype_bytes: int = 2,
    fixed_overhead_bytes: int = DEFAULT_RUNTIME_OVERHEAD_BYTES,
) -> int:
    """A rough M_runtime: peak activations of one step + sampling buffers + fixed overhead.

    * activations: per scheduled token, the tensors alive at once in one layer — residual and
      normed hidden (2·h), q/k/v and attention output ((2·Hq + 2·Hkv)·d), MLP gate/up/act
      (3·I) — in the activation dtype, for ``max_num_batched_tokens`` tokens;
    * sampling: fp32 logits and probabilities for ``max_num_seqs`` rows of the vocabulary;
    * fixed: runtime context, allocator slack, workspaces (default 512 MiB, a guess; measure
      and pass ``--runtime-memory`` when it matters).
    """
    per_token = (
        2 * hidden_size
        + (2 * num_attention_heads + 2 * num_kv_heads) * head_dim
        + 3 * intermediate_size
    ) * activation_dtype_bytes
    activations = per_token * max_num_batched_tokens
    sampling = 2 * 4 * vocab_size * max_num_seqs
    return activations + sampling + fixed_overhead_bytes


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """The terms of C_tokens ≈ (M_HBM − M_weights − M_runtime − M_headroom) / M_KV/token."""

    device_memory: int  # M_HBM
    weights: int  # M_weights = num_params × weight dtype bytes
    runtime: int  # M_runtime (estimate or measured)
    headroom: int  # M_headroom = fraction × M_HBM

    @property
    def kv_cache(self) -> int:
        """Bytes left for KV pages (negative when the model alone does not fit)."""
        return self.device_memory - self.weights - self.runtime - self.headroom

    def c_tokens(self, kv_bytes_per_token: int) -> int:
        """The seed's token capacity (before block rounding and the null block)."""
        return max(self.kv_cache, 0) // kv_bytes_per_token if kv_bytes_per_token else 0

    def terms(self) -> list[tuple[str, int]]:
        return [
            ("M_HBM (device memory)", self.device_memory),
            ("- M_weights", self.weights),
            ("- M_runtime", self.runtime),
            ("- M_headroom", self.headroom),
            ("= KV cache", self.kv_cache),
        ]


def plan_device_memory(
    device_memory: int,
    num_params: int,
    weight_dtype_bytes: float,
    runtime_bytes: int,
    headroom_fraction: float = 0.1,
) -> MemoryBreakdown:
    """Split ``device_memory`` into weights, runtime, headroom and what is left for KV."""
    if not 0.0 <= headroom_fraction < 1.0:
        raise ValueError(f"headroom_fraction must be in [0, 1), got {headroom_fraction}")
    return MemoryBreakdown(
        device_memory=int(device_memory),
        weights=int(round(num_params * weight_dtype_bytes)),
        runtime=int(runtime_bytes),
        headroom=int(device_memory * headroom_fraction),
    )
