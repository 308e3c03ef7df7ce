"""DCP attention's split (past shard, non-causal + the step's own tokens, causal) and its LSE
merge, in one process: with a group of one rank the past is the whole context, so the result
must equal ordinary paged attention over the same cache (the multi-rank runs are in
test_tensor_parallel.py)."""

from __future__ import annotations

import torch

from pagedkv.distributed.parallel_state import GroupCoordinator
from pagedkv.ops.attention import paged_attention
from pagedkv.ops.cache import reshape_and_cache
from pagedkv.ops.dcp_attention import dcp_paged_attention
from pagedkv.ops.metadata import AttentionMetadata


def test_single_rank_dcp_attention_equals_paged_attention() -> None:
    g = torch.Generator().manual_seed(0)
    bs, hkv, hq, d, nb = 4, 1, 4, 16, 64
    kc = torch.zeros(nb, bs, hkv, d)
    vc = torch.zeros(nb, bs, hkv, d)
    # three sequences: a decode row after 37 tokens, a prefill chunk of 6 after 10, a fresh prompt
    starts, lens = [37, 10, 0], [1, 6, 9]
    tables, slots, q_rows, k_rows, v_rows = [], [], [], [], []
    next_block = 1
    for start, n in zip(starts, lens):
        blocks = list(range(next_block, next_block + (start + n + bs - 1) // bs))
        next_block += len(blocks)
        tables.append(blocks)
        past_k = torch.randn(start, hkv, d, generator=g)
        past_v = torch.randn(start, hkv, d, generator=g)
        past_slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(start)])
        reshape_and_cache(past_k, past_v, kc, vc, past_slots)
        slots += [blocks[p // bs] * bs + p % bs for p in range(start, start + n)]
        q_rows.append(torch.randn(n, hq, d, generator=g))
        k_rows.append(torch.randn(n, hkv, d, generator=g))
        v_rows.append(torch.randn(n, hkv, d, generator=g))
    q, k, v = torch.cat(q_rows), torch.cat(k_rows), torch.cat(v_rows)
    width = max(map(len, tables))
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    seq_lens = [s + n for s, n in zip(starts, lens)]
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=bs,
        max_query_len=max(lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        dcp_local_context_lens=starts,  # one rank holds every past token
    )
    reshape_and_cache(k, v, kc, vc, md.slot_mapping)
    want = paged_attention(q, kc, vc, md, d**-0.5)
    got = dcp_paged_attention(q, k, v, kc, vc, md, d**-0.5, GroupCoordinator.single(), (hq,))
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
