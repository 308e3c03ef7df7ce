"""Native CPU kernels (ops/csrc/cpu_kernels.c) against the torch paths they replace, same run.

* GEMV: SmolLM2-135M's projections (its GGUF's own Q4_1 rows; the tied Q8_0 LM head) at
  ``M`` rows: ``native.gemv_q`` on the ggml blocks vs ``F.linear`` on the float32 weights.
  Eight copies of each weight rotate so reads come from DRAM, as in a decode step. This picks
  ``NATIVE_GEMV_MAX_ROWS`` (models/layers.py): the largest M where native still wins.
* The K-quants (Q4_K, Q6_K) on a synthetic 2048 x 2048 weight, same comparison.
* Decode attention: one step of 30 layers (each its own cold KV cache, LBNHC, block 16, fp32,
  Hq=9, Hkv=3, D=64) for 1, 8 and 64 sequences: ``native.paged_decode`` vs the torch path
  (gather + fused flash kernel), best of interleaved rounds.

Usage: python benchmarks/bench_native.py [--rounds N] [--json-only] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench_attention import BS, D, HKV, HQ, LAYERS, make_metadata, time_rounds  # noqa: E402

from pagedkv.bench.common import add_output_args, run_and_emit  # noqa: E402
from pagedkv.ops import attention as attention_mod  # noqa: E402
from pagedkv.ops import native  # noqa: E402
from pagedkv.ops.kv_cache import allocate_kv_cache  # noqa: E402

GEMV_ROWS = (1, 4, 8, 16, 32, 48, 64)
TENSORS = ("blk.0.attn_q.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight", "token_embd.weight")


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
            rows.append({"tensor": name, "qtype": t.qtype.name, "shape": list(w.shape), "rows": m,
                         "native_ms": nat, "blas_ms": blas, "speedup": blas / nat})
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
        raw[:, at:at + 2] = (rng.standard_normal((raw.shape[0], 1)) * 0.01).astype(np.float16).view(np.uint8)
        if qtype == GGMLQuantizationType.Q4_K:
            raw[:, 2:4] = (rng.standard_normal((raw.shape[0], 1)) * 0.01).astype(np.float16).view(np.uint8)
        q = torch.from_numpy(raw.reshape(n, -1).copy())
        w = torch.from_numpy(np_dequantize(raw.reshape(n, -1), qtype)).contiguous()
        ws, qs = [w.clone() for _ in range(8)], [q.clone() for _ in range(8)]
        for m in (1, 4, 16):
            x = torch.randn(m, k)
            nat = best_ms(lambda i, x=x: native.gemv_q(x, qs[i], int(qtype)), rounds)
            blas = best_ms(lambda i, x=x: F.linear(x, ws[i]), rounds)
            rows.append({"tensor": f"synthetic {n}x{k}", "qtype": qtype.name, "shape": [n, k], "rows": m,
                         "native_ms": nat, "blas_ms": blas, "speedup": blas / nat})
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

        def step(use_native: bool, views: Any = views, md: Any = md, query: torch.Tensor = query) -> None:
            native.lib = real if use_native else (lambda: None)
            try:
                for k, v in views:
                    attention_mod.paged_attention(query, k, v, md, D**-0.5)
            finally:
                native.lib = real

        best = time_rounds({"native": lambda: step(True), "torch": lambda: step(False)}, rounds)
        kv_bytes = sum(seq_lens) * HKV * 2 * D * 4 * LAYERS
        out.append({"sequences": n, "context_tokens": sum(seq_lens), "native_ms_per_step": best["native"][0] * 1e3,
                    "torch_ms_per_step": best["torch"][0] * 1e3, "speedup": best["torch"][0] / best["native"][0],
                    "native_GBps": kv_bytes / best["native"][0] / 1e9})
        del buf, views
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not native.available():
        raise SystemExit("native kernels unavailable (no C compiler?): nothing to compare")
    gemv = bench_gemv(args.rounds)
    layer_rows = [r for r in gemv if r["tensor"] != "token_embd.weight"]
    crossover = max((m for m in GEMV_ROWS if all(r["speedup"] > 1.0 for r in layer_rows if r["rows"] == m)),
                    default=0)
    return {"benchmark": "native", "torch_threads": torch.get_num_threads(), "gemv": gemv,
            "gemv_kquants": bench_kquants(args.rounds),
            "gemv_native_wins_up_to_rows": crossover, "decode_attention": bench_decode(args.rounds)}


def table(r: dict[str, Any]) -> str:
    lines = [f"{'GEMV tensor':24s}{'type':>6s}{'M':>4s}{'native ms':>11s}{'BLAS ms':>9s}{'speedup':>9s}"]
    for g in r["gemv"]:
        lines.append(f"{g['tensor']:24s}{g['qtype']:>6s}{g['rows']:4d}{g['native_ms']:11.3f}"
                     f"{g['blas_ms']:9.3f}{g['speedup']:8.2f}x")
    for g in r["gemv_kquants"]:
        lines.append(f"{g['tensor']:24s}{g['qtype']:>6s}{g['rows']:4d}{g['native_ms']:11.3f}"
                     f"{g['blas_ms']:9.3f}{g['speedup']:8.2f}x")
    lines.append(f"native GEMV wins on every layer weight up to M = {r['gemv_native_wins_up_to_rows']}")
    lines.append("")
    lines.append(f"{'decode step (30 layers)':24s}{'native ms':>11s}{'torch ms':>10s}{'speedup':>9s}{'GB/s':>7s}")
    for d in r["decode_attention"]:
        lines.append(f"{d['sequences']:3d} seqs, {d['context_tokens']:6d} tokens  {d['native_ms_per_step']:9.2f}"
                     f"{d['torch_ms_per_step']:10.2f}{d['speedup']:8.2f}x{d['native_GBps']:7.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    add_output_args(p)
    return run_and_emit(run, table, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
