"""Prometheus metrics of one server (vLLM's metric names, ``pagedkv:`` instead of ``vllm:``).

Every server owns a `prometheus_client.CollectorRegistry` (several servers can live in one
process, e.g. in tests). Two sources feed it:

* `ServerMetrics.record_step` runs on the engine thread after each step and observes the
  latency histograms (``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
  ``e2e_request_latency_seconds``) and the per-request counters (``request_success`` by finish
  reason);
* a collector reads the engine's latest stats snapshot (`AsyncLLM.last_stats`, taken after
  every step) at scrape time: KV cache usage and block counts, prefix-cache queries and hits
  (tokens), preemptions, running / waiting requests, prompt and generation tokens, aborted and
  rejected requests, and — when the engine has an ``offload_manager`` — per-tier usage,
  capacity, hits, misses, bytes read / written and health.

Counters are exposed with the ``_total`` suffix, as prometheus_client (and vLLM) do:
``pagedkv:prefix_cache_queries_total``. Every sample carries a ``model_name`` label.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from pagedkv.engine.async_llm import AsyncLLM
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.engine.outputs import RequestOutput

PREFIX = "pagedkv:"

# vLLM's buckets (seconds).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]

# (field of TierStats, metric suffix, kind, help)
TIER_FIELDS = [
    ("usage_bytes", "offload_usage_bytes", "gauge", "Bytes held by the offload tier."),
    ("capacity_bytes", "offload_capacity_bytes", "gauge", "Capacity of the offload tier in bytes."),
    ("healthy", "offload_healthy", "gauge", "1 if the offload tier is reachable, else 0."),
    ("hits", "offload_hits", "counter", "Lookups that found the chunk in the tier."),
    ("misses", "offload_misses", "counter", "Lookups that did not find the chunk in the tier."),
    ("bytes_read", "offload_bytes_read", "counter", "Bytes loaded from the tier."),
    ("bytes_written", "offload_bytes_written", "counter", "Bytes stored into the tier."),
]


class ServerMetrics:
    """The metrics of one server; ``registry`` is exposed at ``/metrics``."""

    def __init__(self, async_llm: AsyncLLM, model_name: str,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.async_llm = async_llm
        labels = ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", labels,
                              buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", labels,
                             buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Histogram of end-to-end request latency in seconds.", labels,
                             buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self.request_success = Counter(PREFIX + "request_success",
                                       "Count of successfully processed requests.",
                                       labels + ["finished_reason"], registry=self.registry)
        self._lock = threading.Lock()
        self._progress: dict[str, tuple[float, int]] = {}  # request id -> (last time, tokens)
        self.registry.register(_EngineCollector(self))

    # ---- engine thread -----------------------------------------------------------------------

    def record_step(self, engine: LLMEngine, outputs: list[RequestOutput], now: float) -> None:
        with self._lock:
            for out in outputs:
                rid = out.request_id
                ntok = sum(len(c.token_ids) for c in out.outputs)
                prev = self._progress.get(rid)
                m = out.metrics
                if prev is None:
                    if ntok and m is not None:
                        ttft = m.time_to_first_token
                        self.ttft.observe(max(ttft if ttft is not None else now - m.arrival_time, 0.0))
                elif ntok > prev[1]:
                    self.itl.observe(max(now - prev[0], 0.0))
                if out.finished:
                    self._progress.pop(rid, None)
                    if m is not None:
                        self.e2e.observe(max(now - m.arrival_time, 0.0))
                    reason = out.outputs[0].finish_reason if out.outputs else None
                    self.request_success.labels(self.model_name, reason or "unknown").inc()
                elif ntok:
                    self._progress[rid] = (now, ntok)

    def record_abort(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            for rid in request_ids:
                self._progress.pop(rid, None)

    # ---- scrape ------------------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Gauges and counters read from the engine's stats snapshot at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        m = self.metrics
        llm = m.async_llm
        s = llm.last_stats
        name = m.model_name

        def gauge(suffix: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + suffix, doc, labels=["model_name"])
            g.add_metric([name], float(value))
            return g

        def counter(suffix: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + suffix, doc, labels=["model_name"])
            c.add_metric([name], float(value))
            return c

        usable = s["num_blocks"] - 1
        free = s["num_free_blocks"]
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s["kv_cache_usage"])
        yield gauge("kv_cache_total_blocks", "Usable KV cache blocks (the null block excluded).", usable)
        yield gauge("kv_cache_free_blocks", "Free KV cache blocks (including cached, evictable ones).", free)
        yield gauge("kv_cache_used_blocks", "KV cache blocks held by requests.", usable - free)
        yield gauge("num_requests_running", "Number of requests in model execution batches.", s["num_running"])
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed.", s["num_waiting"])
        yield gauge("engine_healthy", "1 while the engine loop is running, else 0.", 1.0 if llm.is_healthy else 0.0)
        yield counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      s["prefix_cache_queries"])
        yield counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      s["prefix_cache_hits"])
        if "external_cache_hits" in s:
            yield counter("external_prefix_cache_hits",
                          "External prefix cache hits (offload tiers), in terms of number of loaded tokens.",
                          s["external_cache_hits"])
        yield counter("num_preemptions", "Cumulative number of preemptions from the engine.", s["num_preemptions"])
        yield counter("prompt_tokens", "Number of prefill tokens processed.", s["prompt_tokens"])
        yield counter("generation_tokens", "Number of generation tokens processed.", s["generation_tokens"])
        yield counter("request_aborted", "Requests aborted (client disconnects, cancellations).", llm.num_aborted)
        yield counter("request_rejected", "Requests refused because the waiting queue was full.", llm.num_rejected)
        tiers = s.get("tiers")
        if tiers:
            for field, suffix, kind, doc in TIER_FIELDS:
                cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                fam = cls(PREFIX + suffix, doc, labels=["model_name", "tier", "medium"])
                for tier, st in tiers.items():
                    fam.add_metric([name, tier, str(st.get("medium", ""))], float(st.get(field) or 0))
                yield fam

