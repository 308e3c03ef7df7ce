"""``pagedkv proxy`` (entrypoints/proxy.py) in front of real ``pagedkv serve`` processes.

Two servers (the default model, a small KV pool) for the whole module, playing prefill and
decode; without a KV connector the prefill instance returns ``kv_transfer_params: null`` and the
decode instance computes the prompt itself, so greedy answers through the proxy must be
token-identical to a direct request. Dead instances are free ports nobody listens on. The main
proxy runs as the ``pagedkv proxy`` command; the fault-handling ones run in this process
(`BackgroundServer`), so a test can read which instances served (``app.state.proxy.served``).
"""

from __future__ import annotations

import json
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pagedkv.entrypoints.cli.serve import BackgroundServer
from pagedkv.entrypoints.proxy import create_proxy_app
from pagedkv.forwarding import prefill_body

CMD = [sys.executable, "-m", "pagedkv.entrypoints.cli"]
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
START_TIMEOUT = 240  # model load on a busy 2-core machine


def _pump(stream: Any, q: queue.Queue) -> None:
    for line in stream:
        q.put(line)
    q.put(None)


def _start(args: list[str]) -> tuple[subprocess.Popen, queue.Queue]:
    proc = subprocess.Popen(
        [*CMD, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    q: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, q), daemon=True).start()
    return proc, q


def _wait_url(proc: subprocess.Popen, q: queue.Queue, timeout: float) -> str:
    """The URL of the ``listening on`` line; AssertionError with the output if it never comes."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=0.5)
        except queue.Empty:
            continue
        if line is None:
            break
        seen.append(line)
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            return m.group(1)
    raise AssertionError(
        f"no 'listening on' line (rc={proc.poll()}); output: {''.join(seen[-30:])}"
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _dead_url() -> str:
    """A local URL nobody listens on (a free port, closed again): connections are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def instances() -> Iterator[tuple[str, str]]:
    """Two ``pagedkv serve`` processes (started together), stopped by PID at the end."""
    procs = []
    try:
        for _ in range(2):
            procs.append(
                _start(
                    [
                        "serve",
                        "--port",
                        "0",
                        "--num-kv-blocks",
                        "128",
                        "--max-model-len",
                        "512",
                        "--max-num-seqs",
                        "4",
                        "--log-stats-interval",
                        "0",
                    ]
                )
            )
        urls = [_wait_url(p, q, START_TIMEOUT) for p, q in procs]
        yield urls[0], urls[1]
    finally:
        for p, _ in procs:
            _stop(p)


@pytest.fixture(scope="module")
def proxy_url(instances) -> Iterator[str]:
    """``pagedkv proxy --prefill A --decode B`` as a process."""
    a, b = instances
    proc, q = _start(
        ["proxy", "--prefill", a, "--decode", b, "--port", "0", "--log-level", "debug"]
    )
    try:
        yield _wait_url(proc, q, 60)
    finally:
        _stop(proc)


def _proxy(prefill: list[str], decode: list[str]) -> BackgroundServer:
    return BackgroundServer(
        create_proxy_app(prefill, decode, cooldown=30.0, timeout=120.0, retry_window=1.0)
    )


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def _stream(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON chunks of a streamed request (``[DONE]`` checked and dropped)."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


COMPLETION = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
CHAT = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)


def _completion_text(url: str) -> str:
    r = _post(url, "/v1/completions", COMPLETION)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def expected(instances) -> str:
    """The greedy completion of COMPLETION, asked directly of an instance."""
    return _completion_text(instances[0])


