"""Tier codecs (`pagedkv.offload.codec`) on real KV pages: bytes stored per token, encode and
decode throughput, and what the lossy codec costs the model.

* **pages**: the default model generates a corpus (chat and plain prompts, ``--tokens``) in a
  ``dtype`` engine whose cache is block-contiguous (BLNHC); every block the prefix cache holds
  afterwards (real K/V of every layer) is encoded by each codec, as a tier would store it.
  Reported per dtype and codec: the ratio of raw to stored bytes, bytes per token, and encode /
  decode MB/s on one thread, against ``raw`` (a copy) in the same run.
* **accuracy** (``int8``, lossy): teacher-forced top-1 agreement, KL and ΔPPL of a float32
  engine whose every K and V row goes through the codec's round trip as it is written (a
  context restored from a lossy tier, everywhere), against the same engine without, over the
  same corpus windows (`pagedkv.bench.kv_quant`'s method).

* **pd** (`bench_pd`): prefill/decode transfers with each ``transfer_codec``: a producer and a
  consumer engine in this process (`NixlConnector`, ``--pd-backend``; the TCP backend with its
  same-host copy off, so blocks cross a loopback socket as they would a network) hand over
  ``--pd-prompts`` prompts of ``--pd-tokens`` corpus tokens one at a time. Per codec: bytes
  moved per token, the consumer's TTFT (transfer, decode of the frames, its last prompt token)
  and the transfer latency, against ``raw`` in the same run, and the consumer computing the
  prompt itself (``recompute``).

Targets (issue 37): lossless ≥ 1.3× fewer bytes on bf16 pages; the int8 stage ≥ 1.9× with
top-1 ≥ 99% after a round trip.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from pagedkv.offload.codec import CODECS, make_codec

TARGETS = {"lossless_bf16_ratio": 1.3, "int8_ratio": 1.9, "int8_top1": 0.99}


def _pages(dtype: str, tokens: int, seed: int) -> tuple[list[memoryview], int]:
    """The cached blocks' bytes (one memoryview a block, every layer) after a corpus run."""
    from pagedkv import LLM
    from pagedkv.bench.kv_quant import make_corpus

    blocks = max(tokens // 16, 2048 // 16) + 64  # every corpus block, and a whole context
    llm = LLM(dtype=dtype, kv_cache_layout="BLNHC", num_kv_blocks=blocks, max_model_len=2048)
    make_corpus(llm, tokens, 0.0, seed)
    eng = llm.llm_engine
    ids = [b.block_id for b in eng.kv_cache_manager.block_pool.blocks if b.block_hash is not None]
    buf = eng.runner.kv_buffer
    pages = [memoryview(buf[i].contiguous().view(torch.uint8).numpy()) for i in ids]
    return pages, eng.block_size


def bench_pages(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dtype in args.dtypes:
        pages, bs = _pages(dtype, args.tokens, args.seed)
        raw = sum(p.nbytes for p in pages)
        rows: dict[str, Any] = {}
        for name in CODECS:
            codec = make_codec(name, dtype, 64, quantized=False)
            t0 = time.perf_counter()
            enc = [codec.encode(p) for p in pages]
            t_enc = time.perf_counter() - t0
            stored = sum(memoryview(e).nbytes for e in enc)
            scratch = memoryview(bytearray(pages[0].nbytes))
            t0 = time.perf_counter()
            for e in enc:
                codec.decode(e, scratch)
            t_dec = time.perf_counter() - t0
            rows[name] = dict(
                ratio=raw / stored,
                bytes_per_token=stored / (len(pages) * bs),
                encode_MBps=raw / t_enc / 1e6,
                decode_MBps=raw / t_dec / 1e6,
            )
            if not args.skip_tiers:
                rows[name].update(_tier_loads(pages[: args.tier_chunks], codec, bs))
        out[dtype] = dict(blocks=len(pages), raw_bytes=raw, codecs=rows)
    return out


def _tier_loads(pages: list[memoryview], codec: Any, block_size: int) -> dict[str, float]:
    """Load bandwidth (restored chunk bytes a second, best of 3) of these pages from a disk
    tier (page cache dropped before each load) and from a P2P peer over the TCP backend, with
    ``codec``; and the bytes a token costs on the wire from the peer."""
    import tempfile

    from pagedkv import envs
    from pagedkv.bench.common import drop_page_cache
    from pagedkv.bench.instances import free_port
    from pagedkv.offload.fs_tier import FileSystemTier
    from pagedkv.offload.p2p_tier import P2PTier

    pages = [p.cast("B") for p in pages]  # flat, as the offload worker's chunk views are
    n, size = len(pages), pages[0].nbytes
    keys = [i.to_bytes(32, "big") + b"\0\0\0\0" for i in range(n)]
    dst = [memoryview(bytearray(size)) for _ in range(n)]
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=envs.PAGEDKV_BENCH_DIR) as d:
        tier = FileSystemTier(d, "be" * 16, 4 * n * size, size, codec=codec)
        try:
            assert all(tier.store_batch(list(zip(keys, pages))))
            best = 0.0
            for _ in range(3):
                for f in Path(d).rglob("*.bin"):
                    drop_page_cache(f)
                t0 = time.perf_counter()
                assert all(tier.load_batch(list(zip(keys, dst))))
                best = max(best, n * size / (time.perf_counter() - t0))
            out["disk_load_MBps"] = best / 1e6
        finally:
            tier.shutdown()
    port = free_port()
    mk = lambda peers, listen: P2PTier(  # noqa: E731
        peers,
        "fp",
        "seed",
        size,
        listen_port=listen,
        capacity_bytes=2 * n * size,
        backend="tcp",
        codec=codec,
    )
    server = mk([], port)
    readers = []
    try:
        assert all(server.store_batch(list(zip(keys, pages))))
        best, wire = 0.0, 0
        for _ in range(3):  # a fresh reader each time: its own store starts empty
            reader = mk([("127.0.0.1", port)], 0)
            readers.append(reader)
            t0 = time.perf_counter()
            assert all(reader.load_batch(list(zip(keys, dst))))
            best = max(best, n * size / (time.perf_counter() - t0))
            wire = reader.get_stats().bytes_read
        out["p2p_load_MBps"] = best / 1e6
        out["p2p_wire_bytes_per_token"] = wire / (n * block_size)
    finally:
        for r in readers:
            r.shutdown()
        server.shutdown()
    return out


def bench_accuracy(args: argparse.Namespace) -> dict[str, Any]:
    """Teacher-forced agreement of the int8 codec's round trip on every written K/V row."""
    from pagedkv import LLM
    from pagedkv.bench import kv_quant
    from pagedkv.models import llama

    codec = make_codec("int8", "float32", 64, quantized=False)
    llm = LLM(max_model_len=2048, max_num_batched_tokens=args.window, enable_prefix_caching=False)
    stream = kv_quant.make_corpus(llm, args.accuracy_tokens, 0.0, args.seed)
    wins = kv_quant.windows(stream, args.window)
    ref = [kv_quant.score_window(llm, w) for w in wins]
    original = llama.reshape_and_cache

    def round_trip(t: torch.Tensor) -> torch.Tensor:
        x = t.contiguous().float()
        out = bytearray(x.numel() * 4)
        codec.decode(codec.encode(memoryview(x.view(torch.uint8).numpy())), memoryview(out))
        return torch.frombuffer(out, dtype=torch.float32).view(t.shape).to(t.dtype)

    def lossy(k, v, *rest, **kw):  # noqa: ANN001, ANN202 (reshape_and_cache's signature)
        return original(round_trip(k), round_trip(v), *rest, **kw)

    llama.reshape_and_cache = lossy
    try:
        stats = kv_quant.AgreementStats()
        for w, r in zip(wins, ref):
            stats.add(r, kv_quant.score_window(llm, w), w[1:])
    finally:
        llama.reshape_and_cache = original
    return dict(windows=len(wins), **stats.summary())


def _pd_pair(codec: str, dtype: str, backend: str, blocks: int, max_len: int) -> tuple[Any, Any]:
    from pagedkv import LLM
    from pagedkv.bench.instances import free_port

    def make(role: str) -> Any:
        extra = {"side_channel_port": free_port(), "backend": backend, "transfer_codec": codec}
        if backend == "tcp":
            extra["tcp_fast_path"] = False
        cfg = {"kv_connector": "NixlConnector", "kv_role": role, "kv_connector_extra_config": extra}
        return LLM(dtype=dtype, num_kv_blocks=blocks, max_model_len=max_len, kv_transfer_config=cfg)

    return make("kv_producer"), make("kv_consumer")


def bench_pd(args: argparse.Namespace) -> dict[str, Any]:
    """PD transfers with each ``transfer_codec`` (see the module docstring)."""
    from pagedkv import LLM, SamplingParams
    from pagedkv.bench import kv_quant
    from pagedkv.bench.common import cpu_info

    one = SamplingParams(temperature=0, max_tokens=1)
    remote = SamplingParams(
        temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    out: dict[str, Any] = {"backend": args.pd_backend, "tokens": args.pd_tokens, "cpu": cpu_info()}
    max_len = args.pd_tokens + 16
    blocks = max(args.pd_prompts * (args.pd_tokens // 16 + 2) * 2, max_len // 16 * 2) + 16
    for dtype in args.dtypes:
        llm = LLM(dtype=dtype, num_kv_blocks=blocks, max_model_len=max_len)
        stream = kv_quant.make_corpus(llm, args.pd_prompts * args.pd_tokens, 0.0, args.seed)
        prompts = [
            {"prompt_token_ids": stream[i * args.pd_tokens : (i + 1) * args.pd_tokens]}
            for i in range(args.pd_prompts)
        ]
        llm.llm_engine.kv_cache_manager.reset_prefix_cache()
        rows: dict[str, dict[str, float]] = {}
        t = []
        for p in prompts:  # the consumer computing the prompt itself
            t0 = time.perf_counter()
            llm.generate([p], one, use_tqdm=False)
            t.append(time.perf_counter() - t0)
        rows["recompute"] = {"ttft_s": sorted(t)[len(t) // 2]}
        llm.llm_engine.shutdown()
        for codec in ("raw", "zstd", "lz4", "int8"):
            prod, cons = _pd_pair(codec, dtype, args.pd_backend, blocks, max_len)
            try:
                t = []
                for p in prompts:  # one request at a time: prefill, then the consumer's TTFT
                    (sent,) = prod.generate([p], remote, use_tqdm=False)
                    hand = SamplingParams(
                        temperature=0, max_tokens=1, kv_transfer_params=sent.kv_transfer_params
                    )
                    t0 = time.perf_counter()
                    cons.generate([p], hand, use_tqdm=False)
                    t.append(time.perf_counter() - t0)
                st = cons.llm_engine.connector.xfer_stats
                if st.num_failed or st.num_transfers != len(prompts):
                    raise RuntimeError(f"{codec}: {st.num_failed} failed transfers")
                tokens = len(prompts) * args.pd_tokens
                rows[codec] = {
                    "ttft_s": sorted(t)[len(t) // 2],
                    "transfer_s": st.latency_sum_s / st.num_transfers,
                    "bytes_per_token": st.num_bytes / tokens,
                }
            finally:
                prod.llm_engine.shutdown()
                cons.llm_engine.shutdown()
        raw = rows["raw"]
        for r in rows.values():
            r["ttft_vs_raw"] = r["ttft_s"] / raw["ttft_s"]
            if "bytes_per_token" in r:
                r["bytes_vs_raw"] = r["bytes_per_token"] / raw["bytes_per_token"]
                r["transfer_vs_raw"] = r["transfer_s"] / raw["transfer_s"]
        out[dtype] = rows
    return out


def pd_table(r: dict[str, Any]) -> str:
    lines = [
        f"PD transfers ({r['backend']}, {r['tokens']}-token prompts)",
        "codec     dtype      B/token  bytes/raw  transfer ms  transfer/raw  TTFT ms  TTFT/raw",
    ]
    for dtype, rows in r.items():
        if not isinstance(rows, dict) or dtype == "cpu":
            continue
        for name, c in rows.items():
            lines.append(
                f"{name:9s} {dtype:9s} {c.get('bytes_per_token', float('nan')):8.0f}"
                f" {c.get('bytes_vs_raw', float('nan')):10.3f}"
                f" {c.get('transfer_s', float('nan')) * 1e3:12.1f}"
                f" {c.get('transfer_vs_raw', float('nan')):13.3f}"
                f" {c['ttft_s'] * 1e3:8.1f} {c['ttft_vs_raw']:9.3f}"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = dict(pages=bench_pages(args))
    if not args.skip_accuracy:
        report["int8_accuracy"] = bench_accuracy(args)
    bf16 = report["pages"].get("bfloat16", {}).get("codecs", {})
    acc = report.get("int8_accuracy", {})
    report["targets"] = TARGETS
    report["meets"] = dict(
        lossless_bf16=max(bf16.get(c, {}).get("ratio", 0) for c in ("zstd", "lz4"))
        >= TARGETS["lossless_bf16_ratio"]
        if bf16
        else None,
        int8_ratio=bf16["int8"]["ratio"] >= TARGETS["int8_ratio"] if bf16 else None,
        int8_top1=acc["top1_agreement"] >= TARGETS["int8_top1"] if acc else None,
    )
    return report


def table(r: dict[str, Any]) -> str:
    lines = [
        "codec   dtype      ratio  B/token  encode MB/s  decode MB/s  disk load MB/s"
        "  p2p load MB/s  p2p wire B/token"
    ]
    for dtype, d in r["pages"].items():
        for name, c in d["codecs"].items():
            lines.append(
                f"{name:7s} {dtype:9s} {c['ratio']:6.2f}x {c['bytes_per_token']:8.0f}"
                f" {c['encode_MBps']:11.0f} {c['decode_MBps']:12.0f}"
                f" {c.get('disk_load_MBps', float('nan')):15.0f}"
                f" {c.get('p2p_load_MBps', float('nan')):14.0f}"
                f" {c.get('p2p_wire_bytes_per_token', float('nan')):17.0f}"
            )
    acc = r.get("int8_accuracy")
    if acc:
        lines.append(
            f"int8 round trip on every K/V row: top-1 {acc['top1_agreement']:.2%}, "
            f"KL {acc['mean_kl']:.4f}, dPPL {acc['ppl_delta_pct']:+.2f}% "
            f"over {acc['positions']} positions"
        )
    lines.append(f"meets: {r['meets']}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--tokens", type=int, default=8192, help="corpus tokens whose pages are coded")
    p.add_argument("--accuracy-tokens", type=int, default=20_000)
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--skip-tiers", action="store_true", help="no disk/P2P load measurement")
    p.add_argument("--tier-chunks", type=int, default=256, help="pages loaded from the tiers")
    p.add_argument("--pd-backend", default="tcp", choices=["tcp", "nixl"])
    p.add_argument("--pd-tokens", type=int, default=2048, help="tokens of each PD prompt")
    p.add_argument("--pd-prompts", type=int, default=5)
