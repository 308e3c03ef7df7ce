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
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis_server import RedisServer, free_port
from server_utils import client as http_client
from server_utils import running_server

from pagedkv import LLM
from pagedkv.engine.async_llm import AsyncLLM
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.stats import KVConnectorStats, SchedulerStats, TierStats
from pagedkv.entrypoints.metrics import (
    ServerMetrics,
    build_1_2_5_buckets,
    kv_transfer_metrics,
    percentile,
)
from pagedkv.entrypoints.stat_logger import configure_server_stats
from pagedkv.kv_transfer.stats import TRANSFER_LATENCY_BUCKETS, KVTransferStats
from pagedkv.offload.redis_tier import RedisTier

MODEL = "SmolLM2-135M-Instruct"
NUM_BLOCKS = 200
SCRIPT = os.path.join(os.path.dirname(sys.executable), "pagedkv")
CMD = [SCRIPT] if os.path.exists(SCRIPT) else [sys.executable, "-m", "pagedkv.entrypoints.cli"]

# What vLLM's Grafana dashboard and alerts read (vLLM v1 names; counters with _total).
VLLM_SERIES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket",
    "vllm:request_prefill_time_seconds_bucket",
    "vllm:request_decode_time_seconds_bucket",
    "vllm:request_inference_time_seconds_bucket",
    "vllm:iteration_tokens_total_bucket",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:cache_config_info",
]
PHASES = (
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
)


@pytest.fixture(scope="module")
def server():
    with running_server(
        EngineConfig(num_kv_blocks=NUM_BLOCKS, max_num_seqs=2, max_model_len=256)
    ) as srv:
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
    ((_, v),) = series[name]
    return v


def run_requests(server) -> list[dict]:
    """Five completions at once (max_num_seqs=2: three of them queue), one with n=2; returns
    their usage dicts."""
    bodies = [
        dict(
            prompt=f"Count the birds on wire number {i}:",
            max_tokens=6 + 2 * i,
            ignore_eos=True,
            temperature=0,
        )
        for i in range(4)
    ]
    bodies.append(
        dict(
            prompt="Two short poems about rain:",
            max_tokens=5,
            n=2,
            ignore_eos=True,
            temperature=0.8,
            seed=3,
        )
    )
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


@pytest.mark.slow
def test_default_prefix_has_the_new_histograms_and_no_created_series(server, http):
    run_requests(server)
    text = http.get("/metrics").text
    assert "_created" not in text
    assert "vllm:" not in text
    s = samples(text)
    for phase in PHASES + ("iteration_tokens_total", "request_inference_time_seconds"):
        assert value(s, f"pagedkv:{phase}_count") >= 1, phase
    assert s["pagedkv:cache_config_info"][0][1] == 1.0


