"""Offline throughput: pagedkv against HF transformers ``generate`` on the same workload, in one run.

Workload (fixed seed): ``--num-requests`` requests (64), prompt lengths uniform in
``--prompt-len`` (32:512) tokens, output lengths uniform in ``--output-len`` (32:256) tokens.
Prompts are random token ids drawn uniformly from the vocabulary: both systems see exactly the
same ids (no tokenizer round trip), and ``ignore_eos`` makes every request produce exactly its
requested length, so the work is fixed whatever the text.

* pagedkv: all requests submitted at once to ``LLM.generate`` (continuous batching, greedy,
  ``ignore_eos``, prefix caching on but nothing to hit).
* HF: static batches of ``--hf-batch-size`` (8) in request order, left-padded, greedy, model
  loaded with ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=...)``. A static
  batch runs until its longest request is done (``min_new_tokens == max_new_tokens`` = the
  batch max, so EOS cannot end it early). For fairness only the *requested* tokens of each
  request are counted (its prompt + its own output length); the padding and the extra tokens
  generated for shorter requests of a batch are HF's waste, not credited.

Tokens/s are reported for prompt + output and for output alone, plus the ratio pagedkv / HF.
Batch-1 decode: one request, 32-token prompt, 128 output tokens; decode tok/s excludes the
first token (from the first token's timestamp to the last's: pagedkv's request metrics; for HF
a stopping criterion that never stops timestamps every step).

Compute ceiling: the fp32 (``--dtype``) matmul rate of this machine, measured in the same run
(best of a 1024x1024 @ 1024x1024 loop, over ``torch.matmul`` (MKL) and, in float32, the oneDNN
linear pagedkv can use, ``PAGEDKV_DENSE_LINEAR=onednn``: whichever library is faster sets it),
divided by 2 x parameters FLOPs per token (0.27 GFLOP for SmolLM2-135M). The pagedkv total
tok/s is reported as a fraction of it; the JSON names the library pagedkv's linears used.

Targets (printed beside the figures): pagedkv >= 5x HF total tok/s; >= 75% of the compute
ceiling of the run's dtype (issue 13; the ceiling is measured in that dtype); batch-1 decode
>= 40 tok/s (HF ~15).

Usage: python benchmarks/bench_throughput.py [--num-requests N] [--dtype D] [--skip-hf]
       [--json-out FILE] [--json-only]        (same as ``pagedkv bench throughput``)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import random
import time
from dataclasses import dataclass
from typing import Any

from pagedkv.bench.common import (
    BenchOptionError,
    add_output_args,
    fmt,
    int_range,
    log,
    random_token_ids,
    ratio,
    run_and_emit,
    user_help,
)

# fraction_of_ceiling: issue 13's bar (75% of the same-run matmul ceiling, float32 and bfloat16 alike).
TARGETS = {"vs_hf_total": 5.0, "fraction_of_ceiling": 0.75, "batch1_decode_tok_s": 40.0}
HF_BATCH1_REFERENCE_TOK_S = 15.0
WARMUP_PROMPT_LEN, WARMUP_OUTPUT_LEN = 32, 8  # one untimed request first (lazy init, allocator)


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> Workload:
    rng = random.Random(seed)
    prompts = [
        random_token_ids(rng, rng.randint(*prompt_len), vocab_size) for _ in range(num_requests)
    ]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(num_requests)])


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pagedkv.engine.arg_utils import EngineArgs
    from pagedkv.engine.config import FLOAT_DTYPES

    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int_range, default=(32, 512), metavar="MIN:MAX")
    p.add_argument("--output-len", type=int_range, default=(32, 256), metavar="MIN:MAX")
    p.add_argument("--batch1-prompt-len", type=int, default=32)
    p.add_argument("--batch1-output-len", type=int, default=128)
    p.add_argument("--hf-batch-size", type=int, default=8)
    # float dtypes only: the transformers baseline runs in the same dtype.
    EngineArgs.add_cli_args(
        p, include=("dtype", "model"), overrides=dict(dtype=dict(choices=FLOAT_DTYPES))
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--skip-hf", action="store_true", help="pagedkv only (no transformers baseline)")
    p.add_argument(
        "--matmul-seconds", type=float, default=2.0, help="time spent measuring the matmul rate"
    )
    add_output_args(p)


# ---------------------------------------------------------------- machine ceiling


def matmul_gflops(dtype: Any, seconds: float, n: int = 1024) -> dict[str, float]:
    """Best observed ``n x n @ n x n`` rate in GFLOP/s per library (the machine's peak, as a
    ceiling): ``torch.matmul`` (MKL) and, for float32 where torch has it, oneDNN's linear
    (``pagedkv.ops.dense_linear``), ``seconds`` shared between them."""
    import torch

    from pagedkv.ops import dense_linear

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    bt = b.T.contiguous()
    fns = {"mkl": lambda: torch.matmul(a, b)}
    if dtype == torch.float32 and torch.backends.mkldnn.is_available():
        fns["onednn"] = lambda: dense_linear.onednn_linear(a, bt, None)
    flop = 2 * n**3
    rates = {}
    for name, fn in fns.items():
        for _ in range(3):
            fn()
        best, deadline = 0.0, time.perf_counter() + seconds / len(fns)
        while True:
            t = time.perf_counter()
            for _ in range(5):
                fn()
            best = max(best, 5 * flop / (time.perf_counter() - t) / 1e9)
            if time.perf_counter() > deadline:
                break
        rates[name] = best
    return rates


# ---------------------------------------------------------------- pagedkv


def bench_pagedkv(args: argparse.Namespace, w: Workload) -> dict[str, Any]:
    from pagedkv import LLM, SamplingParams

    t = time.perf_counter()
    max_len = max(
        args.prompt_len[1] + args.output_len[1],
        args.batch1_prompt_len + args.batch1_output_len,
        WARMUP_PROMPT_LEN + WARMUP_OUTPUT_LEN,
    )
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=max_len)
    load_s = time.perf_counter() - t
    vocab = llm.llm_engine.model_config.vocab_size
    rng = random.Random(
        args.seed + 1
    )  # warm-up and batch-1 prompts share nothing with the workload
    llm.generate(
        {"prompt_token_ids": random_token_ids(rng, WARMUP_PROMPT_LEN, vocab)},
        SamplingParams(temperature=0, max_tokens=WARMUP_OUTPUT_LEN, ignore_eos=True),
        use_tqdm=False,
    )

    one = {"prompt_token_ids": random_token_ids(rng, args.batch1_prompt_len, vocab)}
    (o,) = llm.generate(
        one,
        SamplingParams(temperature=0, max_tokens=args.batch1_output_len, ignore_eos=True),
        use_tqdm=False,
    )
    m = o.metrics
    decode_s = m.finished_time - m.first_token_time
    batch1 = (len(o.outputs[0].token_ids) - 1) / decode_s if decode_s > 0 else None
    llm.reset_prefix_cache()

    prompts = [{"prompt_token_ids": p} for p in w.prompts]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in w.output_lens]
    before = llm.stats()["num_preemptions"]
    t = time.perf_counter()
    # The progress bar (stderr; tok/s in its postfix) costs one update per finished request.
    outs = llm.generate(prompts, params, use_tqdm=not args.json_only)
    elapsed = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != w.output_tokens:
        raise RuntimeError(
            f"pagedkv produced {produced} output tokens, {w.output_tokens} requested"
        )
    return dict(
        load_s=load_s,
        elapsed_s=elapsed,
        total_tok_s=(w.prompt_tokens + w.output_tokens) / elapsed,
        output_tok_s=w.output_tokens / elapsed,
        batch1_decode_tok_s=batch1,
        batch1_ttft_s=m.time_to_first_token,
        num_preemptions=llm.stats()["num_preemptions"] - before,
        num_kv_blocks=llm.llm_engine.kv_cache_config.num_blocks,
        num_params=llm.llm_engine.model_config.num_params,
    )


# ---------------------------------------------------------------- transformers


def load_hf(model: str | None, dtype: Any) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from pagedkv.models.loader import resolve_model_path

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = resolve_model_path(model)
    # The GGUF conversion draws a bare tqdm bar on stderr that no transformers switch silences.
    with contextlib.redirect_stderr(io.StringIO()):
        if path.suffix.lower() == ".gguf":
            net = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=dtype
            )
        else:
            net = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return net.eval()


def hf_generate(
    net: Any,
    prompts: list[list[int]],
    new_tokens: int,
    pad_id: int,
    token_times: list[float] | None = None,
) -> int:
    """One static, left-padded, greedy batch of exactly ``new_tokens`` tokens per row; returns
    the tokens generated (all rows, padding waste included). ``token_times`` receives the time
    each token step finished."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Clock(StoppingCriteria):
        """Never stops; timestamps every generated token (called once per step)."""

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            if token_times is not None:
                token_times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = net.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad_id,
            temperature=None,
            top_p=None,
            top_k=None,
            stopping_criteria=StoppingCriteriaList([Clock()]),
        )
    return (out.shape[1] - width) * out.shape[0]


