"""``pagedkv simulate``: size KV pools, CPU tiers and routing for a fleet by replaying a trace
through the real core/ code with a modelled forward pass.

Subcommands:
  run        simulate one fleet shape on a trace (JSON report + table)
  sweep      simulate several cache sizes (device blocks or CPU tier blocks) x policies; JSON
             and a PNG of hit rate and TTFT against cache size
  calibrate  measure the real engine here and write a cost-model JSON (the only torch user)
  generate   write a synthetic trace (chat, system-prompt, agentic) as JSONL
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pagedkv.engine.arg_utils import EngineArgs

DESCRIPTION = __doc__.replace("``pagedkv simulate``", "pagedkv simulate")

EXAMPLES = """examples:
  pagedkv simulate generate --generator chat --num-requests 5000 --rate 20 --out chat.jsonl
  pagedkv simulate run --trace chat.jsonl --replicas 8 --num-blocks 2048 --policy kv
  pagedkv simulate run --generator agentic --num-requests 20000 --rate 200 --replicas 64 \\
      --policy round-robin --cost h200-llama3-8b
  pagedkv simulate sweep --generator chat --num-requests 20000 --rate 100 --replicas 16 \\
      --sweep cpu-tier-blocks=0,2048,8192,32768 --policies kv,round-robin --out benchmarks/results/sim_sweep
  pagedkv simulate calibrate --out benchmarks/results/sim_cost_cpu.json --threads 1
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate",
        help="simulate a fleet on a trace (KV sizing, routing)",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="sim_command", metavar="{run,sweep,calibrate,generate}")
    r = sub.add_parser("run", help="simulate one fleet shape")
    _trace_args(r)
    _fleet_args(r)
    r.add_argument("--out", default=None, help="write the JSON report here")
    r.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    s = sub.add_parser("sweep", help="simulate several cache sizes and policies; JSON + PNG")
    _trace_args(s)
    _fleet_args(s)
    s.add_argument(
        "--sweep",
        required=True,
        metavar="PARAM=V1,V2,...",
        help="num-blocks=... or cpu-tier-blocks=... (blocks per replica)",
    )
    s.add_argument("--policies", default=None, help="comma-separated policies (default: --policy)")
    s.add_argument(
        "--out",
        default="benchmarks/results/sim_sweep",
        help="output prefix: PREFIX.json and PREFIX.png",
    )
    c = sub.add_parser("calibrate", help="fit the cost model to the real engine on this machine")
    c.add_argument("--out", default="benchmarks/results/sim_cost_cpu.json")
    c.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    # The engine's flags, with a small pool and context so calibration runs in minutes.
    small = dict(
        num_kv_blocks=dict(default=512, help="exact KV pool size in blocks (default %(default)s)"),
        max_model_len=dict(default=2048, help="context length cap (default %(default)s)"),
    )
    EngineArgs.add_cli_args(
        c,
        include=("dtype", "num_kv_blocks", "max_model_len", "max_num_batched_tokens"),
        overrides=small,
    )
    c.add_argument(
        "--server",
        action="store_true",
        help="measure through a real `pagedkv serve` process as a client (TTFT, ITL; "
        "fits the per-request serving overhead too) instead of timing engine steps",
    )
    g = sub.add_parser("generate", help="write a synthetic trace (JSONL)")
    _trace_args(g, need_out=True)
    p.set_defaults(func=run, command="simulate")
    return p


def _trace_args(p: argparse.ArgumentParser, need_out: bool = False) -> None:
    from pagedkv.sim.trace import GENERATORS

    t = p.add_argument_group("trace")
    if not need_out:
        t.add_argument(
            "--trace",
            default=None,
            help="a JSONL trace: one request per line, {id, t, prompt_token_ids | segments, "
            "output_len, reply} (pagedkv simulate generate writes one)",
        )
    else:
        t.add_argument("--out", required=True, help="write the trace here (JSONL)")
    t.add_argument(
        "--generator",
        default="chat",
        choices=sorted(GENERATORS),
        help="synthetic trace when no --trace (default chat)",
    )
    t.add_argument("--num-requests", type=int, default=2000)
    t.add_argument("--rate", type=float, default=10.0, help="mean arrivals per second (fleet-wide)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--gen-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="generator parameter, e.g. turns=6, system_len=2048, zipf_s=1.2 (repeatable)",
    )


