"""End-to-end benchmarks behind ``pagedkv bench`` and ``benchmarks/bench_*.py``.

Each module owns one benchmark and exposes the same small interface:
``add_arguments(parser)`` (no heavy imports), ``run(args) -> dict`` (the JSON report) and
``main(argv) -> int`` (parse, run, print the table and the JSON); optionally ``DESCRIPTION``
(the user-facing help; else the docstring's first paragraph) and ``exit_code(report) -> int``.
``BENCHMARKS`` maps the ``pagedkv bench`` name to its module.
"""

from __future__ import annotations

BENCHMARKS: dict[str, str] = {
    "throughput": "pagedkv.bench.throughput",
    "prefix-cache": "pagedkv.bench.prefix_cache",
    "memory": "pagedkv.bench.memory",
    "serve": "pagedkv.bench.serving",
}
