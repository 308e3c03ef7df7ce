"""Tensor / decode context parallelism on this host: capacity per rank, step time, all-reduce share.

* **Capacity** (``--cases``, default TP=1, 2, 3 and TP=6 with DCP=2 on SmolLM2-135M): each
  engine gets the same KV memory per rank (``--kv-memory``); it is sent ``planned + 2``
  requests of ``--context`` tokens (prompt + 16 generated) at once, and the benchmark records
  each rank's KV bytes (asked of the ranks), the blocks, the planned concurrency at that
  context, and the most requests it really ran at once, with its preemptions. SmolLM2 has 3
  KV heads: TP=2 holds 2 + 1, TP=3 one each, and DCP=2 needs two copies of each (TP=6).
* **Step time**: decode steps (``--batch`` requests at ``--decode-context`` tokens) of TP=1
  with every core, TP=1 with one thread, and TP=2 with one thread per rank, on the same host;
  for TP=2 the share of the step spent in the driver's collectives (all-gathers: the
  all-reduce after attention and after the MLP, the embedding's and the logits'). On one host
  TP is not expected to win: the ranks share the cores, and each collective is a round trip.
  Also the prefill of one fresh ``--prefill-tokens`` prompt on the same engines: prefill context
  parallelism would split the same work across the ranks with a KV all-gather per layer, so it
  cannot pay where TP's prefill does not.
* **Collectives**: gloo's all-reduce vs the all-gather + sum pagedkv's CPU all-reduce uses, two
  processes, one decode row of SmolLM2's hidden state.

Usage: python benchmarks/bench_parallel.py [--cases 1,2,3,6x2] [--kv-memory 128MiB]
       [--context 2048] [--batch 8] [--decode-context 256] [--prefill-tokens 1024]
       [--json-only] [--json-out F]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from typing import Any

from pagedkv.bench.common import add_output_args, emit, log, user_help
from pagedkv.core.units import parse_size

GEN_TOKENS = 16


def _case(text: str) -> tuple[int, int]:
    tp, _, dcp = text.partition("x")
    return int(tp), int(dcp or 1)


def capacity(tp: int, dcp: int, args: argparse.Namespace) -> dict[str, Any]:
    """Run ``planned + 2`` requests of ``args.context`` tokens at once; what really ran."""
    from pagedkv.core import planning
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.sampling_params import SamplingParams

    ctx = args.context
    llm = LLM(
        kv_cache_memory=args.kv_memory,
        max_model_len=ctx,
        max_num_batched_tokens=ctx,
        tensor_parallel_size=tp,
        decode_context_parallel_size=dcp,
        max_num_seqs=256,
    )
    engine = llm.llm_engine
    try:
        kc = engine.kv_cache_config
        planned = planning.get_max_concurrency(kc.num_blocks, kc.kv_cache_groups, ctx, ctx)
        n = int(planned) + 2
        params = SamplingParams(max_tokens=GEN_TOKENS, temperature=0, ignore_eos=True)
        vocab = engine.model_config.vocab_size
        for i in range(n):
            prompt = [(7919 * i + 31 * j) % (vocab - 1) + 1 for j in range(ctx - GEN_TOKENS)]
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        peak, start = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, engine.scheduler.num_running)
        return dict(
            tensor_parallel_size=tp,
            decode_context_parallel_size=dcp,
            kv_cache_bytes_per_rank=engine.executor.kv_cache_bytes(),
            num_blocks=kc.num_blocks,
            scheduler_block_size=engine.block_size,
            usable_kv_tokens=engine.num_usable_kv_tokens,
            planned_max_concurrency=planned,
            requests_sent=n,
            max_running_at_once=peak,
            preemptions=engine.scheduler.num_preemptions,
            seconds=time.perf_counter() - start,
        )
    finally:
        engine.shutdown()


def step_time(tp: int, threads: int | None, args: argparse.Namespace) -> dict[str, Any]:
    """Median decode step of ``args.batch`` requests at ``args.decode_context`` tokens, and the
    driver's collective share of it."""
    import torch

    from pagedkv.engine.llm import LLM
    from pagedkv.engine.sampling_params import SamplingParams

    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    llm = LLM(kv_cache_memory=256 << 20, max_model_len=2048, tensor_parallel_size=tp)
    engine = llm.llm_engine
    try:
        steps = args.steps
        params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
        for i in range(args.batch):
            prompt = [(13 * i + j) % 40000 + 10 for j in range(args.decode_context)]
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        while engine.scheduler.num_waiting or any(
            not r.output_token_ids for r in engine.scheduler.running
        ):
            engine.step()  # prefill (and the first token) of every request
        par = engine.executor.driver.parallel
        groups = [] if par is None else [par.tp_group, par.dcp_group]
        times, comm, calls = [], [], []
        for _ in range(steps):
            c0, n0 = sum(g.comm_seconds for g in groups), sum(g.comm_calls for g in groups)
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
            comm.append(sum(g.comm_seconds for g in groups) - c0)
            calls.append(sum(g.comm_calls for g in groups) - n0)
        med = statistics.median(times)
        for r in list(engine.scheduler.running) + list(engine.scheduler.waiting):
            engine.abort_request(r.request_id)
        prefill_s = _prefill_seconds(engine, args.prefill_tokens)
        return dict(
            prefill_tokens=args.prefill_tokens,
            prefill_ms=prefill_s * 1e3,
            prefill_tok_s=args.prefill_tokens / prefill_s,
            tensor_parallel_size=tp,
            torch_threads_per_rank=torch.get_num_threads(),
            batch=args.batch,
            context=args.decode_context,
            median_step_ms=med * 1e3,
            decode_tok_s=args.batch / med,
            collective_ms_per_step=statistics.median(comm) * 1e3,
            collective_share=statistics.median(c / t for c, t in zip(comm, times)),
            collectives_per_step=statistics.median(calls),
        )
    finally:
        engine.shutdown()
        torch.set_num_threads(saved)


