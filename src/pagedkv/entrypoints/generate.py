"""``pagedkv generate "prompt"``: one completion (or ``--n`` of them) from the command line.

Prints the completion text, or with ``--json`` one object: ``text``, ``token_ids``,
``finish_reason`` (of the first sample), ``outputs`` (every sample), ``num_cached_tokens``,
``ttft`` and ``e2e_latency`` (seconds). ``--chat`` renders the prompt as a user message with the
model's chat template (``--system`` adds a system message). ``-`` reads the prompt from stdin
(trailing newlines dropped).

Sampling flags default to `SamplingParams`' own defaults (temperature 1.0, so pass
``--temperature 0`` for greedy). Invalid values exit with code 2 and a one-line message on
stderr, before the model is loaded.

This module also owns the engine and sampling flags that ``pagedkv chat`` shares.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

USER_ERRORS = (ValueError, FileNotFoundError, NotImplementedError)


class CLIError(Exception):
    """A user-facing failure: printed as one line on stderr, exit code 2."""


# ---------------------------------------------------------------- shared flags


def add_engine_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Model and KV-cache flags (`EngineConfig` fields) shared by generate, chat and serve;
    returns the group so a command can add its own engine flags to it."""
    from pagedkv.entrypoints.plan import parse_size

    g = p.add_argument_group("engine")
    g.add_argument("--model", help="a .gguf file or HF model directory (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-model-len", type=int, default=None, help="context length cap")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV pool size in blocks")
    g.add_argument("--kv-cache-memory", type=parse_size, default=None, help="KV pool size, e.g. 512MiB")
    g.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", dest="no_prefix_caching",
                   action="store_true", help="disable prefix caching")
    g.add_argument("--kv-offload", default=None, metavar="SPEC",
                   help="KV tiers, e.g. cpu:4GiB,disk:/var/cache/pagedkv:20GiB,redis://127.0.0.1:6379")
    g.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    return g


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int, temperature: float) -> None:
    """Sampling and stopping flags (`SamplingParams` fields)."""
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help=f"(default {max_tokens})")
    g.add_argument("--temperature", type=float, default=temperature, help=f"0 = greedy (default {temperature})")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 or -1 disables")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None, metavar="STR",
                   help="stop string (repeatable); removed from the output")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def sampling_params(args: argparse.Namespace, **extra: Any) -> Any:
    """`SamplingParams` from the flags; raises CLIError naming the bad value. No torch import."""
    from pagedkv.engine.sampling_params import SamplingParams

    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                              seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos, **extra)
    except ValueError as e:
        raise CLIError(str(e)) from None


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`LLM(...)` keywords from the flags, validated (CLIError) before any weight is read."""
    from pagedkv.engine.config import EngineConfig

    kw = dict(block_size=args.block_size, max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
              kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=not args.no_prefix_caching,
              dtype=args.dtype, seed=args.seed if args.seed is not None else 0,
              kv_offload=args.kv_offload, preemption_mode=args.preemption_mode)
    try:
        EngineConfig(model=args.model, **kw)
    except ValueError as e:
        raise CLIError(str(e)) from None
    return kw


def make_llm(args: argparse.Namespace) -> Any:
    """Load the model; an unreadable or unsupported model becomes a CLIError."""
    kw = engine_kwargs(args)
    from pagedkv import LLM

    try:
        return LLM(model=args.model, **kw)
    except USER_ERRORS as e:
        raise CLIError(str(e)) from None


def fail(prog: str, err: Exception) -> int:
    print(f"pagedkv {prog}: error: {err}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------- generate


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="generate a completion for one prompt",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", help="the prompt text ('-' reads stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--system", default=None, help="with --chat: a system message")
    p.add_argument("--n", type=int, default=1, help="completions to sample (they share the prompt's KV)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_sampling_args(p, max_tokens=64, temperature=1.0)
    add_engine_args(p)
    p.set_defaults(func=run)
    return p


def output_dict(out: Any) -> dict[str, Any]:
    """The JSON shape of one `RequestOutput` (first sample at the top level)."""
    first = out.outputs[0]
    m = out.metrics
    return dict(
        text=first.text, token_ids=list(first.token_ids), finish_reason=first.finish_reason,
        outputs=[dict(index=c.index, text=c.text, token_ids=list(c.token_ids), finish_reason=c.finish_reason)
                 for c in out.outputs],
        prompt=out.prompt, num_prompt_tokens=len(out.prompt_token_ids),
        num_cached_tokens=out.num_cached_tokens,
        ttft=m.time_to_first_token if m else None, e2e_latency=m.e2e_latency if m else None,
    )


def generate(args: argparse.Namespace) -> dict[str, Any]:
    # `echo ... |` appends a newline the user did not mean as part of the prompt.
    prompt = sys.stdin.read().rstrip("\n") if args.prompt == "-" else args.prompt
    if not prompt:
        raise CLIError("the prompt is empty")
    params = sampling_params(args, n=args.n)
    llm = make_llm(args)
    try:
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": prompt})
            (out,) = llm.chat(messages, params, use_tqdm=False)
        else:
            (out,) = llm.generate(prompt, params, use_tqdm=False)
    except ValueError as e:  # prompt too long for the context or the KV pool, no template...
        raise CLIError(str(e)) from None
    return output_dict(out)


def run(args: argparse.Namespace) -> int:
    if args.system is not None and not args.chat:
        return fail("generate", CLIError("--system needs --chat"))
    try:
        result = generate(args)
    except CLIError as e:
        return fail("generate", e)
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
    elif len(result["outputs"]) == 1:
        print(result["text"])
    else:
        for c in result["outputs"]:
            print(f"--- sample {c['index']} ({c['finish_reason']}) ---\n{c['text']}")
    return 0
