"""Quantized KV caches: accuracy and capacity of every KV cache mode against float32, same run.

**Accuracy** (teacher-forced). A float32-cache engine first writes two corpora from a fixed
list of chat and plain prompts (no downloads, reproducible): ``greedy`` (temperature 0, close
to the issue's anchors) and ``sampled`` (temperature 1.0, fixed seeds: realistic, harder text).
Each corpus is one token stream (prompt + continuation per prompt, ``--tokens`` in all) cut
into windows of up to ``--window`` (2,048) tokens. Every mode's engine scores every window
with ONE prefill chunk (``max_num_batched_tokens`` = the window): the model's final hidden
states are captured and turned into full-vocabulary log-probs for the next token at every
position. Prefill attention in pagedkv reads its K/V back from the paged cache after writing
them (``ops/attention._prefill`` gathers from the cache), so every scored position sees its
context through the quantized cache, exactly as decode does (tests/test_bench_kv_quant.py
checks that an int4 cache changes one-chunk prefill log-probs). Against the float32 cache's
log-probs of the same window: top-1 agreement, mean KL(float32 ‖ mode) over positions,
perplexity of each and the delta. Greedy agreement: ``--greedy-tokens`` (48) greedy tokens
(``ignore_eos``) on 8 chat prompts; the fraction of prompts whose tokens all match float32's
and the mean fraction matched before the first divergence. fp8 "calibrated" uses scales from
a calibration pass over prompts disjoint from the corpus.

Targets (issue 14, checked on both corpora, the best row of a family counts): INT8 ≥ 99%
top-1 and |ΔPPL| ≤ 0.5%; FP8 e4m3 per token-head ≥ 98% and ≤ 1%; INT4 ≥ 95% and ≤ 3%; issue
36: INT3 ≥ 95% and ≤ 3%, INT2 ΔPPL ≤ 8%. The KIVI rows (``int3_kivi``, ``int2_kivi``; ``_b32``:
block size 32, which is also their K group) belong to the int3 / int2 families.

**Capacity** (``--only capacity``). One KV memory budget for every mode: the bytes a bfloat16
cache needs for ``--capacity-bf16`` (10) requests of 2,048 KV tokens plus the null block (at 4,
whole requests round a 1.94x page down to 7/4 = 1.75x; at 10 the rounding costs at most 0.1x).
``planned + 2`` distinct random-token requests of ``2048 - bs + 1`` prompt tokens (``bs``: the
row's block size, 16 unless it names another) and 2 output tokens are submitted with a token
budget that prefills all that fit in one step, so every admitted request holds all its blocks at
once; the measured figure is the most requests resident with their prompts fully prefilled
after a step (then they decode together). ``max_num_seqs`` is the requests sent, which is also
how many KIVI residuals the engine reserves out of the budget. The run stops at the first
finished request. Ratio vs bf16; target ≥ 1.9× (INT8/FP8), ≥ 3.4× (INT4), ≥ 4.5× (INT3) and
≥ 6× (INT2).

**Speed** (``--only speed``): decode attention per mode from `pagedkv.bench.kv_quant_attention`
(or ``--speed-script FILE``'s ``run() -> dict`` when that file exists).

Usage: python benchmarks/bench_kv_quant.py [--modes a,b] [--tokens N] [--quick] [--only all|accuracy|capacity|speed]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.bench.common import (
    BenchOptionError,
    add_output_args,
    fmt,
    log,
    run_and_emit,
    user_help,
)

TARGETS = {  # family -> (min top-1 agreement, max |ΔPPL| in %), issue 14; int3/int2 issue 36
    "int8": (0.99, 0.5),
    "fp8_per_token_head": (0.98, 1.0),
    "int4": (0.95, 3.0),
    "int3": (0.95, 3.0),
    "int2": (0.0, 8.0),  # issue 36 bars only ΔPPL at 2 bits
}
CAPACITY_TARGETS = {
    "int8_per_token_head": 1.9,
    "fp8_per_token_head": 1.9,
    "fp8": 1.9,
    "int8": 1.9,
    "fp8_per_token_head_f16": 1.9,
    "int4_per_token_head": 3.4,
    "int4": 3.4,
    "int3": 4.5,
    "int2": 6.0,
    "int3_kivi": 4.5,
    "int3_kivi_b32": 4.5,
    "int2_kivi": 6.0,
    "int2_kivi_b32": 6.0,
}
REFERENCE = "float32"
KV_TOKENS_PER_REQUEST = 2048  # a "2k-token request" holds this many token slots
LOGIT_ROWS_PER_PASS = 512  # rows of [rows, vocab] float32 logits computed at once


@dataclass(frozen=True, slots=True)
class KVMode:
    """One benchmark row: an engine's KV cache settings (``LLM`` keywords)."""

    name: str
    kv_cache_dtype: str
    kv_rotation: str | None = None  # None: what kv_cache_dtype implies
    calibrated: bool = False  # fp8 per-tensor scales from a calibration pass
    family: str | None = None  # the TARGETS key this row is judged by
    block_size: int | None = None  # None: the engine's default (16); KIVI's K groups are blocks

    def llm_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = dict(kv_cache_dtype=self.kv_cache_dtype, kv_rotation=self.kv_rotation)
        if self.block_size is not None:
            kw["block_size"] = self.block_size
        if self.calibrated:
            kw["kv_scales_calibration"] = list(CALIBRATION_PROMPTS)
        return kw


