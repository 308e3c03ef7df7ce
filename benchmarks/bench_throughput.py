"""Offline throughput: pagedkv against HF transformers ``generate`` on the same workload, in one run.

The benchmark lives in `pagedkv.bench.throughput` (also `pagedkv bench throughput`); see its docstring
or `--help` for the workload, the baselines and the targets.

Usage: python benchmarks/bench_throughput.py [--json-only] [--json-out FILE] ...
"""

from __future__ import annotations

import sys

from pagedkv.bench.throughput import main

if __name__ == "__main__":
    sys.exit(main())
