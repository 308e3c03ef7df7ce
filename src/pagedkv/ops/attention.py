"""Paged attention: one flat batch of prefill chunks and decode tokens over a paged KV cache.

Semantics (vLLM/HF): the query at absolute position ``p`` sees keys ``k <= p`` and, with
``sliding_window = w``, only those with ``p - k < w`` — the window counts the token itself, so
``w = 1`` sees only itself; with ``attention_chunk_size = c`` (Llama 4's chunked local
attention) only those of its own chunk, ``k // c == p // c``. Logits are ``s = scale·q·k``,
soft-capped as ``c·tanh(s/c)`` before masking; softmax accumulates in float32 whatever the
cache dtype.

How it runs (CPU-first, vectorised; no per-token Python loop):

* **Native decode** (float32/bf16/fp16 or quantized KV, no softcap, automatic splits): every decode row goes through
  ``ops/csrc/paged_decode.c`` (:func:`pagedkv.ops.native.paged_decode`), which walks each row's
  block table and reads K/V in place with an online softmax (a task per row, or per (row, KV
  head) when rows are few); the rows' tensors are built once per step (``md.rows()``).
  Quantized caches (``kv_quant``) are read as codes, their scales folded into the scores and
  probabilities. Where it does not apply (softcap, forced splits, no compiler) the torch path
  below runs; tests check both. Chunked rows use it too: a row's block table is shifted to
  start at its chunk (when chunks are whole blocks), so the kernel reads only that chunk.
  Triton (CUDA) has no chunk mask: chunked layers take the torch path there.

* **Decode tokens** (``query_len == 1``) of the step are batched. Rows are sorted by length and
  cut into chunks whose gathered K/V fit a cache-sized budget (:data:`KV_CHUNK_BYTES`): a chunk
  pads only to its own longest row, and its K/V are still in cache when the kernel reads them.
  A chunk gathers its blocks with ONE indexing op, masks keys past ``seq_len`` or outside the
  window, and runs one dense kernel with each KV head's ``G`` query heads as rows (GQA without
  repeating K/V).
* **Split-KV ("flash-decoding")**: a row's key range can be cut into ``num_kv_splits``
  segments that enter the kernel as extra rows (one call, more parallel work when a few long
  rows would leave threads idle — automatic then); each yields its normalised output and
  log-sum-exp, combined by :func:`merge_attn_states_multi`. The same merge joins the pieces a
  lone row longer than :data:`KV_CHUNK_BYTES` is read in, one gather at a time.
* **Prefill chunks** (``query_len > 1``, maybe after cached context) run one sequence at a
  time, tiled over queries. Without a window a tile is two dense calls merged by lse: the keys
  every row sees (no mask) and the diagonal square (causal, which the kernel skips by tiles).
  With a window a tile reads only the key range it can see, under an explicit mask.
"""

from __future__ import annotations

import torch

from pagedkv.ops import native
from pagedkv.ops.dense_attention import attend
from pagedkv.ops.kivi import kivi_attention
from pagedkv.ops.kv_gather import PagedKV
from pagedkv.ops.kv_quant import KVQuant
from pagedkv.ops.merge_attn_states import merge_attn_states, merge_attn_states_multi
from pagedkv.ops.metadata import AttentionMetadata, StepRows
from pagedkv.ops.triton import available as triton_available

