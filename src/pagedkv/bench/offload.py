"""KV offloading benchmarks. Prints a table and JSON.

1. ``bandwidth`` (no model): CPU-tier load bandwidth (host chunks → device KV cache through
   `OffloadingWorker.submit_load`, scattered block ids) against a plain memcpy of the same
   bytes (``torch.Tensor.copy_`` between two contiguous tensors) measured in the same run; and
   disk-tier read throughput (`FileSystemTier.load_batch`, cold page cache where it can be
   dropped) against a sequential read of the same number of bytes from one file on the same
   filesystem, with the same cache state. Targets: ≥ 50% for both.
2. ``multiturn`` (the default model): C conversations × T turns sharing a long system prompt;
   the first turn of each conversation pastes a document (~600 tokens), later turns ask short
   questions about it. Turns are played round-robin (turn 1 of every conversation, then turn 2, ...) one request
   at a time, so each conversation's history is evicted from the small device cache before its
   next turn. TTFT (arrival → first token) p50/mean and total throughput, with the tiers
   (``--kv-offload``, default ``cpu:2GiB``) and without. Target: TTFT p50 ≥ 3× lower with tiers.

3. ``codecs``: the tier codecs on real KV pages (`pagedkv.bench.offload_codecs`): stored bytes
   per token, encode/decode MB/s, and the lossy int8 codec's teacher-forced agreement.
   ``codec-ttft``: the multiturn workload's TTFT with each disk codec behind a CPU tier smaller
   than the histories (prefixes come back from disk), against raw pages in the same run.

Usage: python benchmarks/bench_offload.py [bandwidth|multiturn|codecs|all] [--conversations 50 --turns 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagedkv import envs
from pagedkv.bench import offload_codecs
from pagedkv.bench.common import drop_page_cache


def bench_bandwidth(num_chunks: int = 256, repeat: int = 5) -> dict[str, float]:
    from pagedkv.offload.base import CPULoadStoreSpec, GPULoadStoreSpec
    from pagedkv.offload.fs_tier import FileSystemTier
    from pagedkv.offload.worker import HostChunkBuffer, OffloadingWorker
    from pagedkv.ops.kv_cache import allocate_kv_cache

    # SmolLM2-135M in float32, block 16, a block-contiguous layout (one memcpy per block).
    layout = "BLNHC"
    buf, _ = allocate_kv_cache(layout, 30, num_chunks + 1, 16, 3, 64, torch.float32)
    host = HostChunkBuffer.for_kv_cache(buf, layout, (num_chunks + 1) * buf[0].numel() * 4)
    worker = OffloadingWorker(buf, layout, host)
    total = num_chunks * host.chunk_bytes
    perm = torch.randperm(num_chunks).tolist()
    dev_ids = tuple(1 + i for i in perm)  # scattered device blocks
    host_ids = tuple(range(num_chunks))
    loads, stores = [], []
    for r in range(repeat):
        t = time.perf_counter()
        worker.submit_store(2 * r, GPULoadStoreSpec(dev_ids), CPULoadStoreSpec(host_ids))
        stores.append(total / (time.perf_counter() - t))
        t = time.perf_counter()
        worker.submit_load(2 * r + 1, CPULoadStoreSpec(host_ids), GPULoadStoreSpec(dev_ids))
        loads.append(total / (time.perf_counter() - t))
    worker.get_finished()
    a = torch.empty(total // 4, dtype=torch.float32)
    b = torch.ones_like(a)
    copies = []
    for _ in range(repeat):
        t = time.perf_counter()
        a.copy_(b)
        copies.append(total / (time.perf_counter() - t))
    out = {
        "chunk_bytes": host.chunk_bytes,
        "cpu_load_GBps": max(loads) / 1e9,
        "cpu_store_GBps": max(stores) / 1e9,
        "memcpy_GBps": max(copies) / 1e9,
    }
    out["cpu_load_vs_memcpy"] = out["cpu_load_GBps"] / out["memcpy_GBps"]

    with tempfile.TemporaryDirectory(dir=envs.PAGEDKV_BENCH_DIR) as d:
        n = min(num_chunks, 128)
        tier = FileSystemTier(
            d, "be" * 16, capacity_bytes=4 * n * host.chunk_bytes, chunk_bytes=host.chunk_bytes
        )
        keys = [i.to_bytes(32, "big") + b"\0\0\0\0" for i in range(n)]
        assert all(tier.store_batch([(k, host.chunk_view(i)) for i, k in enumerate(keys)]))
        seq = Path(d) / "sequential.bin"
        with open(seq, "wb") as f:
            for i in range(n):
                f.write(host.chunk_view(i))
            f.flush()
            os.fsync(f.fileno())
        files = [p for p in Path(d).rglob("*.bin") if p != seq]
        reads, seq_reads = [], []
        for _ in range(repeat):
            cold = all(drop_page_cache(p) for p in files) and drop_page_cache(seq)
            t = time.perf_counter()
            ok = tier.load_batch([(k, host.chunk_view(i)) for i, k in enumerate(keys)])
            reads.append(n * host.chunk_bytes / (time.perf_counter() - t))
            assert all(ok)
            drop_page_cache(seq)
            t = time.perf_counter()
            with open(seq, "rb", buffering=0) as f:
                while f.readinto(memoryview(bytearray(8 << 20))):
                    pass
            seq_reads.append(n * host.chunk_bytes / (time.perf_counter() - t))
        tier.shutdown()
    out.update(
        {
            "disk_read_GBps": max(reads) / 1e9,
            "sequential_read_GBps": max(seq_reads) / 1e9,
            "disk_odirect": tier.odirect,
            "page_cache_dropped": cold,
        }
    )
    out["disk_read_vs_sequential"] = out["disk_read_GBps"] / out["sequential_read_GBps"]
    return out


SYSTEM = (
    "You are the support assistant of a large public library. You help readers find "
    "books, renew loans, reserve rooms and understand the rules. "
) * 12


WORDS = (
    "atlas catalogue chapter index journal ledger manuscript novel pamphlet quarto "
    "reference shelf volume archive binding folio margin preface register series"
).split()


def _user_turn(conv: int, turn: int) -> str:
    """Turn 0 pastes a document (~600 tokens, unique per conversation); later turns ask short
    questions about it, so most of each later prompt is history worth keeping."""
    if turn == 0:
        words = [WORDS[(conv * 7 + i * i + i // 5) % len(WORDS)] for i in range(400)]
        return f"Conversation {conv}. Please read this record carefully: {' '.join(words)}."
    return f"Question {turn}: which shelf holds book number {conv * 31 + turn}?"


def run_multiturn(
    kv_offload: str | None, conversations: int, turns: int, num_kv_blocks: int, max_tokens: int
) -> dict[str, float]:
    from pagedkv import LLM, SamplingParams

    llm = LLM(num_kv_blocks=num_kv_blocks, max_model_len=4096, kv_offload=kv_offload)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    histories = [[{"role": "system", "content": SYSTEM}] for _ in range(conversations)]
    ttfts: list[float] = []
    tokens = 0
    start = time.perf_counter()
    for turn in range(turns):
        for c, hist in enumerate(histories):
            hist.append({"role": "user", "content": _user_turn(c, turn)})
            out = llm.chat(hist, params, use_tqdm=False)[0]
            ttfts.append(out.metrics.time_to_first_token)
            tokens += len(out.prompt_token_ids) + len(out.outputs[0].token_ids)
            hist.append({"role": "assistant", "content": out.outputs[0].text})
    elapsed = time.perf_counter() - start
    stats = llm.stats()
    working_set = sum(
        len(
            tok.encode(
                tok.apply_chat_template(h, add_generation_prompt=False), add_special_tokens=False
            )
        )
        for h in histories
    )
    llm.llm_engine.shutdown()
    later = ttfts[conversations:]  # turns 2..T: the ones a tier can serve
    disk = (stats.get("offload") or {}).get("disk") or {}
    return {
        "disk_loads": disk.get("loads", 0),
        "disk_bytes_on_disk": disk.get("usage_bytes", 0),
        "disk_bytes_read": disk.get("bytes_read", 0),
        "ttft_p50_s": statistics.median(later),
        "ttft_mean_s": statistics.fmean(later),
        "throughput_tok_s": tokens / elapsed,
        "elapsed_s": elapsed,
        "prefix_hit_tokens": stats["prefix_cache_hits"],
        "external_hit_tokens": stats["external_cache_hits"],
        "working_set_tokens": working_set,
        "device_cache_tokens": (num_kv_blocks - 1) * 16,
    }


def bench_multiturn(args: argparse.Namespace) -> dict[str, object]:
    base = run_multiturn(None, args.conversations, args.turns, args.num_kv_blocks, args.max_tokens)
    tiers = run_multiturn(
        args.kv_offload, args.conversations, args.turns, args.num_kv_blocks, args.max_tokens
    )
    return {
        "without_tiers": base,
        "with_tiers": tiers,
        "ttft_p50_ratio": base["ttft_p50_s"] / tiers["ttft_p50_s"],
        "throughput_ratio": tiers["throughput_tok_s"] / base["throughput_tok_s"],
        "working_set_vs_device": base["working_set_tokens"] / base["device_cache_tokens"],
    }


def bench_codec_ttft(args: argparse.Namespace) -> dict[str, object]:
    """Tiered TTFT with each disk-tier codec (`pagedkv.offload.codec`): the multiturn workload
    behind a CPU tier smaller than the conversations' histories (``--codec-cpu``), so later
    turns load most of their prefixes back from the disk tier, decoded on its I/O threads;
    ratios against ``raw`` in the same run."""
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as root:
        for codec in ("raw", "zstd", "lz4", "int8"):
            spec = f"cpu:{args.codec_cpu},disk:{root}/{codec}:4GiB:{codec}"
            rows[codec] = run_multiturn(
                spec, args.conversations, args.turns, args.num_kv_blocks, args.max_tokens
            )
    raw = rows["raw"]["ttft_p50_s"]
    return {
        "cpu_tier": args.codec_cpu,
        "codecs": rows,
        "ttft_p50_vs_raw": {c: r["ttft_p50_s"] / raw for c, r in rows.items()},
        "disk_bytes_vs_raw": {
            c: r["disk_bytes_on_disk"] / rows["raw"]["disk_bytes_on_disk"] for c, r in rows.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "what",
        nargs="?",
        default="all",
        choices=["bandwidth", "multiturn", "codecs", "codec-ttft", "pd-codecs", "all"],
    )
    ap.add_argument(
        "--codec-cpu", default="64MiB", help="codec-ttft's CPU tier (under the histories)"
    )
    ap.add_argument("--conversations", type=int, default=50)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--num-kv-blocks", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv-offload", default="cpu:2GiB")
    ap.add_argument("--json-only", action="store_true")
    offload_codecs.add_arguments(ap.add_argument_group("codecs"))
    args = ap.parse_args(argv)
    report: dict[str, object] = {}
    if args.what in ("bandwidth", "all"):
        report["bandwidth"] = bench_bandwidth()
    if args.what in ("multiturn", "all"):
        report["multiturn"] = bench_multiturn(args)
    if args.what in ("codecs", "all"):
        report["codecs"] = offload_codecs.run(args)
        if not args.json_only:
            print(offload_codecs.table(report["codecs"]))
    if args.what == "codec-ttft":
        report["codec_ttft"] = bench_codec_ttft(args)
    if args.what == "pd-codecs":
        report["pd_codecs"] = offload_codecs.bench_pd(args)
        if not args.json_only:
            print(offload_codecs.pd_table(report["pd_codecs"]))
    if not args.json_only:
        for section, values in report.items():
            print(f"== {section}")
            for k, v in _flatten(values):
                print(f"  {k:42s} {v:.4g}" if isinstance(v, float) else f"  {k:42s} {v}")
        print(
            "targets: cpu_load_vs_memcpy >= 0.5, disk_read_vs_sequential >= 0.5, "
            "ttft_p50_ratio >= 3"
        )
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


def _flatten(d: object, prefix: str = "") -> list[tuple[str, object]]:
    if not isinstance(d, dict):
        return [(prefix, d)]
    out = []
    for k, v in d.items():
        out.extend(_flatten(v, f"{prefix}.{k}" if prefix else k))
    return out
