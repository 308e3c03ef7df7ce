"""The OpenAI-compatible server through the official ``openai`` client, on 127.0.0.1.

One server (the default model, a small KV pool) for the whole module; every request is small.
"""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from pagedkv.engine.config import EngineConfig
from pagedkv.entrypoints.cli.serve import BackgroundServer
from pagedkv.entrypoints.openai.api_server import create_app

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
# 40+ tokens, so two full 16-token blocks can be prefix hits.
LONG_PROMPT = (
    "Paged attention stores the key and value vectors of every sequence in fixed-size "
    "blocks, like pages of virtual memory, so that memory is allocated on demand and "
    "shared between sequences with a common prefix. Question: what is a block?"
)


@pytest.fixture(scope="module")
def server():
    app = create_app(EngineConfig(num_kv_blocks=512, max_num_seqs=16, max_model_len=1024))
    with BackgroundServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120
    ) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.app.state.pagedkv.async_llm.tokenizer


@pytest.mark.slow
def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    import httpx

    assert httpx.get(server.url + "/health").status_code == 200


def test_completion_non_streaming(client, tokenizer):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert choice.index == 0 and choice.text and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_streaming_equals_non_streaming_and_reports_usage(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_prefix_hits_are_reported_as_cached_tokens(client, server):
    first = client.completions.create(
        model=MODEL, prompt=LONG_PROMPT + " A", max_tokens=2, temperature=0
    )
    second = client.completions.create(
        model=MODEL, prompt=LONG_PROMPT + " B", max_tokens=2, temperature=0
    )
    assert first.usage.prompt_tokens >= 40
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached % 16 == 0 and cached < second.usage.prompt_tokens


def test_chat_non_streaming_and_streaming(client):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10 and 1 <= r.usage.completion_tokens <= 8
    stream = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == msg.content
    assert stream[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" for c in stream)


@pytest.mark.slow
def test_n_greater_than_one(client):
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=7, n=3
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    assert r.usage.completion_tokens <= 15
    # Streaming: every choice streams its own deltas and finishes once.
    texts: dict[int, str] = {0: "", 1: "", 2: ""}
    finished: dict[int, int] = {0: 0, 1: 0, 2: 0}
    for chunk in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=7, n=3, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] += c.text
            finished[c.index] += c.finish_reason is not None
    assert finished == {0: 1, 1: 1, 2: 1}
    assert texts == {c.index: c.text for c in r.choices}  # same seed, same samples
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=1.0,
        seed=3,
        n=2,
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_seed_makes_sampling_reproducible(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, top_p=0.9)
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    assert a == b


@pytest.mark.slow
def test_stop_strings_cut_the_text_streaming_or_not(client):
    base = (
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
        .choices[0]
        .text
    )
    # A stop string in the middle of the greedy continuation: the text must end right before it.
    words = base.split()
    assert len(words) >= 3, base
    stop = words[1]
    cut = base[: base.index(stop)]
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop, stream=True
        )
        if c.choices
    )
    assert streamed == cut
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count: 1, 2, 3,"}],
        max_tokens=12,
        temperature=0,
    )
    text = chat.choices[0].message.content
    if len(text) > 2:
        stop = text[1:3]
        cut = text[: text.index(stop)]
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Count: 1, 2, 3,"}],
            max_tokens=12,
            temperature=0,
            stop=stop,
            stream=True,
        )
        assert "".join(c.choices[0].delta.content or "" for c in r if c.choices) == cut


def test_logprobs(client):
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(chosen)  # greedy: the chosen token is the top one
    assert lp.text_offset == sorted(lp.text_offset)
    c = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(
        len(x.top_logprobs) == 3 and x.top_logprobs[0].logprob == pytest.approx(x.logprob)
        for x in content
    )


