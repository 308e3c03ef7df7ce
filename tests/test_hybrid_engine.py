"""Hybrid models in the engine: sliding-window and full-attention layers in one model, so two KV
cache groups with their own block tables over one pool (out-of-window blocks go back to the
pool while the request runs). A tiny random-weight Qwen2 with explicit ``layer_types``,
greedy, token by token against transformers' own ``generate``, through chunked prefill,
prefix hits, preemption and n > 1; the pool is all free and invariants hold afterwards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_utils import check_clean, random_prompts

from pagedkv import LLM, SamplingParams
from pagedkv.core.specs import SlidingWindowSpec

WINDOW = 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
VOCAB = 96


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        use_sliding_window=True,
        sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
        attn_implementation="eager",
        eos_token_id=None,
        bos_token_id=None,
    )
    hf = Qwen2ForCausalLM(config).eval()
    out = tmp_path_factory.mktemp("tiny_hybrid")
    hf.save_pretrained(out)
    return hf, out


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by transformers' plain full forward pass at every step.

    Not ``generate``: in transformers 5.24 it disagrees with the model's own forward for this
    mixed sliding/full config once the sequence exceeds the window, with or without its KV
    cache (the 23-token prompt below, 5 tokens in: forward gives logits 4.04 / 2.91 to tokens
    3 / 2 at every sequence length, generate picks 2)."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def prompts(seed: int, lens: list[int], shared: int = 0) -> list[list[int]]:
    return random_prompts(VOCAB, seed, lens, shared)


@pytest.mark.parametrize(
    "engine_kw",
    [
        {},  # plenty of blocks, whole prompts in one step
        {"max_num_batched_tokens": 7},  # every prefill chunked, chunk edges cross the window
        # So few blocks that requests are preempted and recomputed (a small token budget bounds
        # the sliding-window groups' prefill peak, which holds a whole chunk before the window
        # trims it).
        # max_model_len 96 (the longest request is 76 tokens): 48 blocks cannot hold one request of
        # 128, and the engine refuses such a cache at start, as vLLM does.
        {"num_kv_blocks": 48, "max_num_batched_tokens": 16, "max_model_len": 96},
    ],
    ids=["plain", "chunked", "preempting"],
)
@pytest.mark.slow
def test_greedy_matches_transformers(hybrid: tuple[Any, Path], engine_kw: dict[str, int]) -> None:
    hf, path = hybrid
    llm = LLM(
        model=str(path), block_size=4, **({"num_kv_blocks": 200, "max_model_len": 128} | engine_kw)
    )
    engine = llm.llm_engine
    assert len(engine.kv_cache_config.kv_cache_groups) >= 2  # really hybrid
    batch = prompts(1, [5, 23, 40, 61, 17, 9], shared=0) + prompts(2, [6, 11, 30], shared=33)
    out_lens = [12, 20, 7, 15, 25, 9, 14, 18, 11]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for p, n, o in zip(batch, out_lens, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, n), f"prompt of {len(p)} tokens"
    if engine_kw.get("num_kv_blocks") == 48:
        assert engine.stats()["num_preemptions"] > 0
    check_clean(llm)


def test_prefix_hits_and_window_release(hybrid: tuple[Any, Path]) -> None:
    """A second request with a long shared prefix hits the cache in both groups (the window
    group only needs its last blocks), and a long running request holds only the window's
    blocks in its sliding-window groups."""
    hf, path = hybrid
    llm = LLM(model=str(path), block_size=4, max_model_len=128, num_kv_blocks=200)
    first, second = prompts(3, [10, 12], shared=48)
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate({"prompt_token_ids": first}, p, use_tqdm=False)
    (out,) = llm.generate({"prompt_token_ids": second}, p, use_tqdm=False)
    assert out.num_cached_tokens >= 44
    assert out.outputs[0].token_ids == hf_greedy(hf, second, 6)

    engine = llm.llm_engine
    engine.add_request(
        "long",
        {"prompt_token_ids": prompts(4, [80])[0]},
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    )
    engine.step()  # the whole prompt in one step
    engine.step()  # a decode: its allocation first releases what fell out of the window
    groups = engine.kv_cache_config.kv_cache_groups
    tables = engine.kv_cache_manager.get_block_ids("long")
    for g, table in zip(groups, tables, strict=True):
        live = [b for b in table if b != 0]
        if isinstance(g.kv_cache_spec, SlidingWindowSpec):
            assert len(live) <= WINDOW // 4 + 1  # only blocks a query can still see
        else:
            assert len(live) == 21  # full attention keeps all 81 tokens' blocks
    while engine.has_unfinished_requests():
        engine.step()
    check_clean(llm)


def test_parallel_samples_fork_in_every_group(hybrid: tuple[Any, Path]) -> None:
    hf, path = hybrid
    llm = LLM(model=str(path), block_size=4, max_model_len=128, num_kv_blocks=200, seed=5)
    (prompt,) = prompts(6, [22])
    (out,) = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(n=3, temperature=0.8, max_tokens=10, ignore_eos=True, seed=11),
        use_tqdm=False,
    )
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 10 for c in out.outputs)
    (greedy,) = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    ref = hf_greedy(hf, prompt, 10)
    assert [c.token_ids for c in greedy.outputs] == [ref, ref]  # forked copies continue exactly
    check_clean(llm)


def test_offloading_a_hybrid_model_round_trips_exactly(hybrid: tuple[Any, Path]) -> None:
    """Offloading serves hybrid models (tests/test_offload_hybrid.py covers the rules): a
    prompt evicted from the device comes back from the CPU tier, output unchanged."""
    hf, path = hybrid
    llm = LLM(
        model=str(path), block_size=4, max_model_len=64, num_kv_blocks=80, kv_offload="cpu:16MiB"
    )
    (prompt,) = prompts(6, [30])
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ref = hf_greedy(hf, prompt, 5)
    for expect_cached in (0, 28):
        assert llm.reset_prefix_cache()
        (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        assert (out.outputs[0].token_ids, out.num_cached_tokens) == (ref, expect_cached)
    check_clean(llm)
