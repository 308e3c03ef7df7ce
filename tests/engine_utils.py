"""Helpers shared by the engine tests on tiny random-weight models (hybrid Qwen2, Gemma)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedkv import LLM


def random_prompts(vocab: int, seed: int, lens: list[int], shared: int = 0) -> list[list[int]]:
    """Prompts of random token ids below ``vocab``, of lengths ``lens``, all starting with the
    same ``shared`` tokens (a prefix-cache hit after the first)."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (shared,), generator=gen).tolist()
    return [prefix + torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


def greedy_by_forward(
    hf: Any, logits: Callable[[Any, list[int]], torch.Tensor], prompt: list[int], n: int
) -> list[int]:
    """``n`` greedy tokens after ``prompt`` by the reference's full forward at every step
    (``logits(hf, ids)``: no cache, so the oracle never runs an incremental path of its own).
    Memoised on ``hf`` (it lives and dies with the model): parametrised cases share it."""
    memo = hf.__dict__.setdefault("_greedy_memo", {})
    key = (tuple(prompt), n)
    if key not in memo:
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(logits(hf, ids)[-1].argmax()))
        memo[key] = ids[len(prompt) :]
    return memo[key]


def check_clean(llm: LLM) -> None:
    """The pool is all free (the null block aside) and its invariants hold."""
    kv = llm.llm_engine.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.block_pool.num_gpu_blocks - 1
