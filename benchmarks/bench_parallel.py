"""Tensor / decode context parallelism on this host: capacity per rank, step time, all-reduce share.

The benchmark lives in `pagedkv.bench.parallel`; see its docstring or `--help`.

Usage: python benchmarks/bench_parallel.py [--cases 1,2,3,6x2] [--kv-memory 128MiB] [--json-only]
"""

from __future__ import annotations

import sys

from pagedkv.bench.parallel import main

if __name__ == "__main__":
    sys.exit(main())
