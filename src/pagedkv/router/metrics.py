"""The router's Prometheus metrics (``GET /metrics``), and the parser of a replica's /metrics.

Router metrics (prefix ``pagedkv_router_``; counters end in ``_total``):

=========================================  =================================================
decisions_total{policy,reason,replica}     routing decisions (reason: kv_hit, load, round_robin,
                                           only_replica)
index_blocks                               distinct block hashes in the global index
replica_indexed_blocks{replica}            blocks the index holds for each replica
replica_up{replica}                        1 while answering and indexed, else 0
replica_refused{replica}                   1 while answering with an incompatible config
predicted_hit_tokens_total{replica}        cached prompt tokens the router predicted
reported_cached_tokens_total{replica}      ``usage.prompt_tokens_details.cached_tokens`` the
                                           replicas reported (only requests whose answer had
                                           usage count, in both of these)
predictions_total{outcome}                 per request with usage: exact, over, under
retries_total{replica}                     requests sent elsewhere after this replica failed
kv_events_total{replica}                   KV events applied (replays included)
kv_event_lag_seconds                       histogram: now minus a live batch's timestamp
kv_resyncs_total{replica,why}              index rebuilds: connect, gap, lost, restart
=========================================  =================================================

No ``_created`` series (`prometheus_client.disable_created_metrics`, as the server does).
"""

from __future__ import annotations

from collections.abc import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.router.scoring import ReplicaLoad

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RouterMetrics:
    """One registry per router app. ``refresh`` (called before each render) sets the gauges."""

    def __init__(self, refresh: Callable[[RouterMetrics], None] | None = None) -> None:
        prometheus_client.disable_created_metrics()  # process-wide, as the server's metrics do
        self.registry = r = CollectorRegistry(auto_describe=True)
        p = "pagedkv_router_"
        self.decisions = Counter(
            p + "decisions", "Routing decisions.", ["policy", "reason", "replica"], registry=r
        )
        self.index_blocks = Gauge(
            p + "index_blocks", "Distinct block hashes in the global index.", registry=r
        )
        self.replica_blocks = Gauge(
            p + "replica_indexed_blocks", "Indexed blocks per replica.", ["replica"], registry=r
        )
        self.replica_up = Gauge(
            p + "replica_up", "1 while the replica answers and is indexed.", ["replica"], registry=r
        )
        self.replica_refused = Gauge(
            p + "replica_refused",
            "1 while the replica's KV cache config differs.",
            ["replica"],
            registry=r,
        )
        self.predicted = Counter(
            p + "predicted_hit_tokens",
            "Prompt tokens predicted to hit the cache.",
            ["replica"],
            registry=r,
        )
        self.reported = Counter(
            p + "reported_cached_tokens",
            "Cached prompt tokens the replicas reported.",
            ["replica"],
            registry=r,
        )
        self.predictions = Counter(
            p + "predictions",
            "Predictions checked against a reported usage.",
            ["outcome"],
            registry=r,
        )
        self.retries = Counter(
            p + "retries",
            "Requests retried elsewhere after a replica failed.",
            ["replica"],
            registry=r,
        )
        self.events = Counter(
            p + "kv_events", "KV events applied to the index.", ["replica"], registry=r
        )
        self.event_lag = Histogram(
            p + "kv_event_lag_seconds",
            "Delay from a replica's event batch to the index.",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.resyncs = Counter(
            p + "kv_resyncs", "Index rebuilds of a replica.", ["replica", "why"], registry=r
        )
        self._refresh = refresh

    def on_batch(self, replica: str, lag: float | None, num_events: int) -> None:
        self.events.labels(replica).inc(num_events)
        if lag is not None:
            self.event_lag.observe(lag)

    def on_resync(self, replica: str, why: str) -> None:
        self.resyncs.labels(replica, why).inc()

    def record_usage(self, replica: str, predicted: int, reported: int) -> None:
        self.predicted.labels(replica).inc(predicted)
        self.reported.labels(replica).inc(reported)
        outcome = (
            "exact" if predicted == reported else ("over" if predicted > reported else "under")
        )
        self.predictions.labels(outcome).inc()

    def render(self) -> bytes:
        if self._refresh is not None:
            self._refresh(self)
        return generate_latest(self.registry)


def parse_replica_load(text: str) -> ReplicaLoad:
    """Running/waiting requests and KV usage from a replica's /metrics (``pagedkv:`` or
    ``vllm:`` prefix; samples of several engines are summed, usage averaged)."""
    running = waiting = 0
    usage: list[float] = []
    for fam in text_string_to_metric_families(text):
        name = fam.name.rpartition(":")[2]
        for s in fam.samples:
            if name == "num_requests_running":
                running += int(s.value)
            elif name == "num_requests_waiting":
                waiting += int(s.value)
            elif name == "kv_cache_usage_perc":
                usage.append(float(s.value))
    return ReplicaLoad(running, waiting, sum(usage) / len(usage) if usage else 0.0)
