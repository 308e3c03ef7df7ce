"""Quantized KV caches in the engine (issue 14): a stateful run with chunked prefill, preemption
and prefix hits gives the same greedy tokens as one request at a time on a roomy cache; offload
tiers move the raw quantized pages and give them back exactly; a tier or peer of another KV
format is a miss or a refusal, never a wrong read; fp8 scales are calibrated, saved and loaded."""

from __future__ import annotations

import json

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.kv_transfer.side_channel import HandshakeError, KVAgentMetadata, check_compatible

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SYSTEM = [(31 * j) % 30000 + 200 for j in range(70)]  # a shared 70-token prefix
PROMPTS = [SYSTEM + [(97 * i + 13 * j) % 40000 + 100 for j in range(20 + 9 * i)] for i in range(6)]


def run(llm: LLM, prompts=PROMPTS, params: SamplingParams = PARAMS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine = llm.llm_engine
    engine.check_invariants()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_config.num_blocks - 1
    return [o.outputs[0].token_ids for o in outs]


QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain why the sky is blue.",
    "Name three prime numbers.",
    "How do bees make honey?",
    "Give me a tip for learning Python.",
]
LIBRARY = (
    "You are a meticulous assistant for a library. " * 6
    + "Answer briefly and precisely, citing the catalogue when you can."
)
# Batch shape changes the last float bits of K/V (BLAS blocks differently for a 32-token chunk
# than for a whole prompt, a preempted request recomputes its decode tokens as a prefill), and
# a code that sits on a rounding boundary flips; with INT4's coarse steps a flip cascades
# through the layers. So a busy run is not bit-identical to a serial one. What must hold: every
# token it emits is (within quantization noise) the greedy choice of an unbusy engine scoring
# the same text. A stale block, a wrong scale or another request's page would give tokens
# several nats away. Tolerances: log-prob gap to the scorer's best token at each position, and
# the mean gap over all positions (noise keeps it small; a wrong read moves every position).
NEAR_BEST = {"int8": 0.05, "fp8_per_token_head": 0.15, "int4": 3.0}
MEAN_GAP = {"int8": 0.01, "fp8_per_token_head": 0.03, "int4": 0.15}


def chat_prompts(llm: LLM) -> list[list[int]]:
    tok = llm.llm_engine.tokenizer
    return [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "system", "content": LIBRARY}, {"role": "user", "content": q}],
                add_generation_prompt=True,
            ),
            add_special_tokens=False,
        )
        for q in QUESTIONS
    ]


