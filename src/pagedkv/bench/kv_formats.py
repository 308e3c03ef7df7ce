"""Which 2–3-bit KV format could meet issue 36's bars: a fake-quantization study, before building.

Every candidate format is *emulated*: transformers' float32 model of the same GGUF runs with an
attention function that replaces each layer's K and V (after RoPE, as pagedkv caches them) by
what the format would store and give back, quantize then dequantize. Scoring is
``bench_kv_quant``'s: teacher-forced next-token log-probs over a corpus the float32 pagedkv
engine writes (``make_corpus``, greedy by default), cut into ``--window``-token windows, each
scored in one forward; top-1 agreement, mean KL and ΔPPL against the unquantized model on the
same windows. Rows ``token-*`` are the engine's shipped per-token-group layouts, so the study
can be checked against ``bench_kv_quant``'s measured rows of the same corpus.

A format (:class:`Format`):

* **K per token** (``k_axis="token"``): asymmetric codes over groups of ``k_group`` values of
  one token-head, as the engine's ``int{4,3,2}_per_token_group``; or **K per channel**
  (``"channel"``, KIVI/KVQuant): each channel's scale spans the ``block_size`` tokens of a
  block, so a block can be coded only when it is full.
* **V per token** in groups of ``v_group`` values.
* ``rotation``: the engine's randomized Hadamard transform of K and V first (its
  ``int{4,3,2}`` shortcuts imply it).
* Every scale is fp16 with the integer zero point in its low mantissa bits (2 bytes; the
  range always holds 0), as the engine stores them.
* **Residual** (KIVI's full-precision window): the query at position ``t`` reads the first
  ``sink`` tokens and every token of the last ``residual_blocks`` blocks up to its own
  (``block(j) > block(t) - residual_blocks``) as ``residual`` stores them (``"exact"``,
  ``"int8"`` per token-head, or ``"int4"`` in groups of 32), and all other tokens as codes. A
  per-channel K needs at least the filling block here.

**Bytes and capacity** are computed, not measured: the codes and scales of one token-head, and
per request the sink and residual tokens at their own width. ``capacity_vs_bf16`` is bf16's
bytes for a request of ``--capacity-tokens`` (2,048, ``bench_kv_quant``'s capacity length)
over the format's, block rounding ignored.

Bars (issue 36, greedy corpus): 3-bit top-1 ≥ 95%, ΔPPL ≤ 3%, capacity ≥ 4.5× bf16; 2-bit
ΔPPL ≤ 8%, capacity ≥ 6×.

Usage: python benchmarks/bench_kv_formats.py [--tokens N] [--window N] [--formats a,b] [--quick]
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from pagedkv.bench.common import (
    BenchOptionError,
    add_output_args,
    fmt,
    log,
    run_and_emit,
    user_help,
)

BF16_BYTES = 2
SCALE_BYTES = 2  # fp16 scale, zero point in its low mantissa bits


RESIDUALS = ("exact", "int8", "int4")


@dataclass(frozen=True, slots=True)
class Format:
    """One candidate layout (see the module docstring)."""

    name: str
    bits: int
    k_axis: str = "token"  # "token" | "channel"
    k_group: int = 32  # values per K scale (token axis)
    v_group: int = 32
    block_size: int = 16  # tokens per K scale (channel axis) and per residual block
    sink: int = 0
    residual_blocks: int = 0
    residual: str = "exact"  # "exact" | "int8" | "int4" (groups of 32, an fp16 scale each)
    rotation: bool = False  # the engine's randomized Hadamard transform before coding

    def check(self, head_size: int) -> None:
        if self.k_axis not in ("token", "channel") or self.residual not in RESIDUALS:
            raise BenchOptionError(f"{self.name}: unknown k_axis or residual")
        if self.k_axis == "channel" and self.residual_blocks < 1:
            raise BenchOptionError(f"{self.name}: a per-channel K needs the filling block exact")
        for g in (self.k_group, self.v_group):
            if head_size % g:
                raise BenchOptionError(f"{self.name}: group {g} does not divide {head_size}")

    def token_head_bytes(self, d: int) -> float:
        """Codes and scales of one token-head, K and V (a channel scale amortised)."""
        codes = 2 * math.ceil(d * self.bits / 8)
        k_scales = d / self.block_size if self.k_axis == "channel" else d / self.k_group
        return codes + SCALE_BYTES * (k_scales + d / self.v_group)

    def request_overhead_bytes(self, d: int) -> float:
        """Sink and residual tokens of one request and KV head, at the residual's width."""
        width = {
            "exact": 2 * d * BF16_BYTES,
            "int8": 2 * (d + SCALE_BYTES),
            "int4": 2 * (d / 2 + SCALE_BYTES * d / 32),
        }[self.residual]
        return (self.sink + self.residual_blocks * self.block_size) * width

    def capacity_vs_bf16(self, d: int, tokens: int) -> float:
        bf16 = tokens * 2 * d * BF16_BYTES
        return bf16 / (tokens * self.token_head_bytes(d) + self.request_overhead_bytes(d))


