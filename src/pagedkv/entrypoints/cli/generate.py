"""``pagedkv generate "prompt"``: one completion (or ``--n``) from the command line.

Also owns what generate, chat and serve share: the engine and sampling flags, the pre-flight
check that fails fast (one line, exit 2) on a bad model or a KV cache too small for one
request before any weight is read, the "loading model ... done in 1.2 s" progress line, and
the KV cache summary line on stderr. ``DESCRIPTION`` is the user-facing help.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pagedkv.entrypoints.cli.common import CLIError, read_model_config

USER_ERRORS = (ValueError, FileNotFoundError, NotImplementedError)

DESCRIPTION = """\
Generate a completion for one prompt and print it (or, with --json, one JSON object with the
text, token ids, finish reason, cached prompt tokens and latencies).

--chat wraps the prompt in the model's chat template as a user message (--system adds a system
message). A prompt of '-' is read from standard input. Sampling flags default to the engine's
own defaults (temperature 1.0: pass --temperature 0 for greedy decoding). Invalid values exit
with code 2 and a one-line message before the model loads. Progress and the KV cache plan go
to standard error; standard output holds only the completion.
"""

EXAMPLES = """\
examples:
  pagedkv generate "The capital of France is" --temperature 0 --max-tokens 32
  pagedkv generate --chat "What is paged attention?" --json
  echo "Once upon a time" | pagedkv generate - --n 3 --seed 1
"""


# ---------------------------------------------------------------- shared flags


def add_engine_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Model and KV-cache flags (`EngineArgs`' ``CACHE_ARGS``) and the distributed ones
    (``PARALLEL_ARGS``) shared by generate, chat and serve; returns the engine group so a
    command can add its own engine flags to it."""
    from pagedkv.engine.arg_utils import PARALLEL_ARGS, EngineArgs

    group = EngineArgs.add_cli_args(p.add_argument_group("engine"))
    EngineArgs.add_cli_args(p.add_argument_group("distributed"), include=PARALLEL_ARGS)
    return group


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int, temperature: float) -> None:
    """Sampling and stopping flags (`SamplingParams` fields)."""
    g = p.add_argument_group("sampling")
    g.add_argument(
        "--max-tokens",
        type=int,
        default=max_tokens,
        help=f"tokens to generate at most (default {max_tokens})",
    )
    g.add_argument(
        "--temperature", type=float, default=temperature, help=f"0 = greedy (default {temperature})"
    )
    g.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)"
    )
    g.add_argument(
        "--top-k", type=int, default=0, help="sample from the k likeliest tokens (default 0: off)"
    )
    g.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="drop tokens below this fraction of the top one (default 0)",
    )
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="above 1 discourages repeats (default 1.0)",
    )
    g.add_argument("--seed", type=int, default=None, help="sampling seed, for reproducible samples")
    g.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="STR",
        help="stop string (repeatable); removed from the output",
    )
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def sampling_params(args: argparse.Namespace, **extra: Any) -> Any:
    """`SamplingParams` from the flags; raises CLIError naming the bad value. No torch import."""
    from pagedkv.engine.sampling_params import SamplingParams

    try:
        return SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
            **extra,
        )
    except ValueError as e:
        raise CLIError(str(e)) from None


def kv_transfer_config_arg(args: argparse.Namespace) -> Any:
    """The `KVTransferConfig` ``--kv-transfer-config`` gives (None without the flag). Bad JSON,
    an unknown or invalid field, or the flag together with ``--kv-offload`` (its short form)
    raise CLIError naming the flag; so does a ``kv_connector`` that no registered name or
    ``kv_connector_module_path`` provides (checked here: the engine would find out only after
    loading the weights)."""
    text = getattr(args, "kv_transfer_config", None)
    if text is None:
        if getattr(args, "kv_side_channel_port", None) is not None:
            raise CLIError(
                "--kv-side-channel-port needs --kv-transfer-config naming a NixlConnector"
            )
        return None
    if args.kv_offload is not None:
        raise CLIError(
            "give either --kv-offload or --kv-transfer-config, not both "
            "(--kv-offload SPEC is the short form of the OffloadingConnector's config)"
        )
    from pagedkv.kv_transfer.config import KVTransferConfig
    from pagedkv.kv_transfer.factory import KVConnectorFactory

    try:
        config = KVTransferConfig.from_cli(text)
        if config.kv_connector is not None:
            KVConnectorFactory.get_connector_class(config)
        return config
    except (ValueError, TypeError) as e:  # TypeError: a field of the wrong JSON type
        msg = str(e)
        named = msg.startswith("--kv-transfer-config")  # from_cli's JSON error names it already
        raise CLIError(msg if named else f"invalid --kv-transfer-config: {msg}") from None