def bench_hf(args: argparse.Namespace, w: Workload, pad_id: int) -> dict[str, Any]:
    import torch

    t = time.perf_counter()
    net = load_hf(args.model, getattr(torch, args.dtype))
    load_s = time.perf_counter() - t
    rng = random.Random(args.seed + 1)
    vocab = net.config.vocab_size
    hf_generate(net, [random_token_ids(rng, WARMUP_PROMPT_LEN, vocab)], WARMUP_OUTPUT_LEN, pad_id)
    times: list[float] = []
    hf_generate(
        net,
        [random_token_ids(rng, args.batch1_prompt_len, vocab)],
        args.batch1_output_len,
        pad_id,
        times,
    )
    batch1 = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else None

    generated = 0
    bs = args.hf_batch_size
    t = time.perf_counter()
    for i in range(0, len(w.prompts), bs):
        generated += hf_generate(net, w.prompts[i : i + bs], max(w.output_lens[i : i + bs]), pad_id)
        log(
            args,
            f"transformers: batch {i // bs + 1}/{-(-len(w.prompts) // bs)} done "
            f"({time.perf_counter() - t:.1f} s)",
        )
    elapsed = time.perf_counter() - t
    return dict(
        load_s=load_s,
        elapsed_s=elapsed,
        total_tok_s=(w.prompt_tokens + w.output_tokens) / elapsed,
        output_tok_s=w.output_tokens / elapsed,
        batch1_decode_tok_s=batch1,
        generated_tokens_incl_waste=generated,
        batch_size=bs,
    )


