"""64 concurrent streaming clients (the official async ``openai`` client): all complete, each
output equals offline ``LLM.generate`` with the same parameters and seed, and the KV pool is
all free afterwards. Plus a tiny run of benchmarks/bench_serving.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

from pagedkv import LLM, SamplingParams
from pagedkv.engine.config import EngineConfig
from pagedkv.entrypoints.cli.serve import BackgroundServer
from pagedkv.entrypoints.openai.api_server import create_app

ROOT = Path(__file__).resolve().parents[1]
NUM_CLIENTS = 64
ENGINE = dict(num_kv_blocks=640, max_num_seqs=64, max_model_len=512)
PREFIXES = [
    "You are a helpful assistant. Answer briefly and precisely, without any preamble. Question: ",
    "The following is a transcript of a lecture on operating systems and virtual memory. ",
]
TOPICS = [
    "paging",
    "caching",
    "hashing",
    "scheduling",
    "batching",
    "eviction",
    "prefetching",
    "swapping",
]


def workload() -> list[tuple[str, dict]]:
    """(prompt, sampling) per client: shared prefixes (prefix hits), greedy and seeded sampling."""
    out = []
    for i in range(NUM_CLIENTS):
        prompt = PREFIXES[i % 2] + f"Explain {TOPICS[i % len(TOPICS)]} in one sentence (#{i})."
        if i % 2:
            sp = dict(temperature=0.8, top_p=0.95, seed=1000 + i, max_tokens=6 + i % 5)
        else:
            sp = dict(temperature=0.0, max_tokens=6 + i % 5)
        out.append((prompt, sp))
    return out


@pytest.fixture(scope="module")
def server():
    app = create_app(EngineConfig(**ENGINE))
    with BackgroundServer(app) as srv:
        yield srv


async def run_clients(url: str, work: list[tuple[str, dict]]) -> list[dict]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)

    async def one(prompt: str, sp: dict) -> dict:
        t0 = time.monotonic()
        stream = await client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt=prompt,
            stream=True,
            stream_options={"include_usage": True},
            **sp,
        )
        text, finish, usage, chunks = "", None, None, 0
        async for chunk in stream:
            if chunk.choices:
                chunks += 1
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        return dict(
            text=text,
            finish_reason=finish,
            usage=usage,
            chunks=chunks,
            seconds=time.monotonic() - t0,
        )

    try:
        return await asyncio.wait_for(asyncio.gather(*(one(p, sp) for p, sp in work)), timeout=300)
    finally:
        await client.close()


@pytest.mark.slow
def test_64_concurrent_streams_match_offline_generate_and_free_the_pool(server):
    work = workload()
    results = asyncio.run(run_clients(server.url, work))
    assert len(results) == NUM_CLIENTS
    for (_, sp), r in zip(work, results):
        assert r["finish_reason"] in ("stop", "length"), r
        assert r["usage"] is not None and 1 <= r["usage"].completion_tokens <= sp["max_tokens"]
        assert r["chunks"] >= 1

    # The pool is all free (cached blocks allowed), and the invariants hold.
    with httpx.Client(base_url=server.url, timeout=30) as http:
        st = http.get("/dashboard/state").json()
        assert st["num_running"] == 0 and st["num_waiting"] == 0
        assert st["counts"]["used"] == 0 and st["counts"]["shared"] == 0
        assert st["counts"]["free"] + st["counts"]["cached"] == st["num_blocks"] - 1
        assert st["prefix_cache"]["hits"] > 0  # the shared prefixes were reused
        metrics = http.get("/metrics").text
    server.app.state.pagedkv.async_llm.call_in_engine(lambda e: e.check_invariants()).result(30)
    ttft_count = next(
        line
        for line in metrics.splitlines()
        if line.startswith("pagedkv:time_to_first_token_seconds_count")
    )
    assert float(ttft_count.rsplit(" ", 1)[1]) >= NUM_CLIENTS

    # Offline, same engine options, same prompts and parameters (seeds included).
    llm = LLM(**ENGINE)
    offline = llm.generate(
        [p for p, _ in work], [SamplingParams(**sp) for _, sp in work], use_tqdm=False
    )
    mismatches = [
        (i, r["text"], o.outputs[0].text)
        for i, (r, o) in enumerate(zip(results, offline))
        if r["text"] != o.outputs[0].text or r["finish_reason"] != o.outputs[0].finish_reason
    ]
    assert not mismatches, mismatches[:5]
    assert [r["usage"].completion_tokens for r in results] == [
        len(o.outputs[0].token_ids) for o in offline
    ]


@pytest.mark.slow
def test_bench_serving_tiny_run(tmp_path):
    out = tmp_path / "bench.json"
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_serving.py"),
            "--num-requests",
            "6",
            "--request-rate",
            "20",
            "--input-len",
            "24",
            "--prefix-len",
            "16",
            "--output-len",
            "4",
            "--num-kv-blocks",
            "256",
            "--max-model-len",
            "512",
            "--json-out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["runs"]] == ["rate=20", "saturation"]
    for run in report["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0
        assert run["output_tokens"] == 24
        assert run["request_throughput"] > 0 and run["output_token_throughput"] > 0
        assert 0 < run["ttft_s"]["p50"] <= run["ttft_s"]["p99"]
        assert 0 <= run["prefix_hit_rate"] <= 1
        # CPU by server thread: the HTTP event loop and the named engine thread both worked.
        threads = run["server_cpu_by_thread_s"]
        assert {"main", "pagedkv-engine"} <= threads.keys()
        assert threads["pagedkv-engine"] > 0
        assert sum(threads.values()) <= run["server_cpu_s"] + 0.05
    off = report["offline"]
    assert off["output_tokens"] == 24 and off["output_token_throughput"] > 0
    assert report["saturation_vs_offline"] == pytest.approx(
        report["runs"][1]["output_token_throughput"] / off["output_token_throughput"]
    )
    assert "saturation" in res.stdout and "offline" in res.stdout
