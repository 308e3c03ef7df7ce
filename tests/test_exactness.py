"""Greedy outputs of the engine equal HF transformers (float32, same GGUF), token by token.

The reference is a plain greedy loop over transformers' own KV cache, one prompt at a time (no
padding). The only forgiven difference is a float near-tie: at the first differing position the
reference's logit gap between its token and ours is below 1e-3; each such case is reported.
Every engine run must end with the pool all free and the invariants holding.

``PAGEDKV_TEST_DEVICE=cuda`` runs both the engine and the reference on the GPU (same device,
same dtype: ``gpu/run_checks.sh`` does this with the Triton kernels in every layer).
"""

from __future__ import annotations

import os

import pytest
import torch

from pagedkv import LLM, SamplingParams

MAX_TOKENS = 24
NEAR_TIE = 1e-3
DEVICE = os.environ.get("PAGEDKV_TEST_DEVICE", "cpu")
if DEVICE != "cpu" and not torch.cuda.is_available():
    pytest.skip(f"PAGEDKV_TEST_DEVICE={DEVICE} but no CUDA device", allow_module_level=True)

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers.",
    "hi",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23? Show your work step by step, then give the final answer on its own line.",
    "Describe a cat to someone who has never seen one, in detail, covering its fur, its eyes, "
    "its habits and the sounds it makes, and why people keep cats as pets.",
    "Write a Python function that reverses a string.",
    "Who wrote Pride and Prejudice?",
    "Give me a short motivational quote.",
    "What are the three states of water?",
]
SYSTEM = (
    "You are a meticulous assistant for a library. " * 12
    + "Answer briefly and precisely, citing the catalogue when you can."
)


@pytest.fixture(scope="module")
def tok(gguf_path):
    from pagedkv.models.tokenizer import Tokenizer

    return Tokenizer.from_gguf(gguf_path)


def chat_ids(tok, question: str, system: str | None = None) -> list[int]:
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}
    ]
    return tok.encode(
        tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False
    )


def assert_same(prompts: list[list[int]], outputs, hf_greedy, report: list[str]) -> None:
    for ids, out in zip(prompts, outputs):
        ours = out.outputs[0].token_ids
        ref, rows = hf_greedy(ids)
        assert len(ours) == MAX_TOKENS
        if ours == ref:
            continue
        i = next(j for j, (a, b) in enumerate(zip(ours, ref)) if a != b)
        gap = float(rows[i][ref[i]] - rows[i][ours[i]])
        assert abs(gap) < NEAR_TIE, (
            f"prompt of {len(ids)} tokens differs at output {i}: ours "
            f"{ours[i]} vs reference {ref[i]} (logit gap {gap:.2e})"
        )
        report.append(f"near-tie at output {i} of a {len(ids)}-token prompt (gap {gap:.1e})")


def run_engine(prompts, **kwargs):
    llm = LLM(device=DEVICE, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine = llm.llm_engine
    engine.check_invariants()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_config.num_blocks - 1
    return llm, outs


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_batch_of_chat_prompts_matches_hf(tok, hf_greedy, block_size):
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) >= 8
    report: list[str] = []
    _, outs = run_engine(prompts, block_size=block_size)
    assert_same(prompts, outs, hf_greedy, report)
    print("\n".join(report))


@pytest.mark.slow
def test_shared_prefixes_hit_the_cache_and_match_hf(tok, hf_greedy):
    prompts = [chat_ids(tok, q, SYSTEM) for q in QUESTIONS[:6]]
    report: list[str] = []
    llm, outs = run_engine(prompts, block_size=16, max_num_seqs=2)
    assert_same(prompts, outs, hf_greedy, report)
    stats = llm.stats()
    assert stats["prefix_cache_hits"] >= 4 * 16 * (len(SYSTEM) // 80)  # most of the system prompt
    assert all(o.num_cached_tokens > 0 for o in outs[2:])
    # Run the same prompts again: now whole prompts (all but the last block) hit.
    outs2 = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs2] == [o.outputs[0].token_ids for o in outs]
    assert all(o.num_cached_tokens >= len(p) - 16 for o, p in zip(outs2, prompts))
    print("\n".join(report))


@pytest.mark.slow
def test_small_kv_cache_forces_preemption_and_matches_hf(tok, hf_greedy):
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    num_blocks = -(-longest // 16) + 3  # one long request fits, the batch does not
    report: list[str] = []
    # max_model_len = the longest request: the engine refuses a cache that cannot hold one
    # max_model_len request (vLLM's start-up rule), and the default (8192) would not fit.
    llm, outs = run_engine(prompts, block_size=16, num_kv_blocks=num_blocks, max_model_len=longest)
    assert llm.stats()["num_preemptions"] > 0
    assert_same(prompts, outs, hf_greedy, report)
    print("\n".join(report))


@pytest.mark.slow
def test_tiny_token_budget_chunks_every_prefill_and_matches_hf(tok, hf_greedy):
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:8]]
    assert min(len(p) for p in prompts) > 7
    report: list[str] = []
    _, outs = run_engine(prompts, block_size=16, max_num_batched_tokens=7)
    assert_same(prompts, outs, hf_greedy, report)
    print("\n".join(report))