def _mode(dtype: str, rotation: str | None = None, family: str | None = None) -> KVMode:
    name = dtype + ("+hadamard" if rotation == "hadamard" else "")
    return KVMode(name, dtype, rotation or "none", family=family)


MODES: tuple[KVMode, ...] = (
    KVMode(REFERENCE, "float32"),
    KVMode("bfloat16", "bfloat16"),
    KVMode("fp8", "fp8", "none"),  # per-tensor e4m3, scale 1.0 (vLLM's default)
    KVMode("fp8+calibrated", "fp8", "none", calibrated=True),
    KVMode("fp8_e5m2", "fp8_e5m2", "none"),
    _mode("fp8_per_token_head", None, "fp8_per_token_head"),
    _mode("fp8_per_token_head", "hadamard", "fp8_per_token_head"),
    _mode("fp8_per_token_head_f16", None, "fp8_per_token_head"),
    _mode("fp8_per_token_head_f16", "hadamard", "fp8_per_token_head"),
    _mode("int8_per_token_head", None, "int8"),
    _mode("int8_per_token_head", "hadamard", "int8"),
    KVMode("int8", "int8", None, family="int8"),  # the shortcut: int8_per_token_head_f16 + hadamard
    _mode("int4_per_token_head", None, "int4"),
    _mode("int4_per_token_head", "hadamard", "int4"),
    _mode("int4_per_token_group", None, "int4"),
    _mode("int4_per_token_group", "hadamard", "int4"),
    KVMode("int4", "int4", None, family="int4"),  # the shortcut: the best shipped INT4
    _mode("int3_per_token_group", None, "int3"),
    KVMode("int3", "int3", None, family="int3"),  # the shortcut: groups of 32 + hadamard
    _mode("int2_per_token_group", None, "int2"),
    KVMode("int2", "int2", None, family="int2"),
    # KIVI (ops/kivi.py): K per channel over a block, V per token, an int8 residual
    KVMode("int3_kivi", "int3_kivi", None, family="int3"),
    KVMode("int3_kivi_b32", "int3_kivi", None, family="int3", block_size=32),
    KVMode("int2_kivi", "int2_kivi", None, family="int2"),
    KVMode("int2_kivi_b32", "int2_kivi", None, family="int2", block_size=32),
)
MODES_BY_NAME = {m.name: m for m in MODES}
# fp8 per tensor too: the FP8 format whose page (1 byte a value, no inline scales) reaches 2x;
# vLLM's per-token-head pages (fp32 scales, 1.88x at head size 64) and pagedkv's fp16-scale ones
# (1.94x: "int8" and fp8_per_token_head_f16).
CAPACITY_MODES = (
    "bfloat16",
    "fp8",
    "int8_per_token_head",
    "int8",
    "fp8_per_token_head",
    "fp8_per_token_head_f16",
    "int4_per_token_head",
    "int4",
    "int3",
    "int2",
)

# ---- corpus and prompts (fixed lists: the corpus is generated, never downloaded) ------------