FORMATS = (
    # The engine's shipped layouts (int4_per_token_group's K groups of 16, V one group).
    Format("token-int4", 4, k_group=16, v_group=64, rotation=True),
    Format("token-int3", 3, rotation=True),
    Format("token-int2", 2, rotation=True),
    # KIVI: K per channel across a block, V per token, the filling block exact.
    Format("kivi-int3-b16", 3, "channel", v_group=64, residual_blocks=1),
    Format("kivi-int3-b16-sink4", 3, "channel", v_group=64, sink=4, residual_blocks=1),
    Format("kivi-int3-b16-sink4-r2", 3, "channel", v_group=64, sink=4, residual_blocks=2),
    Format(
        "kivi-int3-b32-sink4-int8",
        3,
        "channel",
        v_group=64,
        block_size=32,
        sink=4,
        residual_blocks=1,
        residual="int8",
    ),
    Format(
        "kivi-int3-b32-sink4-r2-int8",
        3,
        "channel",
        v_group=64,
        block_size=32,
        sink=4,
        residual_blocks=2,
        residual="int8",
    ),
    Format("kivi-int2-b16-sink4-r2", 2, "channel", sink=4, residual_blocks=2),
    Format(
        "kivi-int2-b32-sink4-int8",
        2,
        "channel",
        block_size=32,
        sink=4,
        residual_blocks=1,
        residual="int8",
    ),
    Format("kivi-int2-b16-sink4-r4-int8", 2, "channel", sink=4, residual_blocks=4, residual="int8"),
    # 2 bits with a 64-token residual, int8 or int4 (the residual's bytes decide whether 6x fits)
    Format(
        "kivi-int2-b32-sink4-r2-int8",
        2,
        "channel",
        block_size=32,
        sink=4,
        residual_blocks=2,
        residual="int8",
    ),
    Format(
        "kivi-int2-b32-sink4-r2-int4",
        2,
        "channel",
        block_size=32,
        sink=4,
        residual_blocks=2,
        residual="int4",
    ),
    Format("kivi-int2-b16-sink4-r4-int4", 2, "channel", sink=4, residual_blocks=4, residual="int4"),
)
QUICK_FORMATS = ("token-int3", "kivi-int3-b16-sink4")


# ---- fake quantization (torch; x is [B, H, T, D]) ---------------------------------------------


def quantize_groups(x: Any, bits: int, dim: int) -> Any:
    """Asymmetric ``bits``-bit codes over ``dim`` of ``x`` (range widened to hold 0, as the
    engine's integer zero point needs), returned dequantized."""
    hi = x.amax(dim, keepdim=True).clamp(min=0)
    lo = x.amin(dim, keepdim=True).clamp(max=0)
    scale = ((hi - lo) / (2**bits - 1)).clamp(min=1e-6)
    zero = (-lo / scale).round()
    q = (x / scale + zero).round().clamp(0, 2**bits - 1)
    return (q - zero) * scale


