"""benchmarks/bench_kv_quant.py (`pagedkv.bench.kv_quant`): the metric code, the scoring path
(one-chunk prefill log-probs must see the quantized cache) and one tiny end-to-end run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.bench.kv_quant import (
    AgreementStats,
    greedy_agreement,
    main,
    meets,
    score_window,
    windows,
)


def test_agreement_stats_identical_is_perfect() -> None:
    lp = torch.log_softmax(torch.randn(5, 11, generator=torch.Generator().manual_seed(0)), -1)
    targets = [1, 2, 3, 4, 5]
    s = AgreementStats()
    s.add(lp, lp, targets)
    out = s.summary()
    assert out["positions"] == 5 and out["top1_agreement"] == 1.0
    assert out["mean_kl"] == pytest.approx(0.0, abs=1e-7) and out["ppl_delta_pct"] == pytest.approx(
        0.0, abs=1e-9
    )
    nll = -sum(float(lp[i, t]) for i, t in enumerate(targets)) / 5
    assert out["ppl_ref"] == pytest.approx(math.exp(nll), rel=1e-6)


def test_agreement_stats_by_hand() -> None:
    ref = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.25, 0.25]]).log()
    mode = torch.tensor([[0.4, 0.5, 0.1], [0.5, 0.25, 0.25]]).log()
    s = AgreementStats()
    s.add(ref, mode, [0, 1])
    s.add(ref[:1], ref[:1], [2])  # a second window accumulates
    out = s.summary()
    assert out["positions"] == 3 and out["top1_agreement"] == pytest.approx(2 / 3)
    kl0 = 0.7 * math.log(0.7 / 0.4) + 0.2 * math.log(0.2 / 0.5)
    assert out["mean_kl"] == pytest.approx(kl0 / 3, rel=1e-5)
    nll_ref = -(math.log(0.7) + math.log(0.25) + math.log(0.1))
    nll = -(math.log(0.4) + math.log(0.25) + math.log(0.1))
    assert out["ppl_ref"] == pytest.approx(math.exp(nll_ref / 3), rel=1e-5)
    assert out["ppl_delta_pct"] == pytest.approx(
        (math.exp((nll - nll_ref) / 3) - 1) * 100, rel=1e-4
    )
    with pytest.raises(ValueError):
        s.add(ref, mode, [0])


def test_greedy_agreement_and_targets() -> None:
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert greedy_agreement(ref, ref) == dict(identical=1.0, prefix_match=1.0)
    out = greedy_agreement(ref, [[1, 2, 9, 9], [5, 6, 7, 8]])
    assert out["identical"] == 0.5 and out["prefix_match"] == pytest.approx((0.5 + 1.0) / 2)
    assert greedy_agreement([[1, 2]], [[3, 2]])["prefix_match"] == 0.0
    assert meets("int8", 0.995, -0.4) is True
    assert meets("int8", 0.995, 0.6) is False and meets("int4", 0.94, 0.0) is False
    assert meets(None, 0.5, 50.0) is None


def test_windows_cut_and_drop_short_tail() -> None:
    assert windows(list(range(40)), 16) == [
        list(range(16)),
        list(range(16, 32)),
    ]  # tail of 8 dropped
    assert [len(w) for w in windows(list(range(50)), 16, min_size=2)] == [16, 16, 16, 2]


def _score_engine(kv_cache_dtype: str, **kw: object) -> LLM:
    return LLM(
        kv_cache_dtype=kv_cache_dtype,
        num_kv_blocks=12,
        max_model_len=96,
        max_num_batched_tokens=96,
        enable_prefix_caching=False,
        **kw,
    )


@pytest.mark.slow
def test_one_chunk_prefill_reads_the_quantized_cache() -> None:
    """The benchmark scores prompts with ONE prefill chunk: that only measures quantization
    because prefill attention reads K/V back from the cache. An int4 cache must change the
    prompt log-probs; and the captured rows must be the engine's own prompt logprobs."""
    ids = [(i * 7919) % 40000 + 100 for i in range(64)]
    f32 = _score_engine("float32")
    ref = score_window(f32, ids)
    assert ref.shape == (63, f32.llm_engine.model_config.vocab_size)
    (o,) = f32.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )
    engine_lp = torch.tensor([next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]])
    mine = ref.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    assert torch.allclose(mine, engine_lp, atol=1e-4)  # row i predicts ids[i + 1]
    int4 = score_window(_score_engine("int4_per_token_head"), ids)
    s = AgreementStats()
    s.add(ref, int4, ids[1:])
    assert s.summary()["mean_kl"] > 1e-4  # a prefill over unquantized K/V would give ~0
    assert (ref - int4).abs().max() > 1e-2


@pytest.mark.slow
def test_end_to_end_tiny(tmp_path) -> None:
    out = tmp_path / "r.json"
    rc = main(
        [
            "--quick",
            "--only",
            "all",
            "--modes",
            "float32,int8_per_token_head,int4",
            "--tokens",
            "96",
            "--window",
            "48",
            "--capacity-modes",
            "bfloat16,int4",
            "--capacity-request-tokens",
            "64",
            "--capacity-bf16",
            "2",
            "--speed-script",
            str(tmp_path / "absent.py"),
            "--json-only",
            "--json-out",
            str(out),
        ]
    )
    assert rc == 0
    r = json.loads(out.read_text())
    acc = r["accuracy"]
    assert acc["corpora"]["greedy"]["scored_positions"] == 94  # two windows of 48
    ref = acc["modes"]["float32"]
    assert ref["greedy"]["top1_agreement"] == 1.0 and ref["sampled"]["mean_kl"] == pytest.approx(
        0, abs=1e-6
    )
    assert ref["greedy_output"] == dict(identical=1.0, prefix_match=1.0)
    for name in ("int8_per_token_head", "int4"):
        m = acc["modes"][name]
        assert 0.5 < m["greedy"]["top1_agreement"] <= 1.0 and m["greedy"]["mean_kl"] > 0
    cap = r["capacity"]["modes"]
    assert cap["bfloat16"]["measured"] == cap["bfloat16"]["planned"] == 2
    assert cap["int4"]["measured"] == cap["int4"]["planned"] >= 6  # 36 vs 128 bytes per token-head
    assert (
        cap["int4"]["decoded_together"] == cap["int4"]["measured"]
    )  # all resident, one decode batch
    assert cap["int4"]["preemptions"] == 0 and cap["int4"]["ratio_vs_bf16"] >= 3.0
    assert "skipped" in r["speed"]
