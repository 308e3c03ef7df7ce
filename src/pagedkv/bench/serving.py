"""Online serving benchmark: Poisson arrivals against ``pagedkv serve``, a saturation run, and
offline ``LLM.generate`` on the same requests in the same run.

Workload: ``--num-requests`` completions per run, each a token-id prompt of ``--input-len``
tokens whose first ``--prefix-len`` tokens are one of ``--num-prefixes`` shared prefixes (so
the prefix cache has something to hit), greedy, ``ignore_eos`` and exactly ``--output-len``
new tokens, streamed (SSE). Every run draws fresh random tokens and the server's prefix cache
is reset before it, so no run profits from an earlier one.

Runs:

1. ``rate=R``: requests arrive as a Poisson process of ``--request-rate`` R per second;
2. ``saturation``: all requests at once (skip with ``--no-saturation``), ``--repeats`` times;
3. offline: right after each saturation run, an ``LLM`` with the same engine options (loaded
   and warmed up in this process before the server starts) runs ``generate`` on the same
   requests while the server sits idle, so both see the same background load. The report gives server
   output-token throughput / offline over all repeats (target >= 0.9: serving costs at most
   10%), and the ratio of each repeat.

Per run: request and token throughput, TTFT, inter-token latency (per token: the gap between
two streamed chunks divided by the tokens the later one carries, from
``stream_options.continuous_usage_stats``) and end-to-end latency (p50 / p99 / mean), and the
prefix-cache hit rate in tokens (from the server's ``/metrics``).

By default the server is started as a subprocess (``pagedkv serve --port 0`` plus the engine
flags below); ``--base-url`` benchmarks a running server instead (then the engine flags must
match it for the offline comparison to be fair).

Usage: pagedkv bench serve [--num-requests 48] [--request-rate 4] [--json-out FILE]
       (same as python benchmarks/bench_serving.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pagedkv.bench.common import BenchOptionError, add_output_args, run_and_emit

TARGET_RATIO = 0.9

DESCRIPTION = """\
Online serving benchmark, like 'vllm bench serve': streamed completions against 'pagedkv serve'
(started for the run, or a running one with --base-url) at a Poisson request rate, then all at
once (saturation), then the same requests offline through LLM.generate in the same process,
for the cost of serving. Reports request and token throughput, time to first token,
inter-token latency and end-to-end latency (p50 / p99 / mean), and the prefix-cache hit rate.

