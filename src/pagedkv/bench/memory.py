"""KV memory utilisation: paged blocks vs contiguous per-request reservation, on one trace.

Trace (fixed seed): ``--num-requests`` (200) requests, all waiting at t=0, with long-tailed
(log-normal) prompt and output lengths, ``prompt + output <= --max-model-len`` (2,048). Output
lengths are unknown to the allocator: a request learns it is done only when it is.

The trace is simulated step by step through the real `pagedkv.core` `KVCacheManager` (no
model): a request is admitted FCFS while its whole prompt fits (its prefill takes one step and
yields its first output token), then every step each running request appends one token,
which needs a slot. When the pool is full the most recently admitted request is preempted
(its blocks freed, recomputed later), as the engine's scheduler does; no request is admitted
in a step that preempted. Prefix caching is off (the prompts share nothing), so a freed block
is simply free.

Contiguous allocation is the same simulation with one block of ``max_model_len`` slots per
request: what a system without paging must reserve when it cannot know the output length.

Effective utilisation = token slots holding live KV / slots reserved, integrated over the
steps (sum of live slots over sum of reserved slots). Also reported: the mean of the per-step
ratios, mean running requests (what the freed memory buys), steps to drain the trace, and
preemptions. Every scheme gets the same pool of ``--pool-tokens`` (16,384) slots.
Target: >= 95% at block size 16.

Hybrid row: KV bytes per token of context for one request of ``--hybrid-contexts`` tokens
(4k, 32k, 128k) in two hybrid models, against the same model with every layer treated as full
attention. "Gemma-3-like" is Gemma-3-27B's shape (62 layers, 16 KV heads of 128, bf16; 5
sliding-window layers of 1,024 to 1 global); "Bamba-like" is Bamba-9B's (32 layers, attention
at 9, 18, 27 with 8 KV heads of 128; Mamba2 layers of 128 heads × 64 × d_state 128, conv 4,
one group; bf16 states), its Mamba layers as ``MambaSpec`` states. Three figures each: the
formula (window or state bytes only, no pool overhead), the planner's bound for one request
(``blocks_per_request × bytes_per_block``), and what the real ``KVCacheManager`` holds after
prefilling the context in ``--max-num-batched-tokens`` chunks and decoding one token (pool
blocks × bytes per pool block: groups share one pool, so a block costs the largest group's
bytes whichever group holds it). Measured needs the type's block manager in ``core``.

Usage: python benchmarks/bench_memory.py [--num-requests N] [--block-sizes 8,16,32] [--json-only]
"""

from __future__ import annotations

import argparse
import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Any

from pagedkv.bench.common import BenchOptionError, add_output_args, log, run_and_emit, user_help

TARGET_UTILISATION_BS16 = 0.95


@dataclass(slots=True)
class TraceRequest:
    prompt_len: int
    output_len: int


def make_trace(
    n: int,
    max_model_len: int,
    seed: int,
    prompt_median: float = 256.0,
    output_median: float = 128.0,
    sigma: float = 1.0,
) -> list[TraceRequest]:
    """Log-normal prompt and output lengths (long tail), clipped to fit ``max_model_len``."""
    rng = random.Random(seed)
    trace = []
    for _ in range(n):
        p = min(max(int(rng.lognormvariate(math.log(prompt_median), sigma)), 1), max_model_len - 1)
        o = min(max(int(rng.lognormvariate(math.log(output_median), sigma)), 1), max_model_len - p)
        trace.append(TraceRequest(p, o))
    return trace


