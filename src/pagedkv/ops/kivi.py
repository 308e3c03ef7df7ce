"""KIVI caches (``int3_kivi`` / ``int2_kivi``): keys coded per channel across a block, values
per token, and each request's sink and recent tokens kept as int8 outside the pages.

Why per channel: a few key channels carry outliers, so per-token groups at 3 bits spend their
levels on them (SmolLM2, emulated: 89% top-1 for per-token int3 against 96% for this layout);
a channel's range over 16-32 tokens is narrow. The cost: a block's keys can be coded only once
the block is full, so the filling block must be held somewhere else. That holder, the
*residual* (:class:`KiviResidual`), also keeps a few more recent blocks and the first
``sink`` tokens: attention mass concentrates there, and int8 there is as good as exact.

What a query at position ``t`` reads for key ``j <= t`` (:func:`hot_mask`): the residual's int8
values when ``j`` is a sink or ``block(j) > block(t) - R`` (``R`` =
``kivi_residual_blocks(block_size)``), and the residual holds ``j``; else the page's codes.
The residual holds what this request computed itself (``starts``: a prefix-cache hit or a
loaded prefix is read from its codes) up to the last ``R`` blocks, and the sinks of a hit whose
sinks another request computed (:class:`KiviSinkStore`: the int8 sinks depend only on the first
tokens, so a hit reads its sinks as the cold run did). Chunking does not change what is read:
block codes are made from the int8 values too, so a block's codes do not depend on which step
completed it.

Layout of a K part (``AttentionSpec.k_part_bytes``): the token-head's packed codes, then
``head_size / block_size`` fp16 channel scales of its block (zero point in the low mantissa
bits): token ``i`` of a block carries channels ``[i·c, (i+1)·c)``. V parts are the per-token
group format of ``ops.kv_quant``.

The write happens in attention (it needs the step's metadata): ``reshape_and_cache`` leaves
the step's rows on the layer's :class:`KVQuant` (``pending``) and :func:`kivi_attention` writes
them, then attends. Torch code, any device; a decode step (one query a sequence) writes for the
whole batch at once and attends in ``ops/csrc/kivi_decode.c`` (CPU) or
``ops/triton/kivi_decode.py`` (CUDA).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from pagedkv.core.specs import (
    KIVI_RESIDUAL_PART,
    KIVI_SINK_TOKENS,
    AttentionSpec,
    KVQuantMode,
    kivi_residual_blocks,
)
from pagedkv.ops import native
from pagedkv.ops.kv_quant import (
    MIN_SCALE,
    KVQuant,
    KVQuantFormat,
    _code_bytes,
    _pack_scale_f16,
    _scale_from,
    dequantize_part,
    pack_codes,
    quantize_part,
    unpack_codes,
)
from pagedkv.ops.metadata import AttentionMetadata

# Query rows attended at once (bounds the [Hq, rows, keys] score tensors).
QUERY_TILE = 256


@dataclass(slots=True)
class KiviStep:
    """The runner's per-step view of the residual: sequence ``i`` of the step owns residual
    row ``rows[i]``, which holds what the request computed from position ``starts[i]`` on."""

    rows: list[int]
    starts: list[int]
    # Per sequence: its row also holds the sinks [0, sink) when its start is past them (a
    # hit's sinks restored from the :class:`KiviSinkStore`). None: no row does.
    sinks: list[bool] | None = None
    # Per block size: which of the step's tokens lie in blocks their request started itself
    # (the same for every layer: computed by the first one).
    own: dict[int, torch.Tensor] = field(default_factory=dict)
    # Per device: (rows, starts, seq_lens, sink_lo) as int64 tensors for the decode kernels
    # (built by the first layer, reused by the others).
    tensors: dict[str, tuple[torch.Tensor, ...]] = field(default_factory=dict)

    def held(self, i: int) -> bool:
        return bool(self.sinks and self.sinks[i])

    def sink_lo(self, sink: int) -> list[int]:
        """Per sequence, the first sink position its row holds (``sink``: none): 0 for restored
        sinks, else its start where that lies among the sinks."""
        return [0 if self.held(i) else min(s, sink) for i, s in enumerate(self.starts)]


@dataclass(slots=True)
class KiviResidual:
    """One layer's residual: ``k [rows, span, Hkv, D + 2]`` and ``v [rows, span, Hkv, Dv + 2]``
    uint8 (int8 codes, then an fp16 scale), ``span = sink + window``. Position ``p`` of a row
    lives at ``p`` when ``p < sink``, else at ``sink + p % window`` (a ring of whole blocks)."""

    k: torch.Tensor
    v: torch.Tensor
    sink: int
    window: int
    k_fmt: KVQuantFormat
    v_fmt: KVQuantFormat

    @classmethod
    def allocate(cls, spec: AttentionSpec, rows: int, device: torch.device | str) -> KiviResidual:
        window = kivi_residual_blocks(spec.block_size) * spec.block_size
        span = KIVI_SINK_TOKENS + window
        d, dv = spec.head_size, spec.head_size_v
        shape = (rows, span, spec.num_kv_heads)
        kb, vb = d + KIVI_RESIDUAL_PART, dv + KIVI_RESIDUAL_PART  # type: ignore[operator]
        mode = KVQuantMode.INT8_PER_TOKEN_HEAD_F16
        return cls(
            torch.zeros(*shape, kb, dtype=torch.uint8, device=device),
            torch.zeros(*shape, vb, dtype=torch.uint8, device=device),
            KIVI_SINK_TOKENS,
            window,
            KVQuantFormat(mode, d, dv, kb, kb),  # type: ignore[arg-type]
            KVQuantFormat(mode, dv, dv, vb, vb),  # type: ignore[arg-type]
        )

    def index(self, pos: torch.Tensor) -> torch.Tensor:
        return torch.where(pos < self.sink, pos, self.sink + pos % self.window)

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[n, H, D]`` → their int8 parts."""
        return (
            quantize_part(k, self.k_fmt, 1.0, self.k.shape[-1]),
            quantize_part(v, self.v_fmt, 1.0, self.v.shape[-1]),
        )

    def decode(self, k8: torch.Tensor, v8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            dequantize_part(k8, self.k_fmt, self.k_fmt.head_size, 1.0),
            dequantize_part(v8, self.v_fmt, self.v_fmt.head_size, 1.0),
        )


