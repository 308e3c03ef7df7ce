"""Bad requests get OpenAI-shaped 4xx errors naming the problem, the queue bound gives 503, a
client that disconnects has its request aborted and its blocks freed, and through all of it
the server stays healthy. A failing engine turns into 503s (a fake engine, no model)."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from server_utils import client as http_client
from server_utils import running_server

from pagedkv.engine.async_llm import AsyncLLM
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.stats import SchedulerStats
from pagedkv.entrypoints.cli.serve import BackgroundServer
from pagedkv.entrypoints.openai.api_server import build_app

MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 2
MAX_QUEUE = 1


@pytest.fixture(scope="module")
def server():
    with running_server(
        EngineConfig(num_kv_blocks=128, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN),
        max_queue_size=MAX_QUEUE,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with http_client(server) as c:
        yield c


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def wait_until(fn, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def state(http) -> dict:
    return http.get("/dashboard/state").json()


def pool_is_idle(http) -> bool:
    s = state(http)
    return (
        s["num_running"] == 0
        and s["num_waiting"] == 0
        and s["counts"]["used"] == 0
        and s["counts"]["shared"] == 0
    )


def assert_healthy(http) -> None:
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    "body, param, words",
    [
        ('{"prompt": "hi", "max_tokens": ', None, "not valid JSON"),
        ("[1, 2, 3]", None, "JSON object"),
        ("{}", "prompt", "missing required field 'prompt'"),
        ('{"prompt": 5}', "prompt", "invalid type for 'prompt'"),
        ('{"prompt": "hi", "max_tokens": "8"}', "max_tokens", "valid integer"),
        ('{"prompt": "hi", "temperature": "hot"}', "temperature", "valid number"),
        ('{"prompt": "hi", "n": 1.5}', "n", "valid integer"),
        ('{"prompt": "hi", "stream": "yes"}', "stream", "valid boolean"),
        ('{"prompt": "hi", "stop": [1]}', "stop", "invalid type for 'stop'"),
        ('{"prompt": "hi", "max_tokens": -1}', "max_tokens", ">= 1 (got -1)"),
        ('{"prompt": "hi", "max_tokens": 0}', "max_tokens", ">= 1 (got 0)"),
        ('{"prompt": "hi", "temperature": -0.5}', "temperature", "temperature"),
        ('{"prompt": "hi", "top_p": 1.5}', "top_p", "top_p"),
        ('{"prompt": "hi", "n": 0}', "n", ">= 1 (got 0)"),
        ('{"prompt": "hi", "logprobs": 50}', "logprobs", "logprobs"),
        ('{"prompt": "hi", "stream_options": {"include_usage": true}}', "stream_options", "stream"),
        ('{"prompt": []}', "prompt", "empty"),
        ('{"prompt": [99999999]}', "prompt", "token ids"),
        ('{"prompt": "hi", "logit_bias": {"1": 5}}', "logit_bias", "not supported"),
    ],
)
def test_bad_completion_requests_get_400_naming_the_field(http, body, param, words):
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    err = error_of(r, 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert words in err["message"], err["message"]


@pytest.mark.parametrize(
    "payload, param, words",
    [
        ({"messages": "hi"}, "messages", "valid array"),
        ({"messages": []}, "messages", "empty"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "unknown role"),
        ({"messages": [{"content": "hi"}]}, "messages[0].role", "missing required field"),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": 1, "content": "b"},
                    {"role": 2},
                ]
            },
            "messages[1].role",
            "valid string",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            "messages[0].content[0]",
            "text",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3},
            "max_completion_tokens",
            ">= 1 (got -3)",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 99},
            "top_logprobs",
            "top_logprobs",
        ),
    ],
)
def test_bad_chat_requests_get_400_naming_the_field(http, payload, param, words):
    err = error_of(http.post("/v1/chat/completions", json=payload), 400)
    assert err["param"] == param, err
    assert words in err["message"], err["message"]


def test_unknown_model_is_404(http):
    for path, extra in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        err = error_of(http.post(path, json={"model": "gpt-17", **extra}), 404)
        assert (
            err["param"] == "model"
            and err["code"] == "model_not_found"
            and "gpt-17" in err["message"]
        )


def test_over_long_prompt_is_400_with_the_limit(http):
    prompt = "word " * (MAX_MODEL_LEN + 50)
    err = error_of(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert str(MAX_MODEL_LEN) in err["message"]
    err = error_of(
        http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}]}),
        400,
    )
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"


def test_unknown_route_and_method(http):
    err = error_of(http.get("/v1/nothing"), 404)
    assert err["type"] == "not_found_error"
    assert http.get("/v1/completions").status_code == 405


def test_server_stays_healthy_after_errors(http):
    for body in ("{", '{"prompt": 1}', '{"prompt": "x", "max_tokens": -5}'):
        http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_healthy(http)
    assert pool_is_idle(http)


def test_openai_client_sees_typed_errors(server):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=-1)
        assert "max_tokens" in str(e.value)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="hi")


# ---- disconnects and the queue bound ---------------------------------------------------------


LONG = {
    "prompt": "Tell me a long story about a dragon.",
    "max_tokens": 200,
    "ignore_eos": True,
    "temperature": 0,
}


def open_stream(server, payload: dict) -> tuple[socket.socket, bytes]:
    """Start a streaming completion on a raw socket; returns it once the first chunk arrived."""
    sock = socket.create_connection((server.host, server.port), timeout=30)
    body = json.dumps({**payload, "stream": True}).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    got = b""
    deadline = time.monotonic() + 30
    while b"data: {" not in got and time.monotonic() < deadline:
        got += sock.recv(65536)
    assert b"200 OK" in got and b"data: {" in got, got[:300]
    return sock, got


def aborted(http) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("pagedkv:request_aborted_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no pagedkv:request_aborted_total")


def test_stream_disconnect_aborts_and_frees_blocks(server, http):
    before = aborted(http)
    sock, _ = open_stream(server, LONG)
    s = state(http)
    assert s["num_running"] == 1 and s["counts"]["used"] > 0
    sock.close()
    wait_until(lambda: pool_is_idle(http), what="the aborted request's blocks to be freed")
    assert aborted(http) == before + 1
    server.app.state.pagedkv.async_llm.call_in_engine(lambda e: e.check_invariants()).result(30)
    assert_healthy(http)


def test_non_streaming_disconnect_aborts_and_frees_blocks(server, http):
    before = aborted(http)
    sock = socket.create_connection((server.host, server.port), timeout=30)
    body = json.dumps({k: v for k, v in LONG.items()}).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    wait_until(lambda: state(http)["counts"]["used"] > 0, what="the request to run")
    sock.close()
    wait_until(lambda: pool_is_idle(http), what="the aborted request's blocks to be freed")
    assert aborted(http) == before + 1
    assert_healthy(http)


def test_full_queue_is_503_with_retry_after(server, http):
    socks = []
    try:
        # max_num_seqs running + max_queue_size waiting fill the server.
        for _ in range(MAX_NUM_SEQS):
            socks.append(open_stream(server, LONG)[0])
        waiting = threading.Thread(
            target=lambda: http.post("/v1/completions", json={**LONG, "max_tokens": 1})
        )
        waiting.start()
        wait_until(lambda: state(http)["num_waiting"] == 1, what="a waiting request")
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        err = error_of(r, 503)
        assert r.headers["retry-after"] == "1" and err["code"] == "queue_full"
        r = http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
        )
        assert r.status_code == 503
        assert "pagedkv:request_rejected_total" in http.get("/metrics").text
    finally:
        for s in socks:
            s.close()
    waiting.join(60)
    wait_until(lambda: pool_is_idle(http), what="the streams to be aborted")
    assert_healthy(http)


# ---- a failing engine --------------------------------------------------------------------------


class FailingEngine:
    """Just enough of `LLMEngine` for AsyncLLM and the app; ``step`` raises."""

    def __init__(self) -> None:
        self.config = EngineConfig(max_num_seqs=4)  # a real config: the app reads its fields
        self.samples: dict[str, object] = {}
        self.tokenizer = None
        self.max_model_len = 64
        self.mm_processor = self.ec = None  # a text model, no encoder-cache transfer

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(num_blocks=8, block_size=16, num_free_blocks=7)

    def process_prompt(self, prompt) -> tuple[list[int], None]:
        return list(prompt["prompt_token_ids"]), None

    def add_request(self, rid, prompt, params, arrival_time=None, cache_salt=None) -> None:
        self.samples[rid] = prompt

    def has_unfinished_requests(self) -> bool:
        return bool(self.samples)

    def has_work(self) -> bool:
        return bool(self.samples)

    def abort_request(self, ids) -> None:
        for i in [ids] if isinstance(ids, str) else ids:
            self.samples.pop(i, None)

    def step(self):
        raise RuntimeError("simulated device failure")


def test_engine_failure_gives_503_and_unhealthy():
    llm = AsyncLLM(FailingEngine())
    with (
        BackgroundServer(build_app(llm)) as srv,
        httpx.Client(base_url=srv.url, timeout=30) as http,
    ):
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        err = error_of(r, 503)
        assert "simulated device failure" in err["message"]
        r = http.get("/health")
        assert r.status_code == 503 and "retry-after" in r.headers
        assert error_of(http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}), 503)
        assert "pagedkv:engine_healthy{" in http.get("/metrics").text


# ---- non-finite numbers, context length, unimplemented fields (issue 9) ------------------------


CHAT_HI = '"messages": [{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', "temperature"),
        ("/v1/completions", '{"prompt": "hi", "temperature": NaN, "stream": true}', "temperature"),
        ("/v1/completions", '{"prompt": "hi", "top_p": Infinity}', "top_p"),
        (
            "/v1/completions",
            '{"prompt": "hi", "repetition_penalty": NaN, "temperature": 0}',
            "repetition_penalty",
        ),
        (
            "/v1/completions",
            '{"prompt": "hi", "presence_penalty": -Infinity, "stream": true}',
            "presence_penalty",
        ),
        ("/v1/completions", '{"prompt": "hi", "frequency_penalty": NaN}', "frequency_penalty"),
        ("/v1/completions", '{"prompt": "hi", "min_p": Infinity}', "min_p"),
        (
            "/v1/completions",
            '{"prompt": "hi", "vendor_extension": {"x": [1, NaN]}}',
            "vendor_extension.x[1]",
        ),
        ("/v1/chat/completions", "{" + CHAT_HI + ', "temperature": NaN}', "temperature"),
        (
            "/v1/chat/completions",
            "{" + CHAT_HI + ', "temperature": Infinity, "stream": true}',
            "temperature",
        ),
        (
            "/v1/chat/completions",
            "{" + CHAT_HI + ', "repetition_penalty": NaN, "stream": true}',
            "repetition_penalty",
        ),
        ("/v1/chat/completions", "{" + CHAT_HI + ', "top_p": -Infinity}', "top_p"),
    ],
)
def test_nan_and_infinity_literals_are_400_naming_the_field(http, path, body, param):
    """Python's JSON parser takes NaN/Infinity; one NaN temperature used to kill the engine."""
    r = http.post(path, content=body, headers={"content-type": "application/json"})
    err = error_of(r, 400)
    assert err["param"] == param, err
    assert "NaN/Infinity are not valid numbers" in err["message"], err["message"]
    assert param in err["message"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", '{"prompt": "hi", "temperature": 1e999}', "temperature"),
        (
            "/v1/chat/completions",
            "{" + CHAT_HI + ', "repetition_penalty": -1e400, "stream": true}',
            "repetition_penalty",
        ),
    ],
)
def test_overflowing_numbers_are_400_naming_the_field(http, path, body, param):
    """``1e999`` parses as inf: refused as not finite, like the literals."""
    err = error_of(http.post(path, content=body, headers={"content-type": "application/json"}), 400)
    assert err["param"] == param and "finite" in err["message"], err