Each prompt is --input-len random token ids whose first --prefix-len are one of --num-prefixes
shared prefixes; every request generates exactly --output-len tokens. Progress goes to
standard error; standard output holds the table and the JSON report.
"""
TOKEN_RANGE = (1000, 40000)  # ordinary BPE tokens, no special ones


# ---- workload -------------------------------------------------------------------------------------


def make_workload(
    seed: int, n: int, input_len: int, prefix_len: int, num_prefixes: int
) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(*TOKEN_RANGE) for _ in range(prefix_len)]
        for _ in range(max(num_prefixes, 1))
    ]
    return [
        prefixes[i % len(prefixes)]
        + [rng.randrange(*TOKEN_RANGE) for _ in range(input_len - prefix_len)]
        for i in range(n)
    ]


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def dist(xs: list[float]) -> dict[str, float]:
    return dict(
        p50=percentile(xs, 50),
        p99=percentile(xs, 99),
        mean=statistics.fmean(xs) if xs else float("nan"),
    )


# ---- client -----------------------------------------------------------------------------------------


async def one_request(
    client: Any, prompt: list[int], output_len: int, model: str
) -> dict[str, Any]:
    payload = dict(
        model=model,
        prompt=prompt,
        max_tokens=output_len,
        temperature=0.0,
        ignore_eos=True,
        stream=True,
        stream_options=dict(include_usage=True, continuous_usage_stats=True),
    )
    t0 = time.perf_counter()
    ttft = None
    itl: list[float] = []
    last_t = t0
    last_tokens = 0
    tokens = 0
    error = None
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = chunk["error"]["message"]
                        break
                    usage = chunk.get("usage") or {}
                    tokens = usage.get("completion_tokens", tokens)
                    if not chunk.get("choices") or tokens == last_tokens:
                        continue
                    now = time.perf_counter()
                    new = tokens - last_tokens
                    if ttft is None:
                        ttft = now - t0
                    else:
                        itl.extend([(now - last_t) / new] * new)
                    last_t, last_tokens = now, tokens
    except Exception as e:
        error = repr(e)
    return dict(ttft=ttft, itl=itl, e2e=time.perf_counter() - t0, output_tokens=tokens, error=error)


def scrape(http: Any, base_url: str) -> dict[str, float]:
    out = {}
    for line in http.get(base_url + "/metrics").text.splitlines():
        for name in ("prefix_cache_queries_total", "prefix_cache_hits_total"):
            if line.startswith(f"pagedkv:{name}"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


async def run_load(
    base_url: str, prompts: list[list[int]], output_len: int, rate: float, seed: int, model: str
) -> dict[str, Any]:
    import httpx

    rng = random.Random(seed)
    limits = httpx.Limits(
        max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4
    )
    async with httpx.AsyncClient(
        base_url=base_url, timeout=httpx.Timeout(600.0), limits=limits
    ) as client:
        tasks = []
        cpu0 = time.process_time()
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            if math.isfinite(rate) and i > 0:
                await asyncio.sleep(rng.expovariate(rate))
            tasks.append(asyncio.ensure_future(one_request(client, prompt, output_len, model)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        client_cpu = time.process_time() - cpu0
    return dict(results=results, duration=duration, client_cpu=client_cpu)


def summarize(
    name: str,
    rate: float,
    prompts: list[list[int]],
    load: dict[str, Any],
    before: dict[str, float],
    after: dict[str, float],
) -> dict[str, Any]:
    res = load["results"]
    ok = [r for r in res if r["error"] is None]
    dur = load["duration"]
    out_tok = sum(r["output_tokens"] for r in ok)
    in_tok = sum(len(p) for p, r in zip(prompts, res) if r["error"] is None)
    dq = after.get("prefix_cache_queries_total", 0) - before.get("prefix_cache_queries_total", 0)
    dh = after.get("prefix_cache_hits_total", 0) - before.get("prefix_cache_hits_total", 0)
    return dict(
        name=name,
        request_rate=rate if math.isfinite(rate) else "inf",
        completed=len(ok),
        failed=len(res) - len(ok),
        errors=sorted({r["error"] for r in res if r["error"]})[:3],
        duration_s=dur,
        input_tokens=in_tok,
        output_tokens=out_tok,
        request_throughput=len(ok) / dur,
        output_token_throughput=out_tok / dur,
        total_token_throughput=(in_tok + out_tok) / dur,
        ttft_s=dist([r["ttft"] for r in ok if r["ttft"] is not None]),
        itl_s=dist([x for r in ok for x in r["itl"]]),
        e2e_s=dist([r["e2e"] for r in ok]),
        prefix_hit_rate=dh / dq if dq else 0.0,
        client_cpu_s=load.get("client_cpu"),
        server_cpu_s=load.get("server_cpu"),
        server_cpu_by_thread_s=load.get("server_cpu_threads"),
    )


# ---- server process ------------------------------------------------------------------------------


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = [
        "--dtype",
        args.dtype,
        "--block-size",
        str(args.block_size),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
    ]
    if args.num_kv_blocks:
        flags += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.max_model_len:
        flags += ["--max-model-len", str(args.max_model_len)]
    if args.model:
        flags += ["--model", args.model]
    return flags


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        dtype=args.dtype,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
    )


class ServerProcess:
    def __init__(self, args: argparse.Namespace) -> None:
        cmd = [
            sys.executable,
            "-m",
            "pagedkv.entrypoints.cli",
            "serve",
            "--port",
            "0",
            "--max-queue-size",
            str(max(args.num_requests, 1)),
            *engine_flags(args),
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.url = None
        self.log: list[str] = []
        deadline = time.monotonic() + 300
        while self.url is None and time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.log.append(line)
            if "listening on" in line:
                self.url = line.split()[-1]
        if self.url is None:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.log[-20:]))
        threading.Thread(target=self._drain, daemon=True).start()

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system, all threads) the server process used so far."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def cpu_by_thread(self) -> dict[str, float] | None:
        """CPU time (user + system) the server's live threads used so far, by OS name: the
        main thread (the HTTP event loop) is ``main``; the engine thread names itself
        ``pagedkv-engine``, and the OpenMP workers it starts inherit that name. None once the
        process is gone (or off Linux)."""
        tick = os.sysconf("SC_CLK_TCK")
        by_name: dict[str, float] = {}
        try:
            tasks = list(Path(f"/proc/{self.proc.pid}/task").iterdir())
        except OSError:
            return None
        for task in tasks:
            try:
                name = (task / "comm").read_text().strip()
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # the thread ended between the listing and the read
                continue
            name = "main" if task.name == str(self.proc.pid) else name
            by_name[name] = by_name.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
        return by_name

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# ---- main ------------------------------------------------------------------------------------------


def offline_run(llm: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    from pagedkv import SamplingParams

    llm.reset_prefix_cache()  # like the server's reset before each run
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    dur = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    out_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tok = sum(len(p) for p in prompts)
    return dict(
        duration_s=dur,
        output_tokens=out_tok,
        output_token_throughput=out_tok / dur,
        total_token_throughput=(in_tok + out_tok) / dur,
        request_throughput=len(prompts) / dur,
        cpu_s=cpu,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark; BenchOptionError for inconsistent options."""
    import httpx

    check_args(args)

    log = (
        (lambda msg: None)
        if args.json_only
        else (lambda msg: print(msg, file=sys.stderr, flush=True))
    )
    offline = not args.no_saturation and not args.no_offline
    llm = None
    if offline:
        from pagedkv import LLM

        log("loading the offline LLM ...")
        llm = LLM(args.model, **engine_kwargs(args))
        # Warm-up on a workload of the same shape (the server gets the rate run as its warm-up):
        # the first batches of new sizes pay one-time kernel selection and allocation costs.
        offline_run(
            llm,
            make_workload(
                args.seed + 10_000,
                args.num_requests,
                args.input_len,
                args.prefix_len,
                args.num_prefixes,
            ),
            min(args.output_len, 8),
        )
    server = None
    if args.base_url:
        base_url = args.base_url.rstrip("/")
    else:
        log("starting pagedkv serve ...")
        server = ServerProcess(args)
        base_url = server.url
    runs: list[dict[str, Any]] = []
    offline_runs: list[dict[str, Any]] = []
    plan = [(f"rate={args.request_rate:g}", args.request_rate)]
    if not args.no_saturation:
        plan += [
            ("saturation" if args.repeats == 1 else f"saturation {k + 1}/{args.repeats}", math.inf)
            for k in range(args.repeats)
        ]
    try:
        with httpx.Client(timeout=60) as http:
            model = http.get(base_url + "/v1/models").json()["data"][0]["id"]
            # Warm-up (first-call allocations), outside the measurements.
            http.post(
                base_url + "/v1/completions",
                json=dict(model=model, prompt=[1000, 1001, 1002], max_tokens=2),
            )
            for k, (name, rate) in enumerate(plan):
                prompts = make_workload(
                    args.seed + 1 + k,
                    args.num_requests,
                    args.input_len,
                    args.prefix_len,
                    args.num_prefixes,
                )
                http.post(base_url + "/reset_prefix_cache")
                before = scrape(http, base_url)
                log(f"run {name}: {len(prompts)} requests ...")
                cpu0 = server.cpu_seconds() if server is not None else None
                threads0 = server.cpu_by_thread() if server is not None else None
                load = asyncio.run(
                    run_load(base_url, prompts, args.output_len, rate, args.seed + k, model)
                )
                failed = sum(r["error"] is not None for r in load["results"])
                log(
                    f"run {name}: done in {load['duration']:.1f} s ({len(prompts) - failed} ok, {failed} failed)"
                )
                cpu1 = server.cpu_seconds() if server is not None else None
                load["server_cpu"] = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
                threads1 = server.cpu_by_thread() if server is not None else None
                if threads0 is not None and threads1 is not None:
                    # Threads that ended during the run are missing here (not from the total).
                    load["server_cpu_threads"] = {
                        k: v - threads0.get(k, 0.0) for k, v in sorted(threads1.items())
                    }
                runs.append(summarize(name, rate, prompts, load, before, scrape(http, base_url)))
                if llm is not None and math.isinf(rate):
                    # The same requests offline, right after, while the server sits idle (its
                    # threads wait on a condition): both see the same background load.
                    log("offline LLM.generate on the same requests ...")
                    offline_runs.append(offline_run(llm, prompts, args.output_len))
    finally:
        if server is not None:
            server.stop()
    report: dict[str, Any] = dict(
        config=dict(
            num_requests=args.num_requests,
            request_rate=args.request_rate,
            input_len=args.input_len,
            prefix_len=args.prefix_len,
            num_prefixes=args.num_prefixes,
            output_len=args.output_len,
            repeats=args.repeats,
            seed=args.seed,
            engine=engine_kwargs(args),
            cpu_count=os.cpu_count(),
            server="external" if args.base_url else "subprocess",
        ),
        runs=runs,
    )
    if offline_runs:
        sat = [r for r in runs if r["name"].startswith("saturation")]
        off_tok = sum(o["output_tokens"] for o in offline_runs)
        off_dur = sum(o["duration_s"] for o in offline_runs)
        in_tok = sum(r["input_tokens"] for r in sat)
        report["offline"] = dict(
            duration_s=off_dur,
            output_tokens=off_tok,
            output_token_throughput=off_tok / off_dur,
            total_token_throughput=(in_tok + off_tok) / off_dur,
            request_throughput=args.num_requests * len(offline_runs) / off_dur,
        )
        report["offline_runs"] = offline_runs
        server_tps = sum(r["output_tokens"] for r in sat) / sum(r["duration_s"] for r in sat)
        ratio = server_tps / report["offline"]["output_token_throughput"]
        report["saturation_vs_offline"] = ratio
        report["saturation_vs_offline_per_repeat"] = [
            r["output_token_throughput"] / o["output_token_throughput"]
            for r, o in zip(sat, offline_runs)
        ]
        report["target"] = TARGET_RATIO
        report["meets_target"] = ratio >= TARGET_RATIO
    return report