def _fleet_args(p: argparse.ArgumentParser) -> None:
    f = p.add_argument_group("fleet")
    f.add_argument("--replicas", type=int, default=3)
    f.add_argument(
        "--num-blocks", type=int, default=4096, help="KV blocks per replica (null block included)"
    )
    # The engine's scheduler flags, per replica (a longer context than the engine's default).
    cap = dict(default=32768, help="each replica's context length cap (default %(default)s)")
    EngineArgs.add_cli_args(
        f,
        include=(
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "tensor_parallel_size",
        ),
        overrides=dict(max_model_len=cap),
    )
    f.add_argument(
        "--cpu-tier-blocks", type=int, default=0, help="CPU offload tier per replica, in blocks"
    )
    f.add_argument(
        "--pd-prefill",
        type=int,
        default=0,
        metavar="P",
        help="PD split: the first P replicas prefill, the rest decode (default 0: no split)",
    )
    f.add_argument(
        "--cost",
        default="h100-llama3-8b",
        help="cost model: a GPU table row (h100-llama3-8b, h200-llama3-8b) or a calibration JSON",
    )
    r = p.add_argument_group("routing (pagedkv router's policies and weights)")
    r.add_argument("--policy", default="kv", choices=["kv", "load", "round-robin"])
    r.add_argument("--overlap-weight", type=float, default=1.0)
    r.add_argument("--tier-credit", type=float, default=0.75)
    r.add_argument("--load-weight", type=float, default=1.0)
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument(
        "--route-candidates",
        type=int,
        default=None,
        help="score the K replicas holding the deepest prompt blocks + K sampled ones (default: all "
        "up to 128 replicas, else 16); 0 = all",
    )
    r.add_argument(
        "--exact-active-blocks",
        action="store_true",
        help="give the kv policy each replica's exact blocks in use (default: what "
        "`pagedkv router` sees; the policy estimates them from running requests)",
    )
    f.add_argument(
        "--host-cores",
        type=int,
        default=0,
        help="replicas share this many CPU cores (a CPU fleet on one host; default 0: off)",
    )
    r.add_argument(
        "--hash-mode",
        default="fast",
        choices=["fast", "real"],
        help="fast: segment hashes; real: the engine's sha256_cbor over token ids",
    )
    r.add_argument(
        "--no-reply-hashes",
        action="store_true",
        help="output blocks never match a later prompt (as when the model's output "
        "differs from the trace's reply)",
    )


def _gen_kwargs(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, _, val = item.partition("=")
        if not _:
            raise ValueError(f"--gen-arg wants KEY=VALUE, got {item!r}")
        try:
            out[key] = int(val)
        except ValueError:
            out[key] = float(val)
    return out


def load_trace(args: argparse.Namespace) -> list:
    from pagedkv.sim.trace import GENERATORS, read_trace

    if getattr(args, "trace", None):
        return read_trace(args.trace)
    return GENERATORS[args.generator](
        args.num_requests, args.rate, args.seed, **_gen_kwargs(args.gen_arg)
    )


def fleet_config(args: argparse.Namespace, **overrides: Any):
    from pagedkv.router.scoring import RoutingWeights
    from pagedkv.sim.fleet import FleetConfig
    from pagedkv.sim.replica import ReplicaConfig

    rc = ReplicaConfig(
        num_blocks=overrides.get("num_blocks", args.num_blocks),
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        cpu_tier_blocks=overrides.get("cpu_tier_blocks", args.cpu_tier_blocks),
        tensor_parallel_size=args.tensor_parallel_size,
    )
    cands = args.route_candidates
    if cands is None:
        cands = 0 if args.replicas <= 128 else 16
    return FleetConfig(
        replicas=args.replicas,
        replica=rc,
        policy=overrides.get("policy", args.policy),
        weights=RoutingWeights(
            args.overlap_weight, args.tier_credit, args.load_weight, args.temperature
        ),
        seed=args.seed,
        hash_mode=args.hash_mode,
        route_candidates=cands,
        reply_hashes=not args.no_reply_hashes,
        pd_prefill=args.pd_prefill,
        host_cores=args.host_cores,
        exact_active_blocks=args.exact_active_blocks,
    )


def run(args: argparse.Namespace) -> int:
    cmd = getattr(args, "sim_command", None)
    if cmd is None:
        print(
            "usage: pagedkv simulate {run,sweep,calibrate,generate} ... (see --help)",
            file=sys.stderr,
        )
        return 2
    return {"run": _run, "sweep": _sweep, "calibrate": _calibrate, "generate": _generate}[cmd](args)


def _write_json(path: str | Path, obj: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=1) + "\n")