CHAT_CORPUS_PROMPTS = (
    "Explain how a hash table handles collisions, with a short example in Python.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main causes of inflation, and how do central banks respond to it?",
    "Give me a weekly meal plan for a vegetarian who trains for a marathon.",
    "Summarize the history of the Roman Empire in a few paragraphs.",
    "How do vaccines train the immune system? Explain it to a twelve-year-old.",
    "Compare TCP and UDP and say when you would use each one.",
    "Write a polite email asking my landlord to fix a leaking kitchen tap.",
)
PLAIN_CORPUS_PROMPTS = (
    "The city council met on Tuesday evening to discuss the new budget. According to",
    'def merge_sort(items):\n    """Sort a list with merge sort."""\n',
    "Photosynthesis is the process by which plants convert light into chemical energy.",
    "Chapter 1\n\nThe rain had not stopped for three days when Anna finally opened the door and",
    "In mathematics, a prime number is a natural number greater than 1 that",
    "Dear diary, today was the strangest day of my life. It started when",
    "The recipe calls for two cups of flour, one egg, and",
    "Climate change affects ocean currents in several ways. First,",
)
GREEDY_CHAT_PROMPTS = (  # disjoint from the corpus prompts
    "What is the capital of Australia, and why was it chosen?",
    "Write a haiku about autumn leaves.",
    "List three tips for writing clean code.",
    "Why is the sky blue?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a coffee shop run by cats.",
    "How does a refrigerator keep food cold?",
)
CALIBRATION_PROMPTS = (  # fp8 per-tensor scale calibration: disjoint from everything above
    "The quick brown fox jumps over the lazy dog while the farmer watches from the barn.",
    "Describe the water cycle, from evaporation to precipitation, in simple terms.",
    "import numpy as np\n\ndef normalize(x):\n    return (x - x.mean()) / x.std()\n",
    "Our quarterly results exceeded expectations thanks to strong sales in Europe and Asia.",
)


