"""Image inputs: what the encoder cache saves, and encoder/prefill/decode disaggregation (EPD)
against one colocated instance.

The model: the default model's language model (SmolLM2-135M-Instruct, its real weights) behind a
CLIP ViT-B/16 vision tower (224 px, 196 patches, 12 layers, random weights: the figures are
speed, not answers) and a LLaVA projector, written once as an HF LLaVA directory under
``--model-dir`` (default ``.bench/epd-model``) with SmolLM2's tokenizer plus an ``<image>``
token. Nothing is downloaded.

Parts:

* ``cache`` (offline, one process): TTFT of requests that repeat one image after different text
  (so no prefix hit reaches the image), with the encoder cache (``encoder_cache_size`` 8192)
  and without it (0), engines alternating request by request.
* ``serving`` (real servers, 2 cores): a mixed load of chat requests, ``--image-share`` of them
  with an image, Poisson arrivals at ``--rate``: one colocated instance on both cores, against
  EPD — an encoder instance (``ec_producer``) on core 0 and the language-model instance
  (``ec_consumer``) on core 1; an image request goes to the encoder's ``/v1/encode`` first and
  then, with its ``ec_transfer_params``, to the other (what ``pagedkv proxy --encoder`` does).
  Streamed: TTFT from arrival (the encode call included) and inter-token latency p50/p99.

Usage: python benchmarks/bench_epd.py [cache|serving|all] [--requests 40] [--rate 1.0] [--json-out F]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from pagedkv.bench.common import add_output_args, cpu_info, machine_line, run_and_emit
from pagedkv.bench.serving import dist

IMAGE_SIZE, PATCH = 224, 16
SEQ = (IMAGE_SIZE // PATCH) ** 2


def build_model(root: Path) -> Path:
    """The benchmark's LLaVA directory (built once; see the module docstring)."""
    if (root / "config.json").exists():
        return root
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    from pagedkv.models.loader import resolve_model_path

    gguf = resolve_model_path(None)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    lm = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    lm.resize_token_embeddings(len(tok))
    vision = CLIPVisionConfig(
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
    )
    cfg = LlavaConfig(
        text_config=lm.config,
        vision_config=vision,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        image_seq_length=SEQ,
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg).eval()
    model.model.language_model.load_state_dict(lm.model.state_dict())
    model.lm_head.weight = model.model.language_model.embed_tokens.weight
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(root)
    tok.save_pretrained(root)
    CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    ).save_pretrained(root)
    return root


def png(seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (256, 320, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


# ---- cache ------------------------------------------------------------------------------------


def run_cache(model: Path, trials: int) -> dict[str, Any]:
    from pagedkv import LLM, SamplingParams

    kw: dict[str, Any] = dict(model=str(model), max_model_len=2048, kv_cache_memory=512 << 20)
    engines = {"cache": LLM(**kw), "no_cache": LLM(encoder_cache_size=0, **kw)}
    image_token = engines["cache"].llm_engine.mm_processor.image_token_id
    img = png(1)
    one = SamplingParams(max_tokens=1, temperature=0)
    rnd = random.Random(0)
    ttft: dict[str, list[float]] = {k: [] for k in engines}
    for t in range(trials + 1):
        text = [rnd.randrange(1000, 40000) for _ in range(64)]
        for name, llm in engines.items():
            req = {
                "prompt_token_ids": [*text, image_token, 28, 29],
                "multi_modal_data": {"image": img},
            }
            t0 = time.perf_counter()
            llm.generate([req], one, use_tqdm=False)
            if t:  # the first round encodes everywhere (and warms up)
                ttft[name].append(time.perf_counter() - t0)
    c = engines["cache"].llm_engine.runner.encoder_cache.stats
    out = {
        "trials": trials,
        "image_tokens": SEQ,
        "ttft_cache_ms": statistics.median(ttft["cache"]) * 1e3,
        "ttft_no_cache_ms": statistics.median(ttft["no_cache"]) * 1e3,
        "encoder_cache_hits": c.hits,
    }
    out["ratio"] = out["ttft_cache_ms"] / out["ttft_no_cache_ms"]
    for llm in engines.values():
        llm.llm_engine.shutdown()
    return out


# ---- serving ----------------------------------------------------------------------------------


async def _one(
    client: Any, lm_url: str, enc_url: str | None, body: dict[str, Any], res: dict[str, Any]
) -> None:
    t0 = last = time.perf_counter()
    try:
        if enc_url is not None and res["image"]:
            r = await client.post(enc_url + "/v1/encode", json=body)
            r.raise_for_status()
            body = dict(body, ec_transfer_params=r.json()["ec_transfer_params"])
        async with client.stream("POST", lm_url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res["error"] = f"HTTP {r.status_code}"
                return
            tokens = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                n = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                if not chunk.get("choices") or n == tokens:
                    continue
                now = time.perf_counter()
                if res["ttft"] is None:
                    res["ttft"] = now - t0
                else:
                    res["itl"].extend([(now - last) / (n - tokens)] * (n - tokens))
                last, tokens = now, n
            res["tokens"] = tokens
    except Exception as e:  # noqa: BLE001 - a lost request is reported, not raised
        res["error"] = f"{type(e).__name__}: {e}"


async def _drive(lm_url: str, enc_url: str | None, reqs: list[dict[str, Any]]) -> list[dict]:
    import httpx

    results = [dict(image=r["image"], ttft=None, itl=[], tokens=0, error=None) for r in reqs]
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        tasks = []
        for req, res in zip(reqs, results):
            delay = start + req["at"] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(_one(client, lm_url, enc_url, req["body"], res)))
        await asyncio.gather(*tasks)
    return results


def _workload(n: int, rate: float, share: float, max_tokens: int, seed: int) -> list[dict]:
    rnd = random.Random(seed)
    words = "the a of to in is it on for that with as by at this from an be are or".split()
    t, out = 0.0, []
    for i in range(n):
        t += rnd.expovariate(rate)
        text = " ".join(rnd.choice(words) for _ in range(40))
        image = rnd.random() < share
        content: Any = text
        if image:
            url = "data:image/png;base64," + base64.b64encode(png(seed * 1000 + i)).decode()
            content = [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": text},
            ]
        body = {
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        out.append({"at": t, "image": image, "body": body})
    return out


def _summary(results: list[dict]) -> dict[str, Any]:
    ok = [r for r in results if r["error"] is None]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if r["error"]})[:3],
        "ttft_s": dist([r["ttft"] for r in ok if r["ttft"] is not None]),
        "ttft_image_s": dist([r["ttft"] for r in ok if r["image"] and r["ttft"] is not None]),
        "itl_s": dist([x for r in ok for x in r["itl"]]),
    }