def gap_to_best(row: dict, tok: int) -> float:
    """Log-prob gap from the best of a prompt_logprobs row to ``tok`` (inf when not in it)."""
    return max(lp.logprob for lp in row.values()) - row[tok].logprob if tok in row else float("inf")


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4", "fp8_per_token_head"])
def test_preemption_chunking_and_prefix_hits_on_a_quantized_cache(kv_cache_dtype):
    """A cache too small for the batch preempts, a 32-token budget chunks every prefill, the
    system prompt hits the cache; an engine with a roomy cache, one request at a time, scores
    what the busy one wrote (teacher-forced prompt logprobs)."""
    scorer = LLM(
        kv_cache_dtype=kv_cache_dtype,
        num_kv_blocks=40,
        max_model_len=256,
        max_num_seqs=1,
        enable_prefix_caching=False,
    )
    exact = LLM(num_kv_blocks=40, max_model_len=256, max_num_seqs=1, enable_prefix_caching=False)
    prompts = chat_prompts(scorer)
    longest = max(len(p) for p in prompts) + 24
    busy = LLM(
        kv_cache_dtype=kv_cache_dtype,
        num_kv_blocks=-(-longest // 16) + 3,
        max_model_len=longest,
        max_num_seqs=6,
        max_num_batched_tokens=32,
    )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first = run(busy, prompts, params)
    assert busy.stats()["num_preemptions"] > 0
    second = run(busy, prompts, params)  # over what the cache kept
    assert busy.stats()["prefix_cache_hits"] > 0
    for outs in (first, second):
        texts = [{"prompt_token_ids": p + o} for p, o in zip(prompts, outs)]
        scoring = SamplingParams(max_tokens=1, prompt_logprobs=20)
        scored = scorer.generate(texts, scoring, use_tqdm=False)
        unquantized = exact.generate(texts, scoring, use_tqdm=False)
        gaps, near = [], []
        for p, o, s, u in zip(prompts, outs, scored, unquantized):
            for i, tok in enumerate(o):
                gaps.append(
                    gap_to_best(s.prompt_logprobs[len(p) + i], tok)
                )  # predicts output token i
                # At a near-tie the noise of the busy run's batch shape can pick the other token
                # (measured: fp8 per token-head, a 0.16-nat tie in float32 that the serial
                # quantized run breaks the other way by 0.22): that token is the float32 cache's
                # own choice, so it is judged against that as well. A wrong read is far from both.
                near.append(min(gaps[-1], gap_to_best(u.prompt_logprobs[len(p) + i], tok)))
        print(
            f"{kv_cache_dtype}: max gap {max(gaps):.3f} ({max(near):.3f} to the nearer reference), "
            f"mean {sum(gaps) / len(gaps):.4f}"
        )
        assert max(near) < NEAR_BEST[kv_cache_dtype], f"a token {max(near):.3f} below the best"
        assert sum(gaps) / len(gaps) < MEAN_GAP[kv_cache_dtype], (
            f"mean gap {sum(gaps) / len(gaps):.4f}"
        )


@pytest.mark.slow
def test_cpu_and_disk_tiers_round_trip_quantized_pages(tmp_path):
    """int4 pages evicted to CPU and disk come back byte-exact: outputs equal a tierless engine
    whose device cache is roomy enough to keep every prefix, and a restarted engine reads them
    from disk.

    The reference must hit the same prefixes: a prefix hit changes the shape of the suffix's
    matmuls, which changes the last float bits of its K/V, and on a quantized cache a value on a
    rounding boundary then flips a code (measured: a tierless cold run differs from a tier-hit
    run at a 0.02-nat near-tie, int4, int8 and fp8 alike). With the same hits the computation
    is the same, so any difference is a page that did not come back exactly. One request at a
    time for the same reason: with two, which requests share a step depends on when the tiers'
    background lookups answer, and a decode step of 2 rows computes K/V in another summation
    order than a step of 1 (that failed intermittently on an AVX2 machine)."""
    engine = dict(kv_cache_dtype="int4", num_kv_blocks=14, max_model_len=144, max_num_seqs=1)
    roomy = LLM(**{**engine, "num_kv_blocks": 200})
    cold, want = run(roomy), run(roomy)  # second run: every full block of every prompt is a hit
    spec = f"cpu:16MiB,disk:{tmp_path}:64MiB"
    first = LLM(**engine, kv_offload=spec)
    assert run(first) == cold
    assert run(first) == want
    assert first.stats()["offload"]["loaded_tokens"] > 0
    first.llm_engine.connector.manager.drain(20.0)
    first.llm_engine.shutdown()
    meta = [json.loads(p.read_text()) for p in tmp_path.rglob("config.json")]
    assert meta and all(m["kv_quant"] == "int4:int4_per_token_group:hadamard" for m in meta)
    second = LLM(**engine, kv_offload=spec)
    assert run(second) == want
    assert second.stats()["offload"]["disk"]["hits"] > 0
    second.llm_engine.shutdown()
    # The same directory under another KV format: a different namespace, so only misses.
    other = LLM(**{**engine, "kv_cache_dtype": "int8"}, kv_offload=spec)
    run(other)
    assert other.stats()["offload"]["disk"]["hits"] == 0
    other.llm_engine.shutdown()


def test_transfer_peers_of_another_kv_format_are_refused():
    base = dict(
        engine_id="a",
        backend="tcp",
        agent_metadata=b"",
        model="m",
        hash_seed="s",
        block_size=16,
        kv_cache_layout="LBNHC",
        num_blocks=10,
        block_lens=(100,),
    )
    mine = KVAgentMetadata(kv_dtype="int4:int4_per_token_group:hadamard", **base)
    theirs = KVAgentMetadata(kv_dtype="int4:int4_per_token_group", **{**base, "engine_id": "b"})
    with pytest.raises(HandshakeError, match="kv_dtype differs"):
        check_compatible(mine, theirs)
    check_compatible(mine, KVAgentMetadata(kv_dtype=mine.kv_dtype, **{**base, "engine_id": "c"}))


@pytest.mark.slow
def test_fp8_scales_are_calibrated_saved_and_loaded(tmp_path):
    path = tmp_path / "scales.json"
    prompts = ["The history of the Roman empire spans", "def fibonacci(n):\n    return"]
    llm = LLM(
        kv_cache_dtype="fp8",
        num_kv_blocks=20,
        max_model_len=128,
        kv_scales_path=str(path),
        kv_scales_calibration=prompts,
    )
    engine = llm.llm_engine
    assert engine.kv_scales_source.startswith("calibration")
    saved = json.loads(path.read_text())
    assert saved["kv_format"] == "fp8:fp8_per_tensor" and len(saved["layers"]) == 30
    k0 = saved["layers"]["model.layers.0.self_attn"]["k_scale"]
    assert 0 < k0 < 1 and k0 != 1.0
    layer0 = engine.runner.kv_quants["model.layers.0.self_attn"]
    assert (layer0.k_scale, layer0.v_scale) == (
        k0,
        saved["layers"]["model.layers.0.self_attn"]["v_scale"],
    )
    calibrated = run(llm, PROMPTS[:2])
    again = LLM(kv_cache_dtype="fp8", num_kv_blocks=20, max_model_len=128, kv_scales_path=str(path))
    assert again.llm_engine.kv_scales_source == f"file {path}"
    assert run(again, PROMPTS[:2]) == calibrated
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read KV scales"):
        LLM(kv_cache_dtype="fp8", num_kv_blocks=20, max_model_len=128, kv_scales_path=str(path))


@pytest.mark.parametrize("kv_cache_dtype", ["int3", "int2"])
def test_low_bit_caches_decode_through_the_native_kernel(kv_cache_dtype, monkeypatch):
    """int3/int2 caches: the engine generates over them, its decode rows read the codes in
    the native kernel (tests/test_native_kv_quant.py checks its numbers), and the tokens are
    the torch path's (which dequantizes) over the same model."""
    from pagedkv.ops import native

    prompt = ["The capital of France is"]
    params = SamplingParams(max_tokens=8, temperature=0)
    llm = LLM(kv_cache_dtype=kv_cache_dtype, num_kv_blocks=24, max_model_len=128)
    calls = []
    real = native.paged_decode

    def spy(*a, **k):
        calls.append(real(*a, **k))
        return calls[-1]

    monkeypatch.setattr(native, "paged_decode", spy)
    (fast,) = llm.generate(prompt, params)
    assert calls and all(c is not None for c in calls), "decode did not take the native kernel"
    monkeypatch.setattr(native, "paged_decode", lambda *a, **k: None)  # the kernel declines
    (slow,) = llm.generate(prompt, params)
    assert fast.outputs[0].token_ids == slow.outputs[0].token_ids


def test_bad_kv_cache_dtype_and_rotation_are_clear_errors():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(kv_cache_dtype="int5")
    with pytest.raises(ValueError, match="kv_rotation"):
        LLM(kv_cache_dtype="int4", kv_rotation="fourier")
