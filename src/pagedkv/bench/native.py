"""Native CPU kernels (ops/csrc/) against the torch paths they replace, same run.

* GEMV: SmolLM2-135M's projections (its GGUF's own Q4_1 rows; the tied Q8_0 LM head) at
  ``M`` rows: ``native.gemv_q`` on the ggml blocks vs ``F.linear`` on the float32 weights.
  Eight copies of each weight rotate so reads come from DRAM, as in a decode step. This picks
  ``NATIVE_GEMV_MAX_ROWS`` (models/layers.py): the largest M where native still wins.
* The K-quants (Q4_K, Q6_K) on a synthetic 2048 x 2048 weight, same comparison.
* Decode attention: one step of 30 layers (each its own cold KV cache, LBNHC, block 16, fp32,
  Hq=9, Hkv=3, D=64) for 1, 8 and 64 sequences: ``native.paged_decode`` vs the torch path
  (gather + fused flash kernel), best of interleaved rounds.
* Batch-1 GEMV against this run's ceilings: every SmolLM2 projection shape (q/o 576x576, k/v
  192x576, up/gate 1536x576, down 576x1536, the 49152x576 LM head) at M = 1, with enough weight
  copies rotating that ~96 MB stream between reuses (as in a decode step), reported as GFLOP/s
  and GB/s of weight bytes beside the fp32 FMA peak (``torch.mm`` of cached 256x256 matrices)
  and the memory bandwidth over the same 96 MB (the better of a copy, read + write bytes, and a
  read), both measured in the same run;
  ``ceiling_frac`` is the time the binding ceiling allows over the measured (CPU-time) median.
  On a loaded machine run it with ``OMP_NUM_THREADS=1 taskset -c 0`` for steady figures.
* The same GEMVs inside the native decode step (``step_gemv``): a batch-1 greedy decode of the
  default model (float32), timed by the kernel's own section clocks (`native_step.StepProfile`:
  the QKV, O, gate/up (+ SiLU) and down sections, thread 0's clock, each including its closing
  barrier). All 30 layers' projections run in one call, without the per-call wrapper, and their
  66 MB stream from memory every token (with the 28 MB LM head, more than the L3). Reported:
  GB/s of projection weight bytes and the fraction of the same-run bandwidth ceiling.

Usage: python benchmarks/bench_native.py [--rounds N] [--m1-only] [--step-tokens 64] [--json-only]
       [--json-out FILE]
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from pagedkv.bench.attention import BS, HKV, HQ, LAYERS, D, make_metadata, time_rounds
from pagedkv.bench.common import add_output_args, run_and_emit
from pagedkv.ops import attention as attention_mod
from pagedkv.ops import native
from pagedkv.ops.kv_cache import allocate_kv_cache

GEMV_ROWS = (1, 4, 8, 16, 32, 48, 64)
TENSORS = (
    "blk.0.attn_q.weight",
    "blk.0.ffn_up.weight",
    "blk.0.ffn_down.weight",
    "token_embd.weight",
)
M1_TENSORS = (
    "blk.0.attn_q.weight",
    "blk.0.attn_k.weight",
    "blk.0.ffn_up.weight",
    "blk.0.ffn_down.weight",
    "token_embd.weight",
)
STREAM_BYTES = (
    96 << 20
)  # weight bytes rotating through the batch-1 GEMV (a decode step streams ~80 MB)


def best_ms(fn: Callable[[int], object], rounds: int, copies: int = 8) -> float:
    for i in range(copies):
        fn(i)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for i in range(copies):
            fn(i)
        best = min(best, (time.perf_counter() - t) / copies)
    return best * 1e3


def bench_gemv(rounds: int) -> list[dict[str, Any]]:
    from pagedkv.models.gguf_loader import dequantize, read_gguf
    from pagedkv.models.loader import resolve_model_path

    g = read_gguf(resolve_model_path(None))
    rows = []
    for name in TENSORS:
        t = g.tensors[name]
        w = dequantize(t).contiguous()
        q = torch.from_numpy(t.raw).view(w.shape[0], -1).contiguous()
        ws, qs = [w.clone() for _ in range(8)], [q.clone() for _ in range(8)]
        for m in GEMV_ROWS:
            x = torch.randn(m, w.shape[1])
            nat = best_ms(lambda i, x=x: native.gemv_q(x, qs[i], int(t.qtype)), rounds)
            blas = best_ms(lambda i, x=x: F.linear(x, ws[i]), rounds)
            rows.append(
                {
                    "tensor": name,
                    "qtype": t.qtype.name,
                    "shape": list(w.shape),
                    "rows": m,
                    "native_ms": nat,
                    "blas_ms": blas,
                    "speedup": blas / nat,
                }
            )
    return rows


def median_ms(fn: Callable[[int], object], copies: int, rounds: int) -> tuple[float, float]:
    """(wall, CPU) median ms per call over ``rounds`` passes through ``copies`` inputs, after a
    warm-up pass. CPU is the process's CPU time over the thread count: on a shared machine a
    descheduled thread adds wall time but no CPU time, so CPU is the steadier figure (a thread
    spinning at a barrier still counts, which only makes it conservative)."""
    for i in range(copies):
        fn(i)
    wall, cpu = [], []
    for _ in range(rounds):
        t, c = time.perf_counter(), time.process_time()
        for i in range(copies):
            fn(i)
        wall.append((time.perf_counter() - t) / copies * 1e3)
        cpu.append((time.process_time() - c) / copies * 1e3 / torch.get_num_threads())
    return statistics.median(wall), statistics.median(cpu)


def ceilings(rounds: int) -> dict[str, float]:
    """This run's fp32 FMA peak (GFLOP/s: ``torch.mm`` on 256x256 matrices that stay in cache)
    and memory bandwidth (GB/s over a ``STREAM_BYTES`` working set: the better of a copy, bytes
    read + written, and a read, ``dot(x, x)``), from CPU-time medians."""
    a, b, c = torch.randn(256, 256), torch.randn(256, 256), torch.empty(256, 256)
    reps = 200
    _, mm = median_ms(lambda i: [torch.mm(a, b, out=c) for _ in range(reps)], 1, rounds)
    # The same working set as the GEMV's rotation: a decode step's ~80 MB of weights may sit in a
    # large L3, and the ceiling must be the one those weights stream from.
    big = torch.randn(STREAM_BYTES // 4)
    src, dst = big[: big.numel() // 2], big[big.numel() // 2 :]
    _, cp = median_ms(lambda i: dst.copy_(src), 1, rounds)
    _, rd = median_ms(lambda i: torch.dot(big, big), 1, rounds)  # BLAS sdot: each byte read once
    # What every call pays before the kernel runs (the wrapper's checks and ctypes): one block.
    tiny, x1, y1 = torch.zeros(1, 20, dtype=torch.uint8), torch.randn(1, 32), torch.empty(1, 1)
    _, call = median_ms(
        lambda i: [native.gemv_q(x1, tiny, native.GGML_Q4_1, out=y1) for _ in range(reps)],
        1,
        rounds,
    )
    return {
        "call_overhead_us": call / reps * 1e3,
        "fma_peak_GFLOPs": 2 * 256**3 * reps / mm / 1e6,
        "copy_GBps": STREAM_BYTES / cp / 1e6,
        "read_GBps": STREAM_BYTES / rd / 1e6,
        "bandwidth_GBps": STREAM_BYTES / min(cp, rd) / 1e6,
    }


def bench_gemv_m1(rounds: int, ceil: dict[str, float]) -> list[dict[str, Any]]:
    """Batch-1 GEMV of each projection shape against the same-run ceilings (see the docstring)."""
    from pagedkv.models.gguf_loader import read_gguf
    from pagedkv.models.loader import resolve_model_path

    g = read_gguf(resolve_model_path(None))
    rows = []
    for name in M1_TENSORS:
        t = g.tensors[name]
        k, n = (int(d) for d in t.shape)
        q = torch.from_numpy(t.raw).view(n, -1).contiguous()
        qs = [q.clone() for _ in range(max(2, -(-STREAM_BYTES // q.numel())))]
        x, out = torch.randn(1, k), torch.empty(1, n)
        wall, med = median_ms(
            lambda i: native.gemv_q(x, qs[i], int(t.qtype), out=out), len(qs), max(rounds, 7)
        )
        flops, nbytes = 2 * n * k, q.numel()
        bound = max(flops / ceil["fma_peak_GFLOPs"], nbytes / ceil["bandwidth_GBps"]) / 1e6  # ms
        rows.append(
            {
                "tensor": name,
                "qtype": t.qtype.name,
                "shape": [n, k],
                "cpu_ms": med,
                "wall_ms": wall,
                "GFLOPs": flops / med / 1e6,
                "weight_GBps": nbytes / med / 1e6,
                "binds": "FMA"
                if flops / ceil["fma_peak_GFLOPs"] > nbytes / ceil["bandwidth_GBps"]
                else "memory",
                "ceiling_frac": bound / med,
            }
        )
    return rows


def bench_kquants(rounds: int, n: int = 2048, k: int = 2048) -> list[dict[str, Any]]:
    """The K-quants of llama.cpp's Q4_K_M files on a synthetic [2048, 2048] weight (SmolLM2's
    576-wide rows are not a whole number of 256-weight super-blocks, so its file has none)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize as np_dequantize

    rows = []
    rng = np.random.default_rng(0)
    for qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K):
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
        at = 208 if qtype == GGMLQuantizationType.Q6_K else 0
        raw[:, at : at + 2] = (
            (rng.standard_normal((raw.shape[0], 1)) * 0.01).astype(np.float16).view(np.uint8)
        )
        if qtype == GGMLQuantizationType.Q4_K:
            raw[:, 2:4] = (
                (rng.standard_normal((raw.shape[0], 1)) * 0.01).astype(np.float16).view(np.uint8)
            )
        q = torch.from_numpy(raw.reshape(n, -1).copy())
        w = torch.from_numpy(np_dequantize(raw.reshape(n, -1), qtype)).contiguous()
        ws, qs = [w.clone() for _ in range(8)], [q.clone() for _ in range(8)]
        for m in (1, 4, 16):
            x = torch.randn(m, k)
            nat = best_ms(lambda i, x=x: native.gemv_q(x, qs[i], int(qtype)), rounds)
            blas = best_ms(lambda i, x=x: F.linear(x, ws[i]), rounds)
            rows.append(
                {
                    "tensor": f"synthetic {n}x{k}",
                    "qtype": qtype.name,
                    "shape": [n, k],
                    "rows": m,
                    "native_ms": nat,
                    "blas_ms": blas,
                    "speedup": blas / nat,
                }
            )
    return rows