@pytest.mark.slow
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
    assert {labels["finished_reason"] for labels, _ in s["vllm:request_success_total"]} == {
        "length"
    }

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
        value(s, "vllm:request_prefill_time_seconds_sum")
        + value(s, "vllm:request_decode_time_seconds_sum"),
        rel=1e-6,
        abs=1e-6,
    )

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

    ((labels, one),) = s["vllm:cache_config_info"]
    assert one == 1.0
    assert labels["block_size"] == "16" and labels["num_gpu_blocks"] == str(NUM_BLOCKS)
    assert labels["cache_dtype"] == "float32" and labels["enable_prefix_caching"] == "True"
    assert labels["prefix_caching_hash_algo"] == "sha256_cbor" and labels["engine"] == "0"
    assert labels["kv_format"] == "float32:none"


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
        [
            *CMD,
            "serve",
            "--port",
            "0",
            "--num-kv-blocks",
            "128",
            "--max-model-len",
            "256",
            "--metrics-prefix",
            "vllm",
            "--log-stats-interval",
            "0.5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
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


STATS_LINE = (
    r"Avg prompt throughput: (\d+\.\d) tokens/s, Avg generation throughput: (\d+\.\d) tokens/s, "
    r"Running: (\d+) reqs, Waiting: (\d+) reqs, KV cache usage: (\d+\.\d)%, "
    r"Prefix cache hit rate: (\d+\.\d)%"
)


@pytest.mark.slow  # a CLI subprocess: torch import + model load
def test_serve_logs_the_stats_line_while_busy(serve_process):
    proc, out, err = serve_process
    seen: list[str] = []
    port = int(_wait_line(out, r"listening on http://127\.0\.0\.1:(\d+)", 300, seen).group(1))
    url = f"http://127.0.0.1:{port}"
    errors: list[str] = []
    seen_err: list[str] = []

    def generate() -> None:
        r = httpx.post(
            url + "/v1/completions",
            timeout=300,
            json=dict(prompt="The lighthouse keeper wrote:", max_tokens=240, ignore_eos=True),
        )
        if r.status_code != 200:
            errors.append(r.text)

    worker = threading.Thread(target=generate)
    worker.start()
    try:
        # While the request runs: a line at INFO (shown at the default --log-level warning).
        m = _wait_line(err, r"INFO .*" + STATS_LINE, 120, seen_err)
        assert float(m.group(2)) > 0 or int(m.group(3)) == 1, m.group(0)
        # 240 tokens (the server's max_model_len is 256): at ~200 tok/s with the native decode
        # step a 48-token request finished inside one 0.5 s interval and no line saw it running.
        # The first line may already be the busy one: waiting for another would miss it.
        busy = (
            m
            if int(m.group(3)) == 1
            else _wait_line(
                err, STATS_LINE.replace(r"Running: (\d+)", r"Running: (1)"), 120, seen_err
            )
        )
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
    r = subprocess.run(
        [*CMD, "serve", "--log-stats-interval", "-1"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert (
        r.stderr.strip()
        .splitlines()[-1]
        .startswith("pagedkv serve: error: invalid --log-stats-interval")
    )


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


@pytest.mark.parametrize(
    "maxmemory, capacity, unbounded", [("64mb", 64 << 20, False), ("0", 0, True)]
)
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


# ---- a PD connector's transfers ----------------------------------------------------------------------


class _SnapshotCollector:
    """A collector over one given `SchedulerStats` (what `_EngineCollector` reads at scrape time)."""

    def __init__(
        self, stats: SchedulerStats, prefix: str, labels: list[str], values: list[str]
    ) -> None:
        self.args = (stats, prefix, labels, values)

    def collect(self):
        return kv_transfer_metrics(*self.args)


def render_snapshot(
    stats: SchedulerStats,
    prefix: str = "pagedkv:",
    labels: tuple[str, ...] = ("model_name",),
    values: tuple[str, ...] = ("m",),
) -> str:
    reg = CollectorRegistry()
    reg.register(_SnapshotCollector(stats, prefix, list(labels), list(values)))
    return generate_latest(reg).decode()


# Six transfers: 1 ms, 2 ms, 2 ms, 40 ms, 3 s and 30 s (past the last bound: +Inf only).
LATENCIES = [0.001, 0.002, 0.002, 0.04, 3.0, 30.0]


def given_transfer_stats() -> KVTransferStats:
    t = KVTransferStats(
        role="kv_consumer",
        num_failed=2,
        num_leases_expired=1,
        transfers_in_flight=3,
        peers=["p@127.0.0.1:5000"],
    )
    for i, lat in enumerate(LATENCIES):
        t.record(num_blocks=i + 1, num_bytes=1000 * (i + 1), latency_s=lat)
    return t


def test_kv_transfer_metrics_exposition():
    text = render_snapshot(
        SchedulerStats(kv_connector_stats=KVConnectorStats(transfer=given_transfer_stats()))
    )
    lines = text.splitlines()
    for line in [
        'pagedkv:kv_transfer_transfers_total{model_name="m"} 6.0',
        'pagedkv:kv_transfer_blocks_total{model_name="m"} 21.0',
        'pagedkv:kv_transfer_bytes_total{model_name="m"} 21000.0',
        'pagedkv:kv_transfer_failures_total{model_name="m"} 2.0',
        'pagedkv:kv_transfer_leases_expired_total{model_name="m"} 1.0',
        'pagedkv:kv_transfer_in_flight{model_name="m"} 3.0',
        "# TYPE pagedkv:kv_transfer_transfers_total counter",
        "# TYPE pagedkv:kv_transfer_in_flight gauge",
        "# TYPE pagedkv:kv_transfer_latency_seconds histogram",
    ]:
        assert line in lines, line
    assert "kv_load_failure_policy" in text  # the failures' HELP says what became of them
    s = samples(text)
    buckets = {labels["le"]: v for labels, v in s["pagedkv:kv_transfer_latency_seconds_bucket"]}
    assert list(buckets) == [str(b) for b in TRANSFER_LATENCY_BUCKETS] + ["+Inf"]
    # Cumulative: le=0.001 holds the 1 ms transfer, le=0.0025 both 2 ms ones too, and so on.
    expected = [sum(lat <= b for lat in LATENCIES) for b in TRANSFER_LATENCY_BUCKETS] + [
        len(LATENCIES)
    ]
    assert list(buckets.values()) == expected
    assert expected[:3] == [1, 3, 3] and expected[-2] == 5  # the 30 s transfer is only in +Inf
    assert value(s, "pagedkv:kv_transfer_latency_seconds_count") == 6
    assert value(s, "pagedkv:kv_transfer_latency_seconds_sum") == pytest.approx(sum(LATENCIES))


def test_kv_transfer_metrics_follow_the_vllm_prefix_and_labels():
    stats = SchedulerStats(kv_connector_stats=KVConnectorStats(transfer=given_transfer_stats()))
    text = render_snapshot(stats, "vllm:", ("model_name", "engine"), (MODEL, "0"))
    assert (
        f'vllm:kv_transfer_failures_total{{engine="0",model_name="{MODEL}"}} 2.0'
        in text.splitlines()
    )
    assert "pagedkv:" not in text


@pytest.mark.parametrize(
    "kcs",
    [None, KVConnectorStats(tiers=[TierStats("cpu", "CPU", capacity_bytes=1 << 20)])],
    ids=["no-connector", "offloading-connector"],
)
def test_no_kv_transfer_metrics_without_a_pd_connector(kcs):
    assert (
        kv_transfer_metrics(
            SchedulerStats(kv_connector_stats=kcs), "pagedkv:", ["model_name"], ["m"]
        )
        == []
    )
    assert "kv_transfer" not in render_snapshot(SchedulerStats(kv_connector_stats=kcs))


def test_producer_engine_exports_its_kv_transfer_metrics_and_role():
    """A real engine with a real `NixlConnector` (TCP backend), scraped through the server's
    collector (`ServerMetrics` over an `AsyncLLM` driving the engine)."""
    llm = LLM(
        num_kv_blocks=64,
        max_model_len=256,
        kv_transfer_config={
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"backend": "tcp", "side_channel_port": free_port()},
        },
    )
    try:
        t = llm.llm_engine.make_stats().kv_connector_stats.transfer
        assert t is not None and t.role == "kv_producer" and t.num_transfers == 0
        async_llm = AsyncLLM(engine=llm.llm_engine)
        try:
            text = ServerMetrics(async_llm, MODEL).render().decode()
        finally:
            async_llm.shutdown()
        lines = text.splitlines()
        for name in (
            "transfers_total",
            "blocks_total",
            "bytes_total",
            "failures_total",
            "leases_expired_total",
            "in_flight",
            "latency_seconds_count",
        ):
            assert f'pagedkv:kv_transfer_{name}{{model_name="{MODEL}"}} 0.0' in lines, name
        ((labels, _),) = samples(text)["pagedkv:cache_config_info"]
        assert labels["kv_connector"] == "NixlConnector" and labels["kv_role"] == "kv_producer"
    finally:
        llm.llm_engine.shutdown()


def test_cache_config_info_has_no_kv_role_without_a_connector(http):
    text = http.get("/metrics").text
    s = samples(text)
    # The module's server may have been switched to vLLM's prefix by an earlier test.
    ((labels, _),) = next(v for k, v in s.items() if k.endswith(":cache_config_info"))
    assert labels["kv_connector"] == "None" and labels["kv_role"] == "None"
    assert "kv_transfer_" not in text and any(k.endswith(":kv_cache_usage_perc") for k in s)