def _run(args: argparse.Namespace) -> int:
    from pagedkv.sim.cost import resolve_cost_model
    from pagedkv.sim.fleet import simulate
    from pagedkv.sim.report import format_table

    report = simulate(load_trace(args), fleet_config(args), resolve_cost_model(args.cost))
    if args.out:
        _write_json(args.out, report)
    print(json.dumps(report, indent=1) if args.json else format_table(report))
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from pagedkv.sim.cost import resolve_cost_model
    from pagedkv.sim.fleet import simulate
    from pagedkv.sim.plot import plot_sweep

    param, _, values = args.sweep.partition("=")
    key = {"num-blocks": "num_blocks", "cpu-tier-blocks": "cpu_tier_blocks"}.get(param)
    if key is None or not values:
        print("--sweep wants num-blocks=V1,V2,... or cpu-tier-blocks=V1,V2,...", file=sys.stderr)
        return 2
    trace = load_trace(args)
    cost = resolve_cost_model(args.cost)
    policies = (args.policies or args.policy).split(",")
    points = []
    for policy in policies:
        for v in (int(x) for x in values.split(",")):
            rep = simulate(trace, fleet_config(args, policy=policy, **{key: v}), cost)
            points.append({"policy": policy, key: v, "report": rep})
            h, t = rep["hit_rate"], rep["latency_s"]["ttft"]
            print(
                f"{policy:12} {param}={v:<8} hit {h['total']:.3f} (device {h['device']:.3f}, "
                f"tier {h['cpu_tier']:.3f})  TTFT p50 {t['p50'] * 1000:.1f} ms  p99 {t['p99'] * 1000:.1f} ms  "
                f"[{rep['perf']['wall_s']:.1f}s]",
                flush=True,
            )
    answers = halving_points(points, key)
    for policy, v in answers.items():
        print(
            f"{policy}: TTFT p99 halved (vs the smallest {param}) "
            + (f"at {param}={v}" if v is not None else "at none of the swept values")
        )
    _write_json(
        f"{args.out}.json", {"sweep": param, "points": points, "ttft_p99_halved_at": answers}
    )
    png = plot_sweep(
        points,
        key,
        f"{param} per replica",
        f"{args.out}.png",
        f"{args.trace or args.generator + ' trace'}: {len(trace)} requests, "
        f"{args.replicas} replicas, cost {cost.name}",
    )
    print(f"wrote {args.out}.json and {png}")
    return 0


def halving_points(points: list[dict], key: str) -> dict[str, int | None]:
    """Per policy, the smallest swept value whose TTFT p99 is at most half the p99 at the
    smallest value ("how much CPU tier per replica halves TTFT p99")."""
    out: dict[str, int | None] = {}
    for policy in dict.fromkeys(p["policy"] for p in points):
        pts = sorted((p for p in points if p["policy"] == policy), key=lambda p: p[key])
        base = pts[0]["report"]["latency_s"]["ttft"]["p99"]
        out[policy] = next(
            (p[key] for p in pts[1:] if p["report"]["latency_s"]["ttft"]["p99"] <= base / 2), None
        )
    return out


def _calibrate(args: argparse.Namespace) -> int:
    if args.server:
        from pagedkv.sim.calibrate import calibrate_server

        flags = [
            "--dtype",
            args.dtype,
            "--num-kv-blocks",
            str(args.num_kv_blocks),
            "--max-model-len",
            str(args.max_model_len),
            "--max-num-batched-tokens",
            str(args.max_num_batched_tokens),
        ]
        report = calibrate_server(flags, threads=args.threads or 1, out=args.out)
    else:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        from pagedkv.sim.calibrate import calibrate

        report = calibrate(
            {
                "dtype": args.dtype,
                "num_kv_blocks": args.num_kv_blocks,
                "max_model_len": args.max_model_len,
                "max_num_batched_tokens": args.max_num_batched_tokens,
            },
            out=args.out,
        )
    cm = report["cost_model"]
    print(
        f"step_s = {cm['base_s'] * 1e3:.3f} ms + {cm['prefill_token_s'] * 1e6:.1f} us/prefill token + "
        f"{cm['decode_seq_s'] * 1e6:.1f} us/decode seq + {cm['context_token_s'] * 1e9:.1f} ns/context token; "
        f"+ {cm['request_overhead_s'] * 1e3:.1f} ms per request "
        f"(fit error {report['fit_mean_relative_error'] * 100:.1f}% over {report['num_steps']} steps, "
        f"{report['wall_s']:.0f}s); wrote {args.out}"
    )
    return 0


def _generate(args: argparse.Namespace) -> int:
    from pagedkv.sim.trace import write_trace

    n = write_trace(args.out, load_trace(args))
    print(f"wrote {n} requests to {args.out}")
    return 0
