"""KV-aware routing: the router's kv policy vs round-robin vs load over three replicas.

``pagedkv router`` with ``--policy kv`` vs ``round-robin`` vs ``load`` over three replicas, on
the same multi-turn conversation trace.

1. Three ``pagedkv serve`` replicas (KV events with replay, prefix caching on), each pinned to
   one CPU of this process's affinity (replica i on CPU i mod n, ``OMP_NUM_THREADS=1``: on a
   2-core machine two replicas share a core, the same for every policy). Pinning is skipped,
   with a note in the JSON, when ``taskset`` is missing.
2. The trace: ``--conversations`` conversations of ``--turns`` turns. Each has its own system
   prompt (``--system-len`` random ordinary token ids); turn t's prompt is turn t-1's prompt +
   a reply (``--reply-len`` tokens standing for the assistant's answer) + a user message
   (``--user-len``), so turn t shares turn t-1's whole prompt as a prefix. Conversations run
   concurrently, each turn after the previous one's answer and a think time (exponential,
   mean ``--think-s``); conversations start at random in the first ``--stagger-s`` x
   conversations seconds (irregular arrivals: a round-robin cursor must not line up with the
   conversations, which would make it sticky by accident). Streamed
   completions, greedy, ``ignore_eos``, ``--max-tokens`` new tokens. Each replica's pool
   (``--num-kv-blocks``, 96 by default) is smaller than the conversations' working set but
   larger than its share of it: the fleet's caches hold every conversation only when each
   stays on one replica, which is what a KV-aware router buys a fleet beyond lucky hits.
3. ``--repeats`` traces (seed, seed + 1, ...), the policies interleaved within each repeat so
   machine drift hits them alike. Per policy and repeat: a fresh router process (unpinned),
   every replica's prefix cache reset first, then the trace. Figures pool every repeat's
   requests (one run of a trace this short moves TTFT p50 by 1.5x on 2 cores); the JSON keeps
   each repeat's hit rate and p50. Measured: prefix hit rate (the replicas' reported
   ``usage.prompt_tokens_details.cached_tokens`` over prompt tokens), TTFT p50/p99, the
   router's decisions by reason and how many of its hit predictions equal the reported ones.
   Ratios against round-robin. Targets: kv's hit rate >= 2x round-robin's, and kv's TTFT p50
   >= 1.5x lower (round-robin / kv >= 1.5).

Every process is started on free ports and stopped by PID at the end (also on Ctrl-C or
SIGTERM); logs go to a temporary directory (kept with ``--keep-logs``). Progress goes to
standard error; standard output holds the table and the JSON.

Usage: pagedkv bench router (or python benchmarks/bench_router.py) [--conversations 12] [--turns 5]
       [--repeats 3] [--policies kv,round-robin,load] [--json-only] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pagedkv.bench.common import BenchOptionError, add_output_args, log, ratio, run_and_emit
from pagedkv.bench.disagg import TOKEN_RANGE
from pagedkv.bench.instances import CLI, Cluster, Instance, free_port, pin_cores, stop_on_sigterm
from pagedkv.bench.serving import dist

TARGET_HIT_RATIO = 2.0  # kv hit rate / round-robin's
TARGET_TTFT_RATIO = 1.5  # round-robin TTFT p50 / kv's
HTTP_TIMEOUT_S = 300.0


@dataclass(slots=True)
class Turn:
    conversation: int
    turn: int
    prompt: list[int]
    think_s: float  # pause before sending it


@dataclass(slots=True)
class TurnResult:
    ok: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    replica: str | None = None
    predicted: int | None = None
    error: str | None = None


@dataclass(slots=True)
class PolicyResult:
    policy: str
    completed: int
    failed: int
    errors: list[str]
    duration_s: float
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    ttft_s: dict[str, float]
    ttft_later_turns_s: dict[str, float]  # turns >= 2 only: where a prefix can hit
    decisions: dict[str, float]  # by reason (the router's metric)
    predictions: dict[str, float]  # exact / over / under (the router's metric)
    requests_per_replica: dict[str, int]
    repeats: list[dict[str, float]]  # per repeat: hit rate, TTFT p50, duration


# ---- trace --------------------------------------------------------------------------------------


def make_trace(args: argparse.Namespace, seed: int) -> list[list[Turn]]:
    """One list of turns per conversation (see the module docstring)."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]

    convs = []
    for c in range(args.conversations):
        prompt = toks(args.system_len) + toks(args.user_len)
        turns = [Turn(c, 0, list(prompt), rng.uniform(0, args.stagger_s * args.conversations))]
        for t in range(1, args.turns):
            prompt = prompt + toks(args.reply_len) + toks(args.user_len)
            turns.append(
                Turn(
                    c,
                    t,
                    list(prompt),
                    rng.expovariate(1 / args.think_s) if args.think_s > 0 else 0.0,
                )
            )
        convs.append(turns)
    return convs