def test_top_level_nan_body_and_nan_inside_strings(http):
    err = error_of(
        http.post("/v1/completions", content="NaN", headers={"content-type": "application/json"}),
        400,
    )
    assert (
        err["param"] is None
        and "invalid JSON: NaN/Infinity are not valid numbers" in err["message"]
    )
    # The words inside a string are text, not numbers.
    r = http.post(
        "/v1/completions", json={"prompt": "NaN and Infinity", "max_tokens": 1, "stop": ["NaN"]}
    )
    assert r.status_code == 200, r.text


def test_server_keeps_serving_after_nan_requests(http):
    for path, body in (
        ("/v1/completions", '{"prompt": "hi", "temperature": NaN, "max_tokens": 3}'),
        ("/v1/chat/completions", "{" + CHAT_HI + ', "repetition_penalty": NaN, "temperature": 0}'),
    ):
        assert (
            http.post(path, content=body, headers={"content-type": "application/json"}).status_code
            == 400
        )
    assert_healthy(http)
    r = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def context_message(prompt_tokens: int, completion: int, where: str) -> str:
    return (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
        f"{prompt_tokens + completion} tokens ({prompt_tokens} in the {where}, {completion} in the "
        f"completion). Please reduce the length of the {where} or completion."
    )


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.slow
def test_max_tokens_beyond_the_context_is_400(http, stream):
    prompt = [1] * 250  # 250 tokens: 6 left in a 256-token context
    err = error_of(
        http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 7, "stream": stream}),
        400,
    )
    assert err["message"] == context_message(250, 7, "prompt")
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    err = error_of(
        http.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 100_000, "stream": stream}
        ),
        400,
    )
    assert "100000 in the completion" in err["message"] and err["param"] == "max_tokens"
    r = http.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": 6, "ignore_eos": True, "stream": stream},
    )
    assert r.status_code == 200, r.text