def run_serving(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    import sys
    import tempfile

    from pagedkv.bench.instances import Cluster, Instance, free_port

    cli = [sys.executable, "-m", "pagedkv.entrypoints.cli", "serve", "--model", str(model)]
    common = ["--max-model-len", "2048", "--log-stats-interval", "0", "--max-num-seqs", "32"]
    reqs = _workload(args.requests, args.rate, args.image_share, args.max_tokens, args.seed)
    warm = _workload(2, 10.0, 1.0, 4, args.seed + 1)
    logs = Path(tempfile.mkdtemp(prefix="pagedkv-epd-"))
    out: dict[str, Any] = {
        "requests": args.requests,
        "rate": args.rate,
        "image_share": args.image_share,
    }

    def port_args() -> tuple[int, list[str]]:
        p = free_port()
        return p, ["--port", str(p)]

    p, pa = port_args()
    colo = Instance("colocated", [*cli, *common, *pa], p, logs / "colocated.log", [0, 1])
    with Cluster([colo]):
        asyncio.run(_drive(colo.url, None, warm))
        out["colocated"] = _summary(asyncio.run(_drive(colo.url, None, reqs)))
    pe, pea = port_args()
    pl, pla = port_args()
    producer = json.dumps(
        {"ec_role": "ec_producer", "ec_connector_extra_config": {"backend": "tcp"}}
    )
    consumer = json.dumps(
        {"ec_role": "ec_consumer", "ec_connector_extra_config": {"backend": "tcp"}}
    )
    enc = Instance(
        "encoder",
        [*cli, *common, *pea, "--ec-transfer-config", producer],
        pe,
        logs / "enc.log",
        [0],
    )
    lm = Instance(
        "lm", [*cli, *common, *pla, "--ec-transfer-config", consumer], pl, logs / "lm.log", [1]
    )
    with Cluster([enc, lm]):
        asyncio.run(_drive(lm.url, enc.url, warm))
        out["epd"] = _summary(asyncio.run(_drive(lm.url, enc.url, reqs)))
    for key in ("itl_s", "ttft_s", "ttft_image_s"):
        for q in ("p50", "p99"):
            a, b = out["epd"][key][q], out["colocated"][key][q]
            out[f"epd_vs_colocated_{key}_{q}"] = a / b if b else None
    out["logs"] = str(logs)
    return out


# ---- report -----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = build_model(Path(args.model_dir))
    report: dict[str, Any] = {
        "benchmark": "epd",
        "machine": machine_line(cpu_info(), None),
        "model": "SmolLM2-135M-Instruct LM + random CLIP ViT-B/16 tower (LLaVA)",
    }
    if args.part in ("cache", "all"):
        report["cache"] = run_cache(model, args.trials)
    if args.part in ("serving", "all"):
        report["serving"] = run_serving(model, args)
    return report


def table(r: dict[str, Any]) -> str:
    lines = [f"EPD on {r['machine']}; {r['model']}"]
    if "cache" in r:
        c = r["cache"]
        lines.append(
            f"repeated image, TTFT: with the encoder cache {c['ttft_cache_ms']:.0f} ms, without "
            f"{c['ttft_no_cache_ms']:.0f} ms ({c['ratio']:.2f}x)"
        )
    if "serving" in r:
        s = r["serving"]

        def ms(x: float | None) -> str:
            return "-" if x is None or x != x else f"{1e3 * x:.0f}"  # no sample: NaN

        lines.append(
            f"serving: {s['requests']} requests at {s['rate']}/s, {s['image_share']:.0%} with an image"
        )
        lines.append(
            f"{'setup':10s} {'ok':>4s} {'TTFT p50':>9s} {'p99':>7s} {'img p50':>8s} {'ITL p50':>8s} {'p99':>7s}"
        )
        for name in ("colocated", "epd"):
            x = s[name]
            lines.append(
                f"{name:10s} {x['completed']:4d} {ms(x['ttft_s']['p50']):>9s} {ms(x['ttft_s']['p99']):>7s} "
                f"{ms(x['ttft_image_s']['p50']):>8s} {ms(x['itl_s']['p50']):>8s} {ms(x['itl_s']['p99']):>7s}"
            )
        ratio = s["epd_vs_colocated_itl_s_p99"]
        lines.append(
            f"EPD / colocated ITL p99: {'-' if ratio is None or ratio != ratio else f'{ratio:.2f}x'}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("part", nargs="?", default="all", choices=["cache", "serving", "all"])
    p.add_argument("--model-dir", default=".bench/epd-model")
    p.add_argument("--trials", type=int, default=5, help="cache: repeated-image requests")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=1.0, help="serving: arrivals per second")
    p.add_argument("--image-share", type=float, default=0.5)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    add_output_args(p)
    return run_and_emit(run, table, p.parse_args(argv))
