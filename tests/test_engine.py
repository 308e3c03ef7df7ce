"""Engine behaviour on the real default model: API shape, sampling options, n > 1, stop
conditions, aborts and bad input. After every test the pool is all free and invariants hold."""

from __future__ import annotations

import math

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.core.request import RequestStatus


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=256, block_size=16, max_model_len=1024)


@pytest.fixture(autouse=True)
def pool_back_to_free(request):
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").llm_engine
        assert not engine.has_unfinished_requests()
        engine.check_invariants()
        assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_config.num_blocks - 1


GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.mark.slow
def test_generate_returns_vllm_shaped_outputs(llm):
    outs = llm.generate(["The capital of France is", "One, two, three,"], GREEDY, use_tqdm=False)
    assert [o.request_id for o in outs] == sorted(o.request_id for o in outs)
    for o in outs:
        assert o.finished and o.prompt and o.prompt_token_ids
        (c,) = o.outputs
        assert c.index == 0 and len(c.token_ids) <= 12 and c.finish_reason in ("stop", "length")
        assert c.text == llm.get_tokenizer().decode(c.token_ids)
        m = o.metrics
        assert m.time_to_first_token is not None and 0 < m.time_to_first_token <= m.e2e_latency
    assert "Paris" in outs[0].outputs[0].text


