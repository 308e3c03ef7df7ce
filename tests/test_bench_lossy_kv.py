"""benchmarks/bench_lossy_kv.py: its prompts, its multiple-choice scoring, and a tiny run whose
exact cache is its own bar (relative rate 1.0) and whose int4 row is judged against it."""

from __future__ import annotations

import json

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.bench import lossy_kv
from pagedkv.bench.common import BenchOptionError
from pagedkv.models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.mark.parametrize("length", [256, 1024, 4096])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_passkey_prompt_fits_and_places_the_needle(tok, length, depth):
    ids = lossy_kv.passkey_prompt(tok, length, depth, 71432)
    room = length - lossy_kv.ANSWER_TOKENS  # the answer's tokens fit too
    assert room - 2 * 40 <= len(ids) <= room  # filler fills it, never past it
    text = tok.decode(ids)
    assert text.startswith(lossy_kv.INTRO.strip()[:40]) and text.endswith("The pass key is")
    at = text.index("The pass key is 71432.")
    fill_start = len(lossy_kv.INTRO)
    fill_end = text.index(lossy_kv.QUESTION.strip()[:10])
    frac = (at - fill_start) / (fill_end - fill_start - len(lossy_kv.NEEDLE.format(key=71432)))
    reps = text.count("The grass is green.")  # the needle sits between two of them
    assert frac == pytest.approx(depth, abs=0.5 / reps + 0.02)


def test_passkey_prompt_refuses_a_length_without_room(tok):
    with pytest.raises(BenchOptionError, match="no room"):
        lossy_kv.passkey_prompt(tok, 40, 0.5, 12345)


def test_the_shipped_recall_items_are_the_generator_output():
    items = lossy_kv.load_recall_items()
    assert items == json.loads(json.dumps(lossy_kv.make_recall_items(*lossy_kv.RECALL_SHAPE)))
    for it in items:
        assert it["gold"] == 0 and len(set(it["choices"])) == 4
        color, animal = it["facts"][it["asked"]]
        assert it["choices"][0] == f" {animal}"
        ctx = lossy_kv.recall_context(it)
        assert f"The {color} box holds a {animal}." in ctx
        assert ctx.endswith(f"hold?\nAnswer: The {color} box holds a")


def test_choice_logprobs_are_the_sum_of_the_choice_tokens(gguf_path):
    llm = LLM(num_kv_blocks=64, max_model_len=256)
    tok = llm.get_tokenizer()
    ctx = tok.encode("The capital of France is", add_special_tokens=False)
    choices = [tok.encode(c, add_special_tokens=False) for c in (" Paris", " a small dog")]
    got = lossy_kv.choice_logprobs(llm, ctx, choices)
    for c, score in zip(choices, got):
        # Recompute each token's logprob from a fresh prompt_logprobs request of the same ids.
        out = llm.generate(
            [{"prompt_token_ids": ctx + c}],
            SamplingParams(max_tokens=1, prompt_logprobs=0),
            use_tqdm=False,
        )[0]
        want = sum(out.prompt_logprobs[len(ctx) + i][t].logprob for i, t in enumerate(c))
        assert score == pytest.approx(want)
    assert got[0] > got[1]  # the model knows this one


def test_unknown_methods_and_bad_options_are_refused(capsys):
    assert lossy_kv.main(["--methods", "int5", "--json-only"]) == 2
    assert "unknown method 'int5'" in capsys.readouterr().err
    assert lossy_kv.main(["--depths", "0.5,1.5", "--json-only"]) == 2


def test_a_snapkv_method_may_name_its_observation_window():
    from pagedkv.bench.lossy_methods import parse_method

    m = parse_method("snapkv:0.25:8")
    assert m.eviction(1000) == {"policy": "snapkv", "budget_tokens": 250, "recent_tokens": 8}
    assert "recent_tokens" not in parse_method("snapkv:0.25").eviction(1000)
    for bad in ("streaming:512:8", "snapkv:0.25:0", "snapkv:0.25:x"):
        with pytest.raises(BenchOptionError, match="window"):
            parse_method(bad)


@pytest.mark.slow
def test_a_tiny_run_judges_int4_against_the_exact_cache(capsys):
    assert lossy_kv.main(["--quick", "--methods", "int4", "--json-only"]) == 0
    r = json.loads(capsys.readouterr().out)
    pk = r["passkey"]["methods"]
    assert set(pk) == {"float32", "int4"}
    for m in pk.values():
        assert len(m["successes"]) == 1 and all(0 <= x <= 4 for x in m["successes"][0])
    assert pk["float32"]["relative_to_exact"] in (1.0, None)
    rc = r["recall"]["methods"]
    assert 0 <= rc["int4"]["accuracy"] <= 1 and rc["float32"]["relative_to_exact"] in (1.0, None)
    te = r["teacher"]["methods"]["int4"]
    assert 0.5 < te["greedy"]["top1_agreement"] <= 1 and te["greedy"]["positions"] > 500
    ph = r["prefix_hit"]
    assert ph["prompts"] == 2 and set(ph["methods"]) == {"int4"}
    hit = ph["methods"]["int4"]
    assert hit["mean_cached_tokens"] == 256  # the whole 256-token document was a hit
    for run in ("cold", "hit", "hit_vs_cold"):
        assert 0 <= hit[run]["identical"] <= 1 and 0 <= hit[run]["mean_common_tokens"] <= 8
