"""Prometheus metrics of one server, under vLLM's metric names.

The prefix is ``pagedkv:`` by default; ``pagedkv serve --metrics-prefix vllm`` exports
``vllm:...`` with vLLM's labels (``model_name`` and ``engine="0"``), so dashboards and alerts
written for vLLM (its Grafana dashboard, for one) work unchanged.

Every server owns a `prometheus_client.CollectorRegistry` (several servers can live in one
process, e.g. in tests). Two sources feed it:

* `ServerMetrics.record_step` runs on the engine thread after each step and observes, per
  request: ``time_to_first_token_seconds``, ``inter_token_latency_seconds``; when it finishes,
  ``e2e_request_latency_seconds`` and its phases ``request_queue_time_seconds`` (arrival to
  first scheduled), ``request_prefill_time_seconds`` (first scheduled to first token),
  ``request_decode_time_seconds`` (first token to the end), ``request_inference_time_seconds``
  (first scheduled to the end), ``request_prompt_tokens``, ``request_generation_tokens`` and
  ``request_success`` by finish reason; per step with outputs, ``iteration_tokens_total``
  (vLLM's definition: the prompt tokens of the requests whose prefill ended in the step plus
  the tokens generated in it);
* a collector reads the engine's latest `SchedulerStats` snapshot (`AsyncLLM.last_stats`,
  taken after every step) at scrape time: KV cache usage and block counts, prefix-cache queries
  and hits (tokens), preemptions, running / waiting requests, prompt and generation tokens,
  aborted and rejected requests, ``cache_config_info`` (a gauge set to 1 whose labels are the
  KV cache configuration), for a vision-language model ``encoder_cache_usage_tokens``,
  ``encoder_cache_budget_tokens``, ``encoder_cache_queries_total``, ``encoder_cache_hits_total``
  (and with EPD ``ec_transfer_{published,fetched,fetch_failures,bytes,seconds}_total``) and,
  with offload tiers, per-tier usage, capacity, hits, misses,
  bytes read / written and health (each tier's `TierStats`). A tier without a size limit (a
  Redis server without ``maxmemory``) reports ``offload_capacity_bytes`` +Inf. With a PD
  connector (`NixlConnector`: ``kv_connector_stats.transfer`` set), its transfers
  (`kv_transfer_metrics`): ``kv_transfer_transfers_total``, ``kv_transfer_blocks_total``,
  ``kv_transfer_bytes_total``, ``kv_transfer_failures_total``,
  ``kv_transfer_leases_expired_total``, the gauge ``kv_transfer_in_flight`` and the histogram
  ``kv_transfer_latency_seconds``. ``cache_config_info`` names the connector and its
  ``kv_role`` ("None" without one).

Counters are exposed with the ``_total`` suffix, as prometheus_client (and vLLM) do:
``pagedkv:prefix_cache_queries_total``. No ``_created`` series are exported
(`prometheus_client.disable_created_metrics`, process-wide: a server process has no other use
for them, and vLLM's dashboards do not read them).

The dashboard reads `ServerMetrics.latency_summary`: TTFT and inter-token latency
percentiles over the last seconds.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pagedkv.engine.multimodal import encoder_cache_state
from pagedkv.kv_transfer.stats import TRANSFER_LATENCY_BUCKETS

if TYPE_CHECKING:
    from pagedkv.engine.async_llm import AsyncLLM
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.engine.outputs import RequestOutput
    from pagedkv.engine.stats import SchedulerStats, TierStats
    from pagedkv.kv_transfer.stats import KVTransferStats

DEFAULT_METRICS_PREFIX = "pagedkv"
METRICS_PREFIXES = ("pagedkv", "vllm")
PREFIX = DEFAULT_METRICS_PREFIX + ":"  # the default, for readers of the exposition

# vLLM's buckets (seconds, tokens).
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
E2E_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
REQUEST_LATENCY_BUCKETS = E2E_BUCKETS
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]

# The dashboard's latency percentiles cover this many recent seconds.
LATENCY_WINDOW_S = 30.0
_MAX_RECENT = 20_000

# (field of TierStats, metric suffix, kind, help)
TIER_FIELDS = [
    ("usage_bytes", "offload_usage_bytes", "gauge", "Bytes held by the offload tier."),
    (
        "capacity_bytes",
        "offload_capacity_bytes",
        "gauge",
        "Capacity of the offload tier in bytes (+Inf: the tier has no size limit).",
    ),
    ("healthy", "offload_healthy", "gauge", "1 if the offload tier is reachable, else 0."),
    ("hits", "offload_hits", "counter", "Lookups that found the chunk in the tier."),
    ("misses", "offload_misses", "counter", "Lookups that did not find the chunk in the tier."),
    ("bytes_read", "offload_bytes_read", "counter", "Bytes loaded from the tier."),
    ("bytes_written", "offload_bytes_written", "counter", "Bytes stored into the tier."),
]

# (field of KVTransferStats, metric suffix, kind, help): a PD connector's transfers.
TRANSFER_FIELDS = [
    (
        "num_transfers",
        "kv_transfer_transfers",
        "counter",
        "KV cache transfers completed by the PD connector.",
    ),
    (
        "num_blocks",
        "kv_transfer_blocks",
        "counter",
        "KV cache blocks moved by completed transfers.",
    ),
    ("num_bytes", "kv_transfer_bytes", "counter", "Bytes moved by completed KV cache transfers."),
    (
        "num_failed",
        "kv_transfer_failures",
        "counter",
        "Failed KV cache transfers; each request is recomputed locally or failed, per kv_load_failure_policy.",
    ),
    (
        "num_leases_expired",
        "kv_transfer_leases_expired",
        "counter",
        "Producer block leases that expired before a consumer fetched the blocks.",
    ),
    (
        "transfers_in_flight",
        "kv_transfer_in_flight",
        "gauge",
        "KV cache transfers in flight (handshaking, receiving or sending).",
    ),
]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    buckets: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


def check_metrics_prefix(prefix: str) -> str:
    """``prefix`` if it is one of `METRICS_PREFIXES`, else ValueError naming it."""
    if prefix not in METRICS_PREFIXES:
        raise ValueError(
            f"invalid metrics prefix {prefix!r}: choose one of {', '.join(METRICS_PREFIXES)}"
        )
    return prefix


def percentile(sorted_values: list[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) of ascending ``sorted_values`` by linear interpolation; None
    when empty."""
    if not sorted_values:
        return None
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass(slots=True)
class _Progress:
    """What `record_step` last saw of one running request."""

    last_time: float
    num_tokens: int