def simulate(
    trace: list[TraceRequest],
    block_size: int,
    pool_tokens: int,
    max_model_len: int,
    max_num_seqs: int,
) -> dict[str, Any]:
    """Run the trace through a `KVCacheManager`; returns utilisation and scheduling figures."""
    from pagedkv.core.kv_cache_manager import KVCacheManager
    from pagedkv.core.request import KVCacheRequest, RequestStatus
    from pagedkv.core.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=3, head_size=64, dtype="float32")
    num_blocks = pool_tokens // block_size + 1  # + the null block
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
        bytes_per_block=spec.page_size_bytes,
    )
    kv = KVCacheManager(config, max_model_len=max_model_len, enable_caching=False)

    # Token ids do not matter without caching: a request is its length; token 0 stands for all.
    reqs = [KVCacheRequest(f"r{i}", [0] * t.prompt_len) for i, t in enumerate(trace)]
    target = {r.request_id: t.output_len for r, t in zip(reqs, trace)}
    waiting: deque[KVCacheRequest] = deque(reqs)
    running: list[KVCacheRequest] = []
    live_sum = reserved_sum = running_sum = 0
    ratios: list[float] = []
    steps = preemptions = 0

    def emit_token(r: KVCacheRequest) -> bool:
        """The step's forward pass produced r's next token; True when r is done."""
        r.append_output_token_ids(0)
        if r.num_output_tokens >= target[r.request_id]:
            kv.free(r)
            r.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    while waiting or running:
        steps += 1
        preempted = False
        i = 0
        while i < len(running):  # decode: one slot for each running request's newest token
            r = running[i]
            while kv.allocate_slots(r, 1) is None:
                victim = running.pop()
                kv.free(victim)
                # Recompute: the tokens so far become the prompt of the restarted request.
                victim.status, victim.num_computed_tokens = RequestStatus.PREEMPTED, 0
                waiting.appendleft(victim)
                preemptions += 1
                preempted = True
                if victim is r:
                    break
            else:
                r.num_computed_tokens += 1
                i += 1
        while not preempted and waiting and len(running) < max_num_seqs:  # admit FCFS
            r = waiting[0]
            if kv.allocate_slots(r, r.num_tokens, full_sequence_must_fit=True) is None:
                break
            waiting.popleft()
            r.status, r.num_computed_tokens = RequestStatus.RUNNING, r.num_tokens
            running.append(r)
        if not running and waiting:
            raise BenchOptionError(
                f"a request of {waiting[0].num_tokens} tokens does not fit the pool"
            )
        # Measure after the step's allocations: these slots hold KV this step.
        live = sum(r.num_computed_tokens for r in running)
        reserved = (num_blocks - 1 - kv.num_free_blocks) * block_size
        live_sum += live
        reserved_sum += reserved
        running_sum += len(running)
        if reserved:
            ratios.append(live / reserved)
        running = [r for r in running if not emit_token(r)]
    kv.check_invariants()
    assert kv.num_free_blocks == num_blocks - 1, "blocks leaked"
    return dict(
        utilisation=live_sum / reserved_sum,
        mean_step_utilisation=sum(ratios) / len(ratios),
        mean_running=running_sum / steps,
        steps=steps,
        preemptions=preemptions,
        tokens_per_step=sum(t.output_len for t in trace) / steps,
    )


# ---------------------------------------------------------------- hybrid models: bytes per token


def gemma3_like_specs(block_size: int) -> dict[str, Any]:
    """Gemma-3-27B's KV layers: layer i is global iff (i + 1) % 6 == 0, else a 1,024 window."""
    from pagedkv.core.specs import FullAttentionSpec, SlidingWindowSpec

    kw = dict(block_size=block_size, num_kv_heads=16, head_size=128, dtype="bfloat16")
    return {
        f"model.layers.{i}.self_attn": FullAttentionSpec(**kw)
        if (i + 1) % 6 == 0
        else SlidingWindowSpec(**kw, sliding_window=1024)
        for i in range(62)
    }


BAMBA_ATTENTION_LAYERS = (9, 18, 27)


def bamba_like_specs(block_size: int) -> dict[str, Any]:
    """Bamba-9B's layers: attention (8 KV heads of 128) at 9, 18, 27; the other 29 are Mamba2
    with a conv state of ``(d_inner + 2·n_groups·d_state) × (d_conv − 1)`` and an SSM state of
    ``heads × head_dim × d_state`` (d_inner 8,192 = 128 heads × 64, d_state 128, d_conv 4)."""
    from pagedkv.core.specs import FullAttentionSpec, MambaSpec

    conv, ssm = (8192 + 2 * 128, 4 - 1), (128, 64, 128)
    return {
        (
            f"model.layers.{i}.self_attn"
            if i in BAMBA_ATTENTION_LAYERS
            else f"model.layers.{i}.mamba"
        ): FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=128, dtype="bfloat16")
        if i in BAMBA_ATTENTION_LAYERS
        else MambaSpec(block_size=block_size, shapes=(conv, ssm), dtypes=("bfloat16", "bfloat16"))
        for i in range(32)
    }


def as_full_attention(specs: dict[str, Any]) -> dict[str, Any]:
    """Every layer as full attention with the model's attention geometry."""
    from pagedkv.core.specs import AttentionSpec, FullAttentionSpec

    a = next(s for s in specs.values() if isinstance(s, AttentionSpec))
    full = FullAttentionSpec(
        block_size=a.block_size, num_kv_heads=a.num_kv_heads, head_size=a.head_size, dtype=a.dtype
    )
    return {name: full for name in specs}


