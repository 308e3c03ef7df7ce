"""Which KV cache memory each layer of the model reads and writes (vLLM's
``bind_kv_cache`` / ``initialize_kv_cache_tensors``).

One buffer holds the whole cache. Two shapes of it:

* **Layer slots** (every model but the one below): the buffer is ``[L, B, H, N, C]`` in the
  configured layout with one slot per layer of the largest group, sized by the attention
  spec's geometry. Layer ``j`` of every group uses slot ``j`` (vLLM's sharing: a block id
  belongs to one group at a time, so groups never collide). A layer whose spec has another
  geometry (a Gemma 4 global layer with a larger head, a group whose block size the planner
  scaled so its page matches) reads the same page bytes through its own
  ``[B, N_g, H_l, C_l]`` view (`page_kv_views`); a Mamba layer reads its states there.
* **One uniform-type group** (``UniformTypeKVCacheSpecs``: one attention type, layers with
  different heads, e.g. DeciLM / Nemotron-NAS): a block holds one page of *every* layer,
  pages of different sizes, so the buffer is block-major bytes ``[B, sum of pages]``
  presented in the layout's dim order with ``L = H = N = 1`` (whatever the layout: only B and
  C are larger than one), and layer ``i``'s pages are the columns at its offset. Offload and
  transfer move whole blocks of it, which is what they do anyway.

Layers without a KV cache of their own get ``(empty, empty)`` (no attention) or their target
layer's views and group (cross-layer KV sharing, ``ModelConfig.kv_sharing_targets``).

A ``vmm`` cache (``KVCacheConfig.vmm``, `bind_vmm_kv_cache`) has two views of one memory: the
model's layers get the *virtual* rows ``[R, T, H, D]`` (row = request), the connector and
block copies the *physical* pages ``[B, N, H, D]`` (the LHBNC buffer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv.core.specs import (
    KVCacheConfig,
    KVCacheSpec,
    KVQuantMode,
    MambaSpec,
    UniformTypeKVCacheSpecs,
    iter_layer_specs,
)
from pagedkv.ops.kv_cache import allocate_kv_cache, page_kv_views
from pagedkv.ops.mamba import mamba_state_views, slot_pages
from pagedkv.ops.vmm import VirtualKVCache, VMMGeometry

KVView = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class KVCacheBinding:
    """The allocated cache: ``buffer`` (what connectors register), one view pair per model
    layer in ``kv_caches``, each layer's group in ``layer_groups`` (0 for a layer without
    attention: it never reads its metadata), and ``distinct`` (every view pair that owns memory
    once, attention views before Mamba ones: what `copy_blocks` walks)."""

    buffer: torch.Tensor
    kv_caches: list[KVView]
    layer_groups: list[int]
    distinct: list[KVView] = field(default_factory=list)
    mamba_layers: set[int] = field(default_factory=set)
    # vmm mode: the memory, and each layer's physical views (what the connector registers;
    # None: the connector registers kv_caches).
    vmm: VirtualKVCache | None = None
    physical: list[KVView] | None = None


def cache_geometry(
    spec: KVCacheSpec, model_dtype: torch.dtype
) -> tuple[int, int, int, int, torch.dtype]:
    """``(block_size, heads, k elems, v elems, storage dtype)`` of an attention spec's page. A
    quantized cache is raw bytes: each token-head's C run is [K part | V part | scales]."""
    if getattr(spec, "kv_quant_mode", KVQuantMode.NONE) is not KVQuantMode.NONE:
        return spec.block_size, spec.num_kv_heads, spec.k_part_bytes, spec.v_part_bytes, torch.uint8
    name = getattr(spec, "dtype", None)
    dtype = getattr(torch, name) if name in ("float32", "bfloat16", "float16") else model_dtype
    return spec.block_size, spec.num_kv_heads, spec.head_size, spec.head_size_v, dtype