def per_token(x: Any, bits: int, group: int) -> Any:
    b, h, t, d = x.shape
    return quantize_groups(x.reshape(b, h, t, d // group, group), bits, -1).reshape(b, h, t, d)


def per_channel(x: Any, bits: int, block: int) -> Any:
    """Each channel's scale spans the tokens of one block (the last one may be partial)."""
    import torch

    return torch.cat(
        [quantize_groups(x[:, :, s : s + block], bits, 2) for s in range(0, x.shape[2], block)], 2
    )


def int8(x: Any) -> Any:
    """Symmetric int8 per token-head, as the engine's KIVI residual stores it."""
    s = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-6)
    return (x / s).round().clamp(-127, 127) * s


def stored(fmt: Format, key: Any, value: Any) -> tuple[Any, Any]:
    """K and V as the format's codes give them back (rotated back when the format rotates)."""
    if fmt.rotation:
        from pagedkv.ops.kv_quant import hadamard_rotation

        r = hadamard_rotation(key.shape[-1]).to(key)
        k, v = stored(replace(fmt, rotation=False), key @ r.T, value @ r.T)
        return k @ r, v @ r
    if fmt.k_axis == "channel":
        k = per_channel(key, fmt.bits, fmt.block_size)
    else:
        k = per_token(key, fmt.bits, fmt.k_group)
    return k, per_token(value, fmt.bits, fmt.v_group)


def residual_mask(fmt: Format, t: int) -> Any:
    """``[t, t]`` bool: key ``j`` is read at residual width by query ``i``."""
    import torch

    pos = torch.arange(t)
    recent = pos[None, :] // fmt.block_size > pos[:, None] // fmt.block_size - fmt.residual_blocks
    return recent | (pos[None, :] < fmt.sink)


def emulated_attention(fmt: Format | None, query: Any, key: Any, value: Any, scaling: float) -> Any:
    """Causal attention (``[B, Hq, T, D]`` query, GQA K/V) reading K/V as ``fmt`` stores
    them (None: exact). Returns ``[B, T, Hq, D]`` (transformers' layout)."""
    import torch

    kq, vq = (key, value) if fmt is None else stored(fmt, key, value)
    if fmt is not None and (fmt.residual_blocks or fmt.sink):
        if fmt.residual == "exact":
            kr, vr = key, value
        elif fmt.residual == "int8":
            kr, vr = int8(key), int8(value)
        else:
            kr, vr = per_token(key, 4, 32), per_token(value, 4, 32)
        near = residual_mask(fmt, key.shape[2])[None, None, :, :, None]
        rep = query.shape[1] // key.shape[1]

        def split(t: Any) -> Any:  # [B, Hkv, T, D] -> [B, Hkv, 1, T, D] for GQA broadcasting
            return t[:, :, None]

        q = query.reshape(query.shape[0], key.shape[1], rep, *query.shape[2:])
        s_far = (q @ split(kq).transpose(-1, -2)) * scaling
        s_near = (q @ split(kr).transpose(-1, -2)) * scaling
        s = torch.where(near[..., 0], s_near, s_far)
        t = key.shape[2]
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        p = s.softmax(-1)
        o = (p * near[..., 0]) @ split(vr) + (p * ~near[..., 0]) @ split(vq)
        return o.reshape(query.shape).transpose(1, 2).contiguous()
    rep = query.shape[1] // key.shape[1]
    o = torch.nn.functional.scaled_dot_product_attention(
        query,
        kq.repeat_interleave(rep, 1),
        vq.repeat_interleave(rep, 1),
        is_causal=True,
        scale=scaling,
    )
    return o.transpose(1, 2).contiguous()


# ---- the run ---------------------------------------------------------------------------------


def _hf_model() -> Any:
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from pagedkv.models.config import default_model_path

    hf_logging.disable_progress_bar()
    gguf = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    state: dict[str, Format | None] = {"fmt": None}

    def attention(module: Any, query: Any, key: Any, value: Any, mask: Any, **kw: Any) -> Any:
        scaling = kw.get("scaling") or module.scaling
        return emulated_attention(state["fmt"], query, key, value, scaling), None

    AttentionInterface.register("pagedkv_emulated", attention)
    model.config._attn_implementation = "pagedkv_emulated"
    model._pagedkv_state = state
    return model


def _logprobs(model: Any, window: list[int], fmt: Format | None) -> Any:
    import torch

    model._pagedkv_state["fmt"] = fmt
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([window])).logits[0, :-1].float(), -1)


def score(model: Any, windows: list[list[int]], refs: list[Any], fmt: Format) -> dict[str, Any]:
    """Top-1 agreement, mean KL(exact ‖ format) and ΔPPL of ``fmt`` over every window."""
    import torch

    agree = n = 0
    nll_ref = nll = kl = 0.0
    for w, ref in zip(windows, refs):
        lp = _logprobs(model, w, fmt)
        tgt = torch.tensor(w[1:])[:, None]
        agree += int((lp.argmax(-1) == ref.argmax(-1)).sum())
        n += len(w) - 1
        nll_ref -= float(ref.gather(1, tgt).sum())
        nll -= float(lp.gather(1, tgt).sum())
        kl += float((ref.exp() * (ref - lp)).sum())
    return {
        "positions": n,
        "top1_agreement": agree / n,
        "mean_kl": kl / n,
        "ppl_ref": math.exp(nll_ref / n),
        "ppl": math.exp(nll / n),
        "ppl_delta_pct": (math.exp((nll - nll_ref) / n) - 1) * 100,
    }


