"""MkDocs hook: the pages that are generated from the code and the results, at build time.

A page opts in with a marker line in its Markdown; the hook replaces the marker:

- ``<!-- generate:cli -->``: every ``pagedkv`` subcommand (walked recursively from
  ``pagedkv.entrypoints.cli.build_parser()``), its usage and a table of its options.
- ``<!-- generate:env -->``: the ``PAGEDKV_*`` environment variables from
  ``pagedkv.envs.describe()`` when that module exists, else the static table below.
- ``<!-- generate:benchmarks -->``: one table per benchmark from ``benchmarks/results/*.json``
  (and the JSON at the end of ``*.log`` files), with the machine each was measured on.

The repository's ``src/`` goes first on ``sys.path`` so the docs describe this checkout's code,
installed or not. Nothing here is imported by pagedkv itself.
"""

from __future__ import annotations

import argparse
import html
import importlib
import json
import os
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
MACHINES = Path(__file__).with_name("machines.json")

if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))


# --------------------------------------------------------------------------- hook entry points


def on_files(files: Any, config: Any) -> Any:
    """Publish the result plots (``benchmarks/results/*.png``) under ``benchmarks/``."""
    from mkdocs.structure.files import File

    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"benchmarks/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    for name, render in GENERATORS.items():
        marker = f"<!-- generate:{name} -->"
        if marker in markdown:
            markdown = markdown.replace(marker, render())
    return markdown


# --------------------------------------------------------------------------- helpers


def cell(value: Any) -> str:
    """One Markdown table cell: pipes escaped, HTML escaped, newlines folded."""
    text = "" if value is None else str(value)
    text = html.escape(" ".join(text.split()), quote=False)
    return text.replace("|", "\\|")


def code(value: Any) -> str:
    """Inline code; a pipe inside backticks does not split a table cell, so none is escaped."""
    text = str(value)
    return f"`{text}`" if text else ""


