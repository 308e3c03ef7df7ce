"""Unified paged attention in Triton: one launch for a flat batch of prefill chunks (with cached
context) and decode rows, in the shape of vLLM's ``triton_unified_attention``.

Work split (vLLM §10.2):

* A program handles ``BLOCK_Q`` query tokens × the ``G = Hq/Hkv`` query heads of ONE KV head
  (GQA packing: ``BLOCK_M = BLOCK_Q·G`` rows share every K/V tile load; see :func:`tiling`). The grid's first axis
  ``T // BLOCK_Q + num_seqs`` bounds the number of q-blocks; each program finds its sequence by
  binary search over ``query_start_loc`` (sequence ``i``'s q-blocks start at
  ``query_start_loc[i] // BLOCK_Q + i``) and surplus programs exit at once.
* Keys are read ``TILE_SIZE`` at a time through the block table (``block_table[seq, pos //
  BLOCK_SIZE]``, offset ``pos % BLOCK_SIZE``; any cache strides). Only tiles some row of the
  q-block can see are visited (causal end, sliding-window start). Online softmax in float32.
* **Split-KV** (flash-decoding, vLLM's "3D" kernel): with ``NUM_SEGMENTS > 1`` a third grid axis
  cuts each sequence's tiles into segments; each writes its unnormalised ``acc``, running max
  ``M`` and sum ``L`` to float32 scratch and :func:`_reduce_segments` merges them by
  log-sum-exp. Chosen automatically for short-query batches whose 2D grid would leave the GPU
  idle (few long decodes), or forced by ``num_kv_splits``.

Quantized caches (``kv_quant``, :func:`_unified_attention_kvq`): tiles are read as bytes and
dequantized in registers (``ops/triton/kv_quant.py``); per-token scales multiply the scores
(K) and the probabilities (V), so the dot operands stay exact integer/fp8 codes.

Semantics match ``pagedkv.ops.attention.paged_attention``: a query at position ``p`` sees keys
``k <= p`` and, with window ``w``, ``p - k < w``; logits ``scale·q·k`` are soft-capped before
masking.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.ops.kv_quant import KVQuant
from pagedkv.ops.metadata import AttentionMetadata
from pagedkv.ops.triton.kv_quant import (
    KV_NONE,
    check_quantized_caches,
    dequant_tile,
    kvq_constexprs,
    mode_code,
)
from pagedkv.ops.triton.utils import apply_softcap, dot_dtype, find_seq_idx, pow2

# Queries per sequence up to which split-KV may be used (vLLM's MAX_3D_QUERY_LEN).
MAX_SPLIT_QUERY_LEN = 8
# Segments per sequence when splitting automatically (vLLM's NUM_PAR_SOFTMAX_SEGMENTS).
NUM_PAR_SOFTMAX_SEGMENTS = 16
# Below this many (q-block, KV head) programs a 2D launch under-fills a GPU: split instead.
MIN_LAUNCH_GRID_SIZE_2D = 128


@triton.jit
def _unified_attention(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    segm_out_ptr,
    segm_max_ptr,
    segm_expsum_ptr,
    scale,
    softcap,
    num_seqs,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_k_b,
    stride_k_n,
    stride_k_h,
    stride_v_b,
    stride_v_n,
    stride_v_h,
    stride_bt,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_V: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    HEAD_PAD_V: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Float caches (the cache dtype is read as is)."""
    _attend(
        out_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        block_table_ptr,
        seq_lens_ptr,
        query_start_loc_ptr,
        segm_out_ptr,
        segm_max_ptr,
        segm_expsum_ptr,
        scale,
        softcap,
        num_seqs,
        stride_q_t,
        stride_q_h,
        stride_o_t,
        stride_o_h,
        stride_k_b,
        stride_k_n,
        stride_k_h,
        stride_v_b,
        stride_v_n,
        stride_v_h,
        stride_bt,
        1.0,
        1.0,
        NUM_Q_HEADS,
        GROUP,
        HEAD_SIZE,
        HEAD_SIZE_V,
        HEAD_PAD,
        HEAD_PAD_V,
        BLOCK_SIZE,
        TILE_SIZE,
        BLOCK_Q,
        BLOCK_M,
        SLIDING_WINDOW,
        USE_SOFTCAP,
        NUM_SEGMENTS,
        DOT_DTYPE,
        DOT_PREC,
        KV_NONE,
        1,
        1,
        False,
    )


