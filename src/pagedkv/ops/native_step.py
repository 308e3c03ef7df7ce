"""The native decode step: every layer of a small decode batch in ONE C call.

At batch 1 a decode step of a 30-layer model is ~300 small torch ops and ctypes calls (norms,
RoPE, cache writes, SiLU, residual adds, one GEMV per projection), costing as much as the GEMVs
themselves. ``pkv_decode_layers`` (``ops/csrc/layer_step.c``) runs the whole layer stack of a
plain Llama-family model (Llama, Mistral, Qwen2) for up to :data:`MAX_ROWS` decode rows in one
call (larger decode steps, up to :data:`CHUNKED_ROWS` rows, in chunks of that many): RMSNorm,
fused qkv GEMV (+ bias), RoPE, the K/V write at the slot mapping, paged decode attention
over the same block tables, o_proj, residual, RMSNorm, gate_up fused with SiLU*mul,
down, residual, and the final RMSNorm. Float32 math; the GEMVs and the decode attention are the
very kernels the torch path calls (same results), RoPE and the cache writes round exactly as
torch does, norms and SiLU differ by summation order / an ulp of exp.

The kernel reads a table of pointers (a ``pkv_model`` of ``pkv_layer`` entries, mirrored here
with ctypes) built once per model: weights never move after loading, and the cache views never
move after allocation (a new ``kv_caches`` list is noticed and the table re-pointed; the
layers' ``kv_quant`` is read then too, from a fresh description). A step then
costs one ctypes call (the embedding lookup is in C too) and ~10 us of Python (~100 us when the
step's weights have just pushed it out of the CPU caches). One table per model: one thread
runs a model's forward passes (as the forward context assumes).

:func:`decode_step` is the hook: it returns ``None`` (the caller runs its torch path) unless
the native library is loaded, ``PAGEDKV_NATIVE_STEP`` is not ``0``, every token of the step is
a decode row and there are at most ``max_rows`` of them, no KV connector is active (its
per-layer hooks need the torch path), every layer's cache is an unquantized, unrotated
float32/bfloat16/float16 cache, and the model's weights are ones the kernel reads: a float32
model (float32 rows, or ggml rows of the GEMV's types), or a bfloat16/float16 model whose every
projection is held in ggml rows (a GGUF model loaded with ``dtype=bfloat16``) or, for bfloat16,
in dense bf16 rows (an HF model in bfloat16: read in place, widened in registers). For these the
step computes in float32 (the GEMVs already do: float32 math on the exact file weights) and
keeps float32 copies of the small dense parts (embedding, norms, biases, the RoPE table); its
hidden states are rounded once to the model dtype at the end, where the per-op path rounds
after every op. Steps above a K-quant projection's row limit (where the per-op path would use
the dense rows) are left to the per-op path. The model describes its layers to it
(:class:`~pagedkv.ops.step_description.NativeStepModel`: weights, norms, RoPE table, attention
geometry, each layer's ``kv_quant``); the step imports nothing from ``models``.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv import envs
from pagedkv.ops import forward_context, native
from pagedkv.ops.metadata import AttentionMetadata
from pagedkv.ops.step_description import DecoderStackDesc, LinearDesc, NativeStepModel

log = logging.getLogger(__name__)

MAX_ROWS = 16  # the kernel's STEP_MAX_M
# Steps above MAX_ROWS rows, up to this many, run as equal chunks of at most MAX_ROWS rows (one
# call each, the weights streamed once per chunk). Measured on a 2-core Zen 1 EPYC, SmolLM2-135M
# float32, decode tokens/s against the per-op path: 149 vs 108 at 24 rows, 158 vs 119 at 32,
# 155 vs 118 at 48, 148 vs 142 at 64: past ~64 rows the per-op path's GEMMs win.
CHUNKED_ROWS = 64
MAX_SEGS = 8  # STEP_MAX_SEGS: runs of one ggml type per fused projection
GGML_BF16 = 30  # STEP_BF16: a segment of plain bfloat16 rows (ggml's own type number)

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p


# Mirrors of the structs in ops/csrc/layer_step.h (_build checks pkv_step_struct_size).
class _Segment(ctypes.Structure):
    _fields_ = [
        ("start", _i64),
        ("end", _i64),
        ("w", _ptr),
        ("row_stride", _i64),
        ("qtype", _i32),
        ("pad_", _i32),
    ]


class _Linear(ctypes.Structure):
    _fields_ = [
        ("N", _i64),
        ("K", _i64),
        ("dense", _ptr),
        ("ldw", _i64),
        ("bias", _ptr),
        ("nseg", _i32),
        ("max_rows", _i32),
        ("seg", _Segment * MAX_SEGS),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
        ("kb", _i64),
        ("kt", _i64),
        ("kh", _i64),
        ("vb", _i64),
        ("vt", _i64),
        ("vh", _i64),
        ("window", _i64),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", _i64),
        ("hidden", _i64),
        ("num_heads", _i64),
        ("num_kv_heads", _i64),
        ("head_dim", _i64),
        ("intermediate", _i64),
        ("block_size", _i64),
        ("num_slots", _i64),
        ("max_pos", _i64),
        ("rope", _ptr),
        ("vocab", _i64),
        ("embed", _ptr),
        ("final_norm", _ptr),
        ("layers", _ptr),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("kv_type", _i32),
        ("act_q8", _i32),
    ]


@dataclass(slots=True)
class NativeStep:
    """The kernel's tables for one model (weights: fixed) over one KV cache list (re-pointed
    when another list arrives). ``keep`` holds every tensor the tables point into, so a
    replaced weight or rope table can leave them stale but never dangling."""

    so: ctypes.CDLL
    table: _Model
    layers: Any  # ctypes array of _Layer
    limits: tuple[int, int]  # (max_rows, kquant_rows) the linears were built for
    keep: list[torch.Tensor] = field(default_factory=list)
    addr: int = 0  # ctypes.addressof(table)
    kv_list: Any = None  # the kv_caches list the cache pointers came from
    kv_ok: bool = False  # the kernel can run over it
    row_cap: int = (
        MAX_ROWS  # most rows a step may have (a half-precision model has no float32 rows)
    )
    out_dtype: torch.dtype = torch.float32  # the model dtype the hidden states are returned in


# The kernel's sections (prof[i] in pkv_decode_layers), in its order.
SECTIONS = (
    "norm+residual",
    "qkv_proj",
    "rope+cache+attention",
    "o_proj",
    "gate_up+silu",
    "down_proj",
)


@dataclass(slots=True)
class StepProfile:
    """Seconds per kernel section summed over the native steps run while this is installed as
    :data:`profile` (thread 0's clock: a section includes its wait at the closing barrier), and
    the number of those steps. For a benchmark's per-op timeline: the step runs in one call."""

    seconds: Any = field(default_factory=lambda: (ctypes.c_double * len(SECTIONS))())
    steps: int = 0

    def as_dict(self) -> dict[str, float]:
        return dict(zip(SECTIONS, self.seconds, strict=True))


profile: StepProfile | None = None  # set to a StepProfile to time the kernel's sections

# id(model) -> its NativeStep, or None when its structure is not one the kernel runs (a plain
# dict: the per-step lookup must be cheap; a finalizer drops the entry with the model).
_PLANS: dict[int, NativeStep | None] = {}


def enabled() -> bool:
    """``PAGEDKV_NATIVE_STEP`` (default on) allows the native step."""
    return bool(envs.PAGEDKV_NATIVE_STEP)


def _f32(t: torch.Tensor | None) -> bool:
    return (
        t is not None and t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
    )


_HALF = (torch.bfloat16, torch.float16)


def _as_f32(t: torch.Tensor | None, keep: list[torch.Tensor]) -> torch.Tensor | None:
    """``t`` itself when float32, else a float32 copy of a bf16/fp16 CPU tensor (kept alive in
    ``keep``; exact: both half formats widen to float32 without rounding); None otherwise."""
    if t is None or t.device.type != "cpu":
        return None
    if t.dtype == torch.float32:
        out = t if t.is_contiguous() else None
    else:
        out = t.detach().float().contiguous() if t.dtype in _HALF else None
    if out is not None:
        keep.append(out)
    return out


def _row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of ``k`` weights in a segment of ``qtype`` (0: a type the step lacks)."""
    if qtype == GGML_BF16:
        return 2 * k
    return native.row_bytes(qtype, k) if qtype in native.SUPPORTED_QTYPES else 0


def _linear(
    desc: LinearDesc, max_rows: int, kquant_rows: int, keep: list[torch.Tensor]
) -> _Linear | None:
    """The kernel's view of a linear: float32 rows plus its ggml segments when it has them, or
    (half models) ggml segments only, or a dense bf16 weight as one bf16 segment."""
    w = desc.weight
    half = w.dtype in _HALF  # no float32 rows: every row must be in ggml segments
    if (
        w.dim() != 2
        or not (half or w.dtype == torch.float32)
        or w.device.type != "cpu"
        or w.stride(1) != 1
    ):
        return None
    lin = _Linear(N=w.shape[0], K=w.shape[1], dense=0 if half else w.data_ptr(), ldw=w.stride(0))
    keep.append(w)
    bias = desc.bias
    if bias is not None:
        bias = _as_f32(bias, keep)
        if bias is None or bias.shape != (w.shape[0],):
            return None
        lin.bias = bias.data_ptr()
    segs = list(desc.segments)
    if len(segs) > MAX_SEGS:
        segs = []  # more type runs than the table holds: the float32 rows
    if not segs and w.dtype == torch.bfloat16 and w.is_contiguous():
        # A dense bf16 projection (an HF model in bfloat16): its rows are read in place as one
        # bf16 segment, widened in registers, so a decode step reads 2 bytes a weight.
        segs = [(0, w.shape[0], GGML_BF16, w.view(torch.uint8))]
    end = 0
    for i, (start, stop, qtype, rows) in enumerate(segs):
        rb = _row_bytes(qtype, w.shape[1])
        if (
            start != end
            or rb == 0
            or rows.dtype != torch.uint8
            or not rows.is_contiguous()
            or rows.shape != (stop - start, rb)
        ):
            return None
        lin.seg[i] = _Segment(start=start, end=stop, w=rows.data_ptr(), row_stride=rb, qtype=qtype)
        keep.append(rows)
        end = stop
    if (segs and end != w.shape[0]) or (half and not segs):
        return None
    lin.nseg = len(segs)
    lin.max_rows = kquant_rows if desc.kquant else max_rows
    return lin


def _build(so: ctypes.CDLL, desc: DecoderStackDesc, limits: tuple[int, int]) -> NativeStep | None:
    """The weight half of the tables, or None if some part is not one the kernel runs."""
    sizes = [so.pkv_step_struct_size(i) for i in range(4)]
    if sizes != [ctypes.sizeof(c) for c in (_Segment, _Linear, _Layer, _Model)]:
        log.warning("native step disabled: struct layout mismatch %s", sizes)
        return None
    layers = desc.layers
    out_dtype = desc.embed.dtype
    keep: list[torch.Tensor] = []
    embed, rope = _as_f32(desc.embed, keep), _as_f32(desc.rope_cos_sin, keep)
    final_norm = _as_f32(desc.final_norm, keep)
    if (
        not layers
        or embed is None
        or rope is None
        or final_norm is None
        or out_dtype not in (torch.float32, *_HALF)
    ):
        return None
    a0 = layers[0]
    hq, hkv, d = a0.num_heads, a0.num_kv_heads, a0.head_dim
    if d % 2 or rope.shape[1] != d or hkv <= 0 or hq % hkv:
        return None
    arr = (_Layer * len(layers))()
    for i, layer in enumerate(layers):
        w1, w2 = _as_f32(layer.input_norm, keep), _as_f32(layer.post_norm, keep)
        if (
            (layer.num_heads, layer.num_kv_heads, layer.head_dim) != (hq, hkv, d)
            or layer.scale != a0.scale
            or {layer.input_eps, layer.post_eps} != {desc.final_eps}
            or w1 is None
            or w2 is None
        ):
            return None
        lins = [_linear(x, *limits, keep) for x in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if any(x is None for x in lins):
            return None
        e = arr[i]
        e.input_norm, e.post_norm = w1.data_ptr(), w2.data_ptr()
        e.qkv, e.o, e.gate_up, e.down = lins
        e.window = layer.sliding_window or 0
    qkv, gu = arr[0].qkv, arr[0].gate_up
    hidden, inter = embed.shape[1], gu.N // 2
    if (
        qkv.N != (hq + 2 * hkv) * d
        or qkv.K != hidden
        or gu.K != hidden
        or gu.N % 2
        or final_norm.shape[0] != hidden
    ):
        return None
    if any(
        (e.o.N, e.o.K, e.down.N, e.down.K, e.gate_up.N)
        != (hidden, hq * d, hidden, inter, 2 * inter)
        for e in arr
    ):
        return None
    table = _Model(
        num_layers=len(layers),
        hidden=hidden,
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        intermediate=inter,
        max_pos=rope.shape[0],
        rope=rope.data_ptr(),
        vocab=embed.shape[0],
        embed=embed.data_ptr(),
        final_norm=final_norm.data_ptr(),
        layers=ctypes.addressof(arr),
        eps=desc.final_eps,
        scale=a0.scale,
        act_q8=int(desc.q8_activations),
    )
    # Without float32 rows a projection must stay on its segments: no step above its row limit.
    row_cap = min(
        [MAX_ROWS]
        + [lin.max_rows for e in arr for lin in (e.qkv, e.o, e.gate_up, e.down) if not lin.dense]
    )
    return NativeStep(
        so, table, arr, limits, keep, ctypes.addressof(table), row_cap=row_cap, out_dtype=out_dtype
    )


def _point_at_caches(
    plan: NativeStep, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], desc: DecoderStackDesc
) -> None:
    """Point the tables at ``kv_caches`` (``plan.kv_ok``: whether the kernel can run over them:
    unquantized float32/bfloat16/float16 caches of the model's shape, and no layer of ``desc``
    with a quantized or rotated cache format)."""
    t = plan.table
    plan.kv_list, plan.kv_ok = kv_caches, False
    if len(kv_caches) != t.num_layers or any(layer.kv_quant is not None for layer in desc.layers):
        return
    shape = None
    for e, (k, v) in zip(plan.layers, kv_caches):
        kvt = native.KV_TYPES.get(k.dtype)
        if (
            kvt is None
            or v.dtype != k.dtype
            or k.device.type != "cpu"
            or k.dim() != 4
            or v.shape != k.shape
            or k.stride(3) != 1
            or v.stride(3) != 1
            or k.shape[2:] != (t.num_kv_heads, t.head_dim)
        ):
            return
        if shape is None:
            shape, t.kv_type = k.shape, kvt
        elif k.shape != shape or kvt != t.kv_type:
            return
        e.k_cache, e.v_cache = k.data_ptr(), v.data_ptr()
        e.kb, e.kt, e.kh = k.stride()[:3]
        e.vb, e.vt, e.vh = v.stride()[:3]
    t.block_size, t.num_slots = shape[1], shape[0] * shape[1]
    plan.kv_ok = True


def plan_for(
    model: NativeStepModel,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    max_rows: int = MAX_ROWS,
    kquant_rows: int = MAX_ROWS,
) -> NativeStep | None:
    """The model's :class:`NativeStep` pointed at ``kv_caches``, or None when the kernel cannot
    run this model or cache. The weight tables are built from the model's description on first
    use (and again only for another library or other row limits); the cache pointers whenever
    ``kv_caches`` is another list than last time, reading the layers' ``kv_quant`` from a fresh
    description (the engine allocates a cache once, so a step compares one identity)."""
    so = native.lib()
    if so is None:
        return None
    limits = (max_rows, kquant_rows)
    key = id(model)
    plan = _PLANS.get(key, False)
    desc = None
    if plan is False or (plan is not None and (plan.so is not so or plan.limits != limits)):
        if plan is False:
            weakref.finalize(model, _PLANS.pop, key, None)
        desc = model.native_step_description()
        plan = _PLANS[key] = _build(so, desc, limits)
    if plan is None:
        return None
    if kv_caches is not plan.kv_list:
        _point_at_caches(plan, kv_caches, desc or model.native_step_description())
    return plan if plan.kv_ok else None


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype is dtype and t.is_contiguous() else t.to(dtype).contiguous()


def decode_step(
    model: NativeStepModel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    md: AttentionMetadata | list[AttentionMetadata],
    max_rows: int = MAX_ROWS,
    kquant_rows: int = MAX_ROWS,
) -> torch.Tensor | None:
    """``model.forward`` of a plain Llama-family model (a :class:`NativeStepModel`, in
    ``models/``: ``LlamaModel``) for a decode-only step of at most ``min(max_rows, MAX_ROWS)``
    rows in one native call (up to :data:`CHUNKED_ROWS` rows in chunks of MAX_ROWS, when the
    model's every projection takes MAX_ROWS rows): returns the final-normed hidden states
    ``[T, hidden]`` float32 (and has written the step's K/V into ``kv_caches``), or None, having
    done nothing, where the native step does not apply. ``kquant_rows``: above this many rows
    a projection held in K-quants is computed from its float32 rows (as ``QuantizedRows``
    does). ``md`` may be a list with one entry per layer only if all are the same object.

    Kept lean: this runs every step, after the weights streamed through the caches (a cold
    Python path costs ~10x a warm one), so the checks are identity and attribute reads."""
    n = input_ids.shape[0]
    if n == 0 or n > (CHUNKED_ROWS if max_rows >= MAX_ROWS else max_rows) or not enabled():
        return None
    if isinstance(md, list):
        if any(m is not md[0] for m in md):
            return None
        md = md[0]
    if (
        md.max_query_len != 1
        or md.kv_observer is not None
        or md.query_start_loc_cpu[-1] != n
        or len(md.seq_lens_cpu) != n
        or forward_context._kv_connector is not None
        or input_ids.device.type != "cpu"
    ):
        return None
    plan = _PLANS.get(id(model))
    if (
        plan is None
        or plan.kv_list is not kv_caches
        or not plan.kv_ok
        or plan.limits != (max_rows, kquant_rows)
        or plan.so is not native.lib()
    ):
        plan = plan_for(model, kv_caches, max_rows, kquant_rows)
        if plan is None:
            return None
    cap = plan.row_cap
    if n > cap and cap < MAX_ROWS:  # a K-quant half model (or a caller's lower limit): no chunks
        return None
    table = md.block_table
    if table.dtype is not torch.int32 or table.stride(1) != 1:
        table = table.to(torch.int32).contiguous()
    out = torch.empty(n, plan.table.hidden, dtype=torch.float32)
    prof = profile
    ids, pos = _as(input_ids, torch.int64), _as(positions, torch.int64)
    slots, lens = _as(md.slot_mapping, torch.int64), _as(md.seq_lens, torch.int32)
    # Above the kernel's rows, equal chunks of at most `cap` rows, one call each: decode rows
    # are independent (each writes its own slot, reads its own blocks), and each call streams
    # the weights once. A chunk refused after an earlier one ran leaves the per-op path to
    # recompute every row (it rewrites the same slots).
    chunks = -(-n // cap)
    args = (ids, out, pos, slots, table, lens)
    bounds = [n * i // chunks for i in range(chunks + 1)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        part = args if chunks == 1 else tuple(t[a:b] for t in args)  # no slicing at batch <= 16
        rc = native.decode_layers(
            plan.so, plan.addr, *part, None if prof is None else ctypes.addressof(prof.seconds)
        )
        if rc != 0:
            return None
    if prof is not None:
        prof.steps += 1
    return out if plan.out_dtype is torch.float32 else out.to(plan.out_dtype)
