"""Helpers shared by the engine tests on tiny random-weight models (hybrid Qwen2, Gemma)."""

from __future__ import annotations

import torch

from pagedkv import LLM


def random_prompts(vocab: int, seed: int, lens: list[int], shared: int = 0) -> list[list[int]]:
    """Prompts of random token ids below ``vocab``, of lengths ``lens``, all starting with the
    same ``shared`` tokens (a prefix-cache hit after the first)."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (shared,), generator=gen).tolist()
    return [prefix + torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


def check_clean(llm: LLM) -> None:
    """The pool is all free (the null block aside) and its invariants hold."""
    kv = llm.llm_engine.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.block_pool.num_gpu_blocks - 1