def _prefill_seconds(engine: Any, n: int, reps: int = 3) -> float:
    """Median time from adding one fresh ``n``-token prompt to its first token (chunked prefill
    at the engine's token budget; a new prompt each time, so no prefix hit)."""
    from pagedkv.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0)
    times = []
    for k in range(reps):
        prompt = [(7 * j + 1000 * (k + 1)) % 40000 + 10 for j in range(n)]
        t0 = time.perf_counter()
        engine.add_request(f"prefill-{k}", {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


_COLLECTIVES = """
import json, sys, time, torch
from pagedkv.distributed.parallel_state import GroupCoordinator, make_store
rank, url, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
torch.set_num_threads(1)
g = GroupCoordinator.create(make_store(url, rank, 2, 60.0), rank, 2)
g.connect()
x = torch.randn(1, 576)
out = {}
for name, fn in (("gloo_allreduce", lambda: g.pg.allreduce([x]).wait()),
                 ("allgather_and_sum", lambda: g.all_reduce(x))):
    for _ in range(50):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    out[name + "_us"] = (time.perf_counter() - t0) / n * 1e6
if rank == 0:
    print(json.dumps(out))
"""


def collectives(iters: int = 2000) -> dict[str, Any]:
    """Two processes, one [1, 576] float32 tensor (a decode row of SmolLM2's hidden state):
    gloo's own all-reduce vs the all-gather + sum `GroupCoordinator.all_reduce` uses."""
    import subprocess
    import sys

    from pagedkv.distributed.parallel_state import get_open_port

    url = f"tcp://127.0.0.1:{get_open_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _COLLECTIVES, str(r), url, str(iters)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        out = procs[0].communicate(timeout=300)[0]
        procs[1].wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=user_help(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--cases", default="1,2,3,6x2", help="TP[xDCP] list (default 1,2,3,6x2)")
    ap.add_argument("--kv-memory", type=parse_size, default=128 << 20, help="KV bytes per rank")
    ap.add_argument("--context", type=int, default=2048, help="tokens per request (capacity)")
    ap.add_argument("--batch", type=int, default=8, help="decode batch (step time)")
    ap.add_argument("--decode-context", type=int, default=256, help="context of the decode batch")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps")
    ap.add_argument("--prefill-tokens", type=int, default=1024, help="prompt of the timed prefill")
    ap.add_argument("--skip-capacity", action="store_true")
    add_output_args(ap)
    args = ap.parse_args(argv)
    cases = [_case(c) for c in args.cases.split(",")]
    report: dict[str, Any] = dict(
        host_cores=os.cpu_count(),
        kv_memory_per_rank=args.kv_memory,
        context=args.context,
        capacity=[],
        step_time=[],
    )
    if not args.skip_capacity:
        for tp, dcp in cases:
            log(args, f"capacity: TP={tp} DCP={dcp}")
            report["capacity"].append(capacity(tp, dcp, args))
    for tp, threads in ((1, None), (1, 1), (2, None)):
        gc.collect()
        time.sleep(3.0)  # the previous engine's processes are gone; let the host settle
        log(args, f"step time: TP={tp} threads={threads or 'all'}")
        report["step_time"].append(step_time(tp, threads, args))
    log(args, "collectives: gloo all-reduce vs all-gather + sum")
    report["collectives"] = collectives()
    base = report["step_time"][0]["median_step_ms"]
    base_prefill = report["step_time"][0]["prefill_ms"]
    for r in report["step_time"]:
        r["step_time_vs_tp1_all_cores"] = r["median_step_ms"] / base
        r["prefill_time_vs_tp1_all_cores"] = r["prefill_ms"] / base_prefill

    def table(rep: dict[str, Any]) -> str:
        rows = [
            f"capacity at {rep['context']} tokens/request, "
            f"{rep['kv_memory_per_rank'] / 2**20:.0f} MiB KV per rank",
            f"{'TP':>3s} {'DCP':>3s} {'KV MiB per rank':>22s} {'blocks':>7s} {'tokens':>7s} "
            f"{'planned':>8s} {'ran at once':>11s} {'preempt':>7s}",
        ]
        for c in rep["capacity"]:
            per = "/".join(f"{b / 2**20:.0f}" for b in c["kv_cache_bytes_per_rank"])
            rows.append(
                f"{c['tensor_parallel_size']:>3d} {c['decode_context_parallel_size']:>3d} "
                f"{per:>22s} {c['num_blocks']:>7d} {c['usable_kv_tokens']:>7d} "
                f"{c['planned_max_concurrency']:>8.2f} {c['max_running_at_once']:>11d} "
                f"{c['preemptions']:>7d}"
            )
        rows.append("")
        rows.append(
            f"decode step, batch {args.batch} at {args.decode_context} tokens; "
            f"prefill of one {args.prefill_tokens}-token prompt"
        )
        rows.append(
            f"{'TP':>3s} {'threads/rank':>12s} {'ms/step':>8s} {'tok/s':>7s} {'vs TP1':>7s} "
            f"{'collectives':>12s} {'prefill ms':>10s} {'vs TP1':>7s}"
        )
        for r in rep["step_time"]:
            rows.append(
                f"{r['tensor_parallel_size']:>3d} {r['torch_threads_per_rank']:>12d} "
                f"{r['median_step_ms']:>8.1f} {r['decode_tok_s']:>7.1f} "
                f"{r['step_time_vs_tp1_all_cores']:>6.2f}x {r['collective_share']:>11.0%} "
                f"{r['prefill_ms']:>10.0f} {r['prefill_time_vs_tp1_all_cores']:>6.2f}x"
            )
        c = rep["collectives"]
        rows.append("")
        rows.append(
            f"2 processes, [1, 576] float32: gloo all-reduce {c['gloo_allreduce_us']:.0f} µs, "
            f"all-gather + sum {c['allgather_and_sum_us']:.0f} µs"
        )
        return "\n".join(rows)

    emit(report, table, args)
    return 0