def engine_args(args: argparse.Namespace) -> Any:
    """`EngineArgs` from the flags, ``--kv-transfer-config`` (and ``--kv-side-channel-port``)
    already checked and parsed by `kv_transfer_config_arg` (CLIError naming the flag); the port
    is folded into the config by `EngineArgs.config_kwargs`."""
    from pagedkv.engine.arg_utils import EngineArgs

    eargs = EngineArgs.from_cli_args(args)
    eargs.kv_transfer_config = kv_transfer_config_arg(args)
    return eargs


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`LLM(...)` keywords (model aside) from the flags, validated (CLIError) before any
    weight is read."""
    from pagedkv.engine.config import EngineConfig

    kw = engine_args(args).config_kwargs()
    try:
        EngineConfig(**kw)
    except ValueError as e:
        raise CLIError(str(e)) from None
    del kw["model"]
    return kw


def preflight(config: Any) -> Any:
    """Check what can be checked without loading weights; returns the model's `ModelConfig`.

    A missing or malformed model, and a KV cache that cannot hold one ``max_model_len``
    request (vLLM's start-up rule, `check_kv_cache_fits`), raise CLIError here, before the
    slow load, so the error is the only line printed."""
    from pagedkv.core.specs import align_hybrid_block_size, get_kv_cache_groups
    from pagedkv.engine.config import (
        check_kv_cache_fits,
        default_kv_cache_memory,
        resolve_dtype_name,
    )
    from pagedkv.models.loader import resolve_model_path

    try:
        path = resolve_model_path(config.model)
    except (FileNotFoundError, ValueError) as e:
        raise CLIError(str(e)) from None
    mc = read_model_config(str(path))
    memory = default_kv_cache_memory(config)
    try:
        dtype = resolve_dtype_name(config.dtype, mc.dtype)
        # A Mamba hybrid's engine raises the block size (LLMEngine._align_hybrid_block_size):
        # check the cache it will really allocate.
        block_size = align_hybrid_block_size(
            mc.kv_cache_specs(1, torch_dtype=dtype), config.block_size
        )
        specs = mc.kv_cache_specs(block_size, torch_dtype=dtype)
        if memory is not None:
            check_kv_cache_fits(
                config,
                get_kv_cache_groups(specs),
                config.max_model_len or mc.max_position_embeddings,
                memory,
            )
    except (ValueError, NotImplementedError) as e:
        raise CLIError(str(e)) from None
    return mc


@contextmanager
def loading_progress(prog: str, what: str) -> Iterator[None]:
    """``pagedkv PROG: loading WHAT ... done in 1.2 s`` on stderr around a slow step (the line
    ends with "failed" if it raises)."""
    print(f"pagedkv {prog}: loading {what} ...", end=" ", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        print("failed", file=sys.stderr, flush=True)
        raise
    print(f"done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def print_kv_summary(prog: str, engine: Any) -> None:
    """The engine's KV cache in `pagedkv plan`'s one-line summary, on stderr."""
    from pagedkv.entrypoints.cli.plan import engine_summary_line

    print(f"pagedkv {prog}: {engine_summary_line(engine)}", file=sys.stderr, flush=True)


def make_llm(args: argparse.Namespace, prog: str = "generate") -> Any:
    """Pre-flight, load the model with a progress line, print the KV summary; every user-facing
    failure becomes a CLIError."""
    from pagedkv.engine.config import EngineConfig

    kw = engine_kwargs(args)
    mc = preflight(EngineConfig(model=args.model, **kw))
    with loading_progress(prog, f"model {mc.name}"):
        from pagedkv import LLM

        try:
            llm = LLM(model=args.model, **kw)
        except USER_ERRORS as e:
            raise CLIError(str(e)) from None
    print_kv_summary(prog, llm.llm_engine)
    return llm


def fail(prog: str, err: Exception) -> int:
    print(f"pagedkv {prog}: error: {err}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------- generate


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "generate",
        help="generate a completion for one prompt",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("prompt", help="the prompt text ('-' reads stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--system", default=None, help="with --chat: a system message")
    p.add_argument(
        "--n",
        type=int,
        default=1,
        help="completions to sample; they share the prompt's KV (default 1)",
    )
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
        text=first.text,
        token_ids=list(first.token_ids),
        finish_reason=first.finish_reason,
        outputs=[
            dict(
                index=c.index,
                text=c.text,
                token_ids=list(c.token_ids),
                finish_reason=c.finish_reason,
            )
            for c in out.outputs
        ],
        prompt=out.prompt,
        num_prompt_tokens=len(out.prompt_token_ids),
        num_cached_tokens=out.num_cached_tokens,
        ttft=m.time_to_first_token if m else None,
        e2e_latency=m.e2e_latency if m else None,
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
            messages = [{"role": "system", "content": args.system}] if args.system else []
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