def chat_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """A one-turn chat prompt (the model's template, generation prompt added) as token ids."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    return tokenizer.encode(rendered, add_special_tokens=False)


def corpus_prompts(tokenizer: Any) -> list[list[int]]:
    """The corpus prompts as token ids: the chat ones through the chat template."""
    return [chat_prompt_ids(tokenizer, t) for t in CHAT_CORPUS_PROMPTS] + [
        tokenizer.encode(t, add_special_tokens=False) for t in PLAIN_CORPUS_PROMPTS
    ]


def make_corpus(llm: Any, num_tokens: int, temperature: float, seed: int) -> list[int]:
    """``num_tokens`` tokens: each corpus prompt followed by what ``llm`` generates from it
    (``ignore_eos``; per-prompt seeds ``seed + i``), concatenated in prompt order and cut."""
    from pagedkv import SamplingParams

    prompts = corpus_prompts(llm.get_tokenizer())
    per = max(16, -(-num_tokens // len(prompts)))
    params = [
        SamplingParams(temperature=temperature, max_tokens=per, ignore_eos=True, seed=seed + i)
        for i in range(len(prompts))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stream = [t for p, o in zip(prompts, outs) for t in p + list(o.outputs[0].token_ids)]
    return stream[:num_tokens]


def windows(stream: Sequence[int], size: int, min_size: int = 16) -> list[list[int]]:
    """``stream`` cut into consecutive windows of ``size`` tokens (a tail shorter than
    ``min_size`` is dropped: too little context to score)."""
    out = [list(stream[i : i + size]) for i in range(0, len(stream), size)]
    return [w for w in out if len(w) >= min_size]


# ---- teacher-forced scoring -------------------------------------------------------------------


def score_window(llm: Any, window: Sequence[int]) -> Any:
    """Log-probs ``[len(window) - 1, vocab]`` (float32) of the next token at every position but
    the last, from ONE prefill of ``window`` through ``llm``'s paged cache.

    The engine's model forward is wrapped to keep its final hidden states; the logits of all
    rows are computed here (the engine itself computes only the sampler's last row). Raises
    RuntimeError unless the prompt ran as one chunk (``max_num_batched_tokens`` too small)."""
    import torch

    from pagedkv import SamplingParams

    model = llm.llm_engine.runner.model
    captured: list[torch.Tensor] = []
    forward = model.forward

    def keep(*args: Any, **kwargs: Any) -> torch.Tensor:
        hidden = forward(*args, **kwargs)
        captured.append(hidden)
        return hidden

    model.forward = keep  # nn.Module.__call__ looks forward up on the instance first
    try:
        llm.generate(
            [{"prompt_token_ids": list(window)}],
            SamplingParams(max_tokens=1, temperature=0),
            use_tqdm=False,
        )
    finally:
        del model.forward
    if len(captured) != 1 or captured[0].shape[0] != len(window):
        raise RuntimeError(f"window of {len(window)} tokens did not run as one prefill chunk")
    rows = captured[0][: len(window) - 1]
    with torch.inference_mode():
        return torch.cat(
            [
                torch.log_softmax(
                    model.compute_logits(rows[i : i + LOGIT_ROWS_PER_PASS]).float(), -1
                )
                for i in range(0, rows.shape[0], LOGIT_ROWS_PER_PASS)
            ]
        )


@dataclass(slots=True)
class AgreementStats:
    """Teacher-forced comparison of a mode's next-token log-probs with the reference's, summed
    over positions (``add`` one window at a time; the figures are means over positions)."""

    positions: int = 0
    top1_agree: int = 0
    kl_sum: float = 0.0  # sum over positions of KL(reference || mode), nats
    nll_ref: float = 0.0  # sum of -log p_ref(actual next token)
    nll: float = 0.0  # sum of -log p_mode(actual next token)

    def add(self, ref_lp: Any, lp: Any, targets: Sequence[int]) -> None:
        """One window: ``ref_lp``, ``lp`` ``[n, vocab]`` log-probs, ``targets`` the n actual
        next tokens."""
        import torch

        if ref_lp.shape != lp.shape or ref_lp.shape[0] != len(targets):
            raise ValueError(
                f"shape mismatch: {tuple(ref_lp.shape)}, {tuple(lp.shape)}, {len(targets)} targets"
            )
        tgt = torch.as_tensor(list(targets), dtype=torch.long).unsqueeze(1)
        self.positions += len(targets)
        self.top1_agree += int((ref_lp.argmax(-1) == lp.argmax(-1)).sum())
        self.kl_sum += float((ref_lp.exp() * (ref_lp - lp)).sum(-1).double().sum())
        self.nll_ref -= float(ref_lp.gather(1, tgt).double().sum())
        self.nll -= float(lp.gather(1, tgt).double().sum())

    def summary(self) -> dict[str, Any]:
        n = self.positions or 1
        ppl_ref, ppl = math.exp(self.nll_ref / n), math.exp(self.nll / n)
        return dict(
            positions=self.positions,
            top1_agreement=self.top1_agree / n,
            mean_kl=self.kl_sum / n,
            ppl_ref=ppl_ref,
            ppl=ppl,
            ppl_delta_pct=(ppl / ppl_ref - 1) * 100,
        )


def greedy_agreement(
    ref: Sequence[Sequence[int]], out: Sequence[Sequence[int]]
) -> dict[str, float]:
    """``identical``: fraction of prompts whose tokens equal the reference's; ``prefix_match``:
    mean over prompts of the fraction of reference tokens matched before the first divergence."""
    if len(ref) != len(out) or not ref:
        raise ValueError("need one output per reference, at least one")
    fracs = []
    for r, o in zip(ref, out):
        k = next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), min(len(r), len(o)))
        fracs.append(k / len(r) if r else 1.0)
    return dict(
        identical=sum(list(r) == list(o) for r, o in zip(ref, out)) / len(ref),
        prefix_match=sum(fracs) / len(fracs),
    )


def meets(family: str | None, top1: float, ppl_delta_pct: float) -> bool | None:
    """Whether a row meets its family's target (None: no target)."""
    if family is None:
        return None
    min_top1, max_delta = TARGETS[family]
    return top1 >= min_top1 and abs(ppl_delta_pct) <= max_delta


# ---- the runs ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Corpus:
    name: str
    temperature: float
    stream: list[int]
    windows: list[list[int]] = field(default_factory=list)


def _engine(mode: KVMode, **kwargs: Any) -> Any:
    from pagedkv import LLM

    return LLM(**mode.llm_kwargs(), enable_prefix_caching=False, **kwargs)


def _greedy(llm: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    from pagedkv import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _score_mode(llm: Any, mode: KVMode, corpora: list[Corpus], ref_dir: Path) -> dict[str, Any]:
    """One row: every window of every corpus scored by ``llm``, against the reference's
    log-probs in ``ref_dir`` (written there when ``mode`` is the reference)."""
    import torch

    row: dict[str, Any] = dict(
        kv_cache_dtype=mode.kv_cache_dtype,
        kv_rotation=mode.kv_rotation or "none",
        family=mode.family,
    )
    if mode.calibrated:
        row["kv_scales_source"] = llm.llm_engine.kv_scales_source
    for c in corpora:
        stats = AgreementStats()
        for i, w in enumerate(c.windows):
            lp = score_window(llm, w)
            path = ref_dir / f"{c.name}_{i}.pt"
            if mode.name == REFERENCE:
                torch.save(lp, path)
            stats.add(torch.load(path), lp, w[1:])
            del lp  # [window, vocab] float32: one at a time
        s = stats.summary()
        s["meets_target"] = meets(mode.family, s["top1_agreement"], s["ppl_delta_pct"])
        row[c.name] = s
    return row


def _families(rows: dict[str, dict[str, Any]], corpora: list[Corpus]) -> dict[str, Any]:
    """Per target family and corpus: its best row (meeting the target first, then top-1)."""
    out = {}
    for fam in TARGETS:
        for c in corpora:
            cands = [(n, r[c.name]) for n, r in rows.items() if r["family"] == fam]
            if cands:
                name, best = max(
                    cands, key=lambda x: (bool(x[1]["meets_target"]), x[1]["top1_agreement"])
                )
                out[f"{fam}/{c.name}"] = dict(best=name, meets_target=best["meets_target"])
    return out


def run_accuracy(args: argparse.Namespace, modes: list[KVMode]) -> dict[str, Any]:
    """Score every corpus window under the reference, then under each mode (one engine at a
    time; the reference log-probs wait on disk, a window at a time, so memory stays flat)."""
    # Room for one window plus the greedy prompts; the reference also holds every corpus
    # sequence at once while it writes them (a smaller pool would preempt and thrash).
    n_prompts = len(CHAT_CORPUS_PROMPTS) + len(PLAIN_CORPUS_PROMPTS)
    seq_len = -(-args.tokens // n_prompts) + 128  # a corpus sequence: prompt + continuation
    window_blocks = -(-(args.window + 16) // 16) + len(GREEDY_CHAT_PROMPTS) * 8
    corpus_blocks = n_prompts * (-(-seq_len // 16) + 1)
    size = dict(
        num_kv_blocks=window_blocks,
        max_model_len=max(args.window, seq_len) + 16,
        max_num_batched_tokens=args.window,
    )
    ref_mode = MODES_BY_NAME[REFERENCE]
    log(
        args, f"loading the {REFERENCE} engine; writing the corpora ({args.tokens} tokens each) ..."
    )
    t0 = time.perf_counter()
    ref = _engine(ref_mode, **{**size, "num_kv_blocks": window_blocks + corpus_blocks})
    corpora = [
        Corpus(name, temp, make_corpus(ref, args.tokens, temp, args.seed))
        for name, temp in (("greedy", 0.0), ("sampled", 1.0))
    ]
    for c in corpora:
        c.windows = windows(c.stream, args.window)
    chat = [
        chat_prompt_ids(ref.get_tokenizer(), t) for t in GREEDY_CHAT_PROMPTS[: args.greedy_prompts]
    ]
    log(args, f"  corpora written in {time.perf_counter() - t0:.0f}s")
    rows: dict[str, dict[str, Any]] = {}
    ref_greedy: list[list[int]] = []
    with tempfile.TemporaryDirectory(prefix="bench_kv_quant_") as tmp:
        for mode in [ref_mode] + [m for m in modes if m.name != REFERENCE]:
            t0 = time.perf_counter()
            llm = ref if mode is ref_mode else _engine(mode, **size)
            row = rows[mode.name] = _score_mode(llm, mode, corpora, Path(tmp))
            greedy_out = _greedy(llm, chat, args.greedy_tokens)
            ref_greedy = ref_greedy or greedy_out
            row["greedy_output"] = greedy_agreement(ref_greedy, greedy_out)
            row["seconds"] = time.perf_counter() - t0
            log(
                args,
                f"  {mode.name:30s} "
                + "  ".join(
                    f"{c.name}: top1 {row[c.name]['top1_agreement']:.2%} dPPL {row[c.name]['ppl_delta_pct']:+.2f}%"
                    for c in corpora
                )
                + f"  greedy output {row['greedy_output']['identical']:.0%}  ({row['seconds']:.0f}s)",
            )
            del llm  # the next engine's cache replaces this one's
    return dict(
        scoring=(
            "one prefill chunk per window (max_num_batched_tokens = window); pagedkv's prefill "
            "attention reads K/V back from the paged cache after writing them, so every scored "
            "position sees its context through the quantized cache, as decode does"
        ),
        corpora={
            c.name: dict(
                temperature=c.temperature,
                seed=args.seed,
                tokens=len(c.stream),
                windows=len(c.windows),
                window_tokens=max(map(len, c.windows)),
                scored_positions=sum(len(w) - 1 for w in c.windows),
            )
            for c in corpora
        },
        greedy_prompts=len(chat),
        greedy_tokens=args.greedy_tokens,
        modes=rows,
        families=_families(rows, corpora),
        targets={k: dict(min_top1=a, max_abs_ppl_delta_pct=b) for k, (a, b) in TARGETS.items()},
    )


def _run_until_first_finish(eng: Any, prompts: list[list[int]]) -> tuple[int, int, int]:
    """Submit ``prompts`` (2 greedy output tokens each) to ``eng`` at once and step until one
    finishes; the rest are aborted. Returns ``(resident, together, steps)``: the most requests
    running with their whole prompt in the cache after a step, the requests that finished in
    the last step (they decoded in one batch), and the steps run."""
    from pagedkv import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    ids = [f"cap-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, {"prompt_token_ids": p}, params)
    resident = together = steps = 0
    try:
        while not together and eng.has_unfinished_requests():
            outs = eng.step()
            steps += 1
            resident = max(
                resident,
                sum(
                    r.num_computed_tokens >= len(r.prompt_token_ids) for r in eng.scheduler.running
                ),
            )
            together = sum(o.finished for o in outs)
    finally:
        eng.abort_request(ids)
    return resident, together, steps


def run_capacity(args: argparse.Namespace) -> dict[str, Any]:
    """Max concurrent 2k-token requests under one KV memory budget, measured by running them."""
    from pagedkv import LLM
    from pagedkv.core.planning import bytes_per_block, kivi_residual_bytes, kivi_sink_store_bytes
    from pagedkv.core.specs import get_kv_cache_groups
    from pagedkv.models.config import load_model_config

    mc = load_model_config(None)
    req_tokens = args.capacity_request_tokens
    bf16 = get_kv_cache_groups(mc.kv_cache_specs(16, "bfloat16", torch_dtype="float32"))
    budget = (args.capacity_bf16 * (req_tokens // 16) + 1) * bytes_per_block(bf16)
    rng = random.Random(args.seed)
    log(
        args,
        f"capacity: KV budget {budget / 2**20:.1f} MiB for every mode (bf16 holds "
        f"{args.capacity_bf16} requests of {req_tokens} tokens)",
    )
    out: dict[str, Any] = {}
    for name in args.capacity_modes:
        mode = MODES_BY_NAME.get(name) or _mode(name)
        bs = mode.block_size or 16
        per_req_blocks = req_tokens // bs
        prompt_len = req_tokens - bs + 1  # all its blocks taken at prefill end; 2 outputs fit
        t0 = time.perf_counter()
        probe = get_kv_cache_groups(
            mc.kv_cache_specs(
                bs, mode.kv_cache_dtype, torch_dtype="float32", kv_rotation=mode.kv_rotation
            )
        )
        # A KIVI cache also holds a residual per request (``kivi_residual_bytes``), outside
        # the pool: the engine reserves one per max_num_seqs row (here: the requests sent),
        # and its sink store once.
        per_req = per_req_blocks * bytes_per_block(probe) + kivi_residual_bytes(probe)
        pool = budget - bytes_per_block(probe) - kivi_sink_store_bytes(probe)
        planned = pool // per_req
        n_submit = planned + 2
        llm = LLM(
            **mode.llm_kwargs(),
            kv_cache_memory=budget,
            max_model_len=req_tokens,
            max_num_batched_tokens=n_submit * prompt_len,
            max_num_seqs=n_submit,
            enable_prefix_caching=False,
            **({} if mode.block_size else {"block_size": bs}),
        )
        eng = llm.llm_engine
        prompts = [
            [rng.randrange(mc.vocab_size) for _ in range(prompt_len)] for _ in range(n_submit)
        ]
        resident, together, steps = _run_until_first_finish(eng, prompts)
        stats = llm.make_stats()
        out[name] = dict(
            kv_cache_dtype=mode.kv_cache_dtype,
            kv_rotation=mode.kv_rotation or "none",
            num_blocks=eng.kv_cache_config.num_blocks,
            bytes_per_block=bytes_per_block(probe),
            block_size=bs,
            prompt_tokens=prompt_len,
            residual_bytes_per_request=kivi_residual_bytes(probe),
            planned=planned,
            measured=resident,
            decoded_together=together,
            submitted=n_submit,
            preemptions=stats.num_preemptions,
            steps=steps,
            seconds=time.perf_counter() - t0,
        )
        log(
            args,
            f"  {name:24s} planned {planned:3d}  measured {resident:3d}  "
            f"({out[name]['seconds']:.0f}s)",
        )
        del llm, eng
    base = out.get("bfloat16", {}).get("measured")
    for name, r in out.items():
        r["ratio_vs_bf16"] = r["measured"] / base if base else None
        r["block_ratio_vs_bf16"] = (
            (r["num_blocks"] - 1) / (out["bfloat16"]["num_blocks"] - 1) if base else None
        )
        target = CAPACITY_TARGETS.get(name)
        r["target_ratio"] = target
        r["meets_target"] = (
            None if target is None or r["ratio_vs_bf16"] is None else r["ratio_vs_bf16"] >= target
        )
    return dict(
        kv_cache_memory=budget,
        request_kv_tokens=req_tokens,
        prompt_tokens=prompt_len,
        output_tokens=2,
        block_size=16,  # the budget's blocks (a mode's own: its row)
        modes=out,
        method=(
            "planned+2 distinct requests submitted at once, all that fit prefilled in one step; "
            "measured = most requests running with their prompt fully in the cache"
        ),
    )


def run_speed(args: argparse.Namespace) -> dict[str, Any]:
    """Decode attention per mode from `pagedkv.bench.kv_quant_attention`, or from
    ``--speed-script`` if given and present."""
    if args.speed_script is None:
        from pagedkv.bench import kv_quant_attention as mod

        path: Path | str = mod.__name__
    else:
        path = Path(args.speed_script)
        if not path.exists():
            return dict(skipped=f"{path} not found")
        spec = importlib.util.spec_from_file_location("bench_kv_quant_attention", path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        if not callable(getattr(mod, "run", None)):
            return dict(skipped=f"{path} has no run()")
    result = mod.run(seqs=4, tokens=256, rounds=1) if args.quick else mod.run()
    text = mod.table(result) if callable(getattr(mod, "table", None)) else None
    return dict(source=str(path), result=result, table=text)


# ---- CLI --------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", default="all", choices=["all", "accuracy", "capacity", "speed"])
    p.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated rows (default: all): {', '.join(MODES_BY_NAME)}",
    )
    p.add_argument(
        "--tokens", type=int, default=None, help="tokens per corpus (20,480; --quick 1,024)"
    )
    p.add_argument(
        "--window",
        type=int,
        default=None,
        help="tokens per scored window = longest context (2,048; --quick 512)",
    )
    p.add_argument(
        "--greedy-prompts",
        type=int,
        default=None,
        help="chat prompts for greedy output (8; --quick 2)",
    )
    p.add_argument(
        "--greedy-tokens", type=int, default=None, help="greedy tokens per prompt (48; --quick 8)"
    )
    p.add_argument(
        "--capacity-bf16",
        type=int,
        default=None,
        help="requests the bf16 cache holds in the capacity budget (10; --quick 2)",
    )
    p.add_argument("--capacity-modes", default=",".join(CAPACITY_MODES))
    p.add_argument(
        "--capacity-request-tokens",
        type=int,
        default=None,
        help="KV token slots one capacity request holds, a multiple of 16 (2,048; --quick 256)",
    )
    p.add_argument(
        "--speed-script",
        default=None,
        metavar="FILE",
        help="a file whose run() -> dict to time instead "
        "(default: pagedkv.bench.kv_quant_attention)",
    )
    p.add_argument("--quick", action="store_true", help="CI size: the --quick defaults above")
    p.add_argument("--seed", type=int, default=0)
    add_output_args(p)


FULL_SIZE = dict(
    tokens=20480,
    window=2048,
    greedy_prompts=len(GREEDY_CHAT_PROMPTS),
    greedy_tokens=48,
    capacity_bf16=10,
    capacity_request_tokens=KV_TOKENS_PER_REQUEST,
)
QUICK_SIZE = dict(
    tokens=1024,
    window=512,
    greedy_prompts=2,
    greedy_tokens=8,
    capacity_bf16=2,
    capacity_request_tokens=256,
)


def _apply_sizes(args: argparse.Namespace) -> None:
    """Options left unset take the full (or ``--quick``) size."""
    for k, v in (QUICK_SIZE if args.quick else FULL_SIZE).items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def run(args: argparse.Namespace) -> dict[str, Any]:
    _apply_sizes(args)
    names = (
        MODES_BY_NAME
        if args.modes is None
        else [m.strip() for m in args.modes.split(",") if m.strip()]
    )
    unknown = [n for n in names if n not in MODES_BY_NAME]
    if unknown:
        raise BenchOptionError(
            f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES_BY_NAME)}"
        )
    args.capacity_modes = [m.strip() for m in str(args.capacity_modes).split(",") if m.strip()]
    bad_cap = [n for n in args.capacity_modes if n not in MODES_BY_NAME]
    if bad_cap:
        raise BenchOptionError(f"unknown capacity mode(s) {', '.join(bad_cap)}")
    if (
        args.tokens < 32
        or not 16 <= args.window <= 8192
        or args.greedy_tokens < 1
        or args.capacity_bf16 < 1
    ):
        raise BenchOptionError(
            "need --tokens >= 32, 16 <= --window <= 8192, --greedy-tokens >= 1, "
            "--capacity-bf16 >= 1"
        )
    if args.capacity_request_tokens < 32 or args.capacity_request_tokens % 16:
        raise BenchOptionError("--capacity-request-tokens must be a multiple of 16, at least 32")
    if not 1 <= args.greedy_prompts <= len(GREEDY_CHAT_PROMPTS):
        raise BenchOptionError(f"--greedy-prompts must be in 1..{len(GREEDY_CHAT_PROMPTS)}")
    report: dict[str, Any] = dict(
        benchmark="kv_quant",
        model="SmolLM2-135M-Instruct (default)",
        dtype="float32",
        reference=REFERENCE,
        quick=args.quick,
    )
    if args.only in ("all", "accuracy"):
        report["accuracy"] = run_accuracy(args, [MODES_BY_NAME[n] for n in names])
    if args.only in ("all", "capacity"):
        report["capacity"] = run_capacity(args)
    if args.only in ("all", "speed"):
        report["speed"] = run_speed(args)
    report["meets_targets"] = meets_targets(report)
    return report


def meets_targets(report: dict[str, Any]) -> dict[str, bool | None]:
    """Every target this report measured: ``{family}/{corpus}`` and ``capacity/{mode}``."""
    out: dict[str, bool | None] = {}
    for key, fam in report.get("accuracy", {}).get("families", {}).items():
        out[key] = fam["meets_target"]
    for name, m in report.get("capacity", {}).get("modes", {}).items():
        if m["target_ratio"] is not None:
            out[f"capacity/{name}"] = m["meets_target"]
    return out


def _pct(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x * 100, spec) + "%"


def _tick(ok: bool | None) -> str:
    return "" if ok is None else ("yes" if ok else "NO")


def table(r: dict[str, Any]) -> str:
    lines: list[str] = []
    acc = r.get("accuracy")
    if acc:
        for cname, c in acc["corpora"].items():
            lines += [
                f"corpus {cname!r}: T={c['temperature']}, {c['tokens']} tokens in {c['windows']} windows of "
                f"<= {c['window_tokens']}, {c['scored_positions']} scored positions; "
                f"float32 PPL {acc['modes'][REFERENCE][cname]['ppl']:.3f}"
            ]
        lines += [
            f"scoring: {acc['scoring']}",
            "",
            f"{'mode':30s}"
            + "".join(
                f"{cn + ' top1':>14s}{'KL':>9s}{'dPPL':>9s}{'target':>7s}" for cn in acc["corpora"]
            )
            + f"{'greedy=':>9s}{'prefix':>8s}",
        ]
        for name, m in acc["modes"].items():
            line = f"{name:30s}"
            for cn in acc["corpora"]:
                s = m[cn]
                line += (
                    f"{_pct(s['top1_agreement']):>14s}{s['mean_kl']:9.5f}{s['ppl_delta_pct']:+8.2f}%"
                    f"{_tick(s['meets_target']):>7s}"
                )
            g = m["greedy_output"]
            line += f"{_pct(g['identical'], '.0f'):>9s}{_pct(g['prefix_match'], '.0f'):>8s}"
            lines.append(line)
        lines.append(
            f"greedy: {acc['greedy_tokens']} tokens on {acc['greedy_prompts']} chat prompts "
            "(greedy= all tokens identical; prefix = matched before the first divergence)"
        )
        lines.append(
            "targets (best row of a family): "
            + ", ".join(
                f"{k} {v['best']} {_tick(v['meets_target'])}" for k, v in acc["families"].items()
            )
        )
    cap = r.get("capacity")
    if cap:
        lines += [
            "",
            f"capacity: KV budget {cap['kv_cache_memory'] / 2**20:.1f} MiB, requests of "
            f"{cap['prompt_tokens']}+{cap['output_tokens']} tokens ({cap['request_kv_tokens']} KV slots)",
            f"{'mode':24s}{'blocks':>8s}{'planned':>9s}{'measured':>10s}{'ratio':>8s}{'blocks x':>10s}"
            f"{'target':>8s}{'met':>5s}",
        ]
        for name, m in cap["modes"].items():
            lines.append(
                f"{name:24s}{m['num_blocks']:8d}{m['planned']:9d}{m['measured']:10d}"
                f"{fmt(m['ratio_vs_bf16'], '.2f'):>7s}x{fmt(m['block_ratio_vs_bf16'], '.3f'):>9s}x"
                f"{fmt(m['target_ratio'], '.1f'):>8s}{_tick(m['meets_target']):>5s}"
            )
    sp = r.get("speed")
    if sp:
        lines += ["", f"speed: {sp.get('skipped') or sp.get('source')}"] + (
            [sp["table"]] if sp.get("table") else []
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=user_help(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    return run_and_emit(run, table, p.parse_args(argv))


__all__ = [
    "AgreementStats",
    "KVMode",
    "MODES",
    "greedy_agreement",
    "main",
    "make_corpus",
    "score_window",
    "windows",
]
