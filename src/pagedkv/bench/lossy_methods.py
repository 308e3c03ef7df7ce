"""The methods `pagedkv.bench.lossy_kv` measures, and the two parts only token eviction needs.

A method is a KV cache format (``int4``: the engine's ``kv_cache_dtype``) or a token-eviction
policy run on the exact (float32) cache, per request (``SamplingParams.kv_eviction``):

* ``streaming:512`` — StreamingLLM, 4 sink tokens and a 508-token window (512 in all),
  original positions; ``streaming-cache:512`` — the same with positions within the cache;
* ``snapkv:0.25`` — SnapKV keeping a quarter of each prompt (``snapkv:256``: 256 tokens);
  ``pyramidkv:0.25`` the same mean budget, shrinking with depth; ``compress_at`` is set
  where a part needs the scored text after the compressed context.

**evict-teacher** (``--only evict-teacher``): teacher-forced through ``prompt_logprobs=1`` on
the same corpora as ``teacher``, in windows of ``--window`` tokens: per position the target's
logprob and the top-1 token, against the exact cache's. Streaming is scored on the positions
past its budget (what the window changed); SnapKV compresses the first half of each window
and is scored on the second half (PyramidKV likewise). Reported: top-1 agreement, ΔPPL. (KL needs full
distributions, which ``prompt_logprobs`` does not return.)

**memory** (``--only memory``): one request per ``--memory-lengths`` length (prompt and
``--memory-output`` output tokens together), stepped by hand, with the most blocks it held
at once (and at its last step: a compacting policy's steady state), against
``KVEvictionConfig.max_blocks_per_request`` (what ``pagedkv plan`` reports): flat beyond the
budget means the same peak at every length.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Any

from pagedkv.bench.common import BenchOptionError, log

EXACT = "float32"
# Mohtashami & Jaggi (2023), the passkey test's filler (bench_lossy_kv's prompts use it too).
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
POLICIES = {
    "streaming": {},
    "streaming-cache": {"positions": "cache"},
    "snapkv": {},
    "pyramidkv": {},
}
COMPACTING = ("snapkv", "pyramidkv")


@dataclass(frozen=True)
class Method:
    """One measured method: engine keywords and, for token eviction, the per-request policy
    (``budget`` tokens, or ``fraction`` of each prompt)."""

    name: str
    kv_cache_dtype: str = EXACT
    policy: str | None = None
    budget: int | None = None
    fraction: float | None = None
    window: int | None = None  # snapkv/pyramidkv: the observation window (recent_tokens)

    @property
    def evicts(self) -> bool:
        return self.policy is not None

    def eviction(self, prompt_len: int, compress_at: int | None = None) -> dict[str, Any] | None:
        """The ``kv_eviction`` dict of a request of ``prompt_len`` tokens (None: a format)."""
        if self.policy is None:
            return None
        base = self.policy.split("-")[0]
        budget = self.budget or max(36 + 16, int(prompt_len * (self.fraction or 1.0)))
        ev: dict[str, Any] = {"policy": base, "budget_tokens": budget, **POLICIES[self.policy]}
        if self.window is not None:
            ev["recent_tokens"] = self.window
        if compress_at is not None and base in COMPACTING:
            ev["compress_at"] = compress_at
        return ev

    def engine_kwargs(self) -> dict[str, Any]:
        return dict(kv_cache_dtype=self.kv_cache_dtype)


def parse_method(name: str) -> Method:
    """``int4`` / ``streaming:512`` / ``streaming-cache:512`` / ``snapkv:0.25`` / ``snapkv:256`` /
    ``snapkv:0.25:8`` (an observation window of 8 tokens instead of SnapKV's 32)."""
    from pagedkv.core.specs import KV_CACHE_DTYPES

    if ":" not in name:
        if name not in KV_CACHE_DTYPES:
            raise BenchOptionError(
                f"unknown method {name!r}: a kv_cache_dtype ({sorted(KV_CACHE_DTYPES)}) or "
                f"a policy ({', '.join(f'{p}:N' for p in POLICIES)})"
            )
        return Method(name, kv_cache_dtype=name)
    policy, _, arg = name.partition(":")
    if policy not in POLICIES:
        raise BenchOptionError(f"unknown policy {policy!r} in {name!r}: {sorted(POLICIES)}")
    arg, _, win = arg.partition(":")
    window = None
    if win:  # snapkv:0.25:8 - an observation window of 8 tokens (the kept recent tokens too)
        if policy not in COMPACTING or not win.isdigit() or int(win) < 1:
            raise BenchOptionError(f"{name!r}: a window (':N', N >= 1) is a snapkv/pyramidkv one")
        window = int(win)
    try:
        value = float(arg)
    except ValueError:
        raise BenchOptionError(f"{name!r}: the budget is a token count or a fraction") from None
    if 0 < value < 1 and policy in COMPACTING:
        return Method(name, policy=policy, fraction=value, window=window)
    if value < 1 or value != int(value):
        raise BenchOptionError(f"{name!r}: the budget is a token count >= 1 or a fraction")
    return Method(name, policy=policy, budget=int(value), window=window)


def sampling_params(method: Method, prompt_len: int, compress_at: int | None = None, **kw: Any):
    from pagedkv import SamplingParams

    return SamplingParams(kv_eviction=method.eviction(prompt_len, compress_at), **kw)


def engine(method: Method, **kwargs: Any) -> Any:
    from pagedkv import LLM

    return LLM(**method.engine_kwargs(), **kwargs)


# ---- teacher-forced through prompt_logprobs -------------------------------------------------------


def _score(llm: Any, method: Method, window: list[int]) -> tuple[list[float], list[int]]:
    """(target logprob, top-1 token) at every position ``1 ..`` of ``window``."""
    half = len(window) // 2
    params = sampling_params(
        method, len(window), compress_at=half, temperature=0, max_tokens=1, prompt_logprobs=1
    )
    (out,) = llm.generate([{"prompt_token_ids": window}], params, use_tqdm=False)
    lps, tops = [], []
    for i in range(1, len(window)):
        row = out.prompt_logprobs[i]
        lps.append(row[window[i]].logprob)
        tops.append(next(t for t, lp in row.items() if lp.rank == 1))
    return lps, tops


def scored_from(method: Method, window_len: int) -> int:
    """The first scored position of a window: past a streaming budget; SnapKV's second half."""
    if method.policy is None:
        return 1
    if method.policy in COMPACTING:
        return window_len // 2 + 1
    assert method.budget is not None
    return method.budget + 1


def run_evict_teacher(args: argparse.Namespace, methods: list[Method]) -> dict[str, Any]:
    from pagedkv.bench import kv_quant

    size = dict(max_model_len=max(args.window, 2048), kv_cache_memory=args.kv_cache_memory)
    ref = engine(Method(EXACT), **size, max_num_batched_tokens=args.window)
    tok = ref.get_tokenizer()
    corpora = {}
    for name, temp in (("greedy", 0.0), ("sampled", 1.0)):
        stream = kv_quant.make_corpus(ref, args.tokens, temp, args.seed)
        corpora[name] = kv_quant.windows(stream, args.window, min_size=args.window // 2)
    exact = {c: [_score(ref, Method(EXACT), w) for w in ws] for c, ws in corpora.items()}
    del ref, tok
    out: dict[str, Any] = dict(window=args.window, corpora={}, methods={})
    for c, ws in corpora.items():
        out["corpora"][c] = dict(windows=len(ws), tokens=sum(map(len, ws)))
    for m in methods:
        t0 = time.perf_counter()
        llm = engine(m, **size, max_num_batched_tokens=args.window)
        res: dict[str, Any] = {}
        for c, ws in corpora.items():
            n = agree = 0
            nll_ref = nll = 0.0
            for w, (ref_lp, ref_top) in zip(ws, exact[c]):
                lp, top = _score(llm, m, w)
                first = scored_from(m, len(w)) - 1
                for i in range(first, len(lp)):
                    n += 1
                    agree += top[i] == ref_top[i]
                    nll_ref -= ref_lp[i]
                    nll -= lp[i]
            ppl_ref, ppl = math.exp(nll_ref / n), math.exp(nll / n)
            res[c] = dict(
                positions=n,
                top1_agreement=agree / n,
                ppl_exact=ppl_ref,
                ppl=ppl,
                ppl_delta_pct=100 * (ppl / ppl_ref - 1),
            )
            log(args, f"  evict-teacher {m.name:20s} {c}: {res[c]}")
        res["seconds"] = time.perf_counter() - t0
        out["methods"][m.name] = res
        del llm
    return out


# ---- memory per request ---------------------------------------------------------------------------


def run_memory(args: argparse.Namespace, methods: list[Method]) -> dict[str, Any]:
    from pagedkv.engine import kv_eviction

    lengths = args.memory_lengths
    out: dict[str, Any] = dict(lengths=lengths, output_tokens=args.memory_output, methods={})
    llm = engine(
        Method(EXACT),
        max_model_len=max(lengths),
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=False,
    )
    eng = llm.llm_engine
    tok = llm.get_tokenizer()
    bs = eng.block_size
    text = tok.encode(FILLER * (max(lengths) // 10 + 10), add_special_tokens=False)
    kv = eng.scheduler.kv_cache_manager
    for m in [Method(EXACT), *[m for m in methods if m.evicts]]:
        peaks, finals, ceilings, secs = [], [], [], []
        for total in lengths:
            n = total - args.memory_output  # the prompt: the request ends at `total` tokens
            ids = text[:n]
            params = sampling_params(
                m, n, temperature=0, max_tokens=args.memory_output, ignore_eos=True
            )
            rid = f"mem-{m.name}-{n}"
            t0 = time.perf_counter()
            eng.add_request(rid, {"prompt_token_ids": ids}, params)
            peak = last = 0
            pool = kv.block_pool
            while eng.has_unfinished_requests():
                eng.step()
                # Blocks in use (the only request; no prefix cache): its table and, in a
                # compressing step, the blocks its compaction replaced.
                used = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
                peak = max(peak, used)
                last = used or last  # the last step before it finished (and was freed)
            secs.append(time.perf_counter() - t0)
            peaks.append(peak)
            finals.append(last)
            ev = kv_eviction.resolve(eng, params)  # the engine's policy (its layer count)
            ceilings.append(
                ev.max_blocks_per_request(bs, n, args.memory_output) if ev else -(-total // bs)
            )
            log(args, f"  memory {m.name:20s} {total:>6} tokens: peak {peak} blocks")
        out["methods"][m.name] = dict(
            peak_blocks=peaks,
            peak_tokens=[p * bs for p in peaks],
            final_tokens=[f * bs for f in finals],
            planned_blocks=ceilings,
            seconds=secs,
        )
    return out
