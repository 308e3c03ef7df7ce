"""Paged attention in plain torch: a flat batch of prefill chunks and decode tokens.

How it runs (CPU-first, vectorised, no per-token Python loop):

* **Decode tokens** (``query_len == 1``) of the whole step are batched: sequences are sorted by
  length and cut into chunks whose gathered K/V fit a cache-sized budget, so each chunk is padded
  only to its own longest sequence and its K/V are still in cache when the matmuls read them.
  A chunk gathers its blocks in ONE indexing op (``kv[block_table[rows, b0:b1]]``), masks keys
  past ``seq_len`` or outside the window, and runs batched matmuls with the queries reshaped to
  ``[S, Hkv, G, D]`` (GQA without repeating K/V).
* **Split-KV ("flash-decoding")**: a chunk whose K/V exceed the budget (or whatever
  ``num_kv_splits`` asks for) is cut along the KV range into segments; each yields its
  normalised output and log-sum-exp, merged by :func:`merge_attn_states_multi`.
* **Prefill chunks** (``query_len > 1``, maybe after cached context) run one sequence at a time,
  tiled over queries; each tile reads only the keys it can see (causal horizon and window).

Semantics: the query at absolute position ``p`` sees keys ``k <= p`` with, when
``sliding_window = w`` is set, ``p - k < w`` (vLLM/HF: the window counts the token itself, so
``w = 1`` sees only itself). Logits are ``s = scale·q·k``, soft-capped as ``c·tanh(s/c)`` before
masking. Softmax and both matmuls run in float32 (bf16/fp16 K/V are upcast after the gather);
the output has the query's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedkv.ops.kv_cache import kv_combined_view
from pagedkv.ops.merge_attn_states import merge_attn_states_multi
from pagedkv.ops.metadata import AttentionMetadata

# Bytes of gathered K+V one decode chunk / KV segment may hold: big enough that per-chunk
# Python overhead is amortised, small enough that the matmuls re-read the gather from cache.
KV_CHUNK_BYTES = 4 << 20
# Bytes of float32 scores one prefill query tile may hold.
PREFILL_SCORES_BYTES = 2 << 20


class _Workspace:
    """Grow-only scratch buffers reused across calls, one per (name, device, dtype).

    Multi-MB tensors allocated fresh each call come straight from mmap and pay a page fault
    per 4 KiB on first touch, which costs more than the gather itself. Views returned by
    :meth:`get` are valid until the next ``get`` of the same name (single-threaded use).
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._bufs.get((name, device, dtype))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._bufs[(name, device, dtype)] = buf
        return buf[:numel].view(shape)


_WORKSPACE = _Workspace()