# ---------------------------------------------------------------- report


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pagedkv.ops import dense_linear

    if args.num_requests < 1 or args.hf_batch_size < 1:
        raise BenchOptionError("--num-requests and --hf-batch-size must be >= 1")
    log(args, "measuring the matmul rate ...")
    rates = matmul_gflops(getattr(torch, args.dtype), args.matmul_seconds)
    gflops = max(rates.values())
    from pagedkv.models.config import load_model_config

    cfg = load_model_config(args.model)
    w = make_workload(
        args.num_requests, args.prompt_len, args.output_len, cfg.vocab_size, args.seed
    )
    log(
        args,
        f"pagedkv: {args.num_requests} requests, {w.prompt_tokens} prompt + {w.output_tokens} output tokens ...",
    )
    ours = bench_pagedkv(args, w)
    gflop_per_token = 2 * ours.pop("num_params") / 1e9
    ceiling = gflops / gflop_per_token
    ours["fraction_of_ceiling"] = ours["total_tok_s"] / ceiling
    hf = None
    if not args.skip_hf:
        log(args, "transformers: same workload ...")
        hf = bench_hf(args, w, pad_id=_pad_id(args.model, cfg))
    ratios = {
        k: ratio(ours[k], hf[k]) if hf else None
        for k in ("total_tok_s", "output_tok_s", "batch1_decode_tok_s")
    }
    meets = {
        "vs_hf_total": None if hf is None else ratios["total_tok_s"] >= TARGETS["vs_hf_total"],
        "fraction_of_ceiling": ours["fraction_of_ceiling"] >= TARGETS["fraction_of_ceiling"],
        "batch1_decode_tok_s": (ours["batch1_decode_tok_s"] or 0) >= TARGETS["batch1_decode_tok_s"],
    }
    return dict(
        benchmark="throughput",
        dtype=args.dtype,
        workload=dict(
            num_requests=args.num_requests,
            prompt_len=list(args.prompt_len),
            output_len=list(args.output_len),
            prompt_tokens=w.prompt_tokens,
            output_tokens=w.output_tokens,
            seed=args.seed,
            prompts="random token ids",
            batch1=dict(prompt_len=args.batch1_prompt_len, output_len=args.batch1_output_len),
        ),
        machine=dict(
            matmul_gflops=gflops,
            matmul_gflops_by_library=rates,
            gflop_per_token=gflop_per_token,
            ceiling_tok_s=ceiling,
            torch_threads=torch.get_num_threads(),
            dense_linear=dense_linear.backend() if args.dtype == "float32" else "blas",
        ),
        pagedkv=ours,
        hf=hf,
        ratios=ratios,
        targets=TARGETS | {"hf_batch1_reference_tok_s": HF_BATCH1_REFERENCE_TOK_S},
        meets_targets=meets,
    )