@dataclass(slots=True)
class _Instruments:
    """The push-style metrics of one prefix (rebuilt when the prefix changes)."""

    registry: CollectorRegistry
    ttft: Any
    itl: Any
    e2e: Any
    queue_time: Any
    prefill_time: Any
    decode_time: Any
    inference_time: Any
    prompt_tokens: Any
    generation_tokens: Any
    iteration_tokens: Any
    request_success: Counter


class ServerMetrics:
    """The metrics of one server; ``registry`` is exposed at ``/metrics``. Implements the
    engine's `StatLogger` protocol (``record_step``, ``record_abort``)."""

    def __init__(
        self,
        async_llm: AsyncLLM,
        model_name: str,
        registry: CollectorRegistry | None = None,
        prefix: str = DEFAULT_METRICS_PREFIX,
    ) -> None:
        prometheus_client.disable_created_metrics()  # process-wide; see the module docstring
        self.model_name = model_name
        self.async_llm = async_llm
        self._lock = threading.Lock()
        self._progress: dict[str, _Progress] = {}  # request id -> progress
        # (monotonic time, seconds) of recent TTFTs and inter-token gaps, for the dashboard.
        self._recent_ttft: deque[tuple[float, float]] = deque(maxlen=_MAX_RECENT)
        self._recent_itl: deque[tuple[float, float]] = deque(maxlen=_MAX_RECENT)
        self._build(check_metrics_prefix(prefix), registry)

    # ---- configuration ------------------------------------------------------------------------

    @property
    def registry(self) -> CollectorRegistry:
        return self._m.registry

    @property
    def label_names(self) -> list[str]:
        """``model_name`` (and ``engine`` under vLLM's prefix, as vLLM labels its metrics)."""
        return ["model_name", "engine"] if self.prefix == "vllm:" else ["model_name"]

    @property
    def label_values(self) -> list[str]:
        return [self.model_name, "0"] if self.prefix == "vllm:" else [self.model_name]

    def use_prefix(self, prefix: str) -> None:
        """Export every metric as ``<prefix>:<name>`` from now on (``pagedkv`` or ``vllm``):
        a new registry, histograms start empty. Call before serving traffic."""
        with self._lock:
            self._build(check_metrics_prefix(prefix), None)

    def _build(self, prefix: str, registry: CollectorRegistry | None) -> None:
        self.prefix = prefix + ":"
        reg = registry or CollectorRegistry(auto_describe=True)
        labels, values = self.label_names, self.label_values
        max_len = int(getattr(getattr(self.async_llm, "engine", None), "max_model_len", 0) or 0)
        token_buckets = build_1_2_5_buckets(max(max_len, 1))

        def hist(name: str, doc: str, buckets: list[float]) -> Any:
            return Histogram(self.prefix + name, doc, labels, buckets=buckets, registry=reg).labels(
                *values
            )

        self._m = _Instruments(
            registry=reg,
            ttft=hist(
                "time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                TTFT_BUCKETS,
            ),
            itl=hist(
                "inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                ITL_BUCKETS,
            ),
            e2e=hist(
                "e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                E2E_BUCKETS,
            ),
            queue_time=hist(
                "request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                REQUEST_LATENCY_BUCKETS,
            ),
            prefill_time=hist(
                "request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
                REQUEST_LATENCY_BUCKETS,
            ),
            decode_time=hist(
                "request_decode_time_seconds",
                "Histogram of time spent in DECODE phase for request.",
                REQUEST_LATENCY_BUCKETS,
            ),
            inference_time=hist(
                "request_inference_time_seconds",
                "Histogram of time spent in RUNNING phase for request.",
                REQUEST_LATENCY_BUCKETS,
            ),
            prompt_tokens=hist(
                "request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
            ),
            generation_tokens=hist(
                "request_generation_tokens", "Number of generation tokens processed.", token_buckets
            ),
            iteration_tokens=hist(
                "iteration_tokens_total",
                "Histogram of number of tokens per engine_step.",
                ITERATION_TOKENS_BUCKETS,
            ),
            request_success=Counter(
                self.prefix + "request_success",
                "Count of successfully processed requests.",
                labels + ["finished_reason"],
                registry=reg,
            ),
        )
        reg.register(_EngineCollector(self))

    # ---- engine thread -----------------------------------------------------------------------

    def record_step(self, engine: LLMEngine, outputs: list[RequestOutput], now: float) -> None:
        """Observe the latencies and token counts of one step's outputs (engine thread)."""
        if not outputs:
            return
        with self._lock:
            iteration_tokens = 0
            for out in outputs:
                iteration_tokens += self._record_output(out, now)
            self._m.iteration_tokens.observe(iteration_tokens)

    def _record_output(self, out: RequestOutput, now: float) -> int:
        """Observe one request's snapshot; returns the tokens it adds to this step (its prompt
        when its first token arrived, plus the tokens generated since the last snapshot)."""
        m = self._m
        rid = out.request_id
        ntok = sum(len(c.token_ids) for c in out.outputs)
        prev = self._progress.get(rid)
        rm = out.metrics
        step_tokens = ntok - (prev.num_tokens if prev else 0)
        if prev is None and ntok:
            step_tokens += len(out.prompt_token_ids)
            if rm is not None:
                ttft = rm.time_to_first_token
                ttft = max(ttft if ttft is not None else now - rm.arrival_time, 0.0)
                m.ttft.observe(ttft)
                self._recent_ttft.append((now, ttft))
        elif prev is not None and ntok > prev.num_tokens:
            gap = max(now - prev.last_time, 0.0)
            m.itl.observe(gap)
            self._recent_itl.append((now, gap))
        if out.finished:
            self._progress.pop(rid, None)
            self._record_finished(out, now, ntok)
        elif ntok:
            self._progress[rid] = _Progress(now, ntok)
        return step_tokens

    def _record_finished(self, out: RequestOutput, now: float, num_generated: int) -> None:
        """The per-request histograms of a finished request: e2e and its phases (vLLM's
        queued / prefill / decode / inference times; the end is the step that finished it)."""
        m = self._m
        rm = out.metrics
        if rm is not None:
            m.e2e.observe(max(now - rm.arrival_time, 0.0))
            scheduled = rm.first_scheduled_time
            first_token = rm.first_token_time
            if scheduled is not None:
                m.queue_time.observe(max(scheduled - rm.arrival_time, 0.0))
                m.inference_time.observe(max(now - scheduled, 0.0))
                if first_token is not None:
                    m.prefill_time.observe(max(first_token - scheduled, 0.0))
            if first_token is not None:
                m.decode_time.observe(max(now - first_token, 0.0))
        m.prompt_tokens.observe(len(out.prompt_token_ids))
        m.generation_tokens.observe(num_generated)
        reason = out.outputs[0].finish_reason if out.outputs else None
        m.request_success.labels(*self.label_values, reason or "unknown").inc()

    def record_abort(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            for rid in request_ids:
                self._progress.pop(rid, None)

    # ---- readers -------------------------------------------------------------------------------

    def latency_summary(self, now: float, window_s: float = LATENCY_WINDOW_S) -> dict[str, Any]:
        """TTFT and inter-token latency p50 / p99 (seconds; None without samples) over the
        ``window_s`` seconds before ``now`` (``time.monotonic()``), with sample counts."""
        since = now - window_s
        with self._lock:
            ttft = sorted(v for t, v in self._recent_ttft if t >= since)
            itl = sorted(v for t, v in self._recent_itl if t >= since)
        return dict(
            window_s=window_s,
            ttft_count=len(ttft),
            itl_count=len(itl),
            ttft_p50=percentile(ttft, 0.5),
            ttft_p99=percentile(ttft, 0.99),
            itl_p50=percentile(itl, 0.5),
            itl_p99=percentile(itl, 0.99),
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _kv_format(engine: Any) -> str:
    groups = getattr(getattr(engine, "kv_cache_config", None), "kv_cache_groups", None)
    return str(getattr(groups[0].kv_cache_spec, "kv_format", "")) if groups else ""


def cache_config_labels(engine: Any) -> dict[str, str]:
    """The labels of ``cache_config_info`` (vLLM's CacheConfig fields that pagedkv has)."""
    config = engine.config
    kv_buffer = getattr(engine, "kv_buffer", None)
    cache_dtype = (
        str(kv_buffer.dtype).removeprefix("torch.") if kv_buffer is not None else str(config.dtype)
    )
    if getattr(config, "kv_cache_dtype", "auto") != "auto":
        cache_dtype = str(config.kv_cache_dtype)  # vLLM reports the --kv-cache-dtype given
    num_blocks = getattr(
        getattr(engine, "kv_cache_config", None), "num_blocks", config.num_kv_blocks
    )
    return {
        "block_size": str(config.block_size),
        "cache_dtype": cache_dtype,
        "enable_prefix_caching": str(bool(config.enable_prefix_caching)),
        "prefix_caching_hash_algo": str(config.prefix_caching_hash_algo),
        "num_gpu_blocks": str(num_blocks),
        "gpu_memory_utilization": str(config.gpu_memory_utilization),
        "kv_cache_layout": str(config.kv_cache_layout),
        # what one page's bytes mean: storage dtype, quant mode, rotation (e.g. int8:int8_per_token_head)
        "kv_format": _kv_format(engine),
        "kv_offload": str(config.kv_offload),
        # vLLM's KVTransferConfig.kv_connector ("None" without a connector; --kv-offload and
        # --kv-transfer-config both name it, only the first sets kv_offload).
        "kv_connector": str(
            getattr(getattr(config, "kv_transfer_config", None), "kv_connector", None)
        ),
        # KVTransferConfig.kv_role: kv_producer / kv_consumer / kv_both ("None" without one).
        "kv_role": str(getattr(getattr(config, "kv_transfer_config", None), "kv_role", None)),
        "device": str(config.device),
    }


def kv_transfer_metrics(
    stats: SchedulerStats, prefix: str, labels: list[str], values: list[str]
) -> list[Metric]:
    """A PD connector's transfer metrics (`TRANSFER_FIELDS` and ``kv_transfer_latency_seconds``),
    each one sample with ``labels`` = ``values``; empty unless ``stats.kv_connector_stats.transfer``
    is set (no connector, or an offloading one)."""
    kcs = stats.kv_connector_stats
    t = kcs.transfer if kcs is not None else None
    if t is None:
        return []
    out: list[Metric] = []
    for field, suffix, kind, doc in TRANSFER_FIELDS:
        cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        fam = cls(prefix + suffix, doc, labels=labels)
        fam.add_metric(values, float(getattr(t, field)))
        out.append(fam)
    out.append(_latency_histogram(t, prefix + "kv_transfer_latency_seconds", labels, values))
    return out


def _latency_histogram(
    t: KVTransferStats, name: str, labels: list[str], values: list[str]
) -> Metric:
    """``t.latency_buckets`` (a count per bucket) as a Prometheus histogram: cumulative counts per
    ``le`` bound of `TRANSFER_LATENCY_BUCKETS`, then +Inf (every observation), and the sum."""
    fam = HistogramMetricFamily(
        name, "Latency of completed KV cache transfers in seconds.", labels=labels
    )
    bounds = [floatToGoString(b) for b in TRANSFER_LATENCY_BUCKETS] + ["+Inf"]
    counts = list(t.latency_buckets) + [0] * max(len(bounds) - len(t.latency_buckets), 0)
    cumulative: list[tuple[str, float]] = []
    total = 0
    for le, n in zip(bounds, counts):
        total += n
        cumulative.append((le, float(total)))
    # Counts past the last slot (none by construction) still belong in +Inf, so it equals _count.
    cumulative[-1] = ("+Inf", float(sum(counts)))
    fam.add_metric(values, cumulative, sum_value=float(t.latency_sum_s))
    return fam


class _EngineCollector(Collector):
    """Gauges and counters read from the engine's stats snapshot at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        m = self.metrics
        llm = m.async_llm
        s = llm.last_stats
        prefix, labels, values = m.prefix, m.label_names, m.label_values

        def gauge(suffix: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(prefix + suffix, doc, labels=labels)
            g.add_metric(values, float(value))
            return g

        def counter(suffix: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(prefix + suffix, doc, labels=labels)
            c.add_metric(values, float(value))
            return c

        pc = s.prefix_cache_stats
        yield gauge(
            "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage
        )
        yield gauge(
            "kv_cache_total_blocks",
            "Usable KV cache blocks (the null block excluded).",
            s.num_usable_blocks,
        )
        yield gauge(
            "kv_cache_free_blocks",
            "Free KV cache blocks (including cached, evictable ones).",
            s.num_free_blocks,
        )
        yield gauge("kv_cache_used_blocks", "KV cache blocks held by requests.", s.num_used_blocks)
        yield gauge(
            "num_requests_running",
            "Number of requests in model execution batches.",
            s.num_running_reqs,
        )
        yield gauge(
            "num_requests_waiting",
            "Number of requests waiting to be processed.",
            s.num_waiting_reqs,
        )
        yield gauge(
            "engine_healthy",
            "1 while the engine loop is running, else 0.",
            1.0 if llm.is_healthy else 0.0,
        )
        yield counter(
            "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            pc.queries,
        )
        yield counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", pc.hits
        )
        yield counter(
            "external_prefix_cache_hits",
            "External prefix cache hits (offload tiers), in terms of number of loaded tokens.",
            pc.external_hits,
        )
        yield counter(
            "num_preemptions",
            "Cumulative number of preemptions from the engine.",
            s.num_preemptions,
        )
        yield counter("prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield counter(
            "generation_tokens", "Number of generation tokens processed.", s.generation_tokens
        )
        yield counter(
            "request_aborted",
            "Requests aborted (client disconnects, cancellations).",
            llm.num_aborted,
        )
        yield counter(
            "request_rejected",
            "Requests refused because the waiting queue was full.",
            llm.num_rejected,
        )
        yield self._cache_config_info()
        yield from self._encoder_cache_metrics(gauge, counter)
        if s.tier_stats:
            yield from self._tier_metrics(s.tier_stats)
        yield from kv_transfer_metrics(s, prefix, labels, values)

    def _encoder_cache_metrics(self, gauge: Any, counter: Any) -> Iterable[Metric]:
        """A vision-language model's encoder cache, and its EPD transfers (`encoder_cache_state`)."""
        ec = encoder_cache_state(self.metrics.async_llm.engine)
        if ec is None:
            return
        yield gauge(
            "encoder_cache_usage_tokens", "Encoder outputs kept, in tokens.", ec["usage_tokens"]
        )
        yield gauge(
            "encoder_cache_budget_tokens",
            "The encoder cache's budget, in tokens.",
            ec["budget_tokens"],
        )
        yield counter(
            "encoder_cache_queries", "Images a prefill chunk needed encoded.", ec["queries"]
        )
        yield counter("encoder_cache_hits", "Of those, found in the encoder cache.", ec["hits"])
        if ec["ec_role"] is None:
            return
        yield counter(
            "ec_transfer_published", "Encoder outputs kept for consumers (EPD).", ec["ec_published"]
        )
        yield counter(
            "ec_transfer_fetched",
            "Encoder outputs read from an encoder instance.",
            ec["ec_fetched"],
        )
        yield counter(
            "ec_transfer_fetch_failures",
            "Encoder outputs a consumer could not read (encoded locally).",
            ec["ec_fetch_failures"],
        )
        yield counter(
            "ec_transfer_bytes", "Bytes of encoder outputs read.", ec["ec_bytes_received"]
        )
        yield counter(
            "ec_transfer_seconds", "Seconds spent reading encoder outputs.", ec["ec_fetch_seconds"]
        )

    def _tier_metrics(self, tiers: list[TierStats]) -> Iterable[Metric]:
        """One family per `TIER_FIELDS` entry, one sample per tier (labels ``tier``, ``medium``)."""
        m = self.metrics
        labels, values = m.label_names, m.label_values
        for field, suffix, kind, doc in TIER_FIELDS:
            cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            fam = cls(m.prefix + suffix, doc, labels=labels + ["tier", "medium"])
            for st in tiers:
                value = float(getattr(st, field))
                if field == "capacity_bytes" and st.capacity_unbounded:
                    value = math.inf  # a tier without a size limit, not a full one
                fam.add_metric(values + [st.name, st.medium], value)
            yield fam

    def _cache_config_info(self) -> GaugeMetricFamily:
        """vLLM's ``cache_config_info``: one sample, value 1, the configuration in its labels."""
        m = self.metrics
        info = cache_config_labels(m.async_llm.engine)
        info["engine"] = "0"
        g = GaugeMetricFamily(
            m.prefix + "cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(info),
        )
        g.add_metric(list(info.values()), 1.0)
        return g


__all__ = [
    "DEFAULT_METRICS_PREFIX",
    "METRICS_PREFIXES",
    "ServerMetrics",
    "build_1_2_5_buckets",
    "cache_config_labels",
    "check_metrics_prefix",
    "kv_transfer_metrics",
    "percentile",
]