def _gather_f32(name: str, src: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``src[blocks]`` as float32 in workspace memory: ``[len(blocks), *src.shape[1:]]``.

    ``index_select`` into a contiguous ``out`` copies whole blocks (memcpy-speed for layouts
    whose blocks are contiguous) and returns them in logical order whatever ``src``'s strides.
    """
    shape = (blocks.numel(), *src.shape[1:])
    dst = _WORKSPACE.get(name, shape, src.dtype, src.device)
    torch.index_select(src, 0, blocks, out=dst)
    if src.dtype == torch.float32:
        return dst
    return _WORKSPACE.get(name + "_f32", shape, torch.float32, src.device).copy_(dst)


@dataclass(slots=True)
class _PagedKV:
    """One layer's paged K/V, with K and V fused into one tensor when they interleave.

    ``kv`` is ``[NB, BS, Hkv, D + Dv]`` (fused) or ``None``.
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    kv: torch.Tensor | None

    @classmethod
    def of(cls, key_cache: torch.Tensor, value_cache: torch.Tensor) -> _PagedKV:
        return cls(key_cache, value_cache, kv_combined_view(key_cache, value_cache))

    @property
    def head_size(self) -> int:
        return self.key_cache.shape[-1]

    @property
    def token_bytes(self) -> int:
        """float32 bytes one gathered token (K and V of all KV heads) takes."""
        return self.key_cache.shape[2] * (self.head_size + self.value_cache.shape[-1]) * 4

    def gather(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(k [B, n*BS, Hkv, D], v [B, n*BS, Hkv, Dv])`` for block ids ``[B, n]``.

        The tensors live in the workspace: use them before the next gather.
        """
        b, n = blocks.shape
        idx = blocks.reshape(-1)
        if self.kv is not None:  # one copy moves K and V together
            kv = _gather_f32("kv", self.kv, idx)
            kv = kv.view(b, n * kv.shape[1], *kv.shape[2:])
            return kv[..., : self.head_size], kv[..., self.head_size:]
        k, v = _gather_f32("k", self.key_cache, idx), _gather_f32("v", self.value_cache, idx)
        return k.view(b, n * k.shape[1], *k.shape[2:]), v.view(b, n * v.shape[1], *v.shape[2:])


def _to_f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
            soft_cap: float | None, need_lse: bool
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Masked GQA attention over a gathered key range, in float32.

    ``q [B, R, Hkv, G, D]`` (already multiplied by ``scale``), ``k [B, L, Hkv, D]``,
    ``v [B, L, Hkv, Dv]`` (any strides with a unit last stride), ``valid`` a bool mask
    broadcastable to ``[B, R, 1, L]``. Returns ``out [B, R, Hkv, G, Dv]`` and, if ``need_lse``,
    ``lse [B, R, Hkv, G]`` (−inf and out = 0 for a row with no valid key; without ``need_lse``
    every row must have one).
    """
    b, r, hkv, g, d = q.shape
    n_keys, dv = k.shape[1], v.shape[-1]
    qh = q.permute(2, 0, 1, 3, 4).reshape(hkv, b, r * g, d)  # small copy: per-head matrices
    scores = q.new_empty(hkv, b, r * g, n_keys)
    # One bmm per KV head: k[:, :, h] is a strided [B, L, D] view that BLAS reads in place,
    # whereas a single matmul over (B, Hkv) would first copy all of K.
    for h in range(hkv):
        torch.bmm(qh[h], k[:, :, h].transpose(1, 2), out=scores[h])
    s = scores.view(hkv, b, r, g, n_keys)
    if soft_cap is not None:
        s.div_(soft_cap).tanh_().mul_(soft_cap)
    s.masked_fill_(~valid, float("-inf"))
    if need_lse:
        lse = torch.logsumexp(s, dim=-1)
        shift = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        p = s.sub_(shift.unsqueeze(-1)).exp_()
    else:
        lse, p = None, torch.softmax(s, dim=-1)
    ph = p.view(hkv, b, r * g, n_keys)
    out = q.new_empty(hkv, b, r * g, dv)
    for h in range(hkv):
        torch.bmm(ph[h], v[:, :, h], out=out[h])
    out = out.view(hkv, b, r, g, dv).permute(1, 2, 0, 3, 4)
    return out, (lse.permute(1, 2, 0, 3) if lse is not None else None)


def _key_mask(key_pos: torch.Tensor, query_pos: torch.Tensor,
              sliding_window: int | None) -> torch.Tensor:
    """``valid[..., q, k]``: key position ``k <= p`` and, with a window, ``p - k < w``.

    ``key_pos [L]``, ``query_pos [..., R]`` (int64) → bool ``[..., R, L]``.
    """
    diff = query_pos.unsqueeze(-1) - key_pos  # p - k
    valid = diff >= 0
    if sliding_window is not None:
        valid &= diff < sliding_window
    return valid


def _decode_chunks(seq_lens: list[int], rows: list[int], token_bytes: int,
                   budget: int) -> list[list[int]]:
    """Cut decode rows, sorted by length, into chunks whose padded gather fits ``budget``.

    Sorting keeps padding small (a chunk pads to its longest row); a single row above the
    budget gets a chunk of its own (and is then split along its KV range).
    """
    chunks: list[list[int]] = []
    cur: list[int] = []
    for i in sorted(rows, key=lambda i: seq_lens[i]):
        # The newest row is the chunk's longest, so the padded gather is rows * its length.
        if cur and (len(cur) + 1) * seq_lens[i] * token_bytes > budget:
            chunks.append(cur)
            cur = []
        cur.append(i)
    if cur:
        chunks.append(cur)
    return chunks


def _decode(query: torch.Tensor, out: torch.Tensor, paged: _PagedKV, md: AttentionMetadata,
            rows: list[int], scale: float, sliding_window: int | None, soft_cap: float | None,
            num_kv_splits: int | None) -> None:
    """Attention for all decode rows (one query token each), written into ``out``.

    Per-row tensors are built once in length order; each chunk then works on slices of them.
    """
    bs, dev = md.block_size, query.device
    hkv, d, dv = paged.key_cache.shape[2], paged.head_size, paged.value_cache.shape[-1]
    g = query.shape[1] // hkv
    chunks = _decode_chunks(md.seq_lens_cpu, rows, paged.token_bytes, KV_CHUNK_BYTES)
    order = [i for chunk in chunks for i in chunk]
    rows_t = torch.tensor(order, dtype=torch.int64, device=dev)
    tokens = torch.tensor([md.query_start_loc_cpu[i] for i in order], dtype=torch.int64,
                          device=dev)
    q = _to_f32(query[tokens]).mul_(scale).view(len(order), 1, hkv, g, d)  # a copy
    q_pos = (md.seq_lens[rows_t].to(torch.int64) - 1).view(-1, 1)  # [S, 1]
    table = md.block_table[rows_t]
    res = torch.empty(len(order), 1, hkv, g, dv, device=dev)
    start = 0
    for chunk in chunks:
        rs = slice(start, start + len(chunk))
        start += len(chunk)
        lens = [md.seq_lens_cpu[i] for i in chunk]  # ascending
        lo = 0 if sliding_window is None else max(0, lens[0] - sliding_window)
        b0, b1 = lo // bs, -(-lens[-1] // bs)
        splits = num_kv_splits or -(-len(chunk) * (b1 - b0) * bs * paged.token_bytes
                                    // KV_CHUNK_BYTES)
        seg = -(-(b1 - b0) // max(1, splits))  # blocks per KV segment
        parts = []
        for s0 in range(b0, b1, seg):
            s1 = min(b1, s0 + seg)
            k, v = paged.gather(table[rs, s0:s1])
            key_pos = torch.arange(s0 * bs, s1 * bs, device=dev)
            valid = _key_mask(key_pos, q_pos[rs], sliding_window).unsqueeze(2)  # [B, 1, 1, L]
            parts.append(_attend(q[rs], k, v, valid, soft_cap, need_lse=seg < b1 - b0))
        if len(parts) == 1:
            res[rs] = parts[0][0]
        else:
            res[rs] = merge_attn_states_multi([o for o, _ in parts], [lse for _, lse in parts])[0]
    out[tokens] = res.view(len(order), hkv * g, dv).to(out.dtype)


def _prefill(query: torch.Tensor, out: torch.Tensor, paged: _PagedKV, md: AttentionMetadata,
             row: int, scale: float, sliding_window: int | None,
             soft_cap: float | None) -> None:
    """Attention for one prefill chunk (``query_len > 1`` tokens after ``ctx`` cached ones)."""
    bs = md.block_size
    t0, t1 = md.query_start_loc_cpu[row], md.query_start_loc_cpu[row + 1]
    seq_len = md.seq_lens_cpu[row]
    q_len, hkv, d = t1 - t0, paged.key_cache.shape[2], paged.head_size
    ctx = seq_len - q_len
    g = query.shape[1] // hkv
    lo = 0 if sliding_window is None else max(0, ctx - sliding_window + 1)
    b0 = lo // bs
    k, v = paged.gather(md.block_table[row: row + 1, b0: -(-seq_len // bs)])
    base = b0 * bs  # absolute position of k[:, 0]
    q_all = _to_f32(query[t0:t1]).mul(scale).view(1, q_len, hkv, g, d)
    tile = max(1, PREFILL_SCORES_BYTES // (4 * query.shape[1] * (seq_len - base)))
    for i0 in range(0, q_len, tile):
        i1 = min(q_len, i0 + tile)
        # Keys this tile can see: [first query's window start, last query's position].
        k0 = base if sliding_window is None else max(base, ctx + i0 - sliding_window + 1)
        k1 = ctx + i1
        key_pos = torch.arange(k0, k1, device=query.device)
        query_pos = torch.arange(ctx + i0, ctx + i1, device=query.device)
        valid = _key_mask(key_pos, query_pos, sliding_window).unsqueeze(1)  # [R, 1, L]
        o, _ = _attend(q_all[:, i0:i1], k[:, k0 - base: k1 - base], v[:, k0 - base: k1 - base],
                       valid, soft_cap, False)
        out[t0 + i0: t0 + i1] = o.reshape(i1 - i0, -1, o.shape[-1])


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    attn_metadata: AttentionMetadata, scale: float,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None,
                    num_kv_splits: int | None = None) -> torch.Tensor:
    """Causal attention of a flat batch of queries over their paged K/V.

    ``query [T, Hq, D]``; ``key_cache [NB, BS, Hkv, D]`` and ``value_cache [NB, BS, Hkv, Dv]``
    (any strides, e.g. views from :func:`allocate_kv_cache`), already holding this step's K/V
    (call ``reshape_and_cache`` first). ``Hq = G·Hkv``; query head ``h`` uses KV head ``h // G``.
    K/V are read through ``attn_metadata.block_table``. ``num_kv_splits`` forces the number of
    KV segments per decode chunk (``None``: automatic, by cache budget; 1: never split).
    Returns ``[T, Hq, Dv]`` in ``query.dtype``.
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    num_tokens, num_heads, _ = query.shape
    if num_heads % key_cache.shape[2]:
        raise ValueError(f"{num_heads} query heads not a multiple of {key_cache.shape[2]} KV heads")
    md = attn_metadata
    paged = _PagedKV.of(key_cache, value_cache)
    out = query.new_empty(num_tokens, num_heads, value_cache.shape[-1])
    qsl = md.query_start_loc_cpu
    q_lens = [qsl[i + 1] - qsl[i] for i in range(md.num_seqs)]
    decode_rows = [i for i, n in enumerate(q_lens) if n == 1]
    if decode_rows:
        _decode(query, out, paged, md, decode_rows, scale, sliding_window, logits_soft_cap,
                num_kv_splits)
    for i, n in enumerate(q_lens):
        if n > 1:
            _prefill(query, out, paged, md, i, scale, sliding_window, logits_soft_cap)
    return out