# ---- client -------------------------------------------------------------------------------------


async def send_turn(client: Any, turn: Turn, max_tokens: int) -> TurnResult:
    """One streamed completion: TTFT (first chunk with text) and the reported cached tokens."""
    payload = dict(
        prompt=turn.prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        stream=True,
        stream_options=dict(include_usage=True),
    )
    res = TurnResult(ok=False, prompt_tokens=len(turn.prompt))
    t0 = time.perf_counter()
    done = False
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            res.replica = r.headers.get("x-pagedkv-replica")
            pred = r.headers.get("x-pagedkv-predicted-cached-tokens")
            res.predicted = int(pred) if pred is not None else None
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        res.error = str(chunk["error"].get("message"))
                        return res
                    if res.ttft is None and chunk.get("choices"):
                        res.ttft = time.perf_counter() - t0
                    usage = chunk.get("usage")
                    if usage:
                        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                            "cached_tokens"
                        ) or 0
    except Exception as e:  # any transport failure: the request failed
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.ok = done and res.ttft is not None
    if not done:
        res.error = "no [DONE]"
    return res


async def drive(
    url: str, convs: list[list[Turn]], max_tokens: int
) -> tuple[list[TurnResult], float]:
    """Every conversation concurrently, its turns in order (think time between)."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=HTTP_TIMEOUT_S) as client:

        async def conversation(turns: list[Turn]) -> list[TurnResult]:
            out = []
            for turn in turns:
                await asyncio.sleep(turn.think_s)
                out.append(await send_turn(client, turn, max_tokens))
            return out

        t0 = time.perf_counter()
        per_conv = await asyncio.gather(*(conversation(c) for c in convs))
        return [r for rs in per_conv for r in rs], time.perf_counter() - t0


# ---- processes ----------------------------------------------------------------------------------


def replica(args: argparse.Namespace, logs: Path, i: int, cores: list[int] | None) -> Instance:
    port = free_port()
    argv = [
        *CLI,
        "serve",
        "--port",
        str(port),
        "--num-kv-blocks",
        str(args.num_kv_blocks),
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--log-stats-interval",
        "0",
        "--max-queue-size",
        "256",
        "--enable-kv-cache-events",
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{free_port()}",
        "--kv-events-replay-endpoint",
        f"tcp://127.0.0.1:{free_port()}",
    ]
    return Instance(f"replica{i}", argv, port, logs / f"replica{i}.log", cores)


def parse_policy(spec: str) -> tuple[str, dict[str, float]]:
    """``kv``, ``round-robin``, ``load`` or a variant with router weights:
    ``kv:overlap=2,load=0.5`` (``overlap``, ``load``, ``tier_credit``, ``temperature``)."""
    policy, _, rest = spec.partition(":")
    weights = {}
    for kv in filter(None, rest.split("+")):
        key, _, value = kv.partition("=")
        if key not in ("overlap", "load", "tier_credit", "temperature"):
            raise BenchOptionError(f"--policies: unknown weight {key!r} in {spec!r}")
        weights[key] = float(value)
    return policy, weights


def router(logs: Path, spec: str, replicas: list[Instance], rep: int) -> Instance:
    policy, weights = parse_policy(spec)
    port = free_port()
    flags = {
        "overlap": "--overlap-weight",
        "load": "--load-weight",
        "tier_credit": "--tier-credit",
        "temperature": "--temperature",
    }
    argv = [
        *CLI,
        "router",
        "--port",
        str(port),
        "--policy",
        policy,
        "--health-interval",
        "0.5",
        *[x for k, v in weights.items() for x in (flags[k], str(v))],
        "--replica",
        *[r.url for r in replicas],
    ]
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", spec) + f"-{rep}"
    return Instance(f"router-{name}", argv, port, logs / f"router-{name}.log")


def reset_caches(replicas: list[Instance]) -> None:
    import httpx

    for r in replicas:
        deadline = time.monotonic() + 30
        while httpx.post(r.url + "/reset_prefix_cache", timeout=30).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{r.name}: /reset_prefix_cache kept failing")
            time.sleep(0.5)  # 409 while a request still holds blocks


def warm_up(replicas: list[Instance], args: argparse.Namespace) -> None:
    """One request per replica (first-call costs out of the measurement)."""
    import httpx

    rng = random.Random(-1)
    for r in replicas:
        prompt = [rng.randrange(*TOKEN_RANGE) for _ in range(args.system_len + args.user_len)]
        httpx.post(
            r.url + "/v1/completions",
            timeout=HTTP_TIMEOUT_S,
            json=dict(prompt=prompt, max_tokens=2, ignore_eos=True),
        )


def router_metrics(url: str) -> tuple[dict[str, float], dict[str, float]]:
    """(decisions by reason, predictions by outcome) from the router's /metrics."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    decisions: dict[str, float] = {}
    for m in re.finditer(
        r'^pagedkv_router_decisions_total\{[^}]*reason="([^"]+)"[^}]*\} (\S+)$', text, re.M
    ):
        decisions[m.group(1)] = decisions.get(m.group(1), 0.0) + float(m.group(2))
    predictions = {
        m.group(1): float(m.group(2))
        for m in re.finditer(
            r'^pagedkv_router_predictions_total\{outcome="([^"]+)"\} (\S+)$', text, re.M
        )
    }
    return decisions, predictions


