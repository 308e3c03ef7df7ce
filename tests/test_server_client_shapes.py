"""The requests benchmark clients send, replayed field by field, and every field they read back.

Neither client is a project dependency (``vllm bench serve`` ships inside vLLM, GuideLLM pulls
datasets, pyarrow and sanic), so this test sends their exact bodies and headers, copied from
their source, and parses the answers as they do:

* ``vllm bench serve`` (vLLM 0.32, ``vllm/benchmarks/lib/endpoint_request_func.py``:
  ``async_request_openai_completions`` / ``async_request_openai_chat_completions``): SSE split on
  blank lines, ``:`` comments skipped, ``data: `` prefix; ``choices[0].text`` /
  ``choices[0].delta.content`` per chunk (the first one is its TTFT), then a chunk without
  choices whose ``usage.completion_tokens`` / ``prompt_tokens`` it records.
* GuideLLM 0.8.1 (``guidellm/backends/openai/request_handlers.py``: ``TextCompletionsRequestHandler``
  / ``ChatCompletionsRequestHandler``): ``stream_options.continuous_usage_stats``, ``stop: null``,
  ``ignore_eos``, ``max_completion_tokens`` and content-part messages; ``data:`` lines, an
  ``error`` key fails the request, ``id``, ``choices[0].text`` / ``delta.content``, ``usage``
  with ``prompt_tokens_details``.

When ``.bench/vllm-venv`` exists (`benchmarks/vllm/`), vLLM's own request functions also run,
from that venv, against the server.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import httpx
import pytest
from server_utils import client as http_client
from server_utils import running_server

from pagedkv.engine.config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".bench" / "vllm-venv" / "bin" / "python"
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
OUT = 12


@pytest.fixture(scope="module")
def server():
    with running_server(EngineConfig(num_kv_blocks=128, max_model_len=512)) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with http_client(server) as c:
        yield c


def sse_messages(raw: str) -> list[str]:
    """vLLM's `StreamedResponseHandler`: messages split on a blank line, stripped."""
    return [m.strip() for m in raw.split("\n\n") if m.strip()]


def vllm_bench_read(raw: str, chat: bool) -> dict:
    """What vLLM's request function records from a stream (its loop, field for field)."""
    out = {"chunks": 0, "text": "", "output_tokens": None, "prompt_len": None}
    for message in sse_messages(raw):
        if message.startswith(":"):
            continue
        chunk = message.removeprefix("data: ")
        if chunk == "[DONE]":
            continue
        data = json.loads(chunk)
        if choices := data.get("choices"):
            piece = choices[0]["delta"].get("content") if chat else choices[0].get("text")
            out["chunks"] += 1
            out["text"] += piece or ""
        elif usage := data.get("usage"):
            out["output_tokens"] = usage.get("completion_tokens")
            if (pt := usage.get("prompt_tokens")) is not None:
                out["prompt_len"] = pt
    return out


def guidellm_read(raw: str, chat: bool) -> dict:
    """What GuideLLM's handlers record from a stream (``add_streaming_line``)."""
    out: dict = {"id": None, "texts": [], "usage": None}
    for line in raw.splitlines():
        line = line.strip()
        if not line.startswith("data:"):
            continue
        line = line[len("data:") :].strip()
        if line == "[DONE]":
            break
        data = json.loads(line)
        assert not data.get("error"), data  # `_check_streaming_error`
        if "id" in data and out["id"] is None:
            out["id"] = data["id"]
        choices, usage = data.get("choices", []), data.get("usage", {})
        choice = choices[0] if choices else {}
        text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        if choices and text:
            out["texts"].append(text)
        if usage:
            out["usage"] = usage
    return out


def prompt_tokens(http: httpx.Client, **body) -> int:
    return http.post("/tokenize", json={"model": MODEL, **body}).json()["count"]