def bench_decode(rounds: int) -> list[dict[str, Any]]:
    rnd = random.Random(1)
    out = []
    for n in (1, 8, 64):
        seq_lens = [rnd.randint(300, 800) for _ in range(n)]
        num_blocks = sum(-(-s // BS) for s in seq_lens) + 8
        md = make_metadata(seq_lens, [1] * n, num_blocks)
        query = torch.randn(n, HQ, D)
        buf, views = allocate_kv_cache("LBNHC", LAYERS, num_blocks, BS, HKV, D, torch.float32)
        buf.normal_()
        real = native.lib

        def step(
            use_native: bool, views: Any = views, md: Any = md, query: torch.Tensor = query
        ) -> None:
            native.lib = real if use_native else (lambda: None)
            try:
                for k, v in views:
                    attention_mod.paged_attention(query, k, v, md, D**-0.5)
            finally:
                native.lib = real

        best = time_rounds({"native": lambda: step(True), "torch": lambda: step(False)}, rounds)
        kv_bytes = sum(seq_lens) * HKV * 2 * D * 4 * LAYERS
        out.append(
            {
                "sequences": n,
                "context_tokens": sum(seq_lens),
                "native_ms_per_step": best["native"][0] * 1e3,
                "torch_ms_per_step": best["torch"][0] * 1e3,
                "speedup": best["torch"][0] / best["native"][0],
                "native_GBps": kv_bytes / best["native"][0] / 1e9,
            }
        )
        del buf, views
    return out


PROJ_SECTIONS = ("qkv_proj", "o_proj", "gate_up+silu", "down_proj")
PROJ_TENSORS = re.compile(
    r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight"
)


def bench_step_gemv(ceil: dict[str, float], steps: int) -> dict[str, Any] | None:
    """Projection GB/s inside ``steps`` native batch-1 decode steps (see the docstring); None when
    the native decode step does not run here (``PAGEDKV_NATIVE_STEP=0``, no compiler)."""
    from pagedkv import LLM, SamplingParams
    from pagedkv.models.gguf_loader import read_gguf
    from pagedkv.models.loader import resolve_model_path
    from pagedkv.ops import native_step

    g = read_gguf(resolve_model_path(None))
    nbytes = sum(int(t.raw.nbytes) for name, t in g.tensors.items() if PROJ_TENSORS.fullmatch(name))
    llm = LLM(max_model_len=256)
    eng = llm.llm_engine
    eng.add_request(
        "step_gemv",
        {"prompt_token_ids": list(range(100, 132))},
        SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True),
    )
    eng.step()  # prefill
    prof = native_step.profile = native_step.StepProfile()
    try:
        while eng.has_unfinished_requests():
            eng.step()
    finally:
        native_step.profile = None
    if not prof.steps:
        return None
    sec = prof.as_dict()
    per_step = sum(sec[k] for k in PROJ_SECTIONS) / prof.steps
    gbps = nbytes / per_step / 1e9
    return {
        "steps": prof.steps,
        "weight_bytes": nbytes,
        "proj_ms_per_step": per_step * 1e3,
        "sections_ms": {k: sec[k] / prof.steps * 1e3 for k in PROJ_SECTIONS},
        "weight_GBps": gbps,
        "bandwidth_frac": gbps / ceil["bandwidth_GBps"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not native.available():
        raise SystemExit("native kernels unavailable (no C compiler?): nothing to compare")
    ceil = ceilings(args.rounds)
    m1 = {
        "benchmark": "native",
        "torch_threads": torch.get_num_threads(),
        "ceilings": ceil,
        "gemv_m1": bench_gemv_m1(args.rounds, ceil),
        "step_gemv": bench_step_gemv(ceil, args.step_tokens),
    }
    if args.m1_only:
        return m1
    gemv = bench_gemv(args.rounds)
    layer_rows = [r for r in gemv if r["tensor"] != "token_embd.weight"]
    crossover = max(
        (m for m in GEMV_ROWS if all(r["speedup"] > 1.0 for r in layer_rows if r["rows"] == m)),
        default=0,
    )
    return {
        **m1,
        "gemv": gemv,
        "gemv_kquants": bench_kquants(args.rounds),
        "gemv_native_wins_up_to_rows": crossover,
        "decode_attention": bench_decode(args.rounds),
    }


def m1_table(r: dict[str, Any]) -> list[str]:
    c = r["ceilings"]
    lines = [
        f"batch-1 GEMV, {r['torch_threads']} threads; same-run ceilings: fp32 FMA peak "
        f"{c['fma_peak_GFLOPs']:.0f} GFLOP/s, memory {c['bandwidth_GBps']:.1f} GB/s "
        f"(copy {c['copy_GBps']:.1f}, read {c['read_GBps']:.1f}); each call pays "
        f"{c['call_overhead_us']:.1f} us before the kernel (wrapper + ctypes), included below",
        f"{'tensor':24s}{'type':>6s}{'N x K':>12s}{'CPU ms':>8s}{'wall ms':>8s}{'GFLOP/s':>8s}"
        f"{'GB/s':>6s}{'binds':>7s}{'of ceil':>8s}",
    ]
    for g in r["gemv_m1"]:
        lines.append(
            f"{g['tensor']:24s}{g['qtype']:>6s}{g['shape'][0]:>6d}x{g['shape'][1]:<5d}{g['cpu_ms']:8.3f}"
            f"{g['wall_ms']:8.3f}{g['GFLOPs']:8.1f}{g['weight_GBps']:6.1f}{g['binds']:>7s}"
            f"{g['ceiling_frac']:7.0%}"
        )
    sg = r.get("step_gemv")
    if sg:
        lines.append(
            f"inside the native decode step (batch 1, {sg['steps']} steps): projections "
            f"{sg['proj_ms_per_step']:.2f} ms a step for {sg['weight_bytes'] / 1e6:.1f} MB of weights, "
            f"{sg['weight_GBps']:.1f} GB/s, {sg['bandwidth_frac']:.0%} of the memory ceiling"
        )
    return lines


def table(r: dict[str, Any]) -> str:
    if "gemv" not in r:
        return "\n".join(m1_table(r))
    lines = [*m1_table(r), ""]
    lines += [
        f"{'GEMV tensor':24s}{'type':>6s}{'M':>4s}{'native ms':>11s}{'BLAS ms':>9s}{'speedup':>9s}"
    ]
    for g in r["gemv"]:
        lines.append(
            f"{g['tensor']:24s}{g['qtype']:>6s}{g['rows']:4d}{g['native_ms']:11.3f}"
            f"{g['blas_ms']:9.3f}{g['speedup']:8.2f}x"
        )
    for g in r["gemv_kquants"]:
        lines.append(
            f"{g['tensor']:24s}{g['qtype']:>6s}{g['rows']:4d}{g['native_ms']:11.3f}"
            f"{g['blas_ms']:9.3f}{g['speedup']:8.2f}x"
        )
    lines.append(
        f"native GEMV wins on every layer weight up to M = {r['gemv_native_wins_up_to_rows']}"
    )
    lines.append("")
    lines.append(
        f"{'decode step (30 layers)':24s}{'native ms':>11s}{'torch ms':>10s}{'speedup':>9s}{'GB/s':>7s}"
    )
    for d in r["decode_attention"]:
        lines.append(
            f"{d['sequences']:3d} seqs, {d['context_tokens']:6d} tokens  {d['native_ms_per_step']:9.2f}"
            f"{d['torch_ms_per_step']:10.2f}{d['speedup']:8.2f}x{d['native_GBps']:7.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--m1-only", action="store_true", help="only the batch-1 GEMV against the ceilings"
    )
    p.add_argument(
        "--step-tokens", type=int, default=64, help="decode steps timed inside the native step"
    )
    add_output_args(p)
    return run_and_emit(run, table, p.parse_args(argv))
