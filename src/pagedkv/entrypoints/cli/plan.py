"""``pagedkv plan``: how many KV blocks, tokens and concurrent requests a memory budget buys.

Defaults are the engine's (`EngineConfig`): dtype, block size, token budget, and the KV memory
the engine sizes its pool from (1 GiB on CPU), so ``pagedkv plan`` with no flags prints what
``pagedkv serve`` will allocate; ``summary_line`` is the one line both print. User-facing help
is ``DESCRIPTION``; no torch import, so this runs on any machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from pagedkv.core import planning
from pagedkv.core.specs import KVQuantMode, align_hybrid_block_size, resolve_kv_cache_dtype
from pagedkv.core.units import parse_size  # noqa: F401  (the one parse_size: test_imports checks)
from pagedkv.engine.arg_utils import EngineArgs, size_arg
from pagedkv.engine.config import DEFAULT_CPU_KV_CACHE_MEMORY, resolve_dtype_name
from pagedkv.entrypoints.cli.common import CLIError, read_model_config

# Bytes per weight element as loaded. GGUF block formats include their per-block scales
# (q4_0: 18 B / 32 weights, q4_1: 20 B / 32, q8_0: 34 B / 32).
WEIGHT_DTYPE_BYTES: dict[str, float] = {
    "float32": 4.0,
    "float16": 2.0,
    "bfloat16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
    "q8_0": 34 / 32,
    "q4_0": 18 / 32,
    "q4_1": 20 / 32,
}

# Rows of the side-by-side table: (label, --kv-cache-dtype value, quant mode).
# "auto" resolves to the activation dtype (--dtype).
KV_MODES: list[tuple[str, str, KVQuantMode]] = [
    ("float32", "float32", KVQuantMode.NONE),
    ("auto", "auto", KVQuantMode.NONE),
    ("fp8_per_tensor", "fp8", KVQuantMode.FP8_PER_TENSOR),
    ("fp8_per_token_head", "fp8", KVQuantMode.FP8_PER_TOKEN_HEAD),
    ("int8_per_token_head", "int8", KVQuantMode.INT8_PER_TOKEN_HEAD),
    ("fp8_per_token_head_f16", "fp8", KVQuantMode.FP8_PER_TOKEN_HEAD_F16),
    ("int8_per_token_head_f16", "int8", KVQuantMode.INT8_PER_TOKEN_HEAD_F16),
    ("int4_per_token_head", "int4", KVQuantMode.INT4_PER_TOKEN_HEAD),
    ("int4_per_token_group", "int4", KVQuantMode.INT4_PER_TOKEN_GROUP),
    ("int3_per_token_group", "int3", KVQuantMode.INT3_PER_TOKEN_GROUP),
    ("int2_per_token_group", "int2", KVQuantMode.INT2_PER_TOKEN_GROUP),
    ("int3_kivi", "int3", KVQuantMode.INT3_KIVI),
    ("int2_kivi", "int2", KVQuantMode.INT2_KIVI),
]


DESCRIPTION = """\
How many KV cache blocks, tokens and concurrent requests a memory budget buys, for the chosen
KV dtype and for every KV quantization mode side by side.

The model's shape comes from a GGUF header (the bundled SmolLM2-135M-Instruct unless --model),
an HF config.json, or flags (--num-layers --num-kv-heads --head-dim ...; flags also override a
loaded model's fields). The budget is the KV memory itself (--memory; default: what the engine
allocates, 1 GiB on CPU) or a device size (--device-memory 24GiB) from which weights, a runtime
estimate and a headroom fraction are subtracted, every term printed. Defaults match the
engine's, so with no flags this prints what 'pagedkv serve' allocates.

Exits with code 2 and a one-line message when one request of --context tokens does not fit,
naming the length that would.
"""

EXAMPLES = """\
examples:
  pagedkv plan                                   # what 'pagedkv serve' will allocate
  pagedkv plan --memory 8GiB --context 4096 --dtype bfloat16
  pagedkv plan --device-memory 24GiB --dtype bfloat16
  pagedkv plan --model path/to/config.json --json