def test_token_id_prompts_and_chat(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("The capital of France is")
    a = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    b = llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=20),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text and out.outputs[0].finish_reason == "stop"


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=10)
    alone = llm.generate("Once upon a time", p, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(
        ["Write a poem", "Once upon a time", "Hello"],
        [
            SamplingParams(temperature=1.0, max_tokens=10),
            p,
            SamplingParams(temperature=0.7, max_tokens=5),
        ],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone
    other = (
        llm.generate(
            "Once upon a time",
            SamplingParams(temperature=1.0, seed=99, max_tokens=10),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    assert other != alone


def test_n_greater_than_one_shares_prompt_blocks(llm):
    engine = llm.llm_engine
    prompt = list(range(500, 540))  # 40 tokens: 2 full blocks + a partial block
    engine.add_request(
        "fork",
        {"prompt_token_ids": prompt},
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6),
    )
    engine.step()  # prefill; the two children are forked from the parent's prompt KV
    tables = [engine.kv_cache_manager.get_block_ids(f"fork{s}")[0] for s in ("", "#1", "#2")]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # full blocks shared by reference
    assert len({t[2] for t in tables}) == 3  # partial block copied on write
    shared = engine.kv_cache_manager.block_pool.blocks[tables[0][0]]
    assert shared.ref_cnt == 3
    assert engine.scheduler.pending_copies and len(engine.scheduler.pending_copies) == 2
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(o for o in engine.step() if o.finished)
    (out,) = outs
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_n_greedy_samples_equal_single_greedy(llm):
    single = llm.generate("Hello, my name is", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    multi = llm.generate(
        "Hello, my name is", SamplingParams(n=3, temperature=0, max_tokens=12), use_tqdm=False
    )[0]
    assert [c.token_ids for c in multi.outputs] == [single] * 3


@pytest.mark.slow
def test_stop_strings_stop_tokens_and_max_tokens(llm):
    tok = llm.get_tokenizer()
    base = llm.generate(
        "Count: 1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20), use_tqdm=False
    )[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 20
    stop = base.text[4:7]
    out = llm.generate(
        "Count: 1, 2, 3, 4,",
        SamplingParams(temperature=0, max_tokens=20, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.find(stop)]
    incl = llm.generate(
        "Count: 1, 2, 3, 4,",
        SamplingParams(temperature=0, max_tokens=20, stop=stop, include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert incl.text.endswith(stop)
    tid = base.token_ids[3]
    out = llm.generate(
        "Count: 1, 2, 3, 4,",
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tid]),
        use_tqdm=False,
    )[0].outputs[0]
    assert (
        out.token_ids == base.token_ids[: base.token_ids.index(tid) + 1] and out.stop_reason == tid
    )
    eos = tok.eos_token_id
    ign = llm.generate(
        "Hi", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(ign.token_ids) == 40 and ign.finish_reason == "length"
    assert eos is not None


def test_logprobs_are_consistent(llm):
    out = llm.generate(
        "The capital of France is",
        SamplingParams(temperature=0, max_tokens=5, logprobs=3),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.logprobs) == 5
    for tid, step in zip(out.token_ids, out.logprobs):
        assert step[tid].rank == 1  # greedy picks the top token
        assert len(step) == 3 and all(v.logprob <= 0 for v in step.values())
        assert sorted(v.rank for v in step.values()) == [1, 2, 3]
    assert math.isclose(
        out.cumulative_logprob,
        sum(s[t].logprob for t, s in zip(out.token_ids, out.logprobs)),
        rel_tol=1e-6,
    )


@pytest.mark.slow
def test_penalties_change_output_and_min_tokens_blocks_eos(llm):
    prompt = "Repeat after me: la la la la la la"
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    pen = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.8, frequency_penalty=1.0),
        use_tqdm=False,
    )[0]
    assert plain.outputs[0].token_ids != pen.outputs[0].token_ids
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    short = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[
        0
    ]
    assert short.finish_reason == "stop" and len(short.token_ids) < 30
    longer = llm.chat(
        msgs,
        SamplingParams(temperature=0, max_tokens=30, min_tokens=len(short.token_ids) + 3),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(longer.token_ids) >= len(short.token_ids) + 3


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"min_p": 2}, "min_p"),
        ({"presence_penalty": 5}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": -1}, "logprobs"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_invalid_sampling_params_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_leave_other_requests_running(llm):
    engine = llm.llm_engine
    engine.add_request("ok", "The capital of France is", GREEDY)
    engine.step()
    with pytest.raises(ValueError, match="maximum model length of 1024"):
        engine.add_request("long", {"prompt_token_ids": [5] * 1025}, GREEDY)
    with pytest.raises(ValueError, match="whole KV cache"):
        small = engine.num_usable_kv_tokens
        engine.max_model_len, old = small + 100, engine.max_model_len
        try:
            engine.add_request("huge", {"prompt_token_ids": [5] * (small + 1)}, GREEDY)
        finally:
            engine.max_model_len = old
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", {"prompt_token_ids": []}, GREEDY)
    with pytest.raises(ValueError, match=r"\[0, 49152\)"):
        engine.add_request("oov", {"prompt_token_ids": [10**6]}, GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", "x", GREEDY)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert outs[-1].finished and outs[-1].request_id == "ok"
    ref = llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0]
    assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
    with pytest.raises(ValueError, match="maximum model length"):
        llm.generate(["fine", {"prompt_token_ids": [1] * 2000}], GREEDY, use_tqdm=False)


@pytest.mark.slow
def test_abort_frees_everything(llm):
    engine = llm.llm_engine
    for i in range(4):
        engine.add_request(
            f"a{i}",
            {"prompt_token_ids": list(range(100 * i, 100 * i + 60))},
            SamplingParams(temperature=0, max_tokens=50, n=2 if i == 0 else 1),
        )
    engine.step()
    engine.step()
    assert engine.kv_cache_manager.num_free_blocks < engine.kv_cache_config.num_blocks - 1
    reqs = list(engine.scheduler.requests.values())
    engine.abort_request([f"a{i}" for i in range(4)])
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in reqs)
    assert not engine.has_unfinished_requests()


def test_engine_option_validation_names_the_option():
    with pytest.raises(ValueError, match="block_size"):
        LLM(block_size=0)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        LLM(num_kv_blocks=1)
    with pytest.raises(ValueError, match=r"max seq len \(8192\).*maximum model length is 336\b"):
        LLM(kv_cache_memory=16 << 20)  # 22 blocks of 16 tokens: 21 usable = 336 tokens
    # Past the model's context the rotary tables end: refused at start, not at position 8192
    # mid-prefill (before the fix, an 8,200-token request failed its step with an IndexError).
    with pytest.raises(ValueError, match=r"max_model_len=8200.*max_position_embeddings=8192"):
        LLM(max_model_len=8200)


@pytest.mark.slow
def test_a_sequence_filling_the_whole_cache_stops_with_length_and_others_go_on():
    """A request whose generation fills the entire KV cache (max_model_len = the whole cache:
    a larger max_model_len is refused at start, as in vLLM) stops with finish_reason "length",
    keeps the tokens it made, and frees its blocks; a request beside it, which forces
    preemptions, finishes normally. Before the fix this looped for ever."""
    small = LLM(num_kv_blocks=8, block_size=16, max_model_len=112)  # 7 usable blocks = 112 tokens
    engine = small.llm_engine
    long_prompt = {"prompt_token_ids": list(range(100, 200))}
    outs = small.generate(
        [long_prompt, "Hello"],
        SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
        use_tqdm=False,
    )
    big, other = outs
    assert big.finished and big.outputs[0].finish_reason == "length"
    assert 0 < len(big.outputs[0].token_ids) < 50
    assert (
        len(big.prompt_token_ids) + len(big.outputs[0].token_ids) <= 7 * 16 + 1
    )  # the last token needs no slot
    assert other.finished and len(other.outputs[0].token_ids) == 50
    assert not engine.has_unfinished_requests()
    engine.check_invariants()
    assert engine.kv_cache_manager.num_free_blocks == 7


def test_forked_children_queued_past_max_num_seqs_can_finish_on_their_first_token():
    """n=3 with max_num_seqs=2: the third sample cannot run beside its siblings, so it waits in
    the queue; with max_tokens=1 it finishes on its first token. The old engine removed it
    from the running list it was never in and failed the whole batch with "error"."""
    small = LLM(num_kv_blocks=64, block_size=16, max_model_len=512, max_num_seqs=2)
    out = small.generate(
        "Once upon a time",
        SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=1),
        use_tqdm=False,
    )[0]
    assert out.error is None
    assert [c.finish_reason for c in out.outputs] == ["length"] * 3
    assert all(len(c.token_ids) == 1 for c in out.outputs)
    engine = small.llm_engine
    assert not engine.has_unfinished_requests()
    engine.check_invariants()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_config.num_blocks - 1