def test_prefill_body_follows_vllms_toy_proxy():
    body = dict(
        COMPLETION,
        stream=True,
        stream_options={"include_usage": True},
        min_tokens=2,
        max_completion_tokens=50,
    )
    p = prefill_body(body)
    assert p["stream"] is False and p["max_tokens"] == 1 and p["max_completion_tokens"] == 1
    assert "stream_options" not in p and "min_tokens" not in p
    assert p["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert body["max_tokens"] == 8 and body["stream"] is True  # the client's body is untouched


@pytest.mark.slow
def test_proxy_answers_are_token_identical_to_a_direct_request(instances, proxy_url):
    direct_url = instances[0]
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        direct = _post(
            direct_url,
            path,
            {**body, "logprobs": True} if "messages" in body else {**body, "logprobs": 1},
        )
        via = _post(
            proxy_url,
            path,
            {**body, "logprobs": True} if "messages" in body else {**body, "logprobs": 1},
        )
        assert direct.status_code == via.status_code == 200, via.text
        d, v = direct.json(), via.json()
        assert v["choices"][0].get("text", v["choices"][0].get("message")) == d["choices"][0].get(
            "text", d["choices"][0].get("message")
        )
        # Token-identical: the same tokens (logprobs list them one by one).
        tokens = (
            (lambda j: j["choices"][0]["logprobs"]["tokens"])
            if "prompt" in body
            else (lambda j: [t["token"] for t in j["choices"][0]["logprobs"]["content"]])
        )
        assert tokens(v) == tokens(d) and len(tokens(v)) >= 1
        assert v["usage"]["completion_tokens"] == d["usage"]["completion_tokens"]
        assert "kv_transfer_params" in v and v["kv_transfer_params"] is None  # no connector
        # Streaming: the decode instance's SSE passes through chunk by chunk.
        field = (
            (lambda c: c["choices"][0]["text"])
            if "prompt" in body
            else (lambda c: c["choices"][0]["delta"].get("content") or "")
        )
        ds, vs = _stream(direct_url, path, body), _stream(proxy_url, path, body)
        assert [field(c) for c in vs if c["choices"]] == [field(c) for c in ds if c["choices"]]
        assert "".join(field(c) for c in vs if c["choices"]) == (
            v["choices"][0]["text"] if "prompt" in body else v["choices"][0]["message"]["content"]
        )
    models = httpx.get(proxy_url + "/v1/models", timeout=30)
    assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == [MODEL]
    assert httpx.get(proxy_url + "/health", timeout=30).status_code == 200


@pytest.mark.slow
def test_round_robin_spreads_requests_over_both_instances(instances, expected):
    a, b = instances
    with _proxy([a, b], [a, b]) as srv:
        texts = [_completion_text(srv.url) for _ in range(4)]
        served = list(srv.app.state.proxy.served)
    assert texts == [expected] * 4
    assert [s[1] for s in served] == [a, b, a, b]  # prefill
    assert [s[2] for s in served] == [a, b, a, b]  # decode
    assert len({s[0] for s in served}) == 4  # a fresh request id each time


@pytest.mark.slow
def test_dead_instances_are_skipped_and_no_request_is_lost(instances, expected):
    a, b = instances
    dead_p, dead_d = _dead_url(), _dead_url()
    with _proxy([dead_p, a], [dead_d, b]) as srv:
        state = srv.app.state.proxy
        texts = [_completion_text(srv.url) for _ in range(2)]
        chunks = _stream(srv.url, "/v1/completions", COMPLETION)
        served = list(state.served)
        dead = [
            i for i in state.prefill.instances + state.decode.instances if i.url in (dead_p, dead_d)
        ]
        assert all(not i.healthy(time.monotonic()) for i in dead)  # in their cool-down
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
    assert texts == [expected] * 2
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected
    assert [(s[1], s[2]) for s in served] == [(a, b)] * 3


@pytest.mark.slow
def test_every_prefill_dead_falls_back_to_the_decode_instance(instances, expected):
    a, b = instances
    with _proxy([_dead_url(), _dead_url()], [b]) as srv:
        assert _completion_text(srv.url) == expected
        chat = _post(srv.url, "/v1/chat/completions", CHAT)
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]
        served = list(srv.app.state.proxy.served)
    assert [(s[1], s[2]) for s in served] == [(None, b)] * 2