@dataclass(slots=True)
class KiviSinkStore:
    """The int8 sinks (positions ``[0, sink)``, every KIVI layer) of recent requests, keyed by
    their first block's hash, so that a prefix-cache hit reads its sinks as the request that
    computed them did, not from 3-bit codes (on the default model, sinks from codes cost more
    than the rest of the hit).

    Sound because a position's K/V depend only on the tokens up to it (and the adapter, the
    images, the cache salt: all in the block hash), and a hit is granted only on equal hashes.
    Holds at most ``capacity`` entries, least recently used out first; each is
    ``sink × (D + Dv + 4) × Hkv`` bytes a layer (46 KB for the default model)."""

    capacity: int
    entries: OrderedDict[bytes, list[tuple[torch.Tensor, torch.Tensor]]] = field(
        default_factory=OrderedDict
    )

    @staticmethod
    def residuals(quants: dict[str, KVQuant]) -> list[KiviResidual]:
        """The distinct residuals of ``quants`` (layers sharing a cache share theirs)."""
        seen: dict[int, KiviResidual] = {}
        for kq in quants.values():
            if kq.residual is not None:
                seen.setdefault(id(kq.residual), kq.residual)
        return list(seen.values())

    def save(self, key: bytes, residuals: list[KiviResidual], row: int) -> None:
        """Keep ``row``'s sinks under ``key`` (a row that holds them: its start was 0)."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        self.entries[key] = [
            (r.k[row, : r.sink].clone(), r.v[row, : r.sink].clone()) for r in residuals
        ]
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def restore(self, key: bytes | None, residuals: list[KiviResidual], row: int) -> bool:
        """Write the sinks kept under ``key`` into ``row``; False (nothing written) if none."""
        saved = self.entries.get(key) if key is not None else None
        if saved is None or len(saved) != len(residuals):
            return False
        self.entries.move_to_end(key)  # type: ignore[arg-type]
        for r, (k, v) in zip(residuals, saved):
            r.k[row, : r.sink], r.v[row, : r.sink] = k, v
        return True


# ---- the K block codec -------------------------------------------------------------------------


def quantize_k_blocks(k: torch.Tensor, bits: int, part_bytes: int) -> torch.Tensor:
    """Whole blocks of keys ``[n, bs, H, D]`` → their K parts ``uint8 [n, bs, H, part_bytes]``:
    each channel asymmetric over the block's tokens (range widened to hold 0, the scale rounded
    up to fp16 with the zero point in its low ``bits`` mantissa bits)."""
    n, bs, h, d = k.shape
    top = float((1 << bits) - 1)
    kf = k.float()
    lo = kf.amin(1, keepdim=True).clamp_(max=0.0)
    hi = kf.amax(1, keepdim=True).clamp_(min=0.0)
    s, with_zero = _pack_scale_f16(((hi - lo) / top).clamp_(min=MIN_SCALE), bits)
    z = torch.round(-lo / s).clamp_(0, top)
    q = torch.round(kf / s + z).clamp_(0, top).to(torch.uint8)
    nv = _code_bytes(d, bits)
    out = torch.empty(n, bs, h, part_bytes, dtype=torch.uint8, device=k.device)
    out[..., :nv] = pack_codes(q, bits)
    scales = with_zero(z.to(torch.int32)).contiguous().view(torch.uint8)  # [n, 1, H, 2D]
    out[..., nv:] = scales.reshape(n, h, bs, -1).transpose(1, 2)
    return out


def dequantize_k_blocks(raw: torch.Tensor, d: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`quantize_k_blocks`: ``uint8 [n, bs, H, part_bytes]`` → float32
    ``[n, bs, H, d]``."""
    n, bs, h, _ = raw.shape
    nv = _code_bytes(d, bits)
    q = unpack_codes(raw[..., :nv], d, bits).float()
    sb = _scale_from(raw[..., nv:].transpose(1, 2).reshape(n, h, 2 * d), torch.int16)
    sb = sb.to(torch.int32)
    low = (1 << bits) - 1
    s = (sb & ~low).to(torch.int16).view(torch.float16).float()
    z = (sb & low).float()
    return (q - z[:, None]) * s[:, None]


