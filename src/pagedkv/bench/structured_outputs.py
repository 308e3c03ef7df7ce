"""Structured outputs: what a grammar costs, per library and per request.

Two parts, both on the default model's tokenizer and weights:

- **library** (``--only library``): for each installed backend (xgrammar, llguidance) and each
  kind (JSON Schema, any JSON object, regex, choice, EBNF grammar): the backend's start-up on
  this tokenizer, compile time (first, and again: xgrammar caches compiled grammars itself),
  and the mask time per token along a valid output (median, p99, max): the numbers that chose
  xgrammar first for ``structured_outputs_backend="auto"``.
- **engine** (``--only engine``): decode throughput of JSON-Schema requests against plain
  requests of the same prompts and output length, in one engine, alternated round by round
  (this machine is noisy), at ``--batch`` 1 and 8 concurrent requests. Plain requests run
  ``ignore_eos`` to ``--max-tokens``; schema requests follow a schema whose shortest document
  is longer than that (an array of ``minItems`` strings), so both produce ``--max-tokens``
  tokens. Reported: tokens/s (best round) of each, their ratio (the target: a JSON-Schema
  request costs ≤ 5% of throughput), and the mask seconds per step from the manager's counter.

Usage: python benchmarks/bench_structured_outputs.py [--only all|library|engine] [--rounds N] [--json-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from pagedkv.bench.common import (
    BenchOptionError,
    add_output_args,
    cpu_info,
    fmt,
    log,
    run_and_emit,
    user_help,
)

TARGET_RATIO = 0.95  # JSON-Schema tokens/s over plain tokens/s
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "zip"],
        },
    },
    "required": ["name", "age", "role", "address"],
}
PERSON_DOC = {
    "name": "Ada Lovelace",
    "age": 36,
    "tags": ["math", "poetry"],
    "role": "admin",
    "address": {"street": "12 St James's Square", "zip": "10001"},
}
ANY_JSON_DOC = {"title": "The quick brown fox jumps over the lazy dog " * 4, "n": [1, 2.5, None]}
# (kind, spec, a valid output): the library part walks each output token by token.
CASES: dict[str, tuple[str, str, str]] = {
    "json_schema": ("json", json.dumps(PERSON), json.dumps(PERSON_DOC, indent=2)),
    "json_object": ("json_object", "", json.dumps(ANY_JSON_DOC)),
    "regex": ("regex", r"[0-9]{3}-[0-9]{3}-[0-9]{4} [A-Z][a-z]+", "555-123-4567 Lovelace"),
    "choice": ("choice", json.dumps(["positive", "negative", "neutral"]), "negative"),
    "grammar": ("grammar", 'root ::= "(" n ("+" n)* ")"\nn ::= [1-9] [0-9]*', "(12+7+300)"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", choices=("all", "library", "engine"), default="all")
    p.add_argument("--rounds", type=int, default=3, help="engine rounds (plain and schema each)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="concurrent requests")
    p.add_argument("--model", default=None, help="model (default: the default GGUF)")
    p.add_argument("--dtype", default="float32")
    add_output_args(p)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.rounds < 1 or args.max_tokens < 8 or any(b < 1 for b in args.batch):
        raise BenchOptionError("need --rounds >= 1, --max-tokens >= 8 and positive --batch")
    report: dict[str, Any] = dict(benchmark="structured_outputs", cpu=cpu_info())
    if args.only in ("all", "library"):
        report["library"] = _library(args)
    if args.only in ("all", "engine"):
        report["engine"] = _engine(args)
    return report


# ---- library ----------------------------------------------------------------------------------


def _library(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pagedkv.engine.structured_output import StructuredOutputManager, backend_installed
    from pagedkv.models.config import load_model_config
    from pagedkv.models.loader import resolve_model_path
    from pagedkv.models.tokenizer import Tokenizer

    path = resolve_model_path(args.model)
    tok = Tokenizer.from_gguf(path) if str(path).endswith(".gguf") else Tokenizer.from_hf_dir(path)
    vocab = load_model_config(args.model).vocab_size
    out: dict[str, Any] = dict(vocab_size=vocab)
    for name in ("xgrammar", "guidance"):
        if not backend_installed(name):
            out[name] = None
            continue
        log(args, f"library: {name} ...")
        t0 = time.perf_counter()
        backend = StructuredOutputManager(tok, vocab).get_backend(name)
        res: dict[str, Any] = dict(startup_s=time.perf_counter() - t0)
        for case, (kind, spec, text) in CASES.items():
            ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
            compile_s: list[float] = []
            masks: list[float] = []
            for rep in range(3):
                t0 = time.perf_counter()
                grammar = backend.compile(kind, spec, False)()
                compile_s.append(time.perf_counter() - t0)
                bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
                for t in ids:
                    t0 = time.perf_counter()
                    grammar.fill_bitmask(bitmask, 0)
                    if rep == 2:
                        masks.append(time.perf_counter() - t0)
                    if not grammar.accept_token(t):
                        raise RuntimeError(f"{name} refused token {t} of its own {case} output")
            masks.sort()
            res[case] = dict(
                tokens=len(ids),
                compile_first_ms=compile_s[0] * 1e3,
                compile_again_ms=compile_s[2] * 1e3,
                mask_us_median=statistics.median(masks) * 1e6,
                mask_us_p99=masks[min(len(masks) - 1, int(0.99 * len(masks)))] * 1e6,
                mask_us_max=masks[-1] * 1e6,
            )
        out[name] = res
    return out


# ---- engine -----------------------------------------------------------------------------------


def _engine(args: argparse.Namespace) -> dict[str, Any]:
    from pagedkv import LLM, SamplingParams
    from pagedkv.engine.sampling_params import StructuredOutputsParams

    log(args, "engine: loading the model ...")
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=1024)
    tok = llm.llm_engine.tokenizer
    manager = llm.llm_engine.structured_output_manager
    # The shortest valid document is longer than --max-tokens: every request runs to it.
    schema = {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"type": "string"}, "minItems": args.max_tokens}
        },
        "required": ["items"],
    }
    asks = [
        "List many fruits as JSON.",
        "List many cities as JSON.",
        "List many colors as JSON.",
        "List many animals as JSON.",
    ]
    rows: list[dict[str, Any]] = []
    for batch in args.batch:
        prompts = [
            tok.apply_chat_template([{"role": "user", "content": asks[i % len(asks)]}])
            for i in range(batch)
        ]
        variants = {
            "plain": SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True),
            "json_schema": SamplingParams(
                temperature=0,
                max_tokens=args.max_tokens,
                structured_outputs=StructuredOutputsParams(json=schema),
            ),
        }
        llm.generate(prompts, variants["json_schema"], use_tqdm=False)  # compile, warm up
        best: dict[str, float] = {}
        mask_s_per_step: list[float] = []
        for r in range(args.rounds):
            for name, params in variants.items():
                m0 = manager.mask_seconds
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                dt = time.perf_counter() - t0
                n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
                best[name] = max(best.get(name, 0.0), n_tok / dt)
                if name == "json_schema":
                    mask_s_per_step.append((manager.mask_seconds - m0) / args.max_tokens)
                log(args, f"batch {batch} round {r}: {name} {n_tok / dt:.1f} tok/s")
        rows.append(
            dict(
                batch=batch,
                plain_tok_s=best["plain"],
                json_schema_tok_s=best["json_schema"],
                ratio=best["json_schema"] / best["plain"],
                mask_ms_per_step=1e3 * statistics.median(mask_s_per_step),
                backend=manager.backend,
                backends_used=sorted({k[0] for k in manager._cache}),
            )
        )
    return dict(
        model=args.model or "default GGUF",
        dtype=args.dtype,
        max_tokens=args.max_tokens,
        rounds=args.rounds,
        target_ratio=TARGET_RATIO,
        rows=rows,
    )


# ---- output -----------------------------------------------------------------------------------


def table(report: dict[str, Any]) -> str:
    lines: list[str] = []
    lib = report.get("library")
    if lib:
        lines += [
            "library (us per mask along a valid output; ms to compile)",
            f"{'backend':10} {'case':12} {'compile':>8} {'again':>8} {'p50':>7} {'p99':>7}",
        ]
        for name in ("xgrammar", "guidance"):
            res = lib.get(name)
            if not res:
                continue
            for case in CASES:
                c = res[case]
                lines.append(
                    f"{name:10} {case:12} {fmt(c['compile_first_ms'], '.2f'):>8} "
                    f"{fmt(c['compile_again_ms'], '.2f'):>8} {fmt(c['mask_us_median']):>7} "
                    f"{fmt(c['mask_us_p99']):>7}"
                )
    eng = report.get("engine")
    if eng:
        lines += [
            "",
            f"engine ({eng['dtype']}, {eng['max_tokens']} tokens per request, best of "
            f"{eng['rounds']})",
            f"{'batch':>5} {'plain tok/s':>12} {'schema tok/s':>13} {'ratio':>6} {'mask ms/step':>13}",
        ]
        for r in eng["rows"]:
            lines.append(
                f"{r['batch']:>5} {fmt(r['plain_tok_s']):>12} {fmt(r['json_schema_tok_s']):>13} "
                f"{fmt(r['ratio'], '.3f'):>6} {fmt(r['mask_ms_per_step'], '.3f'):>13}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=user_help(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    return run_and_emit(run, table, p.parse_args(argv))
