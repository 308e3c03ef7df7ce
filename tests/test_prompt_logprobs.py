"""``SamplingParams(prompt_logprobs=k)`` (vLLM's): every prompt token's raw logprob, its rank and
the top-k, checked against HF transformers (float32, same GGUF) through chunked prefill, a
prefix-cache hit, preemption and ``n > 1``; and on ``/v1/completions`` (``prompt_logprobs``,
``echo`` + ``logprobs``)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from server_utils import running_server

from pagedkv import LLM, SamplingParams
from pagedkv.engine.config import EngineConfig

TOL = 1e-4
K = 3
TEXT = (
    "Paged attention stores the key and value vectors of every sequence in fixed-size blocks, "
    "like pages of virtual memory, so memory is allocated on demand."
)


@pytest.fixture(scope="module")
def llm():
    """16-token chunks (a 30-token prompt takes several steps) in a 7-usable-block pool."""
    return LLM(num_kv_blocks=8, block_size=16, max_model_len=112, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def prompt(llm) -> list[int]:
    ids = llm.get_tokenizer().encode(TEXT)
    assert 24 < len(ids) < 48
    return ids


def rank_band(row: torch.Tensor, t: int) -> tuple[int, int]:
    """The ranks token ``t`` may have given HF's ``row`` and TOL of noise: tokens more than TOL
    above it are always ahead; those within TOL may be on either side."""
    return int((row > row[t] + TOL).sum()) + 1, int((row >= row[t] - TOL).sum())


def check_against_hf(plp, ids: list[int], hf_logits, k: int, tok) -> None:
    """``plp`` is vLLM's list: None, then per token its logprob/rank (exact rank) plus the top-k
    (exact ids, in rank order) of the raw distribution, within TOL of HF's."""
    ref = torch.log_softmax(hf_logits(ids), dim=-1)
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        row, t, d = ref[i - 1], ids[i], plp[i]
        assert abs(d[t].logprob - float(row[t])) < TOL, i
        # Exact rank, except that tokens within TOL of this one (a near-tie deep in the tail,
        # e.g. rank 13,695 of 49k, where float noise of 1e-6 reorders neighbours) may fall on
        # either side; where no token is that close the band is one rank wide, so an off-by-one fails.
        lo, hi = rank_band(row, t)
        assert lo <= d[t].rank <= hi, (i, d[t].rank, lo, hi)
        top = row.topk(k).indices.tolist() if k else []
        assert [t for t, v in sorted(d.items(), key=lambda x: x[1].rank) if v.rank <= k] == top, i
        assert set(d) == {t, *top}
        for x in top:
            assert abs(d[x].logprob - float(row[x])) < TOL
        for x, v in d.items():
            assert v.decoded_token == tok.decode([x], skip_special_tokens=False)


@pytest.mark.slow
def test_prompt_logprobs_match_hf_through_chunked_prefill(llm, prompt, hf_logits):
    """A multi-chunk prompt with k=3 beside a request without prompt logprobs (which gets None)
    and one with k=0 (only the prompt token, with its rank): values, ranks and top-k equal HF's."""
    outs = llm.generate(
        [{"prompt_token_ids": prompt}, "Hello there", {"prompt_token_ids": prompt[:20]}],
        [
            SamplingParams(prompt_logprobs=K, max_tokens=2, temperature=0),
            SamplingParams(max_tokens=2, temperature=0),
            SamplingParams(prompt_logprobs=0, max_tokens=2, temperature=0),
        ],
        use_tqdm=False,
    )
    check_against_hf(outs[0].prompt_logprobs, prompt, hf_logits, K, llm.get_tokenizer())
    assert outs[1].prompt_logprobs is None
    zero = outs[2].prompt_logprobs
    check_against_hf(zero, prompt[:20], hf_logits, 0, llm.get_tokenizer())
    assert all(len(d) == 1 for d in zero[1:])
    llm.llm_engine.check_invariants()


def test_a_prompt_logprobs_request_skips_the_prefix_cache_hit(llm, prompt, hf_logits):
    """The prompt's blocks are cached (a plain request hits them), yet a prompt_logprobs request
    reads none of them (num_cached_tokens 0) and scores every position."""
    sp = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    hit = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    assert hit.num_cached_tokens >= 16
    out = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(prompt_logprobs=K, max_tokens=1),
        use_tqdm=False,
    )[0]
    assert out.num_cached_tokens == 0
    check_against_hf(out.prompt_logprobs, prompt, hf_logits, K, llm.get_tokenizer())