def test_chat_max_completion_tokens_beyond_the_context_is_400(http, server):
    tok = server.app.state.pagedkv.async_llm.tokenizer
    messages = [{"role": "user", "content": "hi"}]
    n = len(
        tok.encode(
            tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False
        )
    )
    for field in ("max_completion_tokens", "max_tokens"):
        for stream in (False, True):
            err = error_of(
                http.post(
                    "/v1/chat/completions",
                    json={"messages": messages, field: 5000, "stream": stream},
                ),
                400,
            )
            assert err["message"] == context_message(n, 5000, "messages")
            assert err["param"] == field and err["code"] == "context_length_exceeded"


def test_implicit_default_max_tokens_is_clamped_not_refused(http):
    """OpenAI's default max_tokens (16) was not asked for: clamped to what the context leaves."""
    r = http.post("/v1/completions", json={"prompt": [1] * 250, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - 250


@pytest.mark.parametrize(
    "field, value",
    [
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "auto"),
        ("tool_choice", "required"),
        ("functions", [{"name": "f", "parameters": {}}]),
        ("function_call", "auto"),
        ("logit_bias", {"42": 100}),
        ("guided_json", {"type": "object"}),
        ("guided_regex", "[a-z]+"),
        ("guided_choice", ["yes", "no"]),
        ("guided_grammar", "root ::= 'a'"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unimplemented_fields_are_400_not_ignored(http, path, field, value):
    base = (
        {"prompt": "hi"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    for stream in (False, True):
        err = error_of(
            http.post(path, json={**base, field: value, "max_tokens": 1, "stream": stream}), 400
        )
        assert err["param"] == field and "not supported" in err["message"], err


@pytest.mark.parametrize(
    "unused",
    [
        {"tools": []},
        {"tool_choice": "none"},
        {"response_format": {"type": "text"}},
        {"logit_bias": {}},
        {"tools": None, "guided_json": None},
    ],
)
def test_unimplemented_fields_with_neutral_values_are_accepted(http, unused):
    r = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **unused},
    )
    assert r.status_code == 200, r.text


def test_a_failing_step_is_500_for_its_request_only(server, http):
    """A fault while running one batch (injected into the real engine's forward pass) fails the
    request of that batch with a 500 (non-streaming) or an error event (streaming); the server
    stays healthy and serves the next request."""
    engine = server.app.state.pagedkv.async_llm.engine
    real = engine.runner.execute_model
    faults = []

    def faulty(*args, **kwargs):
        if not faults:
            faults.append(1)
            raise RuntimeError("injected device fault")
        return real(*args, **kwargs)

    for stream in (False, True):
        faults.clear()
        engine.runner.execute_model = faulty
        try:
            r = http.post(
                "/v1/completions", json={"prompt": "Hi there", "max_tokens": 3, "stream": stream}
            )
        finally:
            engine.runner.execute_model = real
        if stream:
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert r.status_code == 200 and events[-1] == "[DONE]", r.text
            err = json.loads(events[-2])["error"]
        else:
            err = error_of(r, 500)
        assert (
            err["code"] == "engine_generate_error" and "injected device fault" in err["message"]
        ), err
        assert http.get("/health").status_code == 200
        assert_healthy(http)
    wait_until(lambda: pool_is_idle(http), what="the failed request's blocks to be freed")
