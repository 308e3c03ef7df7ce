"""**prefix-hit** (``--only prefix-hit``): does a prefix-cache hit change what a lossy cache
generates?

A KIVI cache (``int3_kivi``) keeps each request's first tokens (the attention sinks) and its
last blocks in int8 outside the pages, but only for what the request computed itself: a hit is
read from its codes (`pagedkv.ops.kivi`). So the same prompt can read its context differently
cold and after a hit. This part measures by how much, against the exact cache in the same run.

Each of ``--hit-prompts`` prompts is a ``--hit-prefix``-token document from the sampled
corpus (`pagedkv.bench.kv_quant.make_corpus`) followed by the corpus's next ``--hit-suffix``
tokens, and ``--hit-output`` tokens are generated greedily from it:

* **exact**: the float32 cache, prefix caching off;
* **cold**: the method's cache, prefix caching off;
* **hit**: the method's cache with prefix caching, after a request for the document alone
  (its whole blocks are then a hit; ``cached_tokens`` says how many were).

Reported per method and run: the share of outputs equal to the exact cache's, and the mean
number of tokens before the first difference; and the share of hit outputs equal to the cold
ones. Greedy agreement is a coarse measure: one early token flip changes the rest.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from pagedkv.bench.common import BenchOptionError, log
from pagedkv.bench.latency import agreement
from pagedkv.bench.lossy_methods import EXACT, Method, engine


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hit-prompts", type=int, default=24, help="prompts (--only prefix-hit)")
    p.add_argument("--hit-prefix", type=int, default=1024, help="document tokens (cached)")
    p.add_argument("--hit-suffix", type=int, default=64, help="tokens after the document")
    p.add_argument("--hit-output", type=int, default=64, help="greedy output tokens")


def _generate(
    llm: Any, prompts: list[list[int]], out_len: int
) -> tuple[list[list[int]], list[int]]:
    """Greedy outputs and cached-token counts, one prompt at a time (so that a prompt's hit
    comes from its own document request, never from a neighbour still being computed)."""
    from pagedkv import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    outs, cached = [], []
    for p in prompts:
        (o,) = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
        outs.append(list(o.outputs[0].token_ids))
        cached.append(o.num_cached_tokens)
    return outs, cached


def _agreement(outs: list[list[int]], ref: list[list[int]]) -> dict[str, float]:
    return dict(
        identical=sum(a == b for a, b in zip(outs, ref)) / len(ref),
        mean_common_tokens=sum(agreement(a, b) for a, b in zip(outs, ref)) / len(ref),
    )


def run_prefix_hit(args: argparse.Namespace, methods: list[Method]) -> dict[str, Any]:
    from pagedkv.bench import kv_quant

    if args.hit_prompts < 1 or min(args.hit_prefix, args.hit_suffix, args.hit_output) < 1:
        raise BenchOptionError("--hit-prompts/--hit-prefix/--hit-suffix/--hit-output must be >= 1")
    n, p, q = args.hit_prompts, args.hit_prefix, args.hit_suffix
    size = dict(max_model_len=p + q + args.hit_output, kv_cache_memory=args.kv_cache_memory)
    # the corpus's pieces (one a corpus prompt) may be longer than a prompt here
    ref = engine(
        Method(EXACT),
        max_model_len=max(4096, p + q + args.hit_output),
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=False,
    )
    stream = kv_quant.make_corpus(ref, n * (p + q), 1.0, args.seed)
    if len(stream) < n * (p + q):
        raise BenchOptionError(f"the corpus has {len(stream)} tokens, fewer than {n * (p + q)}")
    prompts = [stream[i * (p + q) : (i + 1) * (p + q)] for i in range(n)]
    exact, _ = _generate(ref, prompts, args.hit_output)
    del ref
    out: dict[str, Any] = dict(
        prompts=n, prefix_tokens=p, suffix_tokens=q, output_tokens=args.hit_output, methods={}
    )
    for m in methods:
        t0 = time.perf_counter()
        cold_llm = engine(m, **size, enable_prefix_caching=False)
        cold, _ = _generate(cold_llm, prompts, args.hit_output)
        del cold_llm
        hit_llm = engine(m, **size, enable_prefix_caching=True)
        hit: list[list[int]] = []
        cached: list[int] = []
        for prompt in prompts:
            _generate(hit_llm, [prompt[:p]], 1)  # the document alone: its blocks get cached
            o, c = _generate(hit_llm, [prompt], args.hit_output)
            hit += o
            cached += c
        del hit_llm
        res = dict(
            cold=_agreement(cold, exact),
            hit=_agreement(hit, exact),
            hit_vs_cold=_agreement(hit, cold),
            mean_cached_tokens=sum(cached) / n,
            seconds=time.perf_counter() - t0,
        )
        log(args, f"  prefix-hit {m.name:20s} {res}")
        out["methods"][m.name] = res
    return out


def table_lines(r: dict[str, Any]) -> list[str]:
    lines = [
        f"prefix hit: {r['prompts']} prompts of {r['prefix_tokens']} cached + "
        f"{r['suffix_tokens']} tokens, {r['output_tokens']} greedy; identical to exact "
        "(mean tokens before the first difference)"
    ]
    for name, m in r["methods"].items():
        c, h, hc = m["cold"], m["hit"], m["hit_vs_cold"]
        lines.append(
            f"  {name:22s} cold {c['identical']:.0%} ({c['mean_common_tokens']:.1f})  "
            f"hit {h['identical']:.0%} ({h['mean_common_tokens']:.1f})  "
            f"hit = cold {hc['identical']:.0%}  cached {m['mean_cached_tokens']:.0f}"
        )
    return lines
