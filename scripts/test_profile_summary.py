"""Summarize a ``PAGEDKV_TEST_PROFILE`` TSV (one line per test: node id, wall s, CPU s, RSS KiB,
peak RSS KiB) as JSON: totals, the costliest files and tests, and where the peak was reached.

Usage: python scripts/test_profile_summary.py prof.tsv [--top N] [--slow-ids FILE]

``--slow-ids``: a file of node ids (``pytest --collect-only -q -m slow``) to split the totals
into the development loop (``-m "not slow"``) and the rest.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path


def summarize(path: Path, top: int, slow: set[str] | None) -> dict:
    rows = []
    for line in path.read_text().splitlines():
        node, wall, cpu, rss, peak = line.split("\t")[:5]
        rows.append((node, float(wall), float(cpu), int(rss), int(peak)))
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for node, wall, cpu, _, _ in rows:
        f = files[node.split("::")[0]]
        f[0] += wall
        f[1] += cpu
        f[2] += 1
    peak = max(rows, key=lambda r: r[4])
    first_at_peak = next(r for r in rows if r[4] == peak[4])
    out = {
        "tests": len(rows),
        "wall_s": round(sum(r[1] for r in rows), 1),
        "in_process_cpu_s": round(sum(r[2] for r in rows), 1),
        "peak_rss_gib": round(peak[4] / 2**20, 2),
        "peak_reached_in": first_at_peak[0],
        "top_files": [
            {"file": f, "wall_s": round(v[0], 1), "cpu_s": round(v[1], 1), "tests": v[2]}
            for f, v in sorted(files.items(), key=lambda kv: -kv[1][0])[:top]
        ],
        "top_tests": [
            {"test": r[0], "wall_s": round(r[1], 1)}
            for r in sorted(rows, key=lambda r: -r[1])[:top]
        ],
    }
    if slow is not None:
        fast = [r for r in rows if r[0] not in slow]
        out["not_slow"] = {"tests": len(fast), "wall_s": round(sum(r[1] for r in fast), 1)}
        out["slow"] = {
            "tests": len(rows) - len(fast),
            "wall_s": round(out["wall_s"] - out["not_slow"]["wall_s"], 1),
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tsv", type=Path)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--slow-ids", type=Path, default=None)
    args = ap.parse_args()
    slow = None
    if args.slow_ids:
        slow = {ln.strip() for ln in args.slow_ids.read_text().splitlines() if "::" in ln}
    json.dump(summarize(args.tsv, args.top, slow), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