# ---- write, then attend --------------------------------------------------------------------------


def hot_mask(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    have: torch.Tensor,
    sink: int,
    block_size: int,
    blocks: int,
) -> torch.Tensor:
    """``[Tq, Tk]``: key ``k_pos[j]`` is read from the residual by the query at ``q_pos[i]``
    (``have[j]``: the residual holds it)."""
    near = k_pos[None, :] // block_size > q_pos[:, None] // block_size - blocks
    return have[None, :] & (near | (k_pos[None, :] < sink))


def kivi_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    kq: KVQuant,
) -> torch.Tensor:
    """Write the step's rows (left on ``kq.pending`` by ``reshape_and_cache``) into the pages
    and the residual, then attend: ``query [T, Hq, D]`` → ``[T, Hq, Dv]`` float32-accurate in
    ``query``'s dtype. Raises RuntimeError when the runner set up no residual for the step."""
    if kq.pending is None or kq.residual is None or md.kivi is None:
        raise RuntimeError("a KIVI cache needs reshape_and_cache first and the runner's residual")
    key, value, slots = kq.pending
    kq.pending = None
    res, fmt = kq.residual, kq.fmt
    bs = key_cache.shape[1]
    blocks = kivi_residual_blocks(bs)
    qsl, lens = md.query_start_loc_cpu, md.seq_lens_cpu
    # V codes per token, straight into the pages; never into a block the request did not
    # start itself (a prefix-cache hit's last block, whose last token is computed again: its
    # context now reads codes where the first computation read the residual).
    keep = (slots >= 0) & _own_blocks(md, bs, slots.device)
    vb = quantize_part(value[keep], fmt, kq.v_scale, fmt.v_bytes)
    value_cache[slots[keep] // bs, slots[keep] % bs] = vb
    k8, v8 = res.encode(key, value)
    if md.max_query_len == 1:  # decode: write, then the C or Triton kernel
        out = _kernel_decode(query, key_cache, value_cache, md, scale, kq, k8, v8)
        if out is not None:
            return out.to(query.dtype)
    kx, vx = res.decode(k8, v8)  # what the residual gives back: also what blocks are coded from
    out = query.new_empty(query.shape[0], query.shape[1], fmt.head_size_v)
    for i, (row, start) in enumerate(zip(md.kivi.rows, md.kivi.starts)):
        t0, t1, length = qsl[i], qsl[i + 1], lens[i]
        ctx = length - (t1 - t0)
        held = md.kivi.held(i)
        ek, ev, have = _exact_rows(
            res, row, start, held, ctx, length, kx[t0:t1], vx[t0:t1], bs, blocks
        )
        table = md.block_table[i]
        _code_full_blocks(key_cache, table, ek, have, ctx, length, start, bs, fmt)
        _store_residual(res, row, k8[t0:t1], v8[t0:t1], ctx, length, bs, blocks)
        out[t0:t1] = _attend(query[t0:t1], key_cache, value_cache, table, ek, ev, have,
                             ctx, length, scale, fmt, res.sink, bs, blocks)  # fmt: skip
    return out


def _kernel_decode(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    md: AttentionMetadata, scale: float, kq: KVQuant, k8: torch.Tensor, v8: torch.Tensor,
) -> torch.Tensor | None:  # fmt: skip
    """A decode step (one query a sequence) for the whole batch at once: the rows' int8 parts
    ``k8``/``v8`` into the residual, the K codes of every block a row just filled (read back
    from the residual, as :func:`_code_full_blocks`), then ``native.kivi_decode`` (CPU) or
    the Triton kernel (CUDA). Returns None, having written nothing, when neither applies (the
    torch path then runs). Should the C kernel decline the shape after the writes (a head size
    past 256, blocks past 64 tokens), the torch path writes the same values again: harmless."""
    dev = query.device
    if dev.type == "cpu" and native.lib() is None:
        return None
    if dev.type == "cuda":
        from pagedkv.ops.triton import available

        if not available():
            return None
        from pagedkv.ops.triton.kivi_decode import supports

        if not supports(kq.fmt.head_size, kq.fmt.head_size_v, key_cache.shape[1]):
            return None
    elif dev.type != "cpu":
        return None
    res, fmt = kq.residual, kq.fmt
    bs = key_cache.shape[1]
    key = str(dev)
    if key not in md.kivi.tensors:
        md.kivi.tensors[key] = tuple(
            torch.tensor(x, dtype=torch.int64, device=dev)
            for x in (md.kivi.rows, md.kivi.starts, md.seq_lens_cpu, md.kivi.sink_lo(res.sink))
        )
    rows, starts, lens, sink_lo = md.kivi.tensors[key]
    pos = lens - 1
    at = res.index(pos)
    res.k[rows, at], res.v[rows, at] = k8, v8
    full = (lens % bs == 0) & (pos // bs * bs >= starts)  # blocks filled now, started here
    if bool(full.any()):
        sel = full.nonzero().flatten()
        span = (pos[sel] // bs * bs)[:, None] + torch.arange(bs, device=dev)  # [n, bs]
        k = res.k[rows[sel, None], res.index(span)]
        k = dequantize_part(k, res.k_fmt, res.k_fmt.head_size, 1.0)
        ids = md.block_table[sel, pos[sel] // bs].to(torch.int64)
        key_cache[ids] = quantize_k_blocks(k, fmt.mode.code_bits, fmt.k_bytes)
    args = (query, key_cache, value_cache, md.block_table, md.seq_lens, scale, kq, rows, starts,
            sink_lo)  # fmt: skip
    if dev.type == "cuda":
        from pagedkv.ops.triton.kivi_decode import kivi_decode_triton

        return kivi_decode_triton(*args)
    return native.kivi_decode(*args)


def _own_blocks(md: AttentionMetadata, bs: int, device: torch.device) -> torch.Tensor:
    """``[T]`` bool: the token's block starts at or after its request's first own position."""
    if bs in md.kivi.own:
        return md.kivi.own[bs]
    qsl, lens = md.query_start_loc_cpu, md.seq_lens_cpu
    pos = torch.cat(
        [torch.arange(lens[i] - (qsl[i + 1] - qsl[i]), lens[i]) for i in range(md.num_seqs)]
    )
    counts = torch.tensor([qsl[i + 1] - qsl[i] for i in range(md.num_seqs)])
    first = torch.repeat_interleave(torch.tensor(md.kivi.starts), counts)
    md.kivi.own[bs] = (pos // bs * bs >= first).to(device)
    return md.kivi.own[bs]


def _exact_rows(
    res: KiviResidual, row: int, start: int, held: bool, ctx: int, length: int,
    k_new: torch.Tensor, v_new: torch.Tensor, bs: int, blocks: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Residual values ``[length, H, D]`` of one sequence (zeros where it holds none) and
    ``have [length]``: the sinks and last blocks before this step from the ring (as it was;
    ``held``: the sinks whatever ``start``), this step's rows from ``k_new``/``v_new``."""
    dev = k_new.device
    pos = torch.arange(length, device=dev)
    ring_lo = max(0, ((ctx - 1) // bs - blocks + 1) * bs) if ctx else 0
    sinks = pos < res.sink
    past = (pos < ctx) & (((pos >= start) & (sinks | (pos >= ring_lo))) | (sinks & held))
    have = past | (pos >= ctx)
    ek = k_new.new_zeros(length, *k_new.shape[1:])
    ev = v_new.new_zeros(length, *v_new.shape[1:])
    idx = pos[past]
    if idx.numel():
        pk, pv = res.decode(res.k[row, res.index(idx)], res.v[row, res.index(idx)])
        ek[idx], ev[idx] = pk, pv
    ek[ctx:], ev[ctx:] = k_new, v_new
    return ek, ev, have


def _code_full_blocks(
    key_cache: torch.Tensor, table: torch.Tensor, ek: torch.Tensor, have: torch.Tensor,
    ctx: int, length: int, start: int, bs: int, fmt: KVQuantFormat,
) -> None:  # fmt: skip
    """Code the K of every block this step fills, if this request computed all of it (a block
    before ``start`` came coded: a prefix-cache hit or a loaded prefix)."""
    first = max(ctx // bs, -(-start // bs))
    last = length // bs  # blocks [first, last) are full after the step
    if first >= last:
        return
    span = slice(first * bs, last * bs)
    if not bool(have[span].all()):
        raise RuntimeError("a KIVI block to code has tokens the residual does not hold")
    k = ek[span].reshape(last - first, bs, *ek.shape[1:])
    ids = table[first:last].to(torch.int64)
    key_cache[ids] = quantize_k_blocks(k, fmt.mode.code_bits, fmt.k_bytes)


def _store_residual(
    res: KiviResidual, row: int, k8: torch.Tensor, v8: torch.Tensor,
    ctx: int, length: int, bs: int, blocks: int,
) -> None:  # fmt: skip
    """Keep this step's sink rows and the rows of its last ``blocks`` blocks (each ring slot
    written once: rows that a later row of the step would overwrite are skipped)."""
    lo = max(0, ((length - 1) // bs - blocks + 1) * bs)
    pos = torch.arange(ctx, length, device=k8.device)
    sel = (pos >= lo) | (pos < res.sink)
    idx = res.index(pos[sel])
    res.k[row, idx], res.v[row, idx] = k8[sel], v8[sel]


def _attend(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor,
    ek: torch.Tensor, ev: torch.Tensor, have: torch.Tensor, ctx: int, length: int,
    scale: float, fmt: KVQuantFormat, sink: int, bs: int, blocks: int,
) -> torch.Tensor:  # fmt: skip
    """One sequence's causal attention, each key from the residual or from its codes."""
    nb = -(-length // bs)
    ids = table[:nb].to(torch.int64)
    kc = dequantize_k_blocks(key_cache[ids], fmt.head_size, fmt.mode.code_bits)
    kc = kc.reshape(nb * bs, *kc.shape[2:])[:length]
    kc[length // bs * bs :] = 0.0  # the filling block has no codes yet (read from the residual)
    vc = dequantize_part(value_cache[ids], fmt, fmt.head_size_v, 1.0)
    vc = vc.reshape(nb * bs, *vc.shape[2:])[:length]
    hkv = kc.shape[1]
    g = q.shape[1] // hkv
    k_pos = torch.arange(length, device=q.device)
    # [Hkv, 1, keys, D] against queries [Hkv, G, rows, D]
    kc_, ek_ = kc.transpose(0, 1)[:, None], ek.float().transpose(0, 1)[:, None]
    vc_, ev_ = vc.transpose(0, 1)[:, None], ev.float().transpose(0, 1)[:, None]
    out = []
    for r0 in range(0, q.shape[0], QUERY_TILE):
        qt = q[r0 : r0 + QUERY_TILE].float()
        n = qt.shape[0]
        q_pos = torch.arange(ctx + r0, ctx + r0 + n, device=q.device)
        qh = qt.reshape(n, hkv, g, -1).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
        hot = hot_mask(q_pos, k_pos, have, sink, bs, blocks)
        s = torch.where(hot, qh @ ek_.transpose(-1, -2), qh @ kc_.transpose(-1, -2)) * scale
        s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        p = s.softmax(-1)
        o = torch.where(hot, p, 0.0) @ ev_ + torch.where(hot, 0.0, p) @ vc_  # [Hkv, G, n, Dv]
        out.append(o.permute(2, 0, 1, 3).reshape(n, hkv * g, -1))
    return torch.cat(out).to(q.dtype)


def allocate_residuals(
    quants: dict[str, KVQuant], specs: dict[str, AttentionSpec], rows: int,
    device: torch.device | str,
) -> int:  # fmt: skip
    """Give every KIVI layer of ``quants`` its residual of ``rows`` rows (a layer sharing
    another's cache shares its object). Returns the bytes allocated."""
    total = 0
    for name, kq in quants.items():
        if kq.fmt.mode.is_kivi and kq.residual is None:
            kq.residual = KiviResidual.allocate(specs[name], rows, device)
            total += kq.residual.k.numel() + kq.residual.v.numel()
    return total


__all__ = [
    "KiviResidual",
    "KiviSinkStore",
    "KiviStep",
    "allocate_residuals",
    "dequantize_k_blocks",
    "hot_mask",
    "kivi_attention",
    "quantize_k_blocks",
]
