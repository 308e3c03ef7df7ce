"""What idle NIXL agents cost the engine's compute, by progress-thread delay: a table and JSON.

Each case runs in its own process: it creates ``--agents`` NIXL agents (UCX, progress thread on,
the given ``pthrDelay``) and times a decode-shaped matmul loop (``[2048, 2048] @ [2048, 8]``)
while they sit idle; the baseline case creates none, in the same run. NIXL's Python wrapper
hard-codes a delay of 0 (a busy loop); `NixlBackend` uses 100 µs.

Usage: python benchmarks/bench_nixl_progress.py [--agents N] [--iters N] [--json-only]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from pagedkv.bench.common import add_output_args, emit, log, user_help

DELAYS_US = (0, 100, 1000)

_CHILD = """
import json, os, sys, time
import torch
n_agents, delay, iters = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
agents = []
if n_agents:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from nixl_cu12 import nixl_agent_config
    from pagedkv.transfer.nixl import make_agent
    for i in range(n_agents):
        cfg = nixl_agent_config(enable_prog_thread=True, backends=["UCX"])
        agents.append(make_agent(f"bench-{i}", cfg, delay))
a, x = torch.randn(2048, 2048), torch.randn(2048, 8)
for _ in range(20):
    a @ x
time.sleep(0.3)
best = float("inf")
for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ x
    dt = time.perf_counter() - t0
    best = min(best, dt)
print(json.dumps({"s": best, "per_matmul_us": best / iters * 1e6}))
"""


def _case(n_agents: int, delay: int, iters: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(n_agents), str(delay), str(iters)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=user_help(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--agents", type=int, default=2, help="idle agents per case (default 2)")
    ap.add_argument("--iters", type=int, default=200, help="matmuls per timing (default 200)")
    add_output_args(ap)
    args = ap.parse_args(argv)
    from pagedkv.transfer import nixl_import_error
    from pagedkv.transfer.nixl import DEFAULT_PROGRESS_DELAY_US

    reason = nixl_import_error()
    if reason is not None:
        print(f"NIXL is not importable: {reason}", file=sys.stderr)
        return 2
    log(args, "baseline: no agents")
    base = _case(0, 0, args.iters)
    cases = []
    for d in DELAYS_US:
        log(args, f"{args.agents} agents, progress delay {d} µs")
        r = _case(args.agents, d, args.iters)
        cases.append({"delay_us": d, **r, "slowdown_vs_no_agents": r["s"] / base["s"]})
    report = {
        "agents": args.agents,
        "iters": args.iters,
        "baseline_no_agents": base,
        "cases": cases,
        "default_delay_us": DEFAULT_PROGRESS_DELAY_US,
    }

    def table(rep: dict[str, Any]) -> str:
        rows = [f"{'progress delay':>16s} {'µs/matmul':>10s} {'vs no agents':>13s}"]
        rows.append(f"{'(no agents)':>16s} {base['per_matmul_us']:10.1f} {1.0:12.2f}x")
        for c in rep["cases"]:
            rows.append(
                f"{c['delay_us']:>13d} µs {c['per_matmul_us']:10.1f} "
                f"{c['slowdown_vs_no_agents']:12.2f}x"
            )
        return "\n".join(rows)

    emit(report, table, args)
    return 0