@pytest.mark.slow
def test_preemption_recompute_scores_each_position_once(llm, prompt, hf_logits):
    """Two 47-token prompts (3 blocks each) whose 4th blocks do not both fit the 7-block pool
    (the later one is preempted after its prefill and recomputed):
    each gets exactly one entry per prompt token, equal to HF's, and the runner scored each
    prompt row exactly once across all steps (recompute skips what it already scored)."""
    engine = llm.llm_engine
    real = engine.runner.execute_model
    rows: dict[str, list[int]] = {}

    def recording(so):
        result = real(so)
        for rid, (first, t) in result[2].items():
            rows.setdefault(rid, []).extend(range(first, first + len(t.ranks)))
        return result

    before = engine.scheduler.num_preemptions
    engine.runner.execute_model = recording
    try:
        p1 = (prompt + prompt)[:47]
        p2 = p1[::-1]
        outs = llm.generate(
            [{"prompt_token_ids": p1}, {"prompt_token_ids": p2}],
            SamplingParams(prompt_logprobs=K, max_tokens=12, ignore_eos=True, temperature=0),
            use_tqdm=False,
        )
    finally:
        engine.runner.execute_model = real
    assert engine.scheduler.num_preemptions > before
    for out, ids in zip(outs, [p1, p2]):
        check_against_hf(out.prompt_logprobs, ids, hf_logits, K, llm.get_tokenizer())
    assert sorted(rows) == sorted(o.request_id for o in outs)
    assert all(r == list(range(len(p1) - 1)) for r in rows.values())
    llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)  # its step hears of the finish
    assert engine.runner.num_prompt_logprobs_done == {}  # forgotten once finished
    engine.check_invariants()


def test_n_samples_share_one_prompt_logprobs(llm, prompt, hf_logits):
    """n=3: one prompt_logprobs list on the RequestOutput (the prompt is scored once)."""
    out = llm.generate(
        [{"prompt_token_ids": prompt[:20]}],
        SamplingParams(n=3, prompt_logprobs=2, max_tokens=3, temperature=1.0, seed=7),
        use_tqdm=False,
    )[0]
    assert len(out.outputs) == 3
    check_against_hf(out.prompt_logprobs, prompt[:20], hf_logits, 2, llm.get_tokenizer())


def test_invalid_prompt_logprobs_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


@pytest.mark.slow
def test_completions_prompt_logprobs_and_echo_with_logprobs(hf_logits):
    """``prompt_logprobs: 2`` returns vLLM's per-choice list (token ids as keys); ``echo`` with
    ``logprobs: 2`` lists the prompt tokens first (the first null), streaming or not."""
    with (
        running_server(
            EngineConfig(num_kv_blocks=64, max_model_len=512, max_num_batched_tokens=16)
        ) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as http,
    ):
        tok = srv.app.state.pagedkv.async_llm.tokenizer
        ids = tok.encode(TEXT)
        ref = torch.log_softmax(hf_logits(ids), dim=-1)
        r = http.post(
            "/v1/completions",
            json={"prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2},
        )
        assert r.status_code == 200, r.text
        plp = r.json()["choices"][0]["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        for i in range(1, len(ids)):
            d = plp[i][str(ids[i])]
            assert abs(d["logprob"] - float(ref[i - 1, ids[i]])) < TOL
            assert rank_band(ref[i - 1], ids[i])[0] <= d["rank"] <= rank_band(ref[i - 1], ids[i])[1]
            assert d["decoded_token"] == tok.decode([ids[i]], skip_special_tokens=False)
        assert r.json()["choices"][0]["logprobs"] is None
        r = http.post(
            "/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "prompt_logprobs": 21}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"

        body = {"prompt": TEXT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"].startswith(TEXT)
        assert len(lp["tokens"]) == len(ids) + 3
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for i in range(1, len(ids)):
            assert abs(lp["token_logprobs"][i] - float(ref[i - 1, ids[i]])) < TOL
            assert len(lp["top_logprobs"][i]) <= 2
        assert all(x is not None for x in lp["token_logprobs"][len(ids) :])
        assert lp["text_offset"][len(ids)] == len(TEXT) and lp["text_offset"] == sorted(
            lp["text_offset"]
        )

        streamed = []
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        if c["logprobs"] is not None:
                            streamed.append(c["logprobs"])
        tokens = [t for part in streamed for t in part["tokens"]]
        values = [v for part in streamed for v in part["token_logprobs"]]
        offsets = [o for part in streamed for o in part["text_offset"]]
        assert tokens == lp["tokens"] and offsets == lp["text_offset"]
        assert values[0] is None and values[1:] == pytest.approx(lp["token_logprobs"][1:], abs=TOL)