"""


class PlanError(CLIError):
    """A user-facing planning failure: printed on stderr, exit code 2."""


def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="plan KV cache capacity for a memory budget",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_argument_group("model (default: the bundled SmolLM2-135M-Instruct)")
    src.add_argument("--model", help="a .gguf file, an HF config.json, or a directory holding one")
    for flag, what in [
        ("--num-layers", "decoder layers"),
        ("--num-kv-heads", "KV heads"),
        ("--head-dim", "head size"),
        ("--num-heads", "query heads"),
        ("--hidden-size", "hidden size"),
        ("--intermediate-size", "MLP size"),
        ("--vocab-size", "vocabulary size"),
        ("--num-params", "parameter count"),
        ("--max-model-len", "the model's context length"),
        ("--sliding-window", "sliding window (tokens)"),
        ("--full-attention-every", "with --sliding-window: every Nth layer is full"),
    ]:
        src.add_argument(flag, type=int, help=what)
    mem = p.add_argument_group(
        f"memory (default: the engine's KV memory, {fmt_bytes(DEFAULT_CPU_KV_CACHE_MEMORY)} on CPU)"
    ).add_mutually_exclusive_group()
    mem.add_argument(
        "--memory",
        "--kv-cache-memory",
        dest="memory",
        type=size_arg,
        help="KV cache budget, e.g. 8GiB",
    )
    mem.add_argument(
        "--device-memory",
        type=size_arg,
        help="device size; weights, runtime and headroom are subtracted",
    )
    p.add_argument(
        "--weight-dtype",
        default=None,
        help=f"weight storage: {', '.join(WEIGHT_DTYPE_BYTES)} or bytes/param (default: --dtype)",
    )
    p.add_argument(
        "--runtime-memory",
        type=size_arg,
        default=None,
        help="runtime memory (activations, workspaces) instead of the built-in estimate",
    )
    p.add_argument(
        "--headroom",
        type=float,
        default=0.1,
        help="headroom fraction of device memory (default 0.1)",
    )
    # The engine's flags and defaults; --dtype takes any name the sizing knows (no choices).
    EngineArgs.add_cli_args(
        p,
        include=("block_size", "dtype", "kv_cache_dtype"),
        overrides=dict(
            dtype=dict(
                choices=None,
                help="model dtype, which the 'auto' KV dtype follows "
                "(default %(default)s, the engine's)",
            )
        ),
    )
    p.add_argument(
        "--kv-quant-mode", default=None, help="none, fp8_per_tensor, or a *_per_token_head mode"
    )
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="max model length per request (default: the model's context length)",
    )
    seqs = "max running sequences, for the runtime estimate (default %(default)s)"
    EngineArgs.add_cli_args(
        p,
        include=("max_num_batched_tokens", "max_num_seqs"),
        overrides=dict(max_num_seqs=dict(help=seqs)),
    )
    EngineArgs.add_cli_args(
        p.add_argument_group("distributed (per-rank capacity)"),
        include=(
            "tensor_parallel_size",
            "decode_context_parallel_size",
            "cp_kv_cache_interleave_size",
        ),
    )
    EngineArgs.add_cli_args(p, include=("kv_eviction",))
    p.add_argument(
        "--output-tokens",
        type=int,
        default=0,
        help="output tokens per request, for the token-eviction rows (default %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)
    return p


def summary_line(
    num_blocks: int, groups: Any, max_model_len: int, max_num_batched_tokens: int, dcp: int = 1
) -> str:
    """The one-line plan ``pagedkv plan``, ``serve``, ``generate`` and ``chat`` all print:
    blocks (null block included), bytes per block, token slots, and max concurrent requests at
    ``max_model_len``. With decode context parallelism ``dcp`` the blocks are the scheduler's
    virtual ones and the bytes are one rank's share."""
    gs = planning.as_groups(groups)
    bpb = planning.bytes_per_block(gs) // dcp
    block_size = gs[0].kv_cache_spec.block_size if gs else 0
    per_rank = f" ({block_size // dcp} on each of {dcp} DCP ranks)" if dcp > 1 else ""
    tokens = planning.max_num_tokens(num_blocks, gs, max_model_len, max_num_batched_tokens)
    conc = planning.get_max_concurrency(num_blocks, gs, max_model_len, max_num_batched_tokens)
    return (
        f"KV cache: {num_blocks:,} blocks of {block_size} tokens{per_rank} x {bpb:,} B = "
        f"{fmt_bytes(num_blocks * bpb)}, "
        f"{tokens:,} tokens, max {conc:.2f} concurrent requests at max_model_len {max_model_len}"
    )