def table(header: list[str], rows: Iterable[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


# --------------------------------------------------------------------------- CLI reference


def _options_table(parser: argparse.ArgumentParser) -> str:
    fmt = parser._get_formatter()
    env_values = {v: k for k, v in os.environ.items() if k.startswith("PAGEDKV_") and v}
    out = []
    for group in parser._action_groups:
        rows = []
        for action in group._group_actions:
            if action.help == argparse.SUPPRESS or isinstance(
                action, (argparse._HelpAction, argparse._SubParsersAction)
            ):
                continue
            names = ", ".join(action.option_strings) or action.dest
            if action.option_strings and action.nargs != 0:
                # A metavar, not "{a,b,c}": the choices go in the help column, the name stays short.
                metavar = action.metavar or action.dest.upper()
                plain = argparse.Action([], action.dest, nargs=action.nargs, metavar=metavar)
                names += f" {fmt._format_args(plain, metavar)}"
            default = action.default
            shown = "" if default in (None, argparse.SUPPRESS) or action.nargs == 0 else default
            # A default read from the environment (e.g. --api-key from PAGEDKV_API_KEY) is named,
            # never printed: the build machine's secrets must not reach the site.
            if isinstance(shown, str) and shown in env_values:
                shown = "$" + env_values[shown]
            help_text = fmt._expand_help(action) if action.help else ""
            if action.choices and not isinstance(action.choices, dict):
                help_text += f" (choices: {', '.join(map(str, action.choices))})"
            rows.append([code(names), code(shown) if shown != "" else "", cell(help_text)])
        if rows:
            title = group.title or "options"
            out.append(f"**{cell(title)}**\n\n" + table(["option", "default", "help"], rows))
    return "\n".join(out)


def _walk(parser: argparse.ArgumentParser, path: list[str], depth: int) -> list[str]:
    parts = []
    if path:
        name = " ".join(path)
        parts.append(f"{'#' * min(depth + 1, 4)} pagedkv {name}\n")
        desc = (parser.description or "").strip()
        if desc:  # paragraphs kept; Markdown joins the lines of each
            parts.append(html.escape(desc, quote=False) + "\n")
        usage = parser.format_usage().strip()
        parts.append(f"```text\n{usage}\n```\n")
        opts = _options_table(parser)
        if opts:
            parts.append(opts)
        if parser.epilog and "\n" in parser.epilog.strip():  # examples, kept verbatim
            parts.append(f"```text\n{parser.epilog.strip()}\n```\n")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            seen: set[int] = set()
            for sub_name, sub in action.choices.items():
                if id(sub) in seen:  # an alias
                    continue
                seen.add(id(sub))
                if not sub.description and helps.get(sub_name):
                    sub.description = helps[sub_name]
                parts += _walk(sub, [*path, sub_name], depth + 1)
    return parts


def render_cli() -> str:
    from pagedkv.entrypoints.cli import build_parser

    parser = build_parser()
    top = parser.format_usage().strip()
    commands = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            commands = [
                [f"[`{n}`](#{slug('pagedkv ' + n)})", cell(helps.get(n, ""))]
                for n in action.choices
            ]
    head = f"```text\n{top}\n```\n\n" + table(["command", "what it does"], commands)
    return head + "\n" + "\n".join(_walk(parser, [], 1))


# --------------------------------------------------------------------------- environment

# Used only while pagedkv.envs does not exist (it is the one reader of PAGEDKV_* variables).
STATIC_ENV: list[tuple[str, str, str]] = [
    (
        "PAGEDKV_NATIVE",
        "auto",
        (
            "Native C kernels: `0`/`off` disables them (torch paths only); `1`/`on` makes a failed "
            "build an error (CI sets it); `auto` falls back with a warning."
        ),
    ),
    (
        "PAGEDKV_NATIVE_ISA",
        "native",
        (
            "Build a narrower SIMD path than the CPU has: `avx2` or `portable` (to compare paths on "
            "one machine)."
        ),
    ),
    ("PAGEDKV_NATIVE_STEP", "1", "`0` turns off the fused native decode step (per-op path)."),
    (
        "PAGEDKV_DENSE_LINEAR",
        "blas",
        (
            "Float32 linears above 16 rows: `blas` (MKL), `onednn`, or `auto` (the faster, measured "
            "once per process)."
        ),
    ),
    ("PAGEDKV_CACHE_DIR", "~/.cache/pagedkv", "Where the compiled native kernels are cached."),
    ("PAGEDKV_THP", "1", "`0`: no `madvise(MADV_HUGEPAGE)` on CPU KV buffers."),
    ("PAGEDKV_TRITON", "1", "`0` sends CUDA tensors to the torch paths instead of Triton."),
    ("PAGEDKV_API_KEY", "", "Default of `pagedkv serve --api-key`."),
    (
        "PAGEDKV_KV_EVENTS_USE_INT_BLOCK_HASHES",
        "",
        (
            "When set, KV events carry block hashes as 64-bit ints (for routers that key by int) "
            "instead of bytes."
        ),
    ),
]


def _field(item: Any, *names: str) -> Any:
    for n in names:
        if isinstance(item, dict) and n in item:
            return item[n]
        if hasattr(item, n):
            return getattr(item, n)
    return None


def _env_rows(described: Any) -> list[list[str]]:
    """Rows from whatever shape ``describe()`` returns: a mapping name -> info, or an iterable
    of dicts / objects / tuples ``(name, default, help)``."""
    items = described.items() if isinstance(described, dict) else enumerate(described)
    rows = []
    for key, item in items:
        if isinstance(item, (tuple, list)):
            name, default, doc = (list(item) + [None, None, None])[:3]
        elif isinstance(item, str):
            name, default, doc = key, None, item
        else:
            name = _field(item, "name", "var", "env") or key
            default = _field(item, "default")
            doc = _field(item, "help", "doc", "description", "meaning")
            choices = _field(item, "choices")
            if choices:
                doc = f"{doc or ''} One of: {', '.join(map(str, choices))}."
        rows.append([code(name), code(default) if default not in (None, "") else "", cell(doc)])
    return rows


def render_env() -> str:
    try:
        envs = importlib.import_module("pagedkv.envs")
    except ImportError:
        envs = None
    describe: Callable[[], Any] | None = getattr(envs, "describe", None)
    if describe is not None:
        rows = _env_rows(describe())
        source = "generated from `pagedkv.envs.describe()`"
    else:
        rows = [[code(n), code(d) if d else "", doc] for n, d, doc in STATIC_ENV]
        source = "static table (this checkout has no `pagedkv.envs` yet)"
    return table(["variable", "default", "meaning"], rows) + f"\n*Source: {source}.*\n"


# --------------------------------------------------------------------------- benchmarks


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
        for mode, (_, name, r) in best.items():
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
        for name, d in cap:
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
BENCHMARKS: list[tuple[str, str, Callable[[str, dict], bool], Callable]] = [
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
        "KV-aware routing",
        "python benchmarks/bench_router.py",
        lambda n, d: "ratios_vs_round_robin" in d,
        render_router,
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


GENERATORS: dict[str, Callable[[], str]] = {
    "cli": render_cli,
    "env": render_env,
    "benchmarks": render_benchmarks,
}