def _pad_id(model: str | None, cfg: Any) -> int:
    """Left-padding id: the tokenizer's pad (else eos) id; masked out, so any valid id works."""
    from pagedkv.models.loader import resolve_model_path
    from pagedkv.models.tokenizer import Tokenizer

    path = resolve_model_path(model)
    try:
        tok = (
            Tokenizer.from_gguf(path)
            if path.suffix.lower() == ".gguf"
            else Tokenizer.from_hf_dir(path)
        )
        pad = tok.pad_token_id
    except (FileNotFoundError, NotImplementedError, KeyError):
        pad = None
    return pad if pad is not None else (cfg.eos_token_id or 0)


def table(r: dict[str, Any]) -> str:
    ours, hf, ra, mach, w = r["pagedkv"], r["hf"] or {}, r["ratios"], r["machine"], r["workload"]

    def row(label: str, key: str, target: str = "") -> str:
        return (
            f"{label:24s}{fmt(ours.get(key)):>10s}{fmt(hf.get(key)):>10s}"
            f"{fmt(ra.get(key), '.2f'):>8s}{'x' if ra.get(key) else ' '}   {target}"
        ).rstrip()

    lines = [
        f"workload: {w['num_requests']} requests, prompts {w['prompt_len'][0]}-{w['prompt_len'][1]} "
        f"({w['prompt_tokens']} tokens), outputs {w['output_len'][0]}-{w['output_len'][1]} "
        f"({w['output_tokens']} tokens), {r['dtype']}, greedy, ignore_eos",
        f"machine: {mach['matmul_gflops']:.1f} GFLOP/s matmul ({mach['torch_threads']} threads; "
        + ", ".join(f"{k} {v:.1f}" for k, v in mach.get("matmul_gflops_by_library", {}).items())
        + f"), {mach['gflop_per_token']:.3f} GFLOP/token -> ceiling {mach['ceiling_tok_s']:.0f} tok/s; "
        f"pagedkv's float32 linears: {mach.get('dense_linear', 'blas')}",
        "",
        f"{'figure':24s}{'pagedkv':>10s}{'HF':>10s}{'ratio':>9s}   target",
        row("total tok/s", "total_tok_s", f">= {TARGETS['vs_hf_total']:.0f}x HF"),
        row("output tok/s", "output_tok_s"),
        row(
            "batch-1 decode tok/s",
            "batch1_decode_tok_s",
            f">= {TARGETS['batch1_decode_tok_s']:.0f} (HF ~{HF_BATCH1_REFERENCE_TOK_S:.0f})",
        ),
        row("elapsed s", "elapsed_s"),
        f"{'fraction of ceiling':24s}{ours['fraction_of_ceiling']:10.1%}{'':19s}   "
        f">= {TARGETS['fraction_of_ceiling']:.0%} (of the {r['dtype']} ceiling)",
        f"pagedkv preemptions: {ours['num_preemptions']}; KV blocks: {ours['num_kv_blocks']}",
    ]
    if hf:
        lines.append(
            f"HF generated {hf['generated_tokens_incl_waste']} tokens for {w['output_tokens']} requested "
            f"(static batches of {hf['batch_size']}; only requested tokens are counted)"
        )
    lines.append("meets targets: " + ", ".join(f"{k}={v}" for k, v in r["meets_targets"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=user_help(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    return run_and_emit(run, table, p.parse_args(argv))