@triton.jit
def _unified_attention_kvq(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    segm_out_ptr,
    segm_max_ptr,
    segm_expsum_ptr,
    scale,
    softcap,
    num_seqs,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_k_b,
    stride_k_n,
    stride_k_h,
    stride_v_b,
    stride_v_n,
    stride_v_h,
    stride_bt,
    k_scale,
    v_scale,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_V: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    HEAD_PAD_V: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_MODE: tl.constexpr,
    K_GROUP: tl.constexpr,
    V_GROUP: tl.constexpr,
    E5M2: tl.constexpr,
):
    """Quantized caches: ``uint8`` parts (strides in bytes) in format ``KV_MODE``
    (``ops/triton/kv_quant.py``); ``k_scale``/``v_scale`` the per-tensor fp8 scales."""
    _attend(
        out_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        block_table_ptr,
        seq_lens_ptr,
        query_start_loc_ptr,
        segm_out_ptr,
        segm_max_ptr,
        segm_expsum_ptr,
        scale,
        softcap,
        num_seqs,
        stride_q_t,
        stride_q_h,
        stride_o_t,
        stride_o_h,
        stride_k_b,
        stride_k_n,
        stride_k_h,
        stride_v_b,
        stride_v_n,
        stride_v_h,
        stride_bt,
        k_scale,
        v_scale,
        NUM_Q_HEADS,
        GROUP,
        HEAD_SIZE,
        HEAD_SIZE_V,
        HEAD_PAD,
        HEAD_PAD_V,
        BLOCK_SIZE,
        TILE_SIZE,
        BLOCK_Q,
        BLOCK_M,
        SLIDING_WINDOW,
        USE_SOFTCAP,
        NUM_SEGMENTS,
        DOT_DTYPE,
        DOT_PREC,
        KV_MODE,
        K_GROUP,
        V_GROUP,
        E5M2,
    )


