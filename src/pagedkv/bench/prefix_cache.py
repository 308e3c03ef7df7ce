"""Prefix caching: time to first token with a shared system prompt, caching on vs off.

Workload (fixed seed): ``--num-requests`` (32) requests, each a ``--prefix-len`` (1,024)-token
system prompt shared by all of them followed by a distinct ``--question-len`` (16:48)-token
question; ``--max-tokens`` (4) greedy output tokens each. Token ids are random draws from the
vocabulary (the same ids for both engines).

Two engines with identical settings except ``enable_prefix_caching`` run the same requests
one after another: request i+1 is sent only after request i has finished, so every TTFT is
the latency of one prefill on an idle engine (queueing behind other requests would measure the
scheduler, not the cache). The two engines alternate request by request, so background load on
this shared machine hits both alike. The first request is excluded from the statistics: it is
the one that fills the cache. Each engine first serves one unrelated warm-up request.

Reports TTFT p50 / mean for both, the speedup (off / on, target >= 5x at p50) and the cached
prompt tokens per request.

Usage: python benchmarks/bench_prefix_cache.py [--num-requests N] [--prefix-len N] [--json-only]
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from pagedkv.bench.common import (
    BenchOptionError,
    add_output_args,
    int_range,
    log,
    random_token_ids,
    ratio,
    run_and_emit,
    summary,
    user_help,
)

TARGET_SPEEDUP = 5.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pagedkv.engine.arg_utils import EngineArgs
    from pagedkv.engine.config import FLOAT_DTYPES

    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=1024, help="shared system-prompt tokens")
    p.add_argument("--question-len", type=int_range, default=(16, 48), metavar="MIN:MAX")
    p.add_argument("--max-tokens", type=int, default=4, help="output tokens per request")
    EngineArgs.add_cli_args(
        p,
        include=("block_size", "dtype", "model"),
        overrides=dict(dtype=dict(choices=FLOAT_DTYPES)),
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    add_output_args(p)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.num_requests < 2 or args.prefix_len < 1 or args.max_tokens < 1 or args.block_size < 1:
        raise BenchOptionError(
            "need --num-requests >= 2 and positive --prefix-len, --max-tokens, --block-size"
        )
    from pagedkv import LLM, SamplingParams
    from pagedkv.models.config import load_model_config

    vocab = load_model_config(args.model).vocab_size
    rng = random.Random(args.seed)
    prefix = random_token_ids(rng, args.prefix_len, vocab)
    prompts = [
        prefix + random_token_ids(rng, rng.randint(*args.question_len), vocab)
        for _ in range(args.num_requests)
    ]
    warmup = random_token_ids(rng, 32, vocab)
    longest = args.prefix_len + args.question_len[1] + args.max_tokens
    # Room for the cached prefix plus one live request: the cache is never under eviction
    # pressure, so the figure is the cache's speedup, not its eviction policy.
    blocks = 2 * (-(-longest // args.block_size)) + 2
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    engines = {}
    for name, caching in (("on", True), ("off", False)):
        log(args, f"loading the engine with prefix caching {name} ...")
        llm = LLM(
            model=args.model,
            dtype=args.dtype,
            block_size=args.block_size,
            num_kv_blocks=blocks,
            max_model_len=longest,
            enable_prefix_caching=caching,
        )
        llm.generate({"prompt_token_ids": warmup}, params, use_tqdm=False)
        llm.reset_prefix_cache()
        engines[name] = llm
    ttft: dict[str, list[float]] = {"on": [], "off": []}
    cached: dict[str, list[int]] = {"on": [], "off": []}
    log(args, f"{args.num_requests} requests, one after another, alternating engines ...")
    for p in prompts:
        for name, llm in engines.items():
            (o,) = llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)
            ttft[name].append(o.metrics.time_to_first_token)
            cached[name].append(o.num_cached_tokens)
    res: dict[str, Any] = {}
    measured_tokens = sum(map(len, prompts[1:]))
    for name in engines:
        res[name] = dict(
            ttft_s=summary(ttft[name][1:]),
            first_request_ttft_s=ttft[name][0],
            mean_cached_tokens=sum(cached[name][1:]) / (len(prompts) - 1),
            hit_rate=sum(cached[name][1:]) / measured_tokens,
        )
    speedup = {k: ratio(res["off"]["ttft_s"][k], res["on"]["ttft_s"][k]) for k in ("p50", "mean")}
    return dict(
        benchmark="prefix_cache",
        dtype=args.dtype,
        workload=dict(
            num_requests=args.num_requests,
            prefix_len=args.prefix_len,
            question_len=list(args.question_len),
            max_tokens=args.max_tokens,
            block_size=args.block_size,
            seed=args.seed,
            num_kv_blocks=blocks,
            order="sequential (request i+1 sent after request i finished), engines alternating",
            excluded="first request (fills the cache)",
        ),
        caching_on=res["on"],
        caching_off=res["off"],
        speedup=speedup,
        target_speedup=TARGET_SPEEDUP,
        meets_target=(speedup["p50"] or 0) >= TARGET_SPEEDUP,
    )


def table(r: dict[str, Any]) -> str:
    w, on, off, sp = r["workload"], r["caching_on"], r["caching_off"], r["speedup"]
    return "\n".join(
        [
            f"workload: {w['num_requests']} requests = {w['prefix_len']}-token shared prefix + "
            f"{w['question_len'][0]}-{w['question_len'][1]}-token question, {w['max_tokens']} output tokens, "
            f"{r['dtype']}, block {w['block_size']}; sequential; first request excluded",
            "",
            f"{'TTFT (ms)':24s}{'caching on':>12s}{'caching off':>13s}{'speedup':>10s}",
            f"{'p50':24s}{on['ttft_s']['p50'] * 1e3:12.1f}{off['ttft_s']['p50'] * 1e3:13.1f}{sp['p50']:9.2f}x"
            f"   target >= {r['target_speedup']:.0f}x",
            f"{'mean':24s}{on['ttft_s']['mean'] * 1e3:12.1f}{off['ttft_s']['mean'] * 1e3:13.1f}{sp['mean']:9.2f}x",
            f"{'first request':24s}{on['first_request_ttft_s'] * 1e3:12.1f}{off['first_request_ttft_s'] * 1e3:13.1f}",
            f"{'cached tokens/request':24s}{on['mean_cached_tokens']:12.0f}{off['mean_cached_tokens']:13.0f}",
            f"{'prompt tokens cached':24s}{on['hit_rate']:12.1%}{off['hit_rate']:13.1%}",
            f"meets target: {r['meets_target']}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=user_help(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    return run_and_emit(run, table, p.parse_args(argv))