def formula_bytes(specs: dict[str, Any], context: int) -> int:
    """KV a request of ``context`` tokens needs by the formulas, without blocks or pools:
    full layers every token, sliding layers the window, Mamba layers their state."""
    from pagedkv.core.specs import AttentionSpec, MambaSpec, SlidingWindowSpec

    total = 0
    for s in specs.values():
        if isinstance(s, MambaSpec):
            total += s.real_page_size_bytes
        elif isinstance(s, SlidingWindowSpec):
            total += min(s.sliding_window, context) * s.bytes_per_token
        elif isinstance(s, AttentionSpec):
            total += context * s.bytes_per_token
    return total


def measured_bytes(groups: list[Any], context: int, chunk: int) -> int | None:
    """Pool bytes the real ``KVCacheManager`` holds for one request after prefilling
    ``context − 1`` tokens in chunks of ``chunk`` and decoding one (None if a group's type has
    no block manager yet)."""
    from pagedkv.core import planning
    from pagedkv.core.kv_cache_manager import KVCacheManager
    from pagedkv.core.request import KVCacheRequest
    from pagedkv.core.single_type_kv_cache_manager import get_manager_class
    from pagedkv.core.specs import KVCacheConfig

    try:
        for g in groups:
            get_manager_class(g.kv_cache_spec)
    except NotImplementedError:
        return None
    bpb = planning.bytes_per_block(groups)
    # Slack of a block per group: a recurrent group may hold its previous state while a step
    # writes the next one (what is measured is what stays held after the last step).
    num_blocks = planning.blocks_per_request(groups, context, chunk) + len(groups) + 1
    kv = KVCacheManager(
        KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups, bytes_per_block=bpb),
        max_model_len=context,
        enable_caching=False,
    )
    req = KVCacheRequest("r", [0] * (context - 1))
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        if kv.allocate_slots(req, n) is None:
            raise RuntimeError("the planned pool did not hold one request")
        req.num_computed_tokens += n
    req.append_output_token_ids(0)
    if kv.allocate_slots(req, 1) is None:
        raise RuntimeError("the planned pool did not hold one request")
    used = (num_blocks - 1 - kv.num_free_blocks) * bpb
    kv.free(req)
    kv.check_invariants()
    return used


def hybrid_rows(contexts: list[int], block_size: int, chunk: int) -> list[dict[str, Any]]:
    """Bytes per token of context: hybrid model vs all-full-attention, per model and context."""
    from pagedkv.core import planning
    from pagedkv.core.specs import get_kv_cache_groups

    rows = []
    for model, build in (("gemma3_like", gemma3_like_specs), ("bamba_like", bamba_like_specs)):
        specs = build(block_size)
        groups = get_kv_cache_groups(specs)
        full_specs = as_full_attention(specs)
        for ctx in contexts:
            planned = planning.blocks_per_request(groups, ctx, chunk) * planning.bytes_per_block(
                groups
            )
            measured = measured_bytes(groups, ctx, chunk)
            full = formula_bytes(full_specs, ctx)
            rows.append(
                dict(
                    model=model,
                    context=ctx,
                    num_groups=len(groups),
                    group_kinds=sorted({g.kv_cache_spec.kind for g in groups}),
                    bytes_per_block=planning.bytes_per_block(groups),
                    formula_bytes_per_token=formula_bytes(specs, ctx) / ctx,
                    planned_bytes_per_token=planned / ctx,
                    measured_bytes_per_token=None if measured is None else measured / ctx,
                    full_attention_bytes_per_token=full / ctx,
                    saving_vs_full=full / (measured if measured is not None else planned),
                )
            )
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pagedkv.engine.arg_utils import EngineArgs

    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument(
        "--pool-tokens", type=int, default=16384, help="KV slots in the pool (every scheme)"
    )
    p.add_argument("--block-sizes", default="8,16,32", help="paged block sizes, comma-separated")
    EngineArgs.add_cli_args(p, include=("max_num_seqs",))
    p.add_argument("--seed", type=int, default=0, help="trace seed")
    p.add_argument(
        "--hybrid-contexts",
        default="4096,32768,131072",
        help="context lengths of the hybrid row, comma-separated ('' to skip it)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="prefill chunk of the hybrid row (its in-flight tokens)",
    )
    add_output_args(p)