def bind_kv_cache(
    kv_cache_config: KVCacheConfig,
    model_config: Any,
    model_dtype: torch.dtype,
    device: torch.device,
) -> KVCacheBinding:
    """Allocate the zero-filled cache ``kv_cache_config`` plans and give every layer its views.
    Raises ValueError if a layer with attention belongs to no group."""
    mc = model_config
    groups = kv_cache_config.kv_cache_groups
    where = {name: (g, j) for g, grp in enumerate(groups) for j, name in enumerate(grp.layer_names)}
    missing = [
        mc.layer_name(i)
        for i in range(mc.num_layers)
        if mc.owns_kv_cache(i) and mc.layer_name(i) not in where
    ]
    if missing:
        raise ValueError(f"layers {missing[:4]} belong to no KV cache group")
    specs = dict(iter_layer_specs(groups))
    if any(isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs) for g in groups):
        buffer, own = _bind_uniform_type(kv_cache_config, specs, model_dtype, device)
    else:
        buffer, own = _bind_layer_slots(kv_cache_config, specs, where, model_dtype, device)
    kv_caches = _layer_views(mc, own, device)
    layer_groups = [where[n][0] if n in where else 0 for n in _layer_sources(mc)]
    mamba = {i for i in range(mc.num_layers) if isinstance(specs.get(mc.layer_name(i)), MambaSpec)}
    # copy_blocks must copy each piece of memory once (aliased slots would copy twice); an
    # attention view covers its whole page, so it wins over a Mamba layer's states.
    order = sorted(
        (i for i in range(mc.num_layers) if kv_caches[i][0].numel()), key=lambda i: i in mamba
    )
    distinct = list({kv_caches[i][0].data_ptr(): kv_caches[i] for i in order}.values())
    return KVCacheBinding(buffer, kv_caches, layer_groups, distinct, mamba)


def bind_vmm_kv_cache(
    kv_cache_config: KVCacheConfig, model_config: Any, model_dtype: torch.dtype
) -> KVCacheBinding:
    """The ``vmm`` cache (`ops.vmm.VirtualKVCache`) of a model with one full-attention group:
    layer ``j`` of the group is plane set ``j``; its model views are rows ``[R, T, H, D]``
    (block size T: one row is one "block"), its physical views ``[B, N, H, D]``."""
    mc = model_config
    (group,) = kv_cache_config.kv_cache_groups  # engine.vmm refuses anything else
    assert kv_cache_config.vmm is not None
    _, heads, hk, hv, dtype = cache_geometry(group.kv_cache_spec, model_dtype)
    geometry = VMMGeometry(
        num_layers=len(group.layer_names),
        num_kv_heads=heads,
        num_blocks=kv_cache_config.num_blocks,
        block_size=group.kv_cache_spec.block_size,
        token_elems=hk + hv,
        elem_size=torch.empty(0, dtype=dtype).element_size(),
        max_rows=kv_cache_config.vmm.max_rows,
        max_blocks=kv_cache_config.vmm.max_blocks,
    )
    cache = VirtualKVCache.create(geometry, dtype)
    virtual: dict[str, KVView] = {}
    physical: dict[str, KVView] = {}
    for j, name in enumerate(group.layer_names):
        v = cache.virtual[j].permute(1, 2, 0, 3)  # [R, T, H, C]
        p = cache.physical[j].permute(1, 2, 0, 3)  # [B, N, H, C]
        virtual[name] = (v[..., :hk], v[..., hk:])
        physical[name] = (p[..., :hk], p[..., hk:])
    return KVCacheBinding(
        cache.physical,
        _layer_views(mc, virtual),
        [0] * mc.num_layers,
        list(physical.values()),
        vmm=cache,
        physical=_layer_views(mc, physical),
    )


def _layer_sources(mc: Any) -> list[str | None]:
    """The name of the layer whose cache each model layer uses (None: no attention)."""
    out = []
    for i in range(mc.num_layers):
        src = _kv_source(mc, i)
        out.append(mc.layer_name(src) if src is not None else None)
    return out


