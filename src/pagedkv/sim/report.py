"""Simulation results: percentiles, a log-bucketed histogram for inter-token latencies, the
JSON report and its text table."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of already sorted values (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, math.ceil(p / 100 * len(sorted_values)) - 1))
    return float(sorted_values[k])


def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean and p50/p90/p99 (seconds)."""
    vals = sorted(values)
    out = {"mean": sum(vals) / len(vals) if vals else 0.0}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(vals, p)
    return out


@dataclass(slots=True)
class Histogram:
    """Counts of positive values in log buckets 1% wide: percentiles within 1% without keeping
    every inter-token gap (a decode run adds ``k`` equal gaps at once)."""

    counts: dict[int, int] = field(default_factory=dict)
    total: int = 0
    sum: float = 0.0

    def add(self, value: float, count: int = 1) -> None:
        b = int(math.log(value) / 0.00995) if value > 0 else -(1 << 30)
        self.counts[b] = self.counts.get(b, 0) + count
        self.total += count
        self.sum += value * count

    def percentile(self, p: float) -> float:
        if not self.total:
            return 0.0
        rank = max(1, math.ceil(p / 100 * self.total))
        acc = 0
        for b in sorted(self.counts):
            acc += self.counts[b]
            if acc >= rank:
                return 0.0 if b == -(1 << 30) else math.exp((b + 0.5) * 0.00995)
        return 0.0

    def summary(self) -> dict[str, float]:
        out = {"mean": self.sum / self.total if self.total else 0.0}
        for p in PERCENTILES:
            out[f"p{p}"] = self.percentile(p)
        return out


def format_table(report: dict) -> str:
    """A short human-readable summary of a `fleet.simulate` report."""
    lat = report["latency_s"]
    hit = report["hit_rate"]
    lines = [
        f"requests {report['requests']['finished']}/{report['requests']['total']}  "
        f"replicas {report['fleet']['replicas']}  policy {report['fleet']['policy']}  "
        f"sim time {report['sim_time_s']:.1f}s",
        f"hit rate: device {hit['device']:.3f}  cpu tier {hit['cpu_tier']:.3f}  total {hit['total']:.3f}",
        f"{'':8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name in ("ttft", "itl", "e2e"):
        s = lat[name]
        lines.append(
            f"{name:8}" + "".join(f"{s[k] * 1000:>9.1f}m" for k in ("mean", "p50", "p90", "p99"))
        )
    th = report["throughput"]
    lines.append(
        f"throughput: {th['requests_per_s']:.2f} req/s, {th['output_tokens_per_s']:.1f} out tok/s; "
        f"preemptions {report['preemptions']}"
    )
    perf = report.get("perf")
    if perf:
        lines.append(
            f"simulator: {perf['events']} events in {perf['wall_s']:.1f}s = "
            f"{perf['events_per_s']:.0f} events/s ({perf['engine_steps']} engine steps)"
        )
    return "\n".join(lines)