def engine_summary_line(engine: Any) -> str:
    """`summary_line` of a built `LLMEngine`: what it really allocated."""
    kc = engine.kv_cache_config
    return summary_line(
        kc.num_blocks,
        kc.kv_cache_groups,
        engine.max_model_len,
        engine.config.max_num_batched_tokens,
        engine.config.decode_context_parallel_size,
    )


# ---------------------------------------------------------------- model


def build_model_config(args: argparse.Namespace) -> Any:
    """ModelConfig from --model / the default GGUF, with flag overrides; or from flags alone."""
    from pagedkv.models.config import ModelConfig

    shape_flags = (args.num_layers, args.num_kv_heads, args.head_dim)
    if args.model is None and all(x is not None for x in shape_flags):
        heads = args.num_heads or args.num_kv_heads
        hidden = args.hidden_size or heads * args.head_dim
        cfg = ModelConfig(
            architecture="custom",
            num_layers=args.num_layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            intermediate_size=args.intermediate_size or 4 * hidden,
            vocab_size=args.vocab_size or 32000,
            max_position_embeddings=args.max_model_len or 4096,
            num_params=args.num_params or 0,
            name="custom (flags)",
        )
    else:
        cfg = read_model_config(args.model)
    overrides = {
        k: v
        for k, v in dict(
            num_layers=args.num_layers,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            num_attention_heads=args.num_heads,
            hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size,
            vocab_size=args.vocab_size,
            max_position_embeddings=args.max_model_len,
            sliding_window=args.sliding_window,
        ).items()
        if v is not None
    }
    if args.full_attention_every:
        if not (args.sliding_window or cfg.sliding_window):
            raise PlanError("--full-attention-every needs --sliding-window")
        n, k = overrides.get("num_layers", cfg.num_layers), args.full_attention_every
        overrides["layer_types"] = [
            "full_attention" if (i + 1) % k == 0 else "sliding_attention" for i in range(n)
        ]
    if overrides:
        d = cfg.to_dict()
        d.update(overrides)
        if args.num_params is None:
            d["num_params"] = 0  # re-estimate for the new shape
        try:
            cfg = ModelConfig.from_dict(d)
        except ValueError as e:
            raise PlanError(str(e)) from None
    elif args.num_params is not None:
        cfg.num_params = args.num_params
    return cfg


# ---------------------------------------------------------------- planning