def table(report: dict[str, Any]) -> str:
    def ms(x: float) -> str:
        return "-" if math.isnan(x) else f"{1000 * x:.0f}"

    c = report["config"]
    lines = [
        f"bench_serving: {c['num_requests']} requests/run, input {c['input_len']} tokens "
        f"({c['prefix_len']} shared across {c['num_prefixes']} prefixes), output {c['output_len']} tokens, "
        f"{c['cpu_count']} CPUs",
        "",
        f"{'run':<12} {'ok':>4} {'req/s':>7} {'out tok/s':>10} {'tot tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8} {'E2E p50':>8} {'hit rate':>8}",
        f"{'':<12} {'':>4} {'':>7} {'':>10} {'':>10} {'(ms)':>9} {'(ms)':>9} {'(ms)':>8} {'(ms)':>8} {'(ms)':>8} {'':>8}",  # noqa: E501
    ]
    for r in report["runs"]:
        lines.append(
            f"{r['name']:<12} {r['completed']:>4} {r['request_throughput']:>7.2f} "
            f"{r['output_token_throughput']:>10.1f} {r['total_token_throughput']:>10.1f} "
            f"{ms(r['ttft_s']['p50']):>9} {ms(r['ttft_s']['p99']):>9} {ms(r['itl_s']['p50']):>8} "
            f"{ms(r['itl_s']['p99']):>8} {ms(r['e2e_s']['p50']):>8} {100 * r['prefix_hit_rate']:>7.1f}%"
        )
    for r in report["runs"]:
        if r.get("server_cpu_by_thread_s"):
            split = ", ".join(
                f"{k} {v:.1f}" for k, v in r["server_cpu_by_thread_s"].items() if v >= 0.05
            )
            lines.append(f"server CPU s by thread, {r['name']}: {split}")
    off = report.get("offline")
    if off:
        lines.append(
            f"{'offline':<12} {c['num_requests']:>4} {off['request_throughput']:>7.2f} "
            f"{off['output_token_throughput']:>10.1f} {off['total_token_throughput']:>10.1f}"
        )
        lines.append("")
        per = ", ".join(f"{x:.3f}" for x in report["saturation_vs_offline_per_repeat"])
        lines.append(
            f"saturation / offline output-token throughput: {report['saturation_vs_offline']:.3f} "
            f"(per repeat: {per}; target >= {report['target']}: "
            f"{'met' if report['meets_target'] else 'NOT met'})"
        )
    return "\n".join(lines)


def positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return x


def positive_int(text: str) -> int:
    try:
        x = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if x < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return x


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags (no heavy imports)."""
    p.add_argument(
        "--base-url", default=None, help="benchmark this running server instead of starting one"
    )
    p.add_argument(
        "--num-requests", type=positive_int, default=48, help="requests per run (default 48)"
    )
    p.add_argument(
        "--request-rate",
        type=positive_float,
        default=4.0,
        help="Poisson arrival rate, req/s (default 4)",
    )
    p.add_argument("--input-len", type=positive_int, default=96, help="prompt tokens (default 96)")
    p.add_argument(
        "--prefix-len",
        type=int,
        default=64,
        help="shared prefix tokens of each prompt (default 64)",
    )
    p.add_argument(
        "--num-prefixes", type=positive_int, default=4, help="distinct shared prefixes (default 4)"
    )
    p.add_argument(
        "--output-len",
        type=positive_int,
        default=32,
        help="generated tokens per request (default 32)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument(
        "--no-saturation", action="store_true", help="skip the saturation run (and offline)"
    )
    p.add_argument(
        "--no-offline", action="store_true", help="skip the offline LLM.generate comparison"
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="saturation runs, each followed by offline on the same requests (default 1)",
    )
    from pagedkv.engine.arg_utils import EngineArgs
    from pagedkv.engine.config import FLOAT_DTYPES

    sizes = (
        "block_size",
        "num_kv_blocks",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
    )
    g = p.add_argument_group("engine (server and offline)")
    EngineArgs.add_cli_args(
        g,
        include=("model", "dtype", *sizes),
        overrides={
            "dtype": dict(choices=FLOAT_DTYPES),
            **{name: dict(type=positive_int) for name in sizes},
        },
    )
    add_output_args(p)


def check_args(args: argparse.Namespace) -> None:
    if not 0 <= args.prefix_len <= args.input_len:
        raise BenchOptionError("--prefix-len must be in [0, --input-len]")


def exit_code(report: dict[str, Any]) -> int:
    """1 when any request failed (the report is still printed)."""
    return 1 if sum(r["failed"] for r in report["runs"]) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bench_serving",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    return run_and_emit(run, table, p.parse_args(argv), exit_code)


if __name__ == "__main__":
    sys.exit(main())