# Gathered K+V bytes of one decode chunk: enough rows to amortise per-chunk overhead, few
# enough that the gather is still in cache when the kernel reads it.
KV_CHUNK_BYTES = 8 << 20
# Automatic split-KV never makes a segment shorter than this (merge work would dominate).
MIN_SPLIT_TOKENS = 256
# Prefill query tile: at most this many tokens (smaller causal squares leave less masked work
# to the kernel: -25% time for a 512-token prompt) and this many bytes of float32
# (query head × key) scores or mask.
PREFILL_TILE_TOKENS = 128
PREFILL_TILE_BYTES = 16 << 20


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    num_kv_splits: int | None = None,
    kv_quant: KVQuant | None = None,
    attention_chunk_size: int | None = None,
) -> torch.Tensor:
    """Causal attention of a flat batch of queries over their paged K/V.

    ``query [T, Hq, D]``; ``key_cache [NB, BS, Hkv, D]``, ``value_cache [NB, BS, Hkv, Dv]``
    (any strides, e.g. views from ``allocate_kv_cache``) already hold this step's K/V (call
    ``reshape_and_cache`` first). ``Hq = G·Hkv``: query head ``h`` uses KV head ``h // G``.
    K/V are read through ``attn_metadata.block_table``. ``num_kv_splits`` forces the number of
    KV segments per decode row (``None`` or 0: automatic; 1: never split).
    ``kv_quant``: the layer's quantized/rotated cache format (the caches are then ``uint8``
    parts, dequantized as they are read; a rotation is applied to the query and undone on
    the output). ``attention_chunk_size``: chunked local attention (a query sees only keys of
    its own chunk; exclusive with ``sliding_window``). Returns ``[T, Hq, Dv]`` in ``query.dtype``.
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if attention_chunk_size is not None and attention_chunk_size < 1:
        raise ValueError(f"attention_chunk_size must be >= 1, got {attention_chunk_size}")
    if attention_chunk_size is not None and sliding_window is not None:
        raise ValueError("attention_chunk_size and sliding_window are exclusive")
    # The Triton kernel has no chunk mask: chunked layers take the torch path on CUDA too.
    use_triton = query.device.type == "cuda" and triton_available() and attention_chunk_size is None
    if num_kv_splits is not None and num_kv_splits < 0:
        raise ValueError(f"num_kv_splits must be >= 0, got {num_kv_splits}")
    if query.shape[1] % key_cache.shape[2]:
        raise ValueError(
            f"{query.shape[1]} query heads is not a multiple of {key_cache.shape[2]} KV heads"
        )
    observer = attn_metadata.kv_observer
    if kv_quant is not None and kv_quant.fmt.mode.is_kivi:
        if sliding_window is not None or attention_chunk_size is not None or logits_soft_cap:
            raise ValueError(f"{kv_quant.fmt.mode.value} supports plain causal attention only")
        return kivi_attention(query, key_cache, value_cache, attn_metadata, scale, kv_quant)
    if kv_quant is not None and (kv_quant.fmt.quantized or kv_quant.rotation is not None):
        # Rotated keys: q·k = (Rq)·(Rk); the output Σp·Rv is rotated back.
        q = kv_quant.rotate(query)
        if observer is not None:
            observer(
                q, PagedKV.of(key_cache, value_cache, kv_quant), attn_metadata.block_size, scale
            )
        if use_triton:
            from pagedkv.ops.triton.unified_attention import paged_attention_triton

            out = paged_attention_triton(
                q,
                key_cache,
                value_cache,
                attn_metadata,
                scale,
                sliding_window,
                logits_soft_cap,
                num_kv_splits,
                kv_quant=kv_quant,
            )
        else:
            out = _attention(
                q,
                PagedKV.of(key_cache, value_cache, kv_quant),
                attn_metadata,
                scale,
                sliding_window,
                logits_soft_cap,
                num_kv_splits,
                attention_chunk_size,
            )
        return kv_quant.unrotate(out).to(query.dtype)
    if observer is not None:
        observer(query, PagedKV.of(key_cache, value_cache), attn_metadata.block_size, scale)
    if use_triton:
        from pagedkv.ops.triton.unified_attention import paged_attention_triton

        return paged_attention_triton(
            query,
            key_cache,
            value_cache,
            attn_metadata,
            scale,
            sliding_window,
            logits_soft_cap,
            num_kv_splits,
        )
    return _attention(
        query,
        PagedKV.of(key_cache, value_cache),
        attn_metadata,
        scale,
        sliding_window,
        logits_soft_cap,
        num_kv_splits,
        attention_chunk_size,
    )


def _attention(
    query: torch.Tensor,
    paged: PagedKV,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    num_kv_splits: int | None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The CPU/torch path of :func:`paged_attention` over ``paged`` (maybe quantized);
    ``chunk_size``: the attention chunk size (chunked local attention) or None."""
    num_tokens, num_heads, _ = query.shape
    out = query.new_empty(num_tokens, num_heads, paged.head_size_v)
    rows = md.rows()
    if rows.decode:
        _decode(
            query,
            out,
            paged,
            md,
            rows.decode,
            scale,
            sliding_window,
            soft_cap,
            num_kv_splits,
            chunk_size,
        )
    for i in rows.prefill:
        _prefill(query, out, paged, md, i, scale, sliding_window, soft_cap, chunk_size)
    return out


def _first_key(p: int, sliding_window: int | None, chunk_size: int | None) -> int:
    """The first key position a query at position ``p`` sees (keys up to ``p`` are visible)."""
    if sliding_window is not None:
        return max(0, p - sliding_window + 1)
    if chunk_size is not None:
        return p // chunk_size * chunk_size
    return 0