def _layer_views(
    mc: Any, own: dict[str, KVView], device: torch.device | str = "cpu"
) -> list[KVView]:
    """Each model layer's (K, V) views from the owning layers' ``own`` (empty: no cache)."""
    empty = torch.empty(0, device=device)
    return [own[n] if n in own else (empty, empty) for n in _layer_sources(mc)]  # type: ignore[index]


def _kv_source(mc: Any, i: int) -> int | None:
    """The layer whose cache layer ``i`` uses: itself, its KV-sharing target, or None."""
    target = mc.kv_sharing_target(i)
    if target is not None:
        return target
    return i if mc.owns_kv_cache(i) else None


def _bind_layer_slots(
    kv_cache_config: KVCacheConfig,
    specs: dict[str, KVCacheSpec],
    where: dict[str, tuple[int, int]],
    model_dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, dict[str, KVView]]:
    groups = kv_cache_config.kv_cache_groups
    # The attention spec fixes the buffer's geometry (Mamba states live inside its pages).
    alloc = next(
        (g.kv_cache_spec for g in groups if not isinstance(g.kv_cache_spec, MambaSpec)),
        groups[0].kv_cache_spec,
    )
    geometry = cache_geometry(alloc, model_dtype)
    block_size, heads, hk, hv, dtype = geometry
    num_slots = max(len(g.layer_names) for g in groups)
    buffer, tensors = allocate_kv_cache(
        kv_cache_config.layout,
        num_slots,
        kv_cache_config.num_blocks,
        block_size,
        heads,
        hk,
        dtype,
        device,
        head_size_v=hv,
    )
    own: dict[str, KVView] = {}
    for name, (_, slot) in where.items():
        spec = specs[name]
        if isinstance(spec, MambaSpec):
            pages = slot_pages(buffer, kv_cache_config.layout, slot)
            own[name] = mamba_state_views(pages, spec.shapes, spec.dtypes)  # type: ignore[assignment]
            continue
        mine = cache_geometry(spec, model_dtype)
        if mine == geometry:
            own[name] = tensors[slot]
            continue
        if mine[4] != dtype:
            raise NotImplementedError(f"layer {name}: a {mine[4]} cache inside a {dtype} buffer")
        pages = slot_pages(buffer, kv_cache_config.layout, slot).view(dtype)
        own[name] = page_kv_views(pages, *mine[:4])
    return buffer, own


def _bind_uniform_type(
    kv_cache_config: KVCacheConfig,
    specs: dict[str, KVCacheSpec],
    model_dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, dict[str, KVView]]:
    (group,) = kv_cache_config.kv_cache_groups  # from_specs only forms one group of them
    geometries = {name: cache_geometry(specs[name], model_dtype) for name in group.layer_names}
    dtypes = {g[4] for g in geometries.values()}
    if len(dtypes) != 1:
        raise NotImplementedError(
            f"layers of one KV cache group with different cache dtypes: {sorted(map(str, dtypes))}"
        )
    dtype = dtypes.pop()
    elem = torch.empty(0, dtype=dtype).element_size()
    page_elems = group.page_size_bytes // elem
    buffer, _ = allocate_kv_cache(
        kv_cache_config.layout,
        1,
        kv_cache_config.num_blocks,
        1,
        1,
        page_elems,
        dtype,
        device,
        head_size_v=0,
    )
    blocks = buffer.reshape(
        kv_cache_config.num_blocks, page_elems
    )  # block-major: only B and C exceed 1
    own: dict[str, KVView] = {}
    offset = 0
    for name in group.layer_names:
        n = specs[name].page_size_bytes // elem
        own[name] = page_kv_views(blocks[:, offset : offset + n], *geometries[name][:4])
        offset += n
    return buffer, own
