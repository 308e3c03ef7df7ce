"""GPU benchmarks of the Triton attention kernels and the engine (run by gpu/run_checks.sh).

The benchmark lives in `pagedkv.bench.gpu`; see its docstring or `--help`.

Usage: python benchmarks/bench_gpu.py [--out results.json] [--skip-e2e] [--check NAME=RC ...]
"""

from __future__ import annotations

import sys

from pagedkv.bench.gpu import main

if __name__ == "__main__":
    sys.exit(main())
