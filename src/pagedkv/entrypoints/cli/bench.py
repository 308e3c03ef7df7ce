"""``pagedkv bench {throughput,prefix-cache,memory,serve,disagg,router}``: end-to-end benchmarks.

Each is a module of `pagedkv.bench` (also runnable as ``python benchmarks/bench_<name>.py``);
this file only wires their arguments under one subcommand. The modules import nothing heavy
until they run, so ``pagedkv --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from pagedkv.bench import BENCHMARKS
from pagedkv.bench.common import run_and_emit, user_help

DESCRIPTION = """\
Run one of pagedkv's end-to-end benchmarks. Each prints a table and a JSON report on standard
output (--json-only for the JSON alone, --json-out FILE to keep it) and its progress on
standard error. Run 'pagedkv bench BENCHMARK --help' for a benchmark's workload and options.
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help=f"run a benchmark ({', '.join(BENCHMARKS)})",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        doc = getattr(module, "DESCRIPTION", None) or user_help(module.__doc__)
        b = sub.add_parser(
            name,
            help=doc.splitlines()[0].rstrip(".,:"),
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(b)
        b.set_defaults(func=run, bench_module=module_name)
    return p


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(args.bench_module)
    return run_and_emit(module.run, module.table, args, getattr(module, "exit_code", None))