@dataclass(slots=True)
class PolicyRun:
    """One policy over one trace: every turn's result (trace order) and the router's metrics."""

    results: list[TurnResult]
    later: list[bool]  # per result: not its conversation's first turn (a prefix can hit)
    duration_s: float
    decisions: dict[str, float]
    predictions: dict[str, float]


def run_policy(
    policy: str,
    args: argparse.Namespace,
    logs: Path,
    replicas: list[Instance],
    convs: list[list[Turn]],
    rep: int,
) -> PolicyRun:
    reset_caches(replicas)
    rt = router(logs, policy, replicas, rep)
    with Cluster([rt]):
        results, duration = asyncio.run(drive(rt.url, convs, args.max_tokens))
        decisions, predictions = router_metrics(rt.url)
        if args.keep_logs:  # every decision with its costs, hits and loads, for a post-mortem
            import httpx

            rt.log_path.with_suffix(".state.json").write_text(
                httpx.get(rt.url + "/router/state", timeout=10).text
            )
    return PolicyRun(
        results, [t.turn > 0 for c in convs for t in c], duration, decisions, predictions
    )


def summarize(policy: str, runs: list[PolicyRun]) -> PolicyResult:
    """Pool every repeat's requests: one hit rate and one TTFT distribution per policy."""
    results = [r for run in runs for r in run.results]
    later_flags = [f for run in runs for f in run.later]
    ok = [r for r in results if r.ok]
    later = [r for r, f in zip(results, later_flags) if r.ok and f]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    per_replica: dict[str, int] = {}
    for r in ok:
        per_replica[r.replica or "?"] = per_replica.get(r.replica or "?", 0) + 1

    def total(key: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for run in runs:
            for k, v in getattr(run, key).items():
                out[k] = out.get(k, 0.0) + v
        return out

    return PolicyResult(
        policy,
        len(ok),
        len(results) - len(ok),
        sorted({r.error for r in results if r.error})[:5],
        sum(run.duration_s for run in runs),
        prompt_tokens,
        cached,
        cached / prompt_tokens if prompt_tokens else 0.0,
        dist([r.ttft for r in ok if r.ttft is not None]),
        dist([r.ttft for r in later if r.ttft is not None]),
        total("decisions"),
        total("predictions"),
        per_replica,
        [per_run(run) for run in runs],
    )


def per_run(run: PolicyRun) -> dict[str, float]:
    """One repeat's hit rate and TTFT p50 (to show the spread between repeats)."""
    ok = [r for r in run.results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    return dict(
        hit_rate=sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        ttft_p50=dist([r.ttft for r in ok if r.ttft is not None])["p50"],
        duration_s=run.duration_s,
    )


# ---- report -------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    stop_on_sigterm()
    check_args(args)
    cores, note = pin_cores(3, "replicas")
    logs = Path(tempfile.mkdtemp(prefix="bench_router-"))
    report: dict[str, Any] = {
        "config": dict(
            conversations=args.conversations,
            turns=args.turns,
            system_len=args.system_len,
            user_len=args.user_len,
            reply_len=args.reply_len,
            max_tokens=args.max_tokens,
            think_s=args.think_s,
            stagger_s=args.stagger_s,
            seed=args.seed,
            repeats=args.repeats,
            num_kv_blocks=args.num_kv_blocks,
            replicas=3,
            pinning=dict(cores=cores, note=note),
            cpu_count=os.cpu_count(),
        ),
        "policies": {},
    }
    try:
        replicas = [replica(args, logs, i, cores[i]) for i in range(3)]
        log(args, "starting 3 replicas ...")
        with Cluster(replicas):
            warm_up(replicas, args)
            runs: dict[str, list[PolicyRun]] = {p: [] for p in args.policies}
            for rep in range(args.repeats):  # policies interleaved: drift hits every policy alike
                convs = make_trace(args, args.seed + rep)
                for policy in args.policies:
                    log(args, f"repeat {rep + 1}/{args.repeats}: policy {policy} ...")
                    runs[policy].append(run_policy(policy, args, logs, replicas, convs, rep))
            for policy, rs in runs.items():
                report["policies"][policy] = asdict(summarize(policy, rs))
    finally:
        if args.keep_logs:
            log(args, f"logs kept in {logs}")
        else:
            shutil.rmtree(logs, ignore_errors=True)
    pol = report["policies"]
    rr, kv = pol.get("round-robin"), pol.get("kv")
    report["ratios_vs_round_robin"] = {
        p: dict(
            hit_rate=ratio(r["hit_rate"], rr["hit_rate"]) if rr else None,
            ttft_p50_speedup=ratio(rr["ttft_s"]["p50"], r["ttft_s"]["p50"]) if rr else None,
            ttft_p99_speedup=ratio(rr["ttft_s"]["p99"], r["ttft_s"]["p99"]) if rr else None,
        )
        for p, r in pol.items()
    }
    report["targets"] = dict(hit_rate_ratio=TARGET_HIT_RATIO, ttft_p50_speedup=TARGET_TTFT_RATIO)
    met = report["ratios_vs_round_robin"].get("kv") if kv and rr else None
    report["meets_targets"] = (
        None
        if met is None
        else dict(
            hit_rate=met["hit_rate"] is not None and met["hit_rate"] >= TARGET_HIT_RATIO,
            ttft_p50=met["ttft_p50_speedup"] is not None
            and met["ttft_p50_speedup"] >= TARGET_TTFT_RATIO,
        )
    )
    return report


def table(report: dict[str, Any]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None or math.isnan(x) else f"{1000 * x:.0f}"

    def num(x: float | None, fmt: str = ".2f") -> str:
        return "-" if x is None else format(x, fmt)

    c = report["config"]
    lines = [
        f"bench_router: {c['repeats']} x {c['conversations']} conversations x {c['turns']} turns over "
        f"{c['replicas']} replicas ({c['num_kv_blocks']} KV blocks each) "
        f"(system {c['system_len']}, user {c['user_len']}, reply {c['reply_len']} tokens; "
        f"{c['max_tokens']} output tokens), {c['cpu_count']} CPUs, pinning {c['pinning']['cores']}"
        + (f" ({c['pinning']['note']})" if c["pinning"]["note"] else ""),
        "",
        f"{'policy':<12} {'ok':>3} {'fail':>4} {'hit rate':>8} {'TTFT p50':>8} {'TTFT p99':>8} "
        f"{'hit x RR':>8} {'p50 RR/x':>8} {'p99 RR/x':>8} {'pred exact':>10}  per repeat: hit / p50 ms",
    ]
    for p, r in report["policies"].items():
        rat = report["ratios_vs_round_robin"][p]
        n_pred = sum(r["predictions"].values())
        exact = f"{r['predictions'].get('exact', 0):.0f}/{n_pred:.0f}" if n_pred else "-"
        lines.append(
            f"{p:<12} {r['completed']:>3} {r['failed']:>4} {r['hit_rate']:>8.1%} {ms(r['ttft_s']['p50']):>8} "
            f"{ms(r['ttft_s']['p99']):>8} {num(rat['hit_rate']):>8} {num(rat['ttft_p50_speedup']):>8} "
            f"{num(rat['ttft_p99_speedup']):>8} {exact:>10}  "
            + ", ".join(f"{x['hit_rate']:.0%}/{ms(x['ttft_p50'])}" for x in r["repeats"])
        )
    met = report["meets_targets"]
    if met is not None:
        lines += [
            "",
            f"kv hit rate >= {TARGET_HIT_RATIO:g}x round-robin: {'met' if met['hit_rate'] else 'NOT met'}; "
            f"kv TTFT p50 >= {TARGET_TTFT_RATIO:g}x lower: {'met' if met['ttft_p50'] else 'NOT met'}",
        ]
    return "\n".join(lines)


# ---- options ------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--conversations", type=int, default=12, help="concurrent conversations (default 12)"
    )
    p.add_argument("--turns", type=int, default=5, help="turns per conversation (default 5)")
    p.add_argument("--system-len", type=int, default=32, help="system prompt tokens (default 32)")
    p.add_argument("--user-len", type=int, default=32, help="tokens per user message (default 32)")
    p.add_argument(
        "--reply-len",
        type=int,
        default=48,
        help="tokens per earlier reply in the prompt (default 48)",
    )
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per turn (default 8)")
    p.add_argument(
        "--think-s", type=float, default=2.0, help="mean think time between turns, s (default 2)"
    )
    p.add_argument(
        "--stagger-s",
        type=float,
        default=0.5,
        help="conversation starts spread over this many seconds per conversation (default 0.5)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="trace seed of the first repeat (repeat r uses seed + r; default 0)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="traces per policy, policies interleaved; figures pool every repeat's requests (default 3)",
    )
    p.add_argument(
        "--policies",
        type=lambda s: s.split(","),
        default=["kv", "round-robin", "load"],
        help="policies to run, comma-separated (default kv,round-robin,load); a kv variant "
        "with router weights: kv:overlap=2+load=0.5",
    )
    g = p.add_argument_group("engine (every replica)")
    g.add_argument(
        "--num-kv-blocks",
        type=int,
        default=96,
        help="KV pool per replica in blocks (default 96: the conversations' working set fits in the "
        "fleet's caches only when each conversation stays on one replica)",
    )
    g.add_argument(
        "--max-model-len", type=int, default=1024, help="context length cap (default 1024)"
    )
    g.add_argument("--max-num-seqs", type=int, default=8, help="max running sequences (default 8)")
    p.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep the processes' log files (and each router's /router/state)",
    )
    add_output_args(p)