@triton.jit
def _attend(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    segm_out_ptr,
    segm_max_ptr,
    segm_expsum_ptr,
    scale,
    softcap,
    num_seqs,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_k_b,
    stride_k_n,
    stride_k_h,
    stride_v_b,
    stride_v_n,
    stride_v_h,
    stride_bt,
    k_scale,
    v_scale,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_V: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    HEAD_PAD_V: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_MODE: tl.constexpr,
    K_GROUP: tl.constexpr,
    V_GROUP: tl.constexpr,
    E5M2: tl.constexpr,
):
    """One program of :func:`_unified_attention` / :func:`_unified_attention_kvq` (the two
    kernels keep the float kernel's signature apart from the quantized one's)."""
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)
    segm = tl.program_id(2)

    seq_idx = find_seq_idx(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q, True)
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    query_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    q_block_local = q_block_global - (q_start // BLOCK_Q + seq_idx)
    if q_block_local * BLOCK_Q >= query_len:
        return  # a surplus program of the upper-bound grid
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_M)
    query_pos = q_block_local * BLOCK_Q + offs_m // GROUP  # index inside this sequence's queries
    head = kv_head * GROUP + offs_m % GROUP
    # BLOCK_M may exceed BLOCK_Q·G (G not a power of two): those rows belong to no q-block.
    row_mask = (offs_m < BLOCK_Q * GROUP) & (query_pos < query_len)
    abs_pos = context_len + query_pos  # absolute position of each row's query token
    token = (q_start + query_pos).to(tl.int64)

    offs_d = tl.arange(0, HEAD_PAD)
    offs_dv = tl.arange(0, HEAD_PAD_V)
    d_mask = offs_d < HEAD_SIZE
    dv_mask = offs_dv < HEAD_SIZE_V
    q = tl.load(
        q_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    # Keys some row of this q-block can see: [kv_start, kv_end).
    first_pos = context_len + q_block_local * BLOCK_Q
    kv_end = context_len + tl.minimum(q_block_local * BLOCK_Q + BLOCK_Q, query_len)
    tile_lo: tl.int32 = 0
    if SLIDING_WINDOW > 0:
        tile_lo = tl.maximum(first_pos - SLIDING_WINDOW + 1, 0) // TILE_SIZE
    tile_hi = tl.cdiv(kv_end, TILE_SIZE)
    if NUM_SEGMENTS > 1:
        tiles_per_segment = tl.cdiv(seq_len, NUM_SEGMENTS * TILE_SIZE)
        seg_lo = segm * tiles_per_segment
        if seg_lo * TILE_SIZE >= seq_len:
            return  # past the sequence: _reduce_segments never reads this segment
        tile_lo = tl.maximum(tile_lo, seg_lo)
        tile_hi = tl.minimum(tile_hi, seg_lo + tiles_per_segment)

    M = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    L = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD_V], dtype=tl.float32)
    for j in range(tile_lo, tile_hi):
        offs_n = j * TILE_SIZE + tl.arange(0, TILE_SIZE)
        n_mask = offs_n < kv_end
        blk = tl.load(
            block_table_ptr + seq_idx * stride_bt + offs_n // BLOCK_SIZE, mask=n_mask, other=0
        ).to(tl.int64)
        in_blk = offs_n % BLOCK_SIZE
        k_off = blk * stride_k_b + in_blk * stride_k_n + kv_head * stride_k_h
        v_off = blk * stride_v_b + in_blk * stride_v_n + kv_head * stride_v_h
        if KV_MODE == KV_NONE:
            K = tl.load(
                k_ptr + k_off[None, :] + offs_d[:, None],
                mask=d_mask[:, None] & n_mask[None, :],
                other=0.0,
            )
            V = tl.load(
                v_ptr + v_off[:, None] + offs_dv[None, :],
                mask=n_mask[:, None] & dv_mask[None, :],
                other=0.0,
            )
            S = tl.dot(q, K.to(DOT_DTYPE), input_precision=DOT_PREC) * scale
        else:
            # Tiles stay codes where the scale is per token (exact in DOT_DTYPE): the K scale
            # multiplies the scores, the V scale the probabilities (vLLM's Triton backend).
            K, k_tok = dequant_tile(
                k_ptr, k_off, n_mask, offs_d, d_mask, k_scale, 1, KV_MODE, HEAD_SIZE, K_GROUP, E5M2
            )
            V, v_tok = dequant_tile(
                v_ptr,
                v_off,
                n_mask,
                offs_dv,
                dv_mask,
                v_scale,
                0,
                KV_MODE,
                HEAD_SIZE_V,
                V_GROUP,
                E5M2,
            )
            S = tl.dot(q, K.to(DOT_DTYPE), input_precision=DOT_PREC) * (scale * k_tok)
        if USE_SOFTCAP:
            S = apply_softcap(S, softcap)
        visible = row_mask[:, None] & (offs_n[None, :] <= abs_pos[:, None])
        if SLIDING_WINDOW > 0:
            visible = visible & (abs_pos[:, None] - offs_n[None, :] < SLIDING_WINDOW)
        S = tl.where(visible, S, float("-inf"))
        # Online softmax. M stays -inf while a row has seen no key; shift by 0 then (exp(-inf)=0).
        m_new = tl.maximum(M, tl.max(S, 1))
        shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        P = tl.exp(S - shift[:, None])
        alpha = tl.exp(M - shift)
        L = L * alpha + tl.sum(P, 1)
        if KV_MODE != KV_NONE:
            P = P * v_tok  # after L: the V scale weighs values, not probabilities
        acc = acc * alpha[:, None] + tl.dot(
            P.to(DOT_DTYPE), V.to(DOT_DTYPE), input_precision=DOT_PREC
        )
        M = m_new

    if NUM_SEGMENTS > 1:
        # Scratch [T, Hq, NUM_SEGMENTS, HEAD_PAD_V] (+ [T, Hq, NUM_SEGMENTS] for M and L).
        seg_row = (token * NUM_Q_HEADS + head) * NUM_SEGMENTS + segm
        tl.store(
            segm_out_ptr + seg_row[:, None] * HEAD_PAD_V + offs_dv[None, :],
            acc,
            mask=row_mask[:, None] & dv_mask[None, :],
        )
        tl.store(segm_max_ptr + seg_row, M, mask=row_mask)
        tl.store(segm_expsum_ptr + seg_row, L, mask=row_mask)
    else:
        # Every real row sees at least its own key (L > 0); masked rows would divide 0 by 0.
        o = acc / tl.where(L > 0.0, L, 1.0)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_dv[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & dv_mask[None, :],
        )


