"""Metrics for vLLM users: ``--metrics-prefix vllm`` exports vLLM's exact names (and labels), the
per-request phase histograms add up to the end-to-end latency, ``iteration_tokens_total``
follows vLLM's definition, ``cache_config_info`` carries the cache configuration, no
``_created`` series; ``serve`` logs vLLM's stats line while busy; the Redis tier reports the
server's real capacity (``maxmemory``, or unbounded).

A real server (uvicorn, the real model) with the real httpx client; ``pagedkv serve`` as a real
subprocess; a real ``redis-server``.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis_server import RedisServer
from server_utils import client as http_client
from server_utils import running_server

from pagedkv.engine.config import EngineConfig
from pagedkv.entrypoints.metrics import build_1_2_5_buckets, percentile
from pagedkv.entrypoints.stat_logger import configure_server_stats
from pagedkv.offload.redis_tier import RedisTier

MODEL = "SmolLM2-135M-Instruct"
NUM_BLOCKS = 200
SCRIPT = os.path.join(os.path.dirname(sys.executable), "pagedkv")
CMD = [SCRIPT] if os.path.exists(SCRIPT) else [sys.executable, "-m", "pagedkv.entrypoints.cli"]

# What vLLM's Grafana dashboard and alerts read (vLLM v1 names; counters with _total).
VLLM_SERIES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
    "vllm:request_prefill_time_seconds_bucket", "vllm:request_decode_time_seconds_bucket",
    "vllm:request_inference_time_seconds_bucket", "vllm:iteration_tokens_total_bucket",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:cache_config_info",
]
PHASES = ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds")


@pytest.fixture(scope="module")
def server():
    with running_server(EngineConfig(num_kv_blocks=NUM_BLOCKS, max_num_seqs=2, max_model_len=256)) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with http_client(server, timeout=300) as c:
        yield c


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)] of a Prometheus text exposition."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(series: dict, name: str) -> float:
    (_, v), = series[name]
    return v


def run_requests(server) -> list[dict]:
    """Five completions at once (max_num_seqs=2: three of them queue), one with n=2; returns
    their usage dicts."""
    bodies = [dict(prompt=f"Count the birds on wire number {i}:", max_tokens=6 + 2 * i, ignore_eos=True,
                   temperature=0) for i in range(4)]
    bodies.append(dict(prompt="Two short poems about rain:", max_tokens=5, n=2, ignore_eos=True,
                       temperature=0.8, seed=3))
    results: list[dict] = [{}] * len(bodies)

    def one(i: int) -> None:
        with httpx.Client(base_url=server.url, timeout=300) as c:
            r = c.post("/v1/completions", json=bodies[i])
            assert r.status_code == 200, r.text
            results[i] = r.json()["usage"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert all(results), results
    return results


def test_default_prefix_has_the_new_histograms_and_no_created_series(server, http):
    run_requests(server)
    text = http.get("/metrics").text
    assert "_created" not in text
    assert "vllm:" not in text
    s = samples(text)
    for phase in PHASES + ("iteration_tokens_total", "request_inference_time_seconds"):
        assert value(s, f"pagedkv:{phase}_count") >= 1, phase
    assert s["pagedkv:cache_config_info"][0][1] == 1.0


def test_vllm_prefix_exports_vllm_names_labels_and_request_phases(server, http):
    configure_server_stats(server.app.state.pagedkv, metrics_prefix="vllm", log_stats_interval=0)
    usages = run_requests(server)
    text = http.get("/metrics").text
    assert "_created" not in text and "pagedkv:" not in text
    s = samples(text)
    missing = [name for name in VLLM_SERIES if name not in s]
    assert not missing, missing
    # vLLM's labels: model_name and engine.
    assert s["vllm:num_requests_running"] == [({"model_name": MODEL, "engine": "0"}, 0.0)]
    assert {labels["finished_reason"] for labels, _ in s["vllm:request_success_total"]} == {"length"}

    # One observation per request; the phases add up to the end-to-end latency.
    n = len(usages)
    for phase in PHASES + ("e2e_request_latency_seconds", "request_inference_time_seconds"):
        assert value(s, f"vllm:{phase}_count") == n, phase
    phases = sum(value(s, f"vllm:{phase}_sum") for phase in PHASES)
    e2e = value(s, "vllm:e2e_request_latency_seconds_sum")
    assert phases == pytest.approx(e2e, rel=1e-6, abs=1e-6)
    # Three of five requests waited for a slot: some queue time.
    assert value(s, "vllm:request_queue_time_seconds_sum") > 0
    assert value(s, "vllm:request_inference_time_seconds_sum") == pytest.approx(
        value(s, "vllm:request_prefill_time_seconds_sum") + value(s, "vllm:request_decode_time_seconds_sum"),
        rel=1e-6, abs=1e-6)

    # Tokens: per request, and per engine step (vLLM: the prompts whose prefill ended in the
    # step plus the tokens generated in it, so over all steps: every prompt and every token).
    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert value(s, "vllm:request_prompt_tokens_sum") == prompt
    assert value(s, "vllm:request_generation_tokens_sum") == generated
    assert value(s, "vllm:iteration_tokens_total_sum") == prompt + generated
    # Steps run at most two sequences (max_num_seqs=2): more steps than the longest request.
    assert value(s, "vllm:iteration_tokens_total_count") >= 12
    buckets = [labels["le"] for labels, _ in s["vllm:request_prompt_tokens_bucket"]]
    assert buckets == [str(float(b)) for b in build_1_2_5_buckets(256)] + ["+Inf"]

    (labels, one), = s["vllm:cache_config_info"]
    assert one == 1.0
    assert labels["block_size"] == "16" and labels["num_gpu_blocks"] == str(NUM_BLOCKS)
    assert labels["cache_dtype"] == "float32" and labels["enable_prefix_caching"] == "True"
    assert labels["prefix_caching_hash_algo"] == "sha256_cbor" and labels["engine"] == "0"


def test_percentile_interpolates():
    assert percentile([], 0.5) is None
    assert percentile([1.0], 0.99) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([float(i) for i in range(101)], 0.99) == pytest.approx(99.0)


# ---- pagedkv serve: the stats line -----------------------------------------------------------------


def _pump(stream, out: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        out.put(line)
    out.put(None)


@pytest.fixture()
def serve_process() -> Iterator[tuple[subprocess.Popen, queue.Queue, queue.Queue]]:
    proc = subprocess.Popen(
        [*CMD, "serve", "--port", "0", "--num-kv-blocks", "128", "--max-model-len", "256",
         "--metrics-prefix", "vllm", "--log-stats-interval", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out: queue.Queue = queue.Queue()
    err: queue.Queue = queue.Queue()
    for stream, q in ((proc.stdout, out), (proc.stderr, err)):
        threading.Thread(target=_pump, args=(stream, q), daemon=True).start()
    try:
        yield proc, out, err
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _wait_line(q: queue.Queue, pattern: str, timeout: float, seen: list[str]) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=0.5)
        except queue.Empty:
            continue
        if line is None:
            break
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            return m
    raise AssertionError(f"no line matching {pattern!r}; saw: {''.join(seen[-20:])}")


STATS_LINE = (r"Avg prompt throughput: (\d+\.\d) tokens/s, Avg generation throughput: (\d+\.\d) tokens/s, "
              r"Running: (\d+) reqs, Waiting: (\d+) reqs, KV cache usage: (\d+\.\d)%, "
              r"Prefix cache hit rate: (\d+\.\d)%")


def test_serve_logs_the_stats_line_while_busy(serve_process):
    proc, out, err = serve_process
    seen: list[str] = []
    port = int(_wait_line(out, r"listening on http://127\.0\.0\.1:(\d+)", 300, seen).group(1))
    url = f"http://127.0.0.1:{port}"
    errors: list[str] = []
    seen_err: list[str] = []

    def generate() -> None:
        r = httpx.post(url + "/v1/completions", timeout=300,
                       json=dict(prompt="The lighthouse keeper wrote:", max_tokens=48, ignore_eos=True))
        if r.status_code != 200:
            errors.append(r.text)

    worker = threading.Thread(target=generate)
    worker.start()
    try:
        # While the request runs: a line at INFO (shown at the default --log-level warning).
        m = _wait_line(err, r"INFO .*" + STATS_LINE, 120, seen_err)
        assert float(m.group(2)) > 0 or int(m.group(3)) == 1, m.group(0)
        busy = _wait_line(err, STATS_LINE.replace(r"Running: (\d+)", r"Running: (1)"), 120, seen_err)
        assert float(busy.group(5)) > 0  # its blocks are in use
    finally:
        worker.join(300)
    assert not errors, errors
    metrics = httpx.get(url + "/metrics", timeout=30).text
    assert "vllm:generation_tokens_total" in metrics and "pagedkv:" not in metrics
    # Idle: after at most one more (zero-throughput) line, the log stays quiet.
    time.sleep(1.5)
    while not err.empty():
        err.get_nowait()
    time.sleep(1.5)
    quiet = []
    while not err.empty():
        line = err.get_nowait()
        if line and "Avg prompt throughput" in line:
            quiet.append(line)
    assert not quiet, quiet


def test_serve_rejects_a_negative_stats_interval():
    r = subprocess.run([*CMD, "serve", "--log-stats-interval", "-1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("pagedkv serve: error: invalid --log-stats-interval")


# ---- the Redis tier's capacity ------------------------------------------------------------------


def wait_capacity(tier: RedisTier, timeout: float = 10.0):
    """The tier's stats once it has read the server's INFO (no store needed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = tier.get_stats()
        if st.capacity_bytes or st.capacity_unbounded:
            return st
        time.sleep(0.05)
    return tier.get_stats()


@pytest.mark.parametrize("maxmemory, capacity, unbounded", [("64mb", 64 << 20, False), ("0", 0, True)])
def test_redis_tier_reports_the_servers_capacity(maxmemory, capacity, unbounded):
    server = RedisServer(maxmemory=maxmemory).start()
    try:
        tier = RedisTier("127.0.0.1", server.port, "f" * 32, chunk_bytes=1024)
        try:
            st = wait_capacity(tier)
            assert (st.capacity_bytes, st.capacity_unbounded) == (capacity, unbounded)
            assert st.usage_bytes > 0  # the server's used_memory
        finally:
            tier.shutdown()
    finally:
        server.close()