@pytest.mark.slow
def test_every_decode_dead_is_a_503_and_client_errors_pass_through(instances):
    a, _ = instances
    with _proxy([a], [_dead_url(), _dead_url()]) as srv:
        for stream in (False, True):
            r = _post(srv.url, "/v1/completions", {**COMPLETION, "stream": stream})
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["type"] == "server_error" and "decode" in err["message"]
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 503
        assert httpx.get(srv.url + "/v1/models", timeout=30).status_code == 503
        # A 4xx from the prefill instance is the client's: returned as it is, not retried.
        bad = _post(srv.url, "/v1/completions", {**COMPLETION, "temperature": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
        prefill = srv.app.state.proxy.prefill.instances[0]
        assert prefill.healthy(time.monotonic())  # a 400 does not make an instance unhealthy


# ---- return_token_ids and mid-stream resumption -------------------------------------------------


@pytest.mark.slow
def test_return_token_ids_match_the_text_streamed_and_not(instances):
    """vLLM's ``return_token_ids``: completions put ``prompt_token_ids`` on the choice, chat on
    the response; streamed token ids concatenate to the non-streamed ones."""
    a, _ = instances
    body = {**COMPLETION, "max_tokens": 12, "return_token_ids": True}
    full = _post(a, "/v1/completions", body).json()["choices"][0]
    assert len(full["token_ids"]) == 12 and full["prompt_token_ids"]
    chunks = _stream(a, "/v1/completions", body)
    streamed = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    assert streamed == full["token_ids"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert "prompt_token_ids" not in chunks[1]["choices"][0]
    chat = _post(a, "/v1/chat/completions", {**CHAT, "return_token_ids": True}).json()
    assert chat["prompt_token_ids"] and len(chat["choices"][0]["token_ids"]) == 8
    plain = _post(a, "/v1/completions", COMPLETION).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def _serve_victim() -> tuple[subprocess.Popen, str]:
    proc, q = _start(
        [
            "serve",
            "--port",
            "0",
            "--num-kv-blocks",
            "64",
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "2",
            "--log-stats-interval",
            "0",
        ]
    )
    try:
        return proc, _wait_url(proc, q, START_TIMEOUT)
    except BaseException:
        _stop(proc)
        raise


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_decode_instance_killed_mid_stream_is_resumed_token_exact(instances, path):
    """The decode instance is SIGKILLed after the client got a few chunks: the proxy continues
    the choice on the other decode instance from the tokens already sent, and the client's one
    stream is token-identical (text and token ids) to an unbroken greedy answer."""
    a, b = instances
    base = COMPLETION if path == "/v1/completions" else CHAT
    body = {
        **base,
        "max_tokens": 40,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    want = _post(a, path, {k: v for k, v in body.items() if k != "stream_options"}).json()
    want_ids = want["choices"][0]["token_ids"]
    victim, victim_url = _serve_victim()
    try:
        with _proxy([a], [victim_url, b]) as srv:
            got_ids: list[int] = []
            text, chunks = "", []
            with httpx.stream(
                "POST", srv.url + path, json={**body, "stream": True}, timeout=120
            ) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    chunks.append(chunk)
                    for ch in chunk["choices"]:
                        got_ids += ch.get("token_ids", [])
                        text += ch.get("text", "") or (ch.get("delta") or {}).get("content") or ""
                    if len(got_ids) >= 5 and victim.poll() is None:
                        victim.kill()  # mid-answer, after the client has part of it
                        victim.wait(10)
            assert victim.returncode is not None, "the victim was never killed: nothing tested"
            assert got_ids == want_ids
            want_text = want["choices"][0].get("text") or want["choices"][0]["message"]["content"]
            assert text == want_text
            assert len({c["id"] for c in chunks}) == 1  # one stream, one id
            assert chunks[-1]["usage"]["completion_tokens"] == 40
            finishes = [
                ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]
            ]
            assert finishes == ["length"]
            served = srv.app.state.proxy.served[-1]
            assert served[2] == victim_url  # the stream did start on the victim
    finally:
        _stop(victim)


@pytest.mark.slow
def test_a_stream_that_cannot_be_resumed_ends_with_an_error_event():
    """The only engine is SIGKILLed mid-answer and nothing can continue the choice: the client's
    stream must end with an error event before ``[DONE]``, never a silently short answer (the
    kill benchmark counted such streams as "N of 32 tokens": a client saw a normal end)."""
    victim, victim_url = _serve_victim()
    try:
        with _proxy(
            [_dead_url()], [victim_url]
        ) as srv:  # prefill dead: the victim runs it colocated
            body = {**COMPLETION, "max_tokens": 200, "ignore_eos": True, "stream": True}
            events: list[str] = []
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    if len(events) >= 3 and victim.poll() is None:
                        victim.kill()
                        victim.wait(10)
            assert victim.returncode is not None, "the victim was never killed: nothing tested"
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            errors = [c["error"] for c in chunks if "error" in c]
            assert len(errors) == 1 and "error" in chunks[-1], chunks[-3:]
            assert errors[0]["type"] == "server_error" and "resume" in errors[0]["message"], errors[
                0
            ]
            tokens = sum(1 for c in chunks for ch in c.get("choices", []) if ch.get("text"))
            assert tokens < 200
    finally:
        _stop(victim)
