"""Dense reference attention and a builder of random paged batches (tests only).

The reference is deliberately naive: per sequence, contiguous K/V in float64, an explicit
position mask, a plain softmax. Paged kernels are checked against it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from pagedkv.ops.kv_cache import allocate_kv_cache
from pagedkv.ops.metadata import AttentionMetadata


def ref_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: ``q [Lq, Hq, D]`` are the last ``Lq`` of ``k [L, Hkv, D]``'s positions.

    Returns ``(out [Lq, Hq, Dv], lse [Lq, Hq])`` in float64. Query ``i`` sits at position
    ``p = L - Lq + i`` and sees key ``j`` iff ``j <= p`` and (window) ``p - j < w``.
    """
    lq, hq, _ = q.shape
    n, hkv, _ = k.shape
    g = hq // hkv
    kk = k.double().repeat_interleave(g, dim=1)  # [L, Hq, D]: the naive GQA
    vv = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if soft_cap is not None:
        s = soft_cap * torch.tanh(s / soft_cap)
    p = torch.arange(n - lq, n).view(-1, 1)
    j = torch.arange(n).view(1, -1)
    visible = j <= p
    if sliding_window is not None:
        visible &= (p - j) < sliding_window
    s = s.masked_fill(~visible, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vv)
    return out, torch.logsumexp(s, dim=-1).transpose(0, 1)


@dataclass
class PagedBatch:
    """A random mixed batch: dense per-sequence K/V plus the same data in a paged cache."""

    query: torch.Tensor  # [T, Hq, D]
    keys: list[torch.Tensor]  # per sequence [seq_len, Hkv, D]
    values: list[torch.Tensor]  # per sequence [seq_len, Hkv, Dv]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    md: AttentionMetadata

    def reference(
        self, scale: float, sliding_window: int | None = None, soft_cap: float | None = None
    ) -> torch.Tensor:
        qsl = self.md.query_start_loc_cpu
        outs = [
            ref_attention(
                self.query[qsl[i] : qsl[i + 1]],
                self.keys[i],
                self.values[i],
                scale,
                sliding_window,
                soft_cap,
            )[0]
            for i in range(self.md.num_seqs)
        ]
        return torch.cat(outs)


def make_paged_batch(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_size: int,
    dtype: torch.dtype,
    layout: str | None,
    shared_prefix: bool,
    seed: int,
    head_size_v: int | None = None,
) -> PagedBatch:
    """Build a batch whose blocks are a random permutation of the pool (block 0 = null).

    ``layout=None`` allocates K and V as two separate contiguous caches; otherwise one flat
    buffer in that layout. With ``shared_prefix`` each sequence after the first shares its
    leading full blocks (ids and contents) with the previous one, like a prefix-cache hit.
    Unused cache memory holds finite garbage so that a missing mask shows up.
    """
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    dv = head_size if head_size_v is None else head_size_v
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    if layout is None:
        key_cache = torch.empty(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype)
        value_cache = torch.empty(num_blocks, block_size, num_kv_heads, dv, dtype=dtype)
    else:
        _, views = allocate_kv_cache(
            layout, 1, num_blocks, block_size, num_kv_heads, head_size, dtype, head_size_v=dv
        )
        key_cache, value_cache = views[0]
    key_cache.copy_(torch.randn(key_cache.shape, generator=gen) * 30)
    value_cache.copy_(torch.randn(value_cache.shape, generator=gen) * 30)

    free = list(range(1, num_blocks))
    rnd.shuffle(free)
    table = torch.zeros(len(seq_lens), max(blocks_per_seq) + rnd.randint(0, 2), dtype=torch.int32)
    keys, values = [], []
    for i, n in enumerate(seq_lens):
        k = torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, dv, generator=gen).to(dtype)
        ids = [free.pop() for _ in range(blocks_per_seq[i])]
        if shared_prefix and i > 0:
            full = min(seq_lens[i - 1], n) // block_size
            n_shared = rnd.randint(0, full)
            ids[:n_shared] = table[i - 1, :n_shared].tolist()
            k[: n_shared * block_size] = keys[i - 1][: n_shared * block_size]
            v[: n_shared * block_size] = values[i - 1][: n_shared * block_size]
        table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        for pos in range(n):  # deliberately naive writes, independent of reshape_and_cache
            key_cache[ids[pos // block_size], pos % block_size] = k[pos]
            value_cache[ids[pos // block_size], pos % block_size] = v[pos]
        keys.append(k)
        values.append(v)

    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    query = torch.randn(qsl[-1], num_kv_heads * group, head_size, generator=gen).to(dtype)
    slots = [
        table[i, p // block_size].item() * block_size + p % block_size
        for i, (n, lq) in enumerate(zip(seq_lens, query_lens))
        for p in range(n - lq, n)
    ]
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table,
        block_size=block_size,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens),
    )
    return PagedBatch(query, keys, values, key_cache, value_cache, md)