def test_batched_prompts_and_token_id_prompts(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    r = client.completions.create(
        model=MODEL, prompt=[PROMPT, "Two plus two is"], max_tokens=3, temperature=0
    )
    assert [c.index for c in r.choices] == [0, 1]
    single = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    assert single.choices[0].text == r.choices[0].text
    assert single.usage.prompt_tokens == len(ids)


def test_kv_transfer_params_are_accepted_and_returned(server):
    """vLLM's top-level ``kv_transfer_params``: passed to SamplingParams (a known key is
    accepted), and the response carries the connector's params (null: no connector here)."""
    import httpx

    body = dict(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        kv_transfer_params={"skip_reading_prefix_cache": True},
    )
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert "kv_transfer_params" in r.json() and r.json()["kv_transfer_params"] is None
    plain = httpx.post(
        server.url + "/v1/completions", json={**body, "kv_transfer_params": None}, timeout=60
    )
    assert plain.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
    chat = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=60,
        json=dict(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            temperature=0,
            kv_transfer_params={"skip_reading_prefix_cache": True},
        ),
    )
    assert chat.status_code == 200, chat.text
    assert "kv_transfer_params" in chat.json() and chat.json()["kv_transfer_params"] is None


def test_kv_transfer_params_unknown_key_is_a_400_naming_the_field(server):
    import httpx

    for path, extra in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        r = httpx.post(
            server.url + path,
            timeout=60,
            json=dict(model=MODEL, max_tokens=2, kv_transfer_params={"bogus": 1}, **extra),
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        # The key itself is named (kv_transfer_params is a typed model: protocol.KVTransferParams).
        assert err["param"] == "kv_transfer_params.bogus" and "bogus" in err["message"]
        wrong_type = httpx.post(
            server.url + path,
            timeout=60,
            json=dict(model=MODEL, max_tokens=2, kv_transfer_params=[1], **extra),
        )
        assert wrong_type.status_code == 400 and "kv_transfer_params" in wrong_type.text


def test_kv_transfer_params_only_on_the_last_stream_chunk(server):
    import json

    import httpx

    for path, extra in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        for options in (None, {"include_usage": True}):
            body = dict(model=MODEL, max_tokens=3, temperature=0, stream=True, **extra)
            if options:
                body["stream_options"] = options
            with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert "kv_transfer_params" in chunks[-1] and chunks[-1]["kv_transfer_params"] is None
            assert all("kv_transfer_params" not in c for c in chunks[:-1])
            # The final chunk is the finishing one, or the usage chunk after it.
            assert (chunks[-1]["usage"] is not None) == bool(options)
            if not options:
                assert chunks[-1]["choices"][0]["finish_reason"] is not None


def test_debug_kv_cache_reports_the_pool_and_a_broken_invariant(server):
    """``GET /debug/kv_cache``: an idle server has every block but the null one free and its
    invariants hold; a block corrupted on the engine thread (a free block given a reference)
    makes it report ``invariants_ok: false`` with the check's message, and the repair is seen."""
    import httpx

    async_llm = server.app.state.pagedkv.async_llm
    r = httpx.get(server.url + "/debug/kv_cache", timeout=60)
    assert r.status_code == 200, r.text
    idle = r.json()
    num_blocks = async_llm.call_in_engine(lambda e: e.kv_cache_config.num_blocks).result(60)
    assert idle == {
        "num_blocks": num_blocks,
        "num_free_blocks": num_blocks - 1,
        "num_running": 0,
        "num_waiting": 0,
        "invariants_ok": True,
    }

    def corrupt(e) -> int:
        block = e.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks()[0]
        block.ref_cnt += 1
        return block.block_id

    def repair(e) -> None:
        e.kv_cache_manager.block_pool.blocks[bad].ref_cnt -= 1

    bad = async_llm.call_in_engine(corrupt).result(60)
    try:
        broken = httpx.get(server.url + "/debug/kv_cache", timeout=60).json()
    finally:
        async_llm.call_in_engine(repair).result(60)
    assert broken["invariants_ok"] is False and f"block {bad}" in broken["error"]
    assert httpx.get(server.url + "/debug/kv_cache", timeout=60).json() == idle