@triton.jit
def _reduce_segments(
    out_ptr,
    segm_out_ptr,
    segm_max_ptr,
    segm_expsum_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    num_seqs,
    stride_o_t,
    stride_o_h,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_SIZE_V: tl.constexpr,
    HEAD_PAD_V: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    """Merge one (token, query head)'s segments: ``Σ w_s·acc_s / Σ w_s·L_s`` with
    ``w_s = exp(M_s - max M)``; 0 where no segment saw a key."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_idx = find_seq_idx(query_start_loc_ptr, token, num_seqs, 1, False)
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    tiles_per_segment = tl.cdiv(seq_len, NUM_SEGMENTS * TILE_SIZE)
    num_valid = tl.cdiv(seq_len, tiles_per_segment * TILE_SIZE)  # segments that ran

    offs_s = tl.arange(0, NUM_SEGMENTS)
    s_mask = offs_s < num_valid
    offs_dv = tl.arange(0, HEAD_PAD_V)
    dv_mask = offs_dv < HEAD_SIZE_V
    row = (token * NUM_Q_HEADS + head) * NUM_SEGMENTS + offs_s
    m = tl.load(segm_max_ptr + row, mask=s_mask, other=float("-inf"))
    g = tl.max(m, 0)
    w = tl.exp(m - tl.where(g > float("-inf"), g, 0.0))
    denom = tl.sum(tl.load(segm_expsum_ptr + row, mask=s_mask, other=0.0) * w, 0)
    acc = tl.load(
        segm_out_ptr + row[:, None] * HEAD_PAD_V + offs_dv[None, :],
        mask=s_mask[:, None] & dv_mask[None, :],
        other=0.0,
    )
    num = tl.sum(acc * w[:, None], 0)
    o = tl.where(denom > 0.0, num / tl.where(denom > 0.0, denom, 1.0), 0.0)
    tl.store(
        out_ptr + token * stride_o_t + head * stride_o_h + offs_dv,
        o.to(out_ptr.dtype.element_ty),
        mask=dv_mask,
    )


def tiling(group: int, max_query_len: int, head_bytes: int = 256) -> tuple[int, int]:
    """``(BLOCK_M, TILE_SIZE)``: query rows (tokens × the ``group`` heads of a KV head) per
    program and keys per iteration. Decode-only batches: vLLM's 16 rows (``pow2(group)`` if
    larger) and 16 keys. Batches with prefill chunks longer than
    :data:`MAX_SPLIT_QUERY_LEN`: 64 rows × 64 keys, so a K/V tile read from memory serves 64 /
    ``group`` query tokens instead of 16 / ``group`` (prefill is then compute-bound, not
    bandwidth-bound), or 32 keys where a padded head row exceeds ``256`` bytes
    (``head_bytes``: float32 or D > 128), to fit the shared memory of consumer GPUs (~100 KiB);
    short chunks in between: 16 × 32."""
    if max_query_len > MAX_SPLIT_QUERY_LEN:
        return max(64, pow2(group)), 64 if head_bytes <= 256 else 32
    return max(16, pow2(group)), 16 if max_query_len == 1 else 32


def _num_segments(
    num_seqs: int,
    num_kv_heads: int,
    max_query_len: int,
    max_seq_len: int,
    block_q: int,
    tile: int,
    num_kv_splits: int | None,
) -> int:
    """Segments per sequence: forced (``num_kv_splits > 0``, rounded up to a power of two) or,
    automatically, :data:`NUM_PAR_SOFTMAX_SEGMENTS` when the queries are short and the 2D grid
    would be under :data:`MIN_LAUNCH_GRID_SIZE_2D` programs; never more than the longest
    sequence has tiles. 1 means the plain 2D launch."""
    if num_kv_splits:
        return pow2(num_kv_splits)
    q_blocks = num_seqs * triton.cdiv(max_query_len, block_q)
    if max_query_len > MAX_SPLIT_QUERY_LEN or q_blocks * num_kv_heads >= MIN_LAUNCH_GRID_SIZE_2D:
        return 1
    tiles = triton.cdiv(max_seq_len, tile)
    return min(NUM_PAR_SOFTMAX_SEGMENTS, 1 << (tiles.bit_length() - 1))


def unified_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
    kv_quant: KVQuant | None = None,
) -> torch.Tensor:
    """Causal paged attention of ``query [T, Hq, D]`` over ``key_cache [NB, BS, Hkv, D]`` /
    ``value_cache [NB, BS, Hkv, Dv]`` (any strides with a unit last stride; the caches already
    hold this step's K/V). ``query_start_loc [S+1]`` (cu_seqlens_q), ``seq_lens [S]`` (context
    + new) and ``block_table [S, max_blocks]`` are vLLM's. ``num_kv_splits``: ``None``/0 auto,
    1 never split, ``n`` split into ``n`` segments (rounded up to a power of two).
    Returns (or fills) ``out [T, Hq, Dv]`` in ``query.dtype``.

    ``kv_quant`` with a quantized format: the caches are its ``uint8`` parts
    ``[NB, BS, Hkv, k_bytes|v_bytes]``, dequantized in registers as tiles are read. The
    kernel attends over the stored (rotated) values as they are: the caller
    rotates the query, and un-rotates the output (``KVQuant``).
    """
    num_tokens, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, head_size_v = value_cache.shape
    kv_mode = mode_code(kv_quant)
    if kv_mode:
        check_quantized_caches(kv_quant, key_cache, value_cache)
        if head_size != kv_quant.fmt.head_size:
            raise ValueError(f"query head size {head_size} != cache's {kv_quant.fmt.head_size}")
        head_size_v = kv_quant.fmt.head_size_v
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("K/V caches need a unit stride along the head dimension")
    if out is None:
        out = query.new_empty(num_tokens, num_heads, head_size_v)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    head_pad, head_pad_v = pow2(head_size, 16), pow2(head_size_v, 16)
    block_m, tile = tiling(
        group,
        max_query_len,
        max(head_pad, head_pad_v) * max(query.element_size(), key_cache.element_size()),
    )
    block_q = block_m // group
    segments = _num_segments(
        num_seqs, num_kv_heads, max_query_len, max_seq_len, block_q, tile, num_kv_splits
    )
    if segments > 1:
        segm_out = torch.empty(
            num_tokens, num_heads, segments, head_pad_v, dtype=torch.float32, device=query.device
        )
        segm_max = torch.empty(
            num_tokens, num_heads, segments, dtype=torch.float32, device=query.device
        )
        segm_expsum = torch.empty_like(segm_max)
    else:
        segm_out = segm_max = segm_expsum = out  # unused: NUM_SEGMENTS == 1 never touches them
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, segments)
    kernel, quant_args, quant_consts = _unified_attention, (), {}
    if kv_mode:
        kernel, quant_args = _unified_attention_kvq, (kv_quant.k_scale, kv_quant.v_scale)
        quant_consts = kvq_constexprs(kv_quant)
    kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        segm_out,
        segm_max,
        segm_expsum,
        scale,
        soft_cap or 1.0,
        num_seqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_table.stride(0),
        *quant_args,
        NUM_Q_HEADS=num_heads,
        GROUP=group,
        HEAD_SIZE=head_size,
        HEAD_SIZE_V=head_size_v,
        HEAD_PAD=head_pad,
        HEAD_PAD_V=head_pad_v,
        BLOCK_SIZE=block_size,
        TILE_SIZE=tile,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        SLIDING_WINDOW=sliding_window or 0,
        USE_SOFTCAP=soft_cap is not None,
        NUM_SEGMENTS=segments,
        DOT_DTYPE=dot_dtype(query.dtype),
        # fp32 caches: exact fp32 products (tf32 would miss the engine's exactness bar).
        DOT_PREC="ieee" if query.dtype == torch.float32 else "tf32",
        **quant_consts,
    )
    if segments > 1:
        _reduce_segments[(num_tokens, num_heads)](
            out,
            segm_out,
            segm_max,
            segm_expsum,
            seq_lens,
            query_start_loc,
            num_seqs,
            out.stride(0),
            out.stride(1),
            NUM_Q_HEADS=num_heads,
            HEAD_SIZE_V=head_size_v,
            HEAD_PAD_V=head_pad_v,
            TILE_SIZE=tile,
            NUM_SEGMENTS=segments,
        )
    return out


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    num_kv_splits: int | None = None,
    kv_quant: KVQuant | None = None,
) -> torch.Tensor:
    """``pagedkv.ops.attention.paged_attention``'s contract on the Triton kernel, except that
    a ``kv_quant`` rotation is the caller's (see :func:`unified_attention`)."""
    md = attn_metadata
    return unified_attention(
        query,
        key_cache,
        value_cache,
        md.query_start_loc,
        md.seq_lens,
        md.block_table,
        md.max_query_len,
        md.max_seq_len,
        scale,
        sliding_window,
        logits_soft_cap,
        num_kv_splits,
        kv_quant=kv_quant,
    )