def plan_row(
    cfg: Any,
    kv_budget: int,
    block_size: int,
    context: int,
    kv_cache_dtype: str,
    kv_quant_mode: KVQuantMode | str | None,
    model_dtype: str,
    mnbt: int,
    max_num_seqs: int = 0,
) -> dict[str, Any]:
    """Every capacity number for one KV dtype/mode (usable blocks exclude the null block). A
    KIVI mode's residual is reserved per ``max_num_seqs`` row first, as the engine does."""
    # A Mamba hybrid runs with the block size the engine picks (an attention page holds a state).
    block_size = align_hybrid_block_size(
        cfg.kv_cache_specs(1, kv_cache_dtype, kv_quant_mode, model_dtype), block_size
    )
    specs = cfg.kv_cache_specs(block_size, kv_cache_dtype, kv_quant_mode, model_dtype)
    groups = planning.as_groups(specs)
    first = next(
        (g.kv_cache_spec for g in groups if hasattr(g.kv_cache_spec, "dtype")),
        groups[0].kv_cache_spec,
    )
    why = planning.kivi_unsupported(groups)
    if why is not None:
        raise ValueError(why)
    residual = planning.kivi_residual_bytes(groups)
    sinks = planning.kivi_sink_store_bytes(groups)
    kv_budget = max(kv_budget - max_num_seqs * residual - sinks, 0)
    num_blocks = planning.num_blocks_from_memory(kv_budget, groups)
    return dict(
        kv_cache_dtype=first.dtype,
        kv_quant_mode=first.kv_quant_mode.value,
        bytes_per_token=planning.kv_bytes_per_token(groups),
        bytes_per_block=planning.bytes_per_block(groups),
        num_groups=len(groups),
        kivi_residual_bytes_per_request=residual,
        kivi_sink_store_bytes=sinks,
        num_blocks=num_blocks,
        num_usable_blocks=max(num_blocks - 1, 0),
        max_tokens=planning.max_num_tokens(num_blocks, groups, context, mnbt),
        max_concurrency=planning.get_max_concurrency(num_blocks, groups, context, mnbt),
        blocks_per_request=planning.blocks_per_request(groups, context, mnbt),
        max_model_len_that_fits=planning.estimate_max_model_len(groups, kv_budget, context, mnbt)
        if kv_budget > 0
        else 0,
    )


def mode_row(
    cfg: Any,
    kv_budget: int,
    block_size: int,
    context: int,
    label: str,
    kv_cache_dtype: str,
    kv_quant_mode: KVQuantMode | str | None,
    model_dtype: str,
    mnbt: int,
    max_num_seqs: int = 0,
) -> dict[str, Any]:
    """One row of the all-modes table. A mode the model cannot use (e.g. per-token-head scales
    on layers of two geometries, whose pages are then no integer multiples of each other and
    cannot share one pool) is listed with ``supported: False`` and the reason, instead of
    refusing the whole plan: only the selected mode must be plannable."""
    try:
        return dict(
            mode=label,
            supported=True,
            **plan_row(
                cfg,
                kv_budget,
                block_size,
                context,
                kv_cache_dtype,
                kv_quant_mode,
                model_dtype,
                mnbt,
                max_num_seqs,
            ),
        )
    except (ValueError, NotImplementedError) as e:
        return dict(mode=label, supported=False, reason=str(e))


# Token-eviction rows always shown: (label, kv_eviction with budget_tokens None = a quarter
# of the context).
EVICTION_ROWS: list[tuple[str, dict[str, Any]]] = [
    ("streaming 512", {"policy": "streaming", "budget_tokens": 512}),
    ("snapkv 25%", {"policy": "snapkv", "budget_tokens": None}),
    ("pyramidkv 25%", {"policy": "pyramidkv", "budget_tokens": None}),
]


