"""``x-request-id`` and ``truncate_prompt_tokens`` against a live server (httpx)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from server_utils import running_server

from pagedkv import LLM, SamplingParams
from pagedkv.engine.config import EngineConfig

CONFIG = EngineConfig(num_kv_blocks=128, max_num_seqs=4, max_model_len=256)
TEXT = (
    "Paged attention stores the key and value vectors of every sequence in fixed-size blocks, "
    "like pages of virtual memory, so memory is allocated on demand."
)


@pytest.fixture(scope="module")
def server():
    with running_server(CONFIG) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tok(server):
    return server.app.state.pagedkv.async_llm.tokenizer


# ---- x-request-id -------------------------------------------------------------------------------


def test_x_request_id_is_echoed_and_names_the_response(http):
    body = {"prompt": "Hi", "max_tokens": 2}
    r = http.post("/v1/completions", json=body, headers={"x-request-id": "trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    assert r.json()["id"] == "cmpl-trace-42"
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        headers={"X-Request-Id": "chat-7"},
    )
    assert chat.headers["x-request-id"] == "chat-7" and chat.json()["id"] == "chatcmpl-chat-7"
    with http.stream(
        "POST", "/v1/completions", json={**body, "stream": True}, headers={"x-request-id": "s-1"}
    ) as s:
        assert s.headers["x-request-id"] == "s-1"
        assert '"id":"cmpl-s-1"' in s.read().decode().replace(" ", "")


def test_every_response_gets_a_request_id(http):
    a, b = http.get("/health"), http.post("/v1/completions", json={"prompt": 3})
    assert len(a.headers["x-request-id"]) == 32 and b.status_code == 400
    assert b.headers["x-request-id"] != a.headers["x-request-id"]


def test_bad_x_request_id_is_a_400(http):
    r = http.post("/v1/completions", json={"prompt": "Hi"}, headers={"x-request-id": "a b"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-request-id"
    r = http.get("/health", headers={"x-request-id": "x" * 257})
    assert r.status_code == 400


def test_a_request_id_in_flight_is_a_409_and_the_first_request_completes(server):
    """Two requests with the same id at once: the second is refused (the engine keys requests by
    id), the first is unharmed."""

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            h = {"x-request-id": "same"}
            first = asyncio.ensure_future(
                c.post(
                    "/v1/completions",
                    json={"prompt": "Hi", "max_tokens": 60, "ignore_eos": True},
                    headers=h,
                )
            )
            await asyncio.sleep(0.3)  # the first is running
            second = await c.post("/v1/completions", json={"prompt": "Hi"}, headers=h)
            return await first, second

    first, second = asyncio.run(scenario())
    assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] == 60
    assert second.status_code == 409 and second.json()["error"]["param"] == "x-request-id"


# ---- truncate_prompt_tokens ------------------------------------------------------------------


def test_truncate_prompt_tokens_keeps_the_last_tokens(http, tok):
    ids = tok.encode(TEXT)
    assert len(ids) > 12
    r = http.post(
        "/v1/completions",
        json={
            "prompt": TEXT,
            "max_tokens": 6,
            "temperature": 0,
            "truncate_prompt_tokens": 12,
            "echo": True,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == 12
    assert body["choices"][0]["prompt_token_ids"] == ids[-12:]
    assert body["choices"][0]["text"].startswith(tok.decode(ids[-12:]))
    # The same tokens as the engine offline on the truncated prompt, token by token.
    llm = LLM(num_kv_blocks=64, max_model_len=256)
    ref = llm.generate(
        [{"prompt_token_ids": ids[-12:]}], SamplingParams(max_tokens=6, temperature=0)
    )
    assert body["choices"][0]["token_ids"] == list(ref[0].outputs[0].token_ids)


def test_truncate_prompt_tokens_on_chat_and_the_whole_context(http):
    msgs = [{"role": "user", "content": TEXT}]
    r = http.post(
        "/v1/chat/completions",
        json={"messages": msgs, "max_tokens": 1, "truncate_prompt_tokens": 5},
    )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 5
    long = " ".join(["block"] * 400)  # > 256 tokens: refused unless truncated
    assert http.post("/v1/completions", json={"prompt": long, "max_tokens": 1}).status_code == 400
    r = http.post(
        "/v1/completions", json={"prompt": long, "max_tokens": 1, "truncate_prompt_tokens": 200}
    )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 200


@pytest.mark.parametrize("value", [0, -2, 257, "5", 1.5])
def test_bad_truncate_prompt_tokens_is_a_400_naming_it(http, value):
    r = http.post(
        "/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "truncate_prompt_tokens": value}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