def test_vllm_bench_serve_completions(http):
    payload = {
        "model": MODEL,
        "prompt": PROMPT,
        "repetition_penalty": 1.0,
        "max_tokens": OUT,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,  # `--ignore-eos`, as benchmarks run it
    }
    r = http.post("/v1/completions", json=payload, headers={"x-request-id": "bench-0"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "bench-0"
    got = vllm_bench_read(r.text, chat=False)
    assert got["chunks"] >= 1  # else it marks the request failed (no TTFT)
    assert got["output_tokens"] == OUT
    assert got["prompt_len"] == prompt_tokens(http, prompt=PROMPT)
    assert got["text"]


def test_vllm_bench_serve_chat(http):
    messages = [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]
    payload = {
        "model": MODEL,
        "messages": messages,
        "max_completion_tokens": OUT,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    r = http.post(
        "/v1/chat/completions", json=payload, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 200
    got = vllm_bench_read(r.text, chat=True)
    assert got["chunks"] >= 1 and got["output_tokens"] == OUT and got["text"]
    plain = [{"role": "user", "content": PROMPT}]
    assert got["prompt_len"] == prompt_tokens(http, messages=plain, add_generation_prompt=True)


@pytest.mark.parametrize("chat", [False, True], ids=["text_completions", "chat_completions"])
def test_guidellm_requests(http, chat):
    body: dict = {
        "model": MODEL,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "stop": None,
        "ignore_eos": True,
    }
    if chat:
        body["max_completion_tokens"] = OUT
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]
        path = "/v1/chat/completions"
    else:
        body["max_tokens"] = OUT
        body["prompt"] = PROMPT
        path = "/v1/completions"
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    got = guidellm_read(r.text, chat)
    assert got["id"] and got["texts"]
    usage = got["usage"]
    assert usage["completion_tokens"] == OUT and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + OUT
    assert isinstance(usage.get("prompt_tokens_details", {}) or {}, dict)
    # Non-streaming: `compile_non_streaming` reads choices[0].text / message.content and usage.
    body.pop("stream"), body.pop("stream_options")
    full = http.post(path, json=body).json()
    choice = full["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    assert isinstance(text, str) and text and full["usage"]["completion_tokens"] == OUT
    assert full["id"] and full["usage"]["prompt_tokens"] == usage["prompt_tokens"]


@pytest.mark.skipif(not VLLM_PY.exists(), reason="no .bench/vllm-venv (benchmarks/vllm/)")
def test_vllm_bench_request_functions_from_vllm_itself(server):
    """vLLM's own ``async_request_openai_completions`` / ``..._chat_completions``, run by the
    vLLM venv's interpreter against this server: both succeed with the asked output length."""
    script = textwrap.dedent(
        f"""
        import asyncio, json, aiohttp
        from vllm.benchmarks.lib.endpoint_request_func import (
            RequestFuncInput, async_request_openai_completions,
            async_request_openai_chat_completions)
        async def main():
            out = {{}}
            async with aiohttp.ClientSession() as s:
                for name, fn, path in (
                    ("completions", async_request_openai_completions, "/v1/completions"),
                    ("chat", async_request_openai_chat_completions, "/v1/chat/completions"),
                ):
                    inp = RequestFuncInput(prompt={PROMPT!r}, api_url={server.url!r} + path,
                        prompt_len=0, output_len={OUT}, model={MODEL!r}, ignore_eos=True)
                    o = await fn(inp, s)
                    out[name] = dict(success=o.success, error=o.error,
                        output_tokens=o.output_tokens, prompt_len=o.prompt_len,
                        ttft=o.ttft, itl=len(o.itl), text=o.generated_text)
            print(json.dumps(out))
        asyncio.run(main())
        """
    )
    res = subprocess.run([str(VLLM_PY), "-c", script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for name, o in out.items():
        assert o["success"], (name, o["error"])
        assert o["output_tokens"] == OUT and o["prompt_len"] > 0 and o["ttft"] > 0, (name, o)
        assert o["text"]
