"""Native CPU kernels (ops/csrc) against the torch paths they replace, in the same run.

The benchmark lives in `pagedkv.bench.native`; see its docstring or `--help`.

Usage: python benchmarks/bench_native.py [--rounds N] [--m1-only] [--step-tokens 64] [--json-only]
       [--json-out FILE]
"""

from __future__ import annotations

import sys

from pagedkv.bench.native import main

if __name__ == "__main__":
    sys.exit(main())
