"""Plots of a `pagedkv simulate sweep` (matplotlib, PNG). Imported only by the sweep command."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import ScalarFormatter  # noqa: E402


def plot_sweep(points: list[dict], x_key: str, x_label: str, out: str | Path, title: str) -> Path:
    """Hit rate (device, tier, total) and TTFT p50/p99 against ``x_key``, one line per policy.
    ``points``: ``{"policy", x_key, "report"}`` dicts. Writes and returns the PNG path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax_hit, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy in sorted({p["policy"] for p in points}):
        pts = sorted((p for p in points if p["policy"] == policy), key=lambda p: p[x_key])
        xs = [p[x_key] for p in pts]
        hit = [p["report"]["hit_rate"] for p in pts]
        ax_hit.plot(xs, [h["total"] for h in hit], marker="o", label=f"{policy}: total")
        if any(h["cpu_tier"] for h in hit):
            ax_hit.plot(
                xs, [h["device"] for h in hit], ls="--", marker=".", label=f"{policy}: device"
            )
        ttft = [p["report"]["latency_s"]["ttft"] for p in pts]
        ax_ttft.plot(xs, [t["p50"] * 1000 for t in ttft], marker="o", label=f"{policy}: p50")
        ax_ttft.plot(
            xs, [t["p99"] * 1000 for t in ttft], ls="--", marker="^", label=f"{policy}: p99"
        )
    xs_all = [p[x_key] for p in points]
    for ax in (ax_hit, ax_ttft):  # cache sizes grow geometrically: log2 axis (symlog with a 0)
        if min(xs_all) > 0:
            ax.set_xscale("log", base=2)
        elif max(xs_all) > 0:
            ax.set_xscale("symlog", base=2, linthresh=min(x for x in xs_all if x > 0))
        ax.xaxis.set_major_formatter(ScalarFormatter())
    ax_hit.set_xlabel(x_label)
    ax_hit.set_ylabel("prefix cache hit rate (tokens)")
    ax_hit.set_ylim(0, 1)
    ax_hit.grid(alpha=0.3)
    ax_hit.legend(fontsize=8)
    ax_ttft.set_xlabel(x_label)
    ax_ttft.set_ylabel("TTFT (ms)")
    ys = [p["report"]["latency_s"]["ttft"][q] for p in points for q in ("p50", "p99")]
    if min(ys) > 0 and max(ys) / min(ys) > 20:  # queueing blow-ups: log scale
        ax_ttft.set_yscale("log")
    ax_ttft.grid(alpha=0.3, which="both")
    ax_ttft.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
