"""The benchmarks: one module each, behind ``pagedkv bench`` and ``benchmarks/bench_*.py``.

Each ``benchmarks/bench_<name>.py`` is a thin entry point over ``pagedkv.bench.<name>.main``
(same options, same output). Every module has ``main(argv) -> int`` (parse, run, print; the
exit status). The ones listed in ``BENCHMARKS`` (the end-to-end benchmarks, also
``pagedkv bench <name>``) expose the same small interface besides: ``add_arguments(parser)``
(no heavy imports: the CLI builds every parser at start-up), ``run(args) -> dict`` (the JSON
report) and ``table(report) -> str``; optionally ``DESCRIPTION`` (the user-facing help; else the
docstring's first paragraph) and ``exit_code(report) -> int``. ``BENCHMARKS`` maps the
``pagedkv bench`` name to its module.

The others measure one component (``attention``, ``kv_quant_attention``, ``native``: kernels;
``core``: the block pool and hashing; ``offload``: tiers; ``gpu``: the Triton kernels, for
gpu/run_checks.sh; ``kv_quant``, ``latency``) and import torch or the engine at module level.
Benchmarks of the server, the PD proxy and the router start them as processes
(`pagedkv.bench.instances`): those sit above this package. The fleet simulator's own benchmarks
(``benchmarks/bench_sim.py``, ``bench_sim_validate.py``) stay scripts, since they drive
`pagedkv.sim` and `pagedkv.router` in-process.
"""

from __future__ import annotations

BENCHMARKS: dict[str, str] = {
    "throughput": "pagedkv.bench.throughput",
    "prefix-cache": "pagedkv.bench.prefix_cache",
    "memory": "pagedkv.bench.memory",
    "serve": "pagedkv.bench.serving",
    "disagg": "pagedkv.bench.disagg",
    "router": "pagedkv.bench.router",
}
