"""Multi-head latent attention (DeepSeek-V2/V3 MLA) over a paged latent cache.

The cache of one layer holds ONE row per token, ``kv_cache [NB, BS, 1, L + R]`` =
``[kv_c | k_pe]``: the RMS-normed KV latent (``L = kv_lora_rank``) and the rotated shared RoPE
key (``R = qk_rope_head_dim``); vLLM's ``MLAAttentionSpec`` (one head, no V part). Each head's
key is ``[kv_c·W_UKᵀ | k_pe]`` and its value ``kv_c·W_UVᵀ``, where ``kv_b_proj.weight`` is
``[H·(P + V), L]`` = per head ``[W_UK (P rows); W_UV (V rows)]`` (``P = qk_nope_head_dim``,
``V = v_head_dim``). Two ways to compute the same attention (vLLM's ``forward_mha`` /
``forward_mqa``):

* **Prefill, expanded** (query_len > 1): the row's latents are read back from the paged cache
  and expanded by ``kv_b_proj`` into per-head K/V, then ordinary causal multi-head attention.
  Cached context (a prefix hit, earlier chunks of a chunked prefill) is expanded
  :data:`MLA_CONTEXT_CHUNK_TOKENS` at a time, so the expansion stays bounded; each context chunk
  and the new tokens' causal square give an output and a log-sum-exp, merged by
  :func:`~pagedkv.ops.merge_attn_states.merge_attn_states`.
* **Decode, absorbed** (query_len == 1): ``W_UK`` is folded into the query
  (``ql = q_nope·W_UK``, ``[H, L]`` per token), so attention is multi-query over the cache rows
  as they are: keys ``[kv_c | k_pe]`` against ``[ql | q_pe]``, values the ``kv_c`` columns of
  the same rows (a view, no copy). This is :func:`~pagedkv.ops.attention.paged_attention` with
  one KV head and ``Dv = L`` (on CPU the native decode kernel, which reads K and the V view in
  place). The result is mapped back per head by ``W_UV``. The softmax scale is the model's
  (``qk_head_dim**-0.5``, maybe YaRN-corrected), not ``(L + R)**-0.5``: the scores are equal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedkv.ops.attention import paged_attention
from pagedkv.ops.dense_attention import attend
from pagedkv.ops.merge_attn_states import merge_attn_states
from pagedkv.ops.metadata import AttentionMetadata

# Cached-context tokens expanded into per-head K/V at once in a prefill (bounds the expansion:
# DeepSeek-V3 expands 128 heads x 256 values per token, 128 KiB in float32).
MLA_CONTEXT_CHUNK_TOKENS = 1024


def concat_and_cache_mla(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write row ``[kv_c[t] | k_pe[t]]`` to slot ``slot_mapping[t]`` (vLLM's op of that name).

    ``kv_c [T, L]``, ``k_pe [T, R]``, ``kv_cache [NB, BS, 1, L + R]`` (any strides); a negative
    slot is skipped (padding). Values are cast to the cache dtype."""
    slots = slot_mapping.to(device=kv_cache.device, dtype=torch.int64)
    rows = torch.cat([kv_c, k_pe], dim=-1)
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        slots, rows = slots[keep], rows[keep]
    bs = kv_cache.shape[1]
    kv_cache[slots // bs, slots % bs, 0] = rows.to(kv_cache.dtype)


def mla_decode_metadata(md: AttentionMetadata) -> AttentionMetadata | None:
    """The step's decode rows as metadata of their own (``md`` itself when every token is a
    decode row; None when there is none). Build it once per step: every layer shares it."""
    rows = md.rows()
    if not rows.decode:
        return None
    if rows.all_decode:
        return md
    n, dev = len(rows.decode), md.seq_lens.device
    lens = [md.seq_lens_cpu[i] for i in rows.decode]
    return AttentionMetadata(
        slot_mapping=md.slot_mapping[rows.tokens],
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
        seq_lens=rows.seq_lens,
        block_table=rows.block_table,
        block_size=md.block_size,
        max_query_len=1,
        max_seq_len=max(lens),
        query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=lens,
    )


def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    kv_b_weight: torch.Tensor,
    scale: float,
    decode_md: AttentionMetadata | None = None,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Causal MLA of a flat batch over the paged latent cache (already holding this step's rows:
    call :func:`concat_and_cache_mla` first).

    ``q_nope [T, H, P]``, ``q_pe [T, H, R]`` (rotated), ``kv_cache [NB, BS, 1, L + R]``,
    ``kv_b_weight [H·(P + V), L]``. ``decode_md``: :func:`mla_decode_metadata` of ``md`` if the
    caller has it (computed here otherwise). ``num_kv_splits`` is passed to the decode
    ``paged_attention`` (1 forces its torch path). Returns ``[T, H, V]`` in ``q_nope.dtype``.
    """
    t, h, p = q_nope.shape
    r = q_pe.shape[-1]
    lat = kv_cache.shape[-1] - r  # L
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1:
        raise ValueError(f"MLA cache must be [NB, BS, 1, L + R], got {tuple(kv_cache.shape)}")
    if kv_b_weight.shape[1] != lat or kv_b_weight.shape[0] % h:
        raise ValueError(
            f"kv_b_weight {tuple(kv_b_weight.shape)} does not fit {h} heads and latent {lat}"
        )
    v_dim = kv_b_weight.shape[0] // h - p
    w = kv_b_weight.view(h, p + v_dim, lat)
    out = q_nope.new_empty(t, h, v_dim)
    rows = md.rows()
    if rows.decode:
        dmd = decode_md if decode_md is not None else mla_decode_metadata(md)
        tokens = None if rows.all_decode else rows.tokens
        qn = q_nope if tokens is None else q_nope[tokens]
        qp = q_pe if tokens is None else q_pe[tokens]
        ql = torch.bmm(qn.transpose(0, 1), w[:, :p]).transpose(0, 1)  # q_nope·W_UK: [S, H, L]
        q = torch.cat([ql, qp.to(ql.dtype)], dim=-1)
        o = paged_attention(
            q, kv_cache, kv_cache[..., :lat], dmd, scale, num_kv_splits=num_kv_splits
        )
        o = torch.bmm(o.transpose(0, 1), w[:, p:].transpose(1, 2)).transpose(
            0, 1
        )  # ·W_UVᵀ: [S, H, V]
        if tokens is None:
            out.copy_(o)
        else:
            out[tokens] = o.to(out.dtype)
    for i in rows.prefill:
        _prefill(q_nope, q_pe, kv_cache, md, i, kv_b_weight, scale, out)
    return out


def expand_kv(
    latent: torch.Tensor, kv_b_weight: torch.Tensor, num_heads: int, nope: int, pad_v_to: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head ``(k [N, H, P + R], v [N, H, max(V, pad_v_to)])`` from latent rows
    ``[N, L + R]``: ``k = [kv_c·W_UKᵀ | k_pe]``, ``v = kv_c·W_UVᵀ`` (zero-padded so torch's flash
    kernel, which wants ``Dv == D``, takes it; the padding's output columns are 0)."""
    n, lat = latent.shape[0], kv_b_weight.shape[1]
    kv = F.linear(latent[:, :lat], kv_b_weight).view(n, num_heads, -1)
    k_pe = latent[:, None, lat:].expand(n, num_heads, latent.shape[1] - lat)
    k = torch.cat([kv[..., :nope], k_pe], dim=-1)
    v = kv[..., nope:]
    if v.shape[-1] < pad_v_to:
        v = F.pad(v, (0, pad_v_to - v.shape[-1]))
    return k, v


def _prefill(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    row: int,
    kv_b_weight: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Expanded attention of prefill chunk ``row``: its new tokens' causal square, merged by
    log-sum-exp with its cached context taken :data:`MLA_CONTEXT_CHUNK_TOKENS` at a time."""
    t0, t1 = md.query_start_loc_cpu[row], md.query_start_loc_cpu[row + 1]
    seq_len, h, p = md.seq_lens_cpu[row], q_nope.shape[1], q_nope.shape[2]
    ctx, bs = seq_len - (t1 - t0), md.block_size
    nb = -(-seq_len // bs)
    blocks = md.block_table[row, :nb].to(device=kv_cache.device, dtype=torch.int64)
    latent = kv_cache.index_select(0, blocks).reshape(nb * bs, kv_cache.shape[-1])[:seq_len]
    q = (
        torch.cat([q_nope[t0:t1], q_pe[t0:t1].to(q_nope.dtype)], dim=-1)
        .transpose(0, 1)
        .unsqueeze(0)
    )
    d, v_dim = q.shape[-1], out.shape[-1]

    def part(k0: int, k1: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = expand_kv(latent[k0:k1].to(q.dtype), kv_b_weight, h, p, pad_v_to=d)
        return attend(q, k.unsqueeze(0), v.unsqueeze(0), scale, causal=causal)

    o, lse = part(ctx, seq_len, True)  # keys [ctx, seq_len): top-left causal = position causal
    for c0 in range(0, ctx, MLA_CONTEXT_CHUNK_TOKENS):
        o_ctx, lse_ctx = part(c0, min(ctx, c0 + MLA_CONTEXT_CHUNK_TOKENS), False)
        o, lse = merge_attn_states(o_ctx, lse_ctx, o, lse)
    out[t0:t1] = o[0, :, :, :v_dim].transpose(0, 1).to(out.dtype)
