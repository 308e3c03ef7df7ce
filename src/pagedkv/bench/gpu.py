"""GPU benchmarks of the Triton attention kernels and the engine (issue 16 targets).

* ``copy``: the device's copy bandwidth, measured in this run (``dst.copy_(src)`` of 1 GiB,
  read + write bytes per second): the yardstick for decode.
* ``decode``: the unified kernel on a decode batch (Llama-8B-like heads: Hq=32, Hkv=8,
  D=128, bf16, block 16, 64 rows × 4096 context): bytes of KV read per second and their
  fraction of the copy bandwidth (target ≥ 0.70).
* ``prefill``: the unified kernel on 4 prompts of 2048 tokens (no context) vs a dense
  ``scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` on the same shapes:
  TFLOP/s of each (causal FLOPs counted the same way) and their ratio (target ≥ 0.60).
* ``exactness``: greedy float32 outputs of the engine on CUDA equal those on CPU.
* ``e2e``: output tokens per second of the default model (``LLM(device="cuda")``) on a batch
  of 64 prompts.

Without CUDA (or without triton) it prints a JSON saying so and exits 0.
Run: ``python benchmarks/bench_gpu.py [--out results.json] [--skip-e2e] [--check NAME=RC ...]``
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from typing import Any

import torch

HQ, HKV, D, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16


def cuda_time(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Median seconds per call, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes moved (read + written) per second by a device-to-device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / cuda_time(lambda: dst.copy_(src))


def paged_batch(seq_lens: list[int], query_lens: list[int], seed: int = 0) -> dict[str, Any]:
    """Random block tables over a shuffled pool, K/V in one LBNHC buffer, on CUDA."""
    from pagedkv.ops.kv_cache import allocate_kv_cache

    rnd = random.Random(seed)
    need = [-(-n // BS) for n in seq_lens]
    num_blocks = sum(need) + 1
    ids = list(range(1, num_blocks))
    rnd.shuffle(ids)
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    buf, views = allocate_kv_cache("LBNHC", 1, num_blocks, BS, HKV, D, DTYPE, "cuda")
    buf.normal_()
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    return dict(
        query=torch.randn(qsl[-1], HQ, D, dtype=DTYPE, device="cuda"),
        key_cache=views[0][0],
        value_cache=views[0][1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_table=table.cuda(),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def bench_decode(copy_bw: float, batch: int = 64, context: int = 4096) -> dict[str, Any]:
    from pagedkv.ops.triton.unified_attention import unified_attention

    b = paged_batch([context] * batch, [1] * batch)
    kv_bytes = batch * context * HKV * 2 * D * torch.finfo(DTYPE).bits // 8
    t = cuda_time(lambda: unified_attention(scale=D**-0.5, **b))
    return dict(
        batch=batch,
        context=context,
        seconds=t,
        kv_bytes=kv_bytes,
        kv_bytes_per_s=kv_bytes / t,
        fraction_of_copy_bw=kv_bytes / t / copy_bw,
        target=0.70,
    )


def bench_prefill(num_seqs: int = 4, length: int = 2048) -> dict[str, Any]:
    import torch.nn.functional as F

    from pagedkv.ops.triton.unified_attention import unified_attention

    b = paged_batch([length] * num_seqs, [length] * num_seqs)
    flops = num_seqs * 4 * HQ * D * length * (length + 1) / 2  # QK^T and PV over the causal half
    t_paged = cuda_time(lambda: unified_attention(scale=D**-0.5, **b))
    q = torch.randn(num_seqs, HQ, length, D, dtype=DTYPE, device="cuda")
    k = torch.randn(num_seqs, HKV, length, D, dtype=DTYPE, device="cuda")
    v = torch.randn_like(k)
    t_sdpa = cuda_time(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    )
    return dict(
        num_seqs=num_seqs,
        length=length,
        paged_tflops=flops / t_paged / 1e12,
        sdpa_tflops=flops / t_sdpa / 1e12,
        ratio=t_sdpa / t_paged,
        target=0.60,
    )


def bench_e2e(batch: int = 64, max_tokens: int = 128) -> dict[str, Any]:
    import time

    from pagedkv import LLM, SamplingParams

    llm = LLM(device="cuda")
    prompts = [f"Write a short story number {i} about a lighthouse keeper." for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(
        batch=batch,
        max_tokens=max_tokens,
        output_tokens=tokens,
        seconds=elapsed,
        output_tokens_per_s=tokens / elapsed,
    )


def check_exactness(num_prompts: int = 8, max_tokens: int = 32) -> dict[str, Any]:
    """Greedy float32 outputs of the engine on CUDA (Triton kernels) vs on CPU (torch/native
    kernels), prompt by prompt: identical token ids expected."""
    from pagedkv import LLM, SamplingParams

    prompts = [
        f"Question {i}: explain paged attention and KV caches in {i + 2} sentences."
        for i in range(num_prompts)
    ]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = {}
    for device in ("cpu", "cuda"):
        outs = LLM(device=device, num_kv_blocks=256).generate(prompts, params, use_tqdm=False)
        ids[device] = [list(o.outputs[0].token_ids) for o in outs]
    diffs = [
        dict(prompt=i, first_diff=next(j for j, (a, b) in enumerate(zip(c, g)) if a != b))
        for i, (c, g) in enumerate(zip(ids["cpu"], ids["cuda"]))
        if c != g
    ]
    return dict(prompts=num_prompts, max_tokens=max_tokens, identical=not diffs, diffs=diffs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the JSON results to this file too")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument(
        "--check",
        action="append",
        default=[],
        metavar="NAME=RC",
        help="record the exit status of a check run before (gpu/run_checks.sh)",
    )
    args = ap.parse_args(argv)
    try:
        import triton  # noqa: F401

        has_triton = True
    except ImportError:
        has_triton = False
    if not torch.cuda.is_available() or not has_triton:
        res: dict[str, Any] = dict(
            gpu=False,
            reason="no CUDA device" if not torch.cuda.is_available() else "triton not installed",
        )
    else:
        res = dict(
            gpu=True,
            device=torch.cuda.get_device_name(),
            torch=torch.__version__,
            triton=__import__("triton").__version__,
        )
        bw = copy_bandwidth()
        res["copy_bytes_per_s"] = bw
        res["decode"] = bench_decode(bw)
        res["prefill"] = bench_prefill()
        res["exactness"] = check_exactness()
        if not args.skip_e2e:
            res["e2e"] = bench_e2e()
        res["targets_met"] = dict(
            decode=res["decode"]["fraction_of_copy_bw"] >= 0.70,
            prefill=res["prefill"]["ratio"] >= 0.60,
        )
    if args.check:
        res["checks"] = {name: int(rc) for name, rc in (c.split("=", 1) for c in args.check)}
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0
