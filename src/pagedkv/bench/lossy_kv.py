"""Lossy KV memory: what each method loses, against the exact cache in the same run.

A lossy method changes what the model can ever see again, so one perplexity number does not
clear it (the seed's §8.2). Every part below runs the exact cache (float32) first, then each
method (``--methods``: KV cache formats such as ``int8``, ``fp8_per_token_head``, ``int4``;
token-eviction policies join as they are built), one engine at a time:

- **passkey** (``--only passkey``): the needle-in-a-haystack grid. A 5-digit pass key sits at
  depth 10-90% (``--depths``) of ``--lengths`` tokens of filler (1k, 2k, 4k, 8k), in the
  classic prompt (Mohtashami and Jaggi's filler sentences); the model greedily continues
  "The pass key is" and succeeds when the key appears in its first 8 tokens. ``--trials``
  (50) keys per cell. Reported per cell: successes of each method and of the exact cache (its
  own rate is the bar: a method is judged relative to it), and the method's rate relative to
  the exact one over the whole grid.
- **recall** (``--only recall``): an lm-eval-style multiple-choice task scored through
  ``prompt_logprobs``: the ``benchmarks/data/kv_recall.jsonl`` items the repo ships (written by
  `make_recall_items`, seeded) each list key-value facts ("The red box holds a lion.") spread
  through filler, then ask for one as a cloze ("Answer: The red box holds a"); each of 4
  choices (" lion", ...) is scored by the sum of its tokens' logprobs after the question, and
  the item is right when the true one scores highest (lm-eval's ``acc``). Accuracy of each
  method and of the exact cache. (Three facts in ~1.2k tokens, as a cloze: the default model
  answers ~90% with the exact cache; six facts asked as "which animal is in the red box?" left
  it at chance, which could judge no method.)
- **teacher** (``--only teacher``): teacher-forced top-1 agreement, KL and ΔPPL against the
  exact cache over ``--tokens`` (20k) positions of two generated corpora, and greedy-output
  agreement on chat prompts (`pagedkv.bench.kv_quant`'s method, reused).
- **prefix-hit** (``--only prefix-hit``, cache formats): greedy outputs after a prefix-cache
  hit against cold runs and the exact cache (`pagedkv.bench.lossy_prefix_hit`).

Usage: python benchmarks/bench_lossy_kv.py [--methods int8,int4] [--only all|passkey|recall|teacher] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path
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
from pagedkv.bench.lossy_methods import (
    EXACT,
    FILLER,
    Method,
    engine,
    parse_method,
    run_evict_teacher,
    run_memory,
    sampling_params,
)
from pagedkv.bench.lossy_prefix_hit import add_arguments as add_prefix_hit_arguments
from pagedkv.bench.lossy_prefix_hit import run_prefix_hit
from pagedkv.bench.lossy_prefix_hit import table_lines as prefix_hit_lines

DEFAULT_METHODS = ("int8", "fp8_per_token_head", "int4", "streaming:512", "snapkv:0.25")
RECALL_FILE = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "kv_recall.jsonl"
# Mohtashami & Jaggi (2023), the passkey test's own filler and question.
INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
    "it. I will quiz you about the important information there.\n"
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER_TOKENS = 8


# ---- methods (`pagedkv.bench.lossy_methods`) -------------------------------------------------


def method_kwargs(name: str) -> dict[str, Any]:
    """The `LLM` keywords of a method (token eviction runs on the exact float32 cache)."""
    return parse_method(name).engine_kwargs()


# ---- passkey ----------------------------------------------------------------------------------


def passkey_prompt(tokenizer: Any, length: int, depth: float, key: int) -> list[int]:
    """Token ids of a passkey prompt with the needle at ``depth`` (0..1) of the filler; with
    its ``ANSWER_TOKENS`` it holds at most ``length`` tokens (8192 = a model's whole context)."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    head, needle, tail = enc(INTRO), enc(NEEDLE.format(key=key)), enc(QUESTION)
    filler = enc(FILLER)
    room = length - ANSWER_TOKENS - len(head) - len(needle) - len(tail)
    if room < len(filler):
        raise BenchOptionError(f"length {length} leaves no room for filler")
    reps = room // len(filler)
    before = round(reps * depth)
    return head + filler * before + needle + filler * (reps - before) + tail


def run_passkey(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    keys = [[rng.randrange(10_000, 100_000) for _ in range(args.trials)] for _ in args.depths]
    out: dict[str, Any] = dict(
        lengths=args.lengths, depths=args.depths, trials=args.trials, methods={}
    )
    size = dict(max_model_len=max(args.lengths))
    for m in [Method(EXACT), *args.methods]:
        name = m.name
        t0 = time.perf_counter()
        llm = engine(m, **size, kv_cache_memory=args.kv_cache_memory)
        tok = llm.get_tokenizer()
        grid: list[list[int]] = []
        for length in args.lengths:
            row = []
            for d, cell_keys in zip(args.depths, keys):
                prompts = [
                    {"prompt_token_ids": passkey_prompt(tok, length, d, k)} for k in cell_keys
                ]
                params = [
                    sampling_params(
                        m, len(p["prompt_token_ids"]), temperature=0, max_tokens=ANSWER_TOKENS
                    )
                    for p in prompts
                ]
                outs = llm.generate(prompts, params, use_tqdm=False)
                row.append(sum(str(k) in o.outputs[0].text for k, o in zip(cell_keys, outs)))
            grid.append(row)
            log(args, f"  passkey {name:20s} {length:>5} tokens: {row} of {args.trials}")
        out["methods"][name] = dict(successes=grid, seconds=time.perf_counter() - t0)
        del llm
    exact = out["methods"][EXACT]["successes"]
    exact_total = sum(map(sum, exact))
    for m in out["methods"].values():
        total = sum(map(sum, m["successes"]))
        m["success_rate"] = total / (args.trials * len(args.depths) * len(args.lengths))
        m["relative_to_exact"] = total / exact_total if exact_total else None
    return out


# ---- recall (multiple choice through prompt_logprobs) -----------------------------------------

COLORS = (
    "red", "blue", "green", "yellow", "purple", "orange", "black", "white", "silver", "golden",
    "pink", "brown",
)  # fmt: skip
ANIMALS = (
    "lion", "zebra", "parrot", "turtle", "rabbit", "wolf", "dolphin", "camel", "owl", "tiger",
    "goat", "penguin",
)  # fmt: skip


# make_recall_items' arguments for the shipped file: 100 items, 3 facts, 16 filler sentences
# after each, seed 0.
RECALL_SHAPE = (100, 3, 16, 0)


def make_recall_items(n: int, facts: int, filler_reps: int, seed: int) -> list[dict[str, Any]]:
    """``n`` items (what ``benchmarks/data/kv_recall.jsonl`` holds, written with
    ``make_recall_items(*RECALL_SHAPE)``): ``facts`` (color, animal) pairs, the asked
    color's index, 4 choices (the true animal first: ``gold`` = 0) and the filler sentences
    after each fact. `recall_context` renders the text (~1.2k tokens with the default model)."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        colors = rng.sample(COLORS, facts)
        animals = rng.sample(ANIMALS, facts)
        asked = rng.randrange(facts)
        wrong = rng.sample([a for a in ANIMALS if a != animals[asked]], 3)
        items.append(
            dict(
                facts=[[c, a] for c, a in zip(colors, animals)],
                asked=asked,
                filler_reps=filler_reps,
                choices=[f" {animals[asked]}"] + [f" {w}" for w in wrong],
                gold=0,
            )
        )
    return items


def recall_context(item: dict[str, Any]) -> str:
    """The item's prompt: the facts spread through filler, then the question."""
    text = INTRO
    for color, animal in item["facts"]:
        text += f"The {color} box holds a {animal}. " + FILLER * item["filler_reps"]
    color = item["facts"][item["asked"]][0]
    return text + f"\nQuestion: what does the {color} box hold?\nAnswer: The {color} box holds a"


def load_recall_items(path: Path = RECALL_FILE) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def choice_logprobs(
    llm: Any, context: Sequence[int], choices: Sequence[Sequence[int]], method: Method | None = None
) -> list[float]:
    """Sum of each choice's token logprobs after ``context`` (lm-eval's loglikelihood), from
    ``prompt_logprobs`` of context + choice (``prompt_logprobs`` requests do not read the
    prefix cache, so each is scored in full). A SnapKV method compresses the context
    (``compress_at``), so the choice reads the compressed cache."""
    m = method or Method(EXACT)
    prompts = [{"prompt_token_ids": list(context) + list(c)} for c in choices]
    params = [
        sampling_params(
            m,
            len(p["prompt_token_ids"]),
            compress_at=len(context),
            temperature=0,
            max_tokens=1,
            prompt_logprobs=0,
        )
        for p in prompts
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    scores = []
    for o in outs:
        ids = o.prompt_token_ids
        lps = o.prompt_logprobs
        scores.append(sum(lps[i][ids[i]].logprob for i in range(len(context), len(ids))))
    return scores


def run_recall(args: argparse.Namespace) -> dict[str, Any]:
    items = load_recall_items()[: args.recall_items]
    out: dict[str, Any] = dict(items=len(items), file=str(RECALL_FILE.name), methods={})
    for m in [Method(EXACT), *args.methods]:
        name = m.name
        t0 = time.perf_counter()
        llm = engine(m, max_model_len=4096, kv_cache_memory=args.kv_cache_memory)
        tok = llm.get_tokenizer()
        right = 0
        for it in items:
            ctx = tok.encode(recall_context(it), add_special_tokens=False)
            chs = [tok.encode(c, add_special_tokens=False) for c in it["choices"]]
            scores = choice_logprobs(llm, ctx, chs, m)
            right += max(range(len(scores)), key=scores.__getitem__) == it["gold"]
        out["methods"][name] = dict(accuracy=right / len(items), seconds=time.perf_counter() - t0)
        log(args, f"  recall  {name:20s} accuracy {right / len(items):.2%}")
        del llm
    exact = out["methods"][EXACT]["accuracy"]
    for m in out["methods"].values():
        m["relative_to_exact"] = m["accuracy"] / exact if exact else None
    return out


# ---- teacher-forced ---------------------------------------------------------------------------


def run_teacher(args: argparse.Namespace) -> dict[str, Any]:
    from pagedkv.bench import kv_quant

    modes = [kv_quant.KVMode(m.name, m.kv_cache_dtype, None) for m in args.methods if not m.evicts]
    if not modes:
        return {}
    ns = argparse.Namespace(
        tokens=args.tokens,
        window=args.window,
        seed=args.seed,
        greedy_prompts=8,
        greedy_tokens=48,
        json_only=args.json_only,
    )
    res = kv_quant.run_accuracy(ns, modes)
    return dict(corpora=res["corpora"], scoring=res["scoring"], methods=res["modes"])


# ---- the command ------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated")
    p.add_argument(
        "--only",
        choices=("all", "passkey", "recall", "teacher", "evict-teacher", "memory", "prefix-hit"),
        default="all",
    )
    p.add_argument("--lengths", default="1024,2048,4096,8192", help="passkey context tokens")
    p.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="passkey needle depths")
    p.add_argument("--trials", type=int, default=50, help="passkey keys per cell")
    p.add_argument("--recall-items", type=int, default=100)
    p.add_argument("--tokens", type=int, default=20_000, help="teacher-forced positions per corpus")
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=int, default=2 << 30, help="bytes per engine")
    p.add_argument(
        "--memory-lengths", default="1024,2048,4096,8192", help="request tokens (--only memory)"
    )
    p.add_argument("--memory-output", type=int, default=64, help="output tokens (--only memory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a smoke-sized run")
    add_prefix_hit_arguments(p)
    add_output_args(p)


def run(args: argparse.Namespace) -> dict[str, Any]:
    args.methods = [parse_method(m) for m in args.methods.split(",") if m and m != EXACT]
    try:
        args.lengths = [int(x) for x in str(args.lengths).split(",")]
        args.depths = [float(x) for x in str(args.depths).split(",")]
        args.memory_lengths = [int(x) for x in str(args.memory_lengths).split(",")]
    except ValueError:
        raise BenchOptionError(
            "--lengths, --depths and --memory-lengths are comma-separated numbers"
        ) from None
    if args.quick:
        args.lengths, args.depths, args.trials = [512], [0.2, 0.8], 4
        args.recall_items, args.tokens, args.window = 2, 1024, 512
        args.memory_lengths, args.memory_output = [256, 512], 8
        args.hit_prompts, args.hit_prefix, args.hit_suffix, args.hit_output = 2, 256, 16, 8
    if args.trials < 1 or not all(0 <= d <= 1 for d in args.depths):
        raise BenchOptionError("need --trials >= 1 and depths in [0, 1]")
    report: dict[str, Any] = dict(
        benchmark="lossy_kv", cpu=cpu_info(), exact=EXACT, methods=[m.name for m in args.methods]
    )
    if args.only in ("all", "passkey"):
        log(args, "passkey grid ...")
        report["passkey"] = run_passkey(args)
    if args.only in ("all", "recall"):
        log(args, "recall task ...")
        report["recall"] = run_recall(args)
    if args.only in ("all", "teacher"):
        log(args, "teacher-forced agreement ...")
        report["teacher"] = run_teacher(args)
    evicting = [m for m in args.methods if m.evicts]
    if args.only in ("all", "evict-teacher") and evicting:
        log(args, "teacher-forced agreement of token eviction ...")
        report["evict_teacher"] = run_evict_teacher(args, evicting)
    if args.only in ("all", "memory") and evicting:
        log(args, "memory per request ...")
        report["memory"] = run_memory(args, evicting)
    # Cache formats only: token eviction never serves what it compressed as a hit.
    quantized = [m for m in args.methods if not m.evicts]
    if args.only in ("all", "prefix-hit") and quantized:
        log(args, "prefix-cache hits against cold runs ...")
        report["prefix_hit"] = run_prefix_hit(args, quantized)
    return report


def table(r: dict[str, Any]) -> str:
    lines: list[str] = []
    pk = r.get("passkey")
    if pk:
        lines.append(
            f"passkey: successes of {pk['trials']} per cell; rows = lengths {pk['lengths']}, "
            f"columns = depths {pk['depths']}"
        )
        for name, m in pk["methods"].items():
            rel = m["relative_to_exact"]
            lines.append(
                f"  {name:22s} rate {m['success_rate']:.1%}  vs exact {fmt(rel, '.2f')}  "
                + " | ".join(" ".join(f"{x:>2}" for x in row) for row in m["successes"])
            )
    rc = r.get("recall")
    if rc:
        lines.append(f"recall: accuracy over {rc['items']} items")
        for name, m in rc["methods"].items():
            lines.append(
                f"  {name:22s} {m['accuracy']:.1%}  vs exact {fmt(m['relative_to_exact'], '.2f')}"
            )
    for key, title in (
        ("teacher", "teacher-forced vs exact: top-1 / dPPL (greedy corpus; sampled corpus)"),
        (
            "evict_teacher",
            "token eviction, teacher-forced vs exact: top-1 / dPPL (greedy; sampled)",
        ),
    ):
        if r.get(key):
            lines.append(title)
            for name, m in r[key]["methods"].items():
                g, s = m["greedy"], m["sampled"]
                lines.append(
                    f"  {name:22s} {g['top1_agreement']:.2%} {g['ppl_delta_pct']:+.2f}%; "
                    f"{s['top1_agreement']:.2%} {s['ppl_delta_pct']:+.2f}%"
                )
    mem = r.get("memory")
    if mem:
        lines.append(f"peak KV tokens per request at request lengths {mem['lengths']}")
        for name, m in mem["methods"].items():
            lines.append(
                f"  {name:22s} {m['peak_tokens']}  (planned blocks {m['planned_blocks']}; "
                f"at the last step {m.get('final_tokens')})"
            )
    if r.get("prefix_hit"):
        lines += prefix_hit_lines(r["prefix_hit"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=user_help(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    return run_and_emit(run, table, p.parse_args(argv))