def eviction_row(
    cfg: Any, value: dict[str, Any], label: str, sel: dict[str, Any], context: int, out: int
) -> dict[str, Any]:
    """Per-request blocks under a token-eviction policy (`core.token_eviction`), as the
    engine's block tables hold them: the peak (a compacting policy holds the prompt and its
    copy during the compressing step) and the steady state after the prompt, with the
    requests the pool holds at once in that steady state. A request is a ``context - out``
    token prompt and ``out`` output tokens."""
    from pagedkv.core.token_eviction import KVEvictionConfig, KVEvictionError
    from pagedkv.core.units import cdiv

    bs = sel["block_size"]
    prompt = max(context - out, 1)
    value = dict(value)
    if value.get("budget_tokens") is None and value.get("policy") != "streaming":
        value["budget_tokens"] = max(prompt // 4, 36 + 16)
    try:
        ev = KVEvictionConfig.from_value(value)
    except (KVEvictionError, TypeError) as e:
        raise PlanError(str(e)) from None
    assert ev is not None
    layers = sum(1 for i in range(cfg.num_layers) if cfg.owns_kv_cache(i))
    ev = dataclasses.replace(ev, num_layers=layers)
    peak = ev.max_blocks_per_request(bs, prompt, out)
    if ev.policy == "streaming":
        steady = cdiv(ev.sink_blocks(bs) * bs + (ev.recent_tokens or 0) + bs, bs)
        steady = min(steady, cdiv(context, bs))
    elif ev.compresses(prompt):
        steady = cdiv(max(ev.kept_tokens(ev.compression_point(prompt))) + out, bs)
    else:
        steady = cdiv(context, bs)
    usable = sel["num_usable_blocks"]
    return dict(
        policy=label,
        kv_eviction={k: v for k, v in value.items() if v is not None},
        peak_blocks_per_request=peak,
        steady_blocks_per_request=steady,
        max_concurrency_steady=usable / steady if steady else 0.0,
        exact_blocks_per_request=cdiv(context, bs),
    )


def group_rows(groups: Any, context: int, mnbt: int) -> list[dict[str, Any]]:
    """Per KV cache group: its type and window/chunk, its layers, the KV bytes one token
    writes in it, and the pool blocks (and bytes: blocks × bytes per pool block) one request
    of ``context`` tokens holds in it."""
    bpb = planning.bytes_per_block(groups)
    rows = []
    for g in planning.as_groups(groups):
        s = g.kv_cache_spec
        blocks = -(-s.max_memory_usage_bytes(context, mnbt) // s.page_size_bytes)
        rows.append(
            dict(
                kind=s.kind,
                num_layers=len(g.layer_names),
                block_size=s.block_size,
                sliding_window=getattr(s, "sliding_window", None),
                attention_chunk_size=getattr(s, "attention_chunk_size", None),
                bytes_per_token=g.bytes_per_token,
                page_size_bytes=g.page_size_bytes,
                blocks_per_request=blocks,
                bytes_per_request=blocks * bpb,
            )
        )
    return rows


def weight_dtype_bytes(name: str) -> float:
    key = name.lower()
    if key in WEIGHT_DTYPE_BYTES:
        return WEIGHT_DTYPE_BYTES[key]
    try:
        from pagedkv.core.specs import normalize_dtype

        return WEIGHT_DTYPE_BYTES[normalize_dtype(key)]
    except (ValueError, KeyError):
        pass
    try:
        return float(name)
    except ValueError:
        raise PlanError(
            f"unknown --weight-dtype {name!r}: use {', '.join(WEIGHT_DTYPE_BYTES)} or a number"
        ) from None


def parallel_plan(
    args: argparse.Namespace, cfg: Any, model_dtype: str, num_blocks: int
) -> dict[str, Any]:
    """Per-rank KV bytes at ``--tensor-parallel-size`` / ``--decode-context-parallel-size``:
    every rank holds ``num_blocks`` blocks of ``--block-size`` tokens of its own KV heads
    (`engine.rank_planning`, what the engine's workers allocate)."""
    from pagedkv.core.parallel import shard_heads
    from pagedkv.engine.rank_planning import rank_kv_cache_groups

    config = _engine_config(args)
    tp, dcp = config.tensor_parallel_size, config.decode_context_parallel_size
    ranks = []
    for r in range(tp):
        bpb = planning.bytes_per_block(
            rank_kv_cache_groups(config, cfg, model_dtype, args.block_size, r)
        )
        h = shard_heads(cfg.num_attention_heads, cfg.num_kv_heads, tp, r)
        ranks.append(
            dict(
                rank=r,
                dcp_rank=r % dcp,
                q_heads=[h.q_start, h.q_end],
                kv_heads=[h.kv_start, h.kv_end],
                bytes_per_block=bpb,
                kv_cache_bytes=bpb * num_blocks,
            )
        )
    return dict(
        tensor_parallel_size=tp,
        decode_context_parallel_size=dcp,
        cp_kv_cache_interleave_size=config.cp_kv_cache_interleave_size,
        scheduler_block_size=args.block_size * dcp,
        ranks=ranks,
    )


def _engine_config(args: argparse.Namespace) -> Any:
    """The parallel part of the engine config the flags describe (PlanError when invalid)."""
    from pagedkv.engine.config import EngineConfig

    try:
        return EngineConfig(
            block_size=args.block_size,
            tensor_parallel_size=args.tensor_parallel_size,
            decode_context_parallel_size=args.decode_context_parallel_size,
            cp_kv_cache_interleave_size=args.cp_kv_cache_interleave_size,
            kv_cache_dtype=args.kv_cache_dtype,
        )
    except ValueError as e:
        raise PlanError(str(e)) from None


def make_plan(args: argparse.Namespace) -> dict[str, Any]:
    """The whole plan as a JSON-able dict; raises PlanError for user-facing failures."""
    cfg = full_cfg = build_model_config(args)
    tp = getattr(args, "tensor_parallel_size", 1)
    dcp = getattr(args, "decode_context_parallel_size", 1)
    if tp > 1:
        # Plan as the scheduler does: for the rank whose block is largest, in virtual blocks
        # of block_size x dcp tokens, each rank's memory holding 1/dcp of every block.
        from pagedkv.engine.rank_planning import hybrid_block_size, rank_model_config, widest_rank

        config = _engine_config(args)
        dtype = resolve_dtype_name(args.dtype, cfg.dtype)
        try:
            # a Mamba hybrid's block size is the one the largest rank needs (as the engine's)
            block = hybrid_block_size(config, cfg, dtype, args.block_size)
            args = argparse.Namespace(**{**vars(args), "block_size": block})
            cfg = rank_model_config(config, cfg, widest_rank(config, cfg, dtype, block))
        except ValueError as e:
            raise PlanError(str(e)) from None
        args = argparse.Namespace(**{**vars(args), "block_size": args.block_size * dcp})
        if args.memory is not None:
            args.memory *= dcp
    context = args.context or cfg.max_position_embeddings
    model_dtype = resolve_dtype_name(args.dtype, cfg.dtype)  # "auto" as the engine resolves it
    try:
        resolve_kv_cache_dtype(args.kv_cache_dtype, model_dtype, args.kv_quant_mode)
    except ValueError as e:
        raise PlanError(str(e)) from None
    memory: dict[str, Any]
    if args.device_memory is None:
        kv_budget = args.memory if args.memory is not None else DEFAULT_CPU_KV_CACHE_MEMORY * dcp
        source = "--memory" if args.memory is not None else "the engine's default on CPU"
        memory = dict(source=source, kv_cache=kv_budget // dcp)  # per rank
    else:
        from pagedkv.core.specs import dtype_size

        wdt = args.weight_dtype or model_dtype
        runtime = args.runtime_memory
        runtime_src = "--runtime-memory"
        if runtime is None:
            runtime_src = "estimate"
            runtime = planning.estimate_runtime_bytes(
                hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size,
                num_attention_heads=cfg.num_attention_heads,
                num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim,
                vocab_size=cfg.vocab_size,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs,
                activation_dtype_bytes=dtype_size(model_dtype),
            )
        try:
            mb = planning.plan_device_memory(
                args.device_memory, cfg.num_params, weight_dtype_bytes(wdt), runtime, args.headroom
            )
        except ValueError as e:
            raise PlanError(str(e)) from None
        kv_budget = mb.kv_cache
        memory = dict(
            source="--device-memory",
            device_memory=mb.device_memory,
            weight_dtype=wdt,
            weights=mb.weights,
            runtime=mb.runtime,
            runtime_source=runtime_src,
            headroom=mb.headroom,
            headroom_fraction=args.headroom,
            kv_cache=kv_budget,
        )
    try:
        selected = plan_row(
            cfg,
            max(kv_budget, 0),
            args.block_size,
            context,
            args.kv_cache_dtype,
            args.kv_quant_mode,
            model_dtype,
            args.max_num_batched_tokens,
            args.max_num_seqs,
        )
    except (ValueError, NotImplementedError) as e:
        raise PlanError(str(e)) from None
    modes = [
        mode_row(
            cfg,
            max(kv_budget, 0),
            args.block_size,
            context,
            label,
            dt,
            mode,
            model_dtype,
            args.max_num_batched_tokens,
            args.max_num_seqs,
        )
        for label, dt, mode in KV_MODES
    ]
    if "device_memory" in memory:
        memory["c_tokens"] = (
            max(kv_budget, 0) // selected["bytes_per_token"] if selected["bytes_per_token"] else 0
        )
    block_size = align_hybrid_block_size(
        cfg.kv_cache_specs(1, args.kv_cache_dtype, args.kv_quant_mode, model_dtype), args.block_size
    )  # what the engine runs a Mamba hybrid with
    specs = cfg.kv_cache_specs(block_size, args.kv_cache_dtype, args.kv_quant_mode, model_dtype)
    try:
        planning.check_enough_kv_cache_memory(
            specs, kv_budget, context, args.max_num_batched_tokens
        )
    except ValueError as e:
        where = ""
        if "device_memory" in memory:
            where = (
                f" (KV budget = device {fmt_bytes(memory['device_memory'])} - weights "
                f"{fmt_bytes(memory['weights'])} - runtime {fmt_bytes(memory['runtime'])} - headroom "
                f"{fmt_bytes(memory['headroom'])} = {fmt_bytes(memory['kv_cache'])})"
            )
        raise PlanError(f"{e}{where}") from None
    model = {
        k: v
        for k, v in dataclasses.asdict(full_cfg).items()
        if k
        in (
            "name",
            "architecture",
            "num_layers",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "hidden_size",
            "num_params",
            "max_position_embeddings",
            "sliding_window",
            "path",
        )
    }
    summary = summary_line(
        selected["num_blocks"],
        planning.as_groups(specs),
        context,
        args.max_num_batched_tokens,
        dcp,
    )
    selected["groups"] = group_rows(planning.as_groups(specs), context, args.max_num_batched_tokens)
    selected["block_size"] = block_size
    eviction = None
    if len(selected["groups"]) == 1 and selected["groups"][0]["kind"] == "full_attention":
        out = getattr(args, "output_tokens", 0)
        rows = list(EVICTION_ROWS)
        kv_ev = getattr(args, "kv_eviction", None)
        if kv_ev is not None:
            try:
                chosen = json.loads(kv_ev) if isinstance(kv_ev, str) else kv_ev
            except json.JSONDecodeError as e:
                raise PlanError(f"--kv-eviction is not valid JSON: {e}") from None
            if not isinstance(chosen, dict):
                raise PlanError("--kv-eviction must be a JSON object")
            rows.insert(0, ("--kv-eviction", chosen))
        eviction = [eviction_row(full_cfg, v, label, selected, context, out) for label, v in rows]
    parallel = None
    if tp > 1:
        physical = argparse.Namespace(**{**vars(args), "block_size": args.block_size // dcp})
        parallel = parallel_plan(physical, full_cfg, model_dtype, selected["num_blocks"])
    return dict(
        parallel=parallel,
        model=model,
        summary=summary,
        block_size=block_size,
        context=context,
        dtype=model_dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        memory=memory,
        null_block="num_blocks includes the null block; usable = num_blocks - 1; "
        "max_tokens and max_concurrency count usable blocks only",
        selected=selected,
        modes=modes,
        eviction=eviction,
    )


# ---------------------------------------------------------------- output


def format_plan(plan: dict[str, Any]) -> str:
    m, sel, mem = plan["model"], plan["selected"], plan["memory"]
    lines = [
        f"model: {m['name']} ({m['architecture']}, {m['num_layers']} layers, "
        f"{m['num_attention_heads']} query / {m['num_kv_heads']} KV heads x {m['head_dim']}, "
        f"{m['num_params'] / 1e6:.1f}M params, max len {m['max_position_embeddings']})",
    ]
    par = plan.get("parallel")
    if par:
        lines.append(
            f"tensor parallel {par['tensor_parallel_size']}, decode context parallel "
            f"{par['decode_context_parallel_size']}: the figures below are per rank, for the "
            f"rank whose block is largest; scheduler blocks of {par['scheduler_block_size']} "
            "tokens"
        )
        for r in par["ranks"]:
            lines.append(
                f"  rank {r['rank']} (dcp rank {r['dcp_rank']}): query heads "
                f"{r['q_heads'][0]}-{r['q_heads'][1] - 1}, KV heads {r['kv_heads'][0]}-"
                f"{r['kv_heads'][1] - 1}, {r['bytes_per_block']:,} B per block, "
                f"{fmt_bytes(r['kv_cache_bytes'])} of KV cache"
            )
    if mem["source"] == "--device-memory":
        lines.append(
            "memory (C_tokens = (M_HBM - M_weights - M_runtime - M_headroom) / M_KV/token):"
        )
        lines.append(f"  M_HBM (device memory)   {fmt_bytes(mem['device_memory']):>12}")
        lines.append(
            f"  - M_weights             {fmt_bytes(mem['weights']):>12}  "
            f"({m['num_params']:,} params x {mem['weight_dtype']})"
        )
        lines.append(
            f"  - M_runtime             {fmt_bytes(mem['runtime']):>12}  ({mem['runtime_source']})"
        )
        lines.append(
            f"  - M_headroom            {fmt_bytes(mem['headroom']):>12}  "
            f"({mem['headroom_fraction']:.0%} of device)"
        )
        lines.append(f"  = KV cache              {fmt_bytes(mem['kv_cache']):>12}")
        lines.append(
            f"  C_tokens ~ {mem['c_tokens']:,} tokens at {sel['bytes_per_token']:,} B/token"
        )
    else:
        lines.append(f"KV cache memory: {fmt_bytes(mem['kv_cache'])} ({mem['source']})")
    lines.append(plan["summary"])
    lines += [
        f"block size {plan['block_size']}, context {plan['context']}, KV {sel['kv_cache_dtype']}"
        f" (quant {sel['kv_quant_mode']}), {sel['num_groups']} KV cache group(s)",
        f"  bytes per token     {sel['bytes_per_token']:,}",
        f"  bytes per block     {sel['bytes_per_block']:,}",
        f"  blocks              {sel['num_blocks']:,} ({sel['num_usable_blocks']:,} usable + 1 null)",
        f"  max tokens          {sel['max_tokens']:,}",
        f"  max concurrent requests @ {plan['context']}: {sel['max_concurrency']:.2f}"
        f" ({sel['blocks_per_request']} blocks each)",
    ]
    if len(sel.get("groups", [])) > 1:
        for i, g in enumerate(sel["groups"]):
            limit = (
                f" {g['sliding_window']}"
                if g["sliding_window"]
                else f" {g['attention_chunk_size']}"
                if g["attention_chunk_size"]
                else ""
            )
            lines.append(
                f"  group {i}: {g['kind']}{limit} x {g['num_layers']} layers, {g['bytes_per_token']:,} B/token,"
                f" {g['blocks_per_request']:,} blocks per request"
            )
    lines += ["", "all KV quantization modes:"]
    header = f"  {'mode':<25}{'dtype':<10}{'B/token':>9}{'B/block':>11}{'blocks':>11}{'max tokens':>13}{'max conc':>10}"
    lines.append(header)
    for r in plan["modes"]:
        if not r["supported"]:
            lines.append(f"  {r['mode']:<25}unsupported: {r['reason']}")
            continue
        lines.append(
            f"  {r['mode']:<25}{r['kv_cache_dtype']:<10}{r['bytes_per_token']:>9,}"
            f"{r['bytes_per_block']:>11,}{r['num_blocks']:>11,}{r['max_tokens']:>13,}"
            f"{r['max_concurrency']:>10.2f}"
        )
    if plan.get("eviction"):
        lines += ["", f"token eviction (lossy), per request of {plan['context']} tokens:"]
        lines.append(
            f"  {'policy':<16}{'peak blocks':>12}{'steady blocks':>15}{'exact blocks':>14}"
            f"{'conc (steady)':>15}"
        )
        for r in plan["eviction"]:
            lines.append(
                f"  {r['policy']:<16}{r['peak_blocks_per_request']:>12,}"
                f"{r['steady_blocks_per_request']:>15,}{r['exact_blocks_per_request']:>14,}"
                f"{r['max_concurrency_steady']:>15.2f}"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        plan = make_plan(args)
    except PlanError as e:
        print(f"pagedkv plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return 0