def _key_mask(
    key_pos: torch.Tensor,
    query_pos: torch.Tensor,
    sliding_window: int | None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``valid[..., r, l]``: key position ``k <= p`` and, with a window, ``p - k < w``; with
    an attention chunk size ``c``, ``k // c == p // c``.

    ``key_pos [L]`` and ``query_pos [..., R]`` (int64) → bool ``[..., R, L]``.
    """
    diff = query_pos.unsqueeze(-1) - key_pos  # p - k
    valid = diff >= 0
    if sliding_window is not None:
        valid &= diff < sliding_window
    if chunk_size is not None:
        valid &= (query_pos // chunk_size).unsqueeze(-1) == key_pos // chunk_size
    return valid


def _decode_chunks(
    seq_lens: list[int],
    rows: list[int],
    token_bytes: int,
    budget: int,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
) -> list[list[int]]:
    """Cut decode rows, sorted by length, into chunks whose padded gather fits ``budget``.

    A chunk gathers keys from the first one its shortest row sees (``len - w`` with a window,
    the start of its attention chunk with ``chunk_size``, else 0) up to its longest row's end,
    for every row. Sorting keeps that padding small; a row alone above the budget still gets a
    chunk of its own.
    """
    chunks: list[list[int]] = []
    cur: list[int] = []
    for i in sorted(rows, key=lambda i: seq_lens[i]):
        if cur:
            first = _first_key(seq_lens[cur[0]] - 1, sliding_window, chunk_size)
            if (len(cur) + 1) * (seq_lens[i] - first) * token_bytes > budget:
                chunks.append(cur)
                cur = []
        cur.append(i)
    if cur:
        chunks.append(cur)
    return chunks


def _auto_kv_splits(num_rows: int, num_kv_heads: int, num_keys: int) -> int:
    """KV segments per row so that a few long rows still give every thread work.

    The kernel parallelises over (row, KV head, segment) items: split only when there are
    fewer than two items per thread, and never below :data:`MIN_SPLIT_TOKENS` per segment.
    """
    items = num_rows * num_kv_heads
    want = -(-2 * torch.get_num_threads() // items)
    return max(1, min(want, num_keys // MIN_SPLIT_TOKENS))


def _decode(
    query: torch.Tensor,
    out: torch.Tensor,
    paged: PagedKV,
    md: AttentionMetadata,
    rows: list[int],
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    num_kv_splits: int | None,
    chunk_size: int | None = None,
) -> None:
    """Attention of all decode rows (one query token each), written into ``out``.

    Per-row tensors are built once, in chunk order; each chunk works on slices of them. A
    chunk's key range is read in pieces of at most :data:`KV_CHUNK_BYTES` (only a lone long
    row needs more than one), each cut into ``splits`` segments computed in one kernel call.
    """
    if (
        soft_cap is None
        and num_kv_splits in (None, 0)
        and _native_decode(query, out, paged, md.rows(), scale, sliding_window, chunk_size)
    ):
        return
    if md.contiguous:
        for i in rows:
            _contiguous_decode_row(
                query, out, paged, md, i, scale, sliding_window, soft_cap, chunk_size
            )
        return
    bs, dev = md.block_size, query.device
    chunks = _decode_chunks(
        md.seq_lens_cpu, rows, paged.token_bytes, KV_CHUNK_BYTES, sliding_window, chunk_size
    )
    order = [i for chunk in chunks for i in chunk]
    rows_t = torch.tensor(order, dtype=torch.int64, device=dev)
    tokens = torch.tensor([md.query_start_loc_cpu[i] for i in order], dtype=torch.int64, device=dev)
    q = query[tokens].unsqueeze(2)  # [S, Hq, 1, D]
    q_pos = (md.seq_lens[rows_t].to(torch.int64) - 1).view(-1, 1)  # [S, 1]
    table = md.block_table[rows_t]
    res = out.new_empty(len(order), out.shape[1], 1, out.shape[2])
    start = 0
    for chunk in chunks:
        rs = slice(start, start + len(chunk))
        start += len(chunk)
        lens = [md.seq_lens_cpu[i] for i in chunk]  # ascending
        lo = _first_key(lens[0] - 1, sliding_window, chunk_size)
        b0, b1 = lo // bs, -(-lens[-1] // bs)  # blocks holding a key some row can see
        splits = min(
            b1 - b0,
            num_kv_splits or _auto_kv_splits(len(chunk), paged.num_kv_heads, (b1 - b0) * bs),
        )
        piece = KV_CHUNK_BYTES // (len(chunk) * bs * paged.token_bytes)  # blocks per gather
        piece = max(splits, piece // splits * splits)
        parts = [
            _decode_piece(
                q[rs],
                q_pos[rs],
                table[rs],
                paged,
                p0,
                min(b1, p0 + piece),
                splits,
                scale,
                sliding_window,
                soft_cap,
                exact_lse=piece < b1 - b0,
                chunk_size=chunk_size,
            )
            for p0 in range(b0, b1, piece)
        ]
        if len(parts) == 1:
            res[rs] = parts[0][0]
        else:
            res[rs] = merge_attn_states_multi([o for o, _ in parts], [lse for _, lse in parts])[0]
    out[tokens] = res.squeeze(2)


def _contiguous_decode_row(
    query: torch.Tensor,
    out: torch.Tensor,
    paged: PagedKV,
    md: AttentionMetadata,
    i: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    chunk_size: int | None,
) -> None:
    """One decode row over a vmm row (``md.contiguous``): its visible keys are one slice of
    the row, read in place (the torch path where the native kernel does not apply)."""
    t, seq_len = md.query_start_loc_cpu[i], md.seq_lens_cpu[i]
    lo = _first_key(seq_len - 1, sliding_window, chunk_size)
    k, v = _row_kv(paged, md, i, lo, seq_len)
    q = query[t : t + 1].transpose(0, 1).unsqueeze(0)  # [1, Hq, 1, D]
    o, _ = attend(q, k, v, scale, soft_cap=soft_cap, exact_empty_lse=False)
    out[t] = o[0, :, 0].to(out.dtype)


def _row_kv(
    paged: PagedKV, md: AttentionMetadata, i: int, lo: int, hi: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values ``[lo, hi)`` of sequence ``i`` as ``[1, hi - lo, Hkv, D]``: a view of its
    vmm row (``md.contiguous``), else gathered from its blocks ``lo // bs ..``."""
    if md.contiguous:
        row = int(md.block_table[i, 0])
        return paged.key_cache[row : row + 1, lo:hi], paged.value_cache[row : row + 1, lo:hi]
    bs = md.block_size
    k, v = paged.gather(md.block_table[i : i + 1, lo // bs : -(-hi // bs)])
    base = lo // bs * bs
    return k[:, lo - base : hi - base], v[:, lo - base : hi - base]


def _native_decode(
    query: torch.Tensor,
    out: torch.Tensor,
    paged: PagedKV,
    rows: StepRows,
    scale: float,
    sliding_window: int | None,
    chunk_size: int | None = None,
) -> bool:
    """All decode rows through the native kernel (reads K/V in place: no gather, no padding,
    online softmax in float32; a quantized cache's codes are converted in registers, never
    dequantized into a copy). ``query`` is already rotated for a rotated cache. Returns False,
    having done nothing, where it does not apply (no library, a KV dtype or format the kernel
    lacks, a chunk size that is not whole blocks): the torch path below then runs.

    Chunked local attention: the kernel takes no per-row start, but a row's keys are exactly
    those of its chunk, so each row's block table is shifted to begin at its chunk's first
    block and its length cut to the tokens of that chunk (positions are already in q/k)."""
    if native.lib() is None or query.device.type != "cpu":
        return False
    table, lens = rows.block_table, rows.seq_lens
    if chunk_size is not None:
        bs = paged.key_cache.shape[1]
        if chunk_size % bs:
            return False
        skip = (
            (lens.to(torch.int64) - 1) // chunk_size * (chunk_size // bs)
        )  # blocks before its chunk
        cols = torch.arange(table.shape[1], device=table.device) + skip.unsqueeze(1)
        table = table.gather(1, cols.clamp_(max=table.shape[1] - 1))
        lens = lens - (skip * bs).to(lens.dtype)
    q = query if rows.all_decode else query[rows.tokens]
    res = native.paged_decode(
        q,
        paged.key_cache,
        paged.value_cache,
        table,
        lens,
        scale,
        sliding_window,
        kv_quant=paged.quant,
    )
    if res is None:
        return False
    if rows.all_decode:
        out.copy_(res[0])
    else:
        out[rows.tokens] = res[0].to(out.dtype)
    return True


def _decode_piece(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    table: torch.Tensor,
    paged: PagedKV,
    p0: int,
    p1: int,
    splits: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    exact_lse: bool,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode rows ``q [B, Hq, 1, D]`` over their key blocks ``[p0, p1)``, as ``splits``
    segments batched into one kernel call (flash-decoding) and merged by log-sum-exp.

    Returns ``(out [B, Hq, 1, Dv], lse [B, Hq, 1])``.
    """
    b, bs = q.shape[0], paged.key_cache.shape[1]
    seg = -(-(p1 - p0) // splits)  # blocks per segment
    blocks = table[:, p0:p1]
    if seg * splits > p1 - p0:
        # Pad with null blocks. Only a chunk's last piece can need it (the others are whole
        # multiples of ``splits``), so padded keys lie past every row's end: masked as future.
        blocks = torch.nn.functional.pad(blocks, (0, seg * splits - (p1 - p0)))
    k, v = paged.gather(blocks)  # [B, splits*seg*BS, Hkv, *]
    key_pos = torch.arange(p0 * bs, (p0 + seg * splits) * bs, device=q.device)
    valid = _key_mask(key_pos, q_pos, sliding_window, chunk_size)  # [B, 1, L]
    if splits > 1:  # segments become extra rows: [B*splits, L/splits, ...]
        seg_len = seg * bs
        k = k.reshape(b * splits, seg_len, *k.shape[2:])
        v = v.reshape(b * splits, seg_len, *v.shape[2:])
        valid = valid.view(b * splits, 1, seg_len)
        q = q.unsqueeze(1).expand(b, splits, *q.shape[1:]).reshape(b * splits, *q.shape[1:])
    o, lse = attend(
        q, k, v, scale, valid, soft_cap=soft_cap, exact_empty_lse=exact_lse or splits > 1
    )
    if splits == 1:
        return o, lse
    o = o.view(b, splits, *o.shape[1:]).transpose(0, 1)  # [splits, B, Hq, 1, Dv]
    lse = lse.view(b, splits, *lse.shape[1:]).transpose(0, 1)
    return merge_attn_states_multi(o, lse)


def _prefill(
    query: torch.Tensor,
    out: torch.Tensor,
    paged: PagedKV,
    md: AttentionMetadata,
    row: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    chunk_size: int | None = None,
) -> None:
    """Attention of one prefill chunk: ``q_len`` new tokens after ``ctx`` cached ones."""
    bs, dev = md.block_size, query.device
    t0, t1 = md.query_start_loc_cpu[row], md.query_start_loc_cpu[row + 1]
    seq_len, q_len = md.seq_lens_cpu[row], t1 - t0
    ctx = seq_len - q_len
    lo = _first_key(ctx, sliding_window, chunk_size)
    base = lo if md.contiguous else lo // bs * bs  # absolute position of key 0 of k/v
    k, v = _row_kv(paged, md, row, base, seq_len)
    q = query[t0:t1].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D] view
    tile = max(
        1, min(PREFILL_TILE_TOKENS, PREFILL_TILE_BYTES // (4 * query.shape[1] * (seq_len - base)))
    )
    for i0 in range(0, q_len, tile):
        i1 = min(q_len, i0 + tile)
        p0, p1 = ctx + i0, ctx + i1  # absolute positions of this tile's queries
        qt = q[:, :, i0:i1]
        if sliding_window is None and chunk_size is None:
            # Keys [0, p0) are visible to every row; [p0, p1) form a causal square.
            o, lse = attend(
                qt,
                k[:, p0 - base : p1 - base],
                v[:, p0 - base : p1 - base],
                scale,
                causal=True,
                soft_cap=soft_cap,
            )
            if p0 > 0:
                o_ctx, lse_ctx = attend(
                    qt, k[:, : p0 - base], v[:, : p0 - base], scale, soft_cap=soft_cap
                )
                o, lse = merge_attn_states(o_ctx, lse_ctx, o, lse)
        else:
            k0 = max(
                base, _first_key(p0, sliding_window, chunk_size)
            )  # first key the first row sees
            key_pos = torch.arange(k0, p1, device=dev)
            valid = _key_mask(key_pos, torch.arange(p0, p1, device=dev), sliding_window, chunk_size)
            o, _ = attend(
                qt,
                k[:, k0 - base : p1 - base],
                v[:, k0 - base : p1 - base],
                scale,
                valid,
                soft_cap=soft_cap,
                exact_empty_lse=False,
            )
        out[t0 + i0 : t0 + i1] = o[0].transpose(0, 1)