def meets(fmt: Format, row: dict[str, Any]) -> bool | None:
    """Issue 36's bar for the format's width (None: no bar at this width)."""
    if fmt.bits == 3:
        return (
            row["top1_agreement"] >= 0.95
            and row["ppl_delta_pct"] <= 3
            and row["capacity_vs_bf16"] >= 4.5
        )
    if fmt.bits == 2:
        return row["ppl_delta_pct"] <= 8 and row["capacity_vs_bf16"] >= 6
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    by_name = {f.name: f for f in FORMATS}
    names = (
        args.formats.split(",")
        if args.formats
        else (list(QUICK_FORMATS) if args.quick else list(by_name))
    )
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise BenchOptionError(f"unknown formats {unknown}; known: {sorted(by_name)}")
    tokens = args.tokens or (1024 if args.quick else 20480)
    window = args.window or (512 if args.quick else 2048)
    model = _hf_model()
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for n in names:
        by_name[n].check(d)

    from pagedkv import LLM
    from pagedkv.bench.kv_quant import make_corpus, windows
    from pagedkv.models.config import default_model_path

    log(args, f"corpus: {tokens} tokens at temperature {args.temperature}")
    llm = LLM(
        model=str(default_model_path()),
        dtype="float32",
        kv_cache_dtype="float32",
        num_kv_blocks=tokens // 16 + 512,
    )
    stream = make_corpus(llm, tokens, args.temperature, args.seed)
    del llm
    wins = windows(stream, window)
    refs = [_logprobs(model, w, None) for w in wins]
    rows: dict[str, Any] = {}
    for n in names:
        f, t0 = by_name[n], time.perf_counter()
        row = score(model, wins, refs, f)
        row |= {
            "format": asdict(f),
            "token_head_bytes": f.token_head_bytes(d),
            "request_overhead_bytes": f.request_overhead_bytes(d),
            "capacity_vs_bf16": f.capacity_vs_bf16(d, args.capacity_tokens),
            "seconds": time.perf_counter() - t0,
        }
        row["meets_target"] = meets(f, row)
        rows[n] = row
        log(args, f"{n}: top-1 {row['top1_agreement']:.3f}, ΔPPL {row['ppl_delta_pct']:+.2f}%")
    return {
        "benchmark": "kv_formats",
        "method": "fake quantization of K/V after RoPE in transformers' float32 model",
        "model": "SmolLM2-135M-Instruct (default)",
        "head_size": d,
        "corpus": {
            "tokens": len(stream),
            "window": window,
            "windows": len(wins),
            "temperature": args.temperature,
            "seed": args.seed,
        },
        "capacity_tokens": args.capacity_tokens,
        "formats": rows,
    }


def table(r: dict[str, Any]) -> str:
    lines = [
        f"KV formats, emulated: {r['corpus']['tokens']} tokens in windows of "
        f"{r['corpus']['window']}, capacity at {r['capacity_tokens']} tokens",
        "| format | top-1 | ΔPPL | KL | bytes/token-head | capacity vs bf16 | bar |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in r["formats"].items():
        bar = {True: "met", False: "missed", None: "-"}[row["meets_target"]]
        lines.append(
            f"| {name} | {row['top1_agreement'] * 100:.1f}% | {row['ppl_delta_pct']:+.2f}% | "
            f"{row['mean_kl']:.4f} | {fmt(row['token_head_bytes'])} | "
            f"{row['capacity_vs_bf16']:.2f}× | {bar} |"
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--formats", default=None, help="comma-separated format names (default all)")
    p.add_argument("--tokens", type=int, default=None, help="corpus tokens (20,480; quick 1,024)")
    p.add_argument("--window", type=int, default=None, help="tokens per window (2,048; quick 512)")
    p.add_argument("--temperature", type=float, default=0.0, help="corpus temperature (greedy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--capacity-tokens", type=int, default=2048)
    p.add_argument("--quick", action="store_true", help="two formats on 1,024 tokens")
    add_output_args(p)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=user_help(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    return run_and_emit(run, table, p.parse_args(argv))


__all__ = ["FORMATS", "Format", "emulated_attention", "main", "per_channel", "per_token"]