def policy_choices(policies: list[str]) -> str | None:
    """None when ``pagedkv router --policy`` accepts every name in ``policies``, else the names it
    accepts (``kv, load, round-robin``). The router sits above `pagedkv.bench` in the layers, so
    its own command line answers (``--help`` exits right after the options are checked)."""
    argv = [*CLI, "router", *[f"--policy={p}" for p in policies or [""]], "--help"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if res.returncode == 0 and policies:
        return None
    m = re.search(r"choose from (.+?)\)", res.stderr)
    return m.group(1).replace("'", "") if m else res.stderr.strip()


def check_args(args: argparse.Namespace) -> None:
    if (
        min(args.conversations, args.turns, args.max_tokens, args.user_len, args.repeats) < 1
        or args.system_len < 0
    ):
        raise BenchOptionError(
            "--conversations, --turns, --max-tokens, --user-len and --repeats must be >= 1"
        )
    if args.reply_len < 0 or args.think_s < 0 or args.stagger_s < 0:
        raise BenchOptionError("--reply-len, --think-s and --stagger-s must be >= 0")
    choices = policy_choices([parse_policy(p)[0] for p in args.policies])
    if choices is not None:
        raise BenchOptionError(f"--policies: choose from {choices}")
    longest = args.system_len + args.turns * args.user_len + (args.turns - 1) * args.reply_len
    if longest + args.max_tokens > args.max_model_len:
        raise BenchOptionError(
            f"the last turn ({longest} tokens) + --max-tokens must fit in --max-model-len"
        )


def exit_code(report: dict[str, Any]) -> int:
    """1 when a request failed (the report is still printed)."""
    return 1 if any(r["failed"] for r in report["policies"].values()) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bench_router",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    return run_and_emit(run, table, p.parse_args(argv), exit_code)