def run(args: argparse.Namespace) -> dict[str, Any]:
    try:
        sizes = [int(x) for x in args.block_sizes.split(",") if x.strip()]
    except ValueError:
        raise BenchOptionError(
            f"invalid --block-sizes {args.block_sizes!r}: use e.g. 8,16,32"
        ) from None
    if not sizes or min(sizes) < 1 or args.num_requests < 1 or args.max_num_seqs < 1:
        raise BenchOptionError("block sizes, --num-requests and --max-num-seqs must be positive")
    if args.pool_tokens < args.max_model_len:
        raise BenchOptionError("--pool-tokens must hold at least one --max-model-len request")
    try:
        contexts = [int(x) for x in args.hybrid_contexts.split(",") if x.strip()]
    except ValueError:
        raise BenchOptionError(
            f"invalid --hybrid-contexts {args.hybrid_contexts!r}: use e.g. 4096,32768"
        ) from None
    if any(c < 2 for c in contexts) or args.max_num_batched_tokens < 1:
        raise BenchOptionError(
            "--hybrid-contexts must be >= 2 and --max-num-batched-tokens positive"
        )
    trace = make_trace(args.num_requests, args.max_model_len, args.seed)
    schemes: dict[str, dict[str, Any]] = {}
    for bs in sizes:
        log(args, f"simulating paged blocks of {bs} tokens ...")
        schemes[f"paged_{bs}"] = simulate(
            trace, bs, args.pool_tokens, args.max_model_len, args.max_num_seqs
        )
    log(args, f"simulating contiguous reservation of {args.max_model_len} tokens per request ...")
    schemes["contiguous"] = simulate(
        trace, args.max_model_len, args.pool_tokens, args.max_model_len, args.max_num_seqs
    )
    schemes["contiguous"]["block_size"] = args.max_model_len
    for bs in sizes:
        schemes[f"paged_{bs}"]["block_size"] = bs
    p = sorted(t.prompt_len for t in trace)
    o = sorted(t.output_len for t in trace)
    u16 = schemes.get("paged_16", {}).get("utilisation")
    return dict(
        benchmark="memory",
        trace=dict(
            num_requests=len(trace),
            max_model_len=args.max_model_len,
            pool_tokens=args.pool_tokens,
            seed=args.seed,
            distribution="log-normal (prompt median 256, output median 128, sigma 1)",
            prompt_len=dict(
                p50=p[len(p) // 2], p99=p[int(len(p) * 0.99)], max=p[-1], mean=sum(p) / len(p)
            ),
            output_len=dict(
                p50=o[len(o) // 2], p99=o[int(len(o) * 0.99)], max=o[-1], mean=sum(o) / len(o)
            ),
        ),
        schemes=schemes,
        target_utilisation_bs16=TARGET_UTILISATION_BS16,
        meets_target=None if u16 is None else u16 >= TARGET_UTILISATION_BS16,
        hybrid=dict(
            block_size=16,
            max_num_batched_tokens=args.max_num_batched_tokens,
            rows=hybrid_rows(contexts, 16, args.max_num_batched_tokens),
        ),
    )


def table(r: dict[str, Any]) -> str:
    t = r["trace"]
    lines = [
        f"trace: {t['num_requests']} requests, prompt p50/mean/max {t['prompt_len']['p50']}/"
        f"{t['prompt_len']['mean']:.0f}/{t['prompt_len']['max']}, output p50/mean/max {t['output_len']['p50']}/"
        f"{t['output_len']['mean']:.0f}/{t['output_len']['max']}; max_model_len {t['max_model_len']}, "
        f"pool {t['pool_tokens']} slots",
        "",
        f"{'scheme':14s}{'utilisation':>12s}{'per-step':>10s}{'running':>9s}{'steps':>8s}{'tok/step':>10s}"
        f"{'preempt':>9s}",
    ]
    for name, s in r["schemes"].items():
        lines.append(
            f"{name:14s}{s['utilisation']:12.1%}{s['mean_step_utilisation']:10.1%}{s['mean_running']:9.1f}"
            f"{s['steps']:8d}{s['tokens_per_step']:10.1f}{s['preemptions']:9d}"
        )
    lines.append(
        f"target: >= {r['target_utilisation_bs16']:.0%} at block size 16 -> meets target: {r['meets_target']}"
    )
    h = r.get("hybrid") or {}
    if h.get("rows"):
        lines += [
            "",
            f"hybrid models: KV bytes per token of context (one request; block size {h['block_size']}, "
            f"prefill chunks of {h['max_num_batched_tokens']})",
            f"{'model':13s}{'context':>9s}{'formula':>10s}{'planned':>10s}{'measured':>10s}"
            f"{'all-full':>10s}{'saving':>8s}",
        ]
        for x in h["rows"]:
            m = x["measured_bytes_per_token"]
            lines.append(
                f"{x['model']:13s}{x['context']:9d}{x['formula_bytes_per_token']:10,.0f}"
                f"{x['planned_bytes_per_token']:10,.0f}{'-' if m is None else f'{m:,.0f}':>10s}"
                f"{x['full_attention_bytes_per_token']:10,.0f}{x['saving_vs_full']:7.1f}x"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=user_help(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    return run_and_emit(run, table, p.parse_args(argv))
