"""Helpers shared by the benchmarks: output (table + JSON), statistics, workloads."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


class BenchOptionError(Exception):
    """A bad benchmark option: one line on stderr, exit code 2."""


def user_help(doc: str | None) -> str:
    """A benchmark docstring as ``--help`` text: reST quoting dropped, no "Usage: python
    benchmarks/..." paragraph (argparse prints the real usage)."""
    paras = [p for p in (doc or "").strip().split("\n\n") if not p.lstrip().startswith("Usage:")]
    text = "\n\n".join(paras)
    return re.sub(r"``?([^`]+?)``?", r"\1", text) + "\n"


def add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json-only", action="store_true", help="print only the JSON report")
    p.add_argument(
        "--json-out", metavar="FILE", default=None, help="also write the JSON report to FILE"
    )


def emit(
    report: dict[str, Any], table: Callable[[dict[str, Any]], str], args: argparse.Namespace
) -> None:
    """Print the table (unless ``--json-only``), then the JSON; write ``--json-out``."""
    if not args.json_only:
        print(table(report))
        print()
    print(json.dumps(report, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")


def log(args: argparse.Namespace, msg: str) -> None:
    """Progress on stderr (stdout stays table + JSON)."""
    if not args.json_only:
        print(msg, file=sys.stderr, flush=True)


def summary(xs: Sequence[float]) -> dict[str, float]:
    """p50 / mean / min / max of a sample (seconds or whatever ``xs`` holds)."""
    if not xs:
        return dict(p50=float("nan"), mean=float("nan"), min=float("nan"), max=float("nan"))
    return dict(p50=statistics.median(xs), mean=statistics.fmean(xs), min=min(xs), max=max(xs))


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def random_token_ids(rng: random.Random, n: int, vocab_size: int, low: int = 0) -> list[int]:
    """``n`` token ids drawn uniformly from ``[low, vocab_size)``."""
    return [rng.randrange(low, vocab_size) for _ in range(n)]


def int_range(text: str) -> tuple[int, int]:
    """argparse type for ``MIN:MAX`` (inclusive) or a single ``N``."""
    try:
        lo, _, hi = text.partition(":")
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid range {text!r}: use MIN:MAX or N") from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"invalid range {text!r}: need 1 <= MIN <= MAX")
    return a, b


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def run_and_emit(
    run: Callable[[argparse.Namespace], dict[str, Any]],
    table: Callable[[dict[str, Any]], str],
    args: argparse.Namespace,
    exit_code: Callable[[dict[str, Any]], int] | None = None,
) -> int:
    """Run a benchmark and print its report; a bad option is exit code 2 (one line on stderr),
    else ``exit_code(report)`` (0 without one)."""
    try:
        report = run(args)
    except BenchOptionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    emit(report, table, args)
    return exit_code(report) if exit_code is not None else 0


def cpu_info() -> dict[str, Any]:
    """The CPU the figures were taken on (rates differ several-fold between hosts)."""
    info: dict[str, Any] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, val = line.partition(":")
        key, val = key.strip(), val.strip()
        if key in ("model name", "cpu family", "model") and key not in info:
            info[key] = val
        elif key == "flags" and "simd" not in info:
            flags = set(val.split())
            info["simd"] = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return info


def machine_line(cpu: dict[str, Any], cores: int | None) -> str:
    """One line naming the host, for a report's ``machine`` field: cores, CPU model, family and
    model numbers, SIMD."""
    n = f"{cores} cores" if cores else f"{os.cpu_count()} CPUs"
    return (
        f"{n}: {cpu.get('model name', '?')} (family {cpu.get('cpu family', '?')}, model "
        f"{cpu.get('model', '?')}), {'/'.join(cpu.get('simd', [])) or 'no AVX2'}, CPU only"
    )


def drop_page_cache(path: Path) -> bool:
    """Evict ``path``'s pages (best effort, no root needed): fsync + posix_fadvise DONTNEED."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
