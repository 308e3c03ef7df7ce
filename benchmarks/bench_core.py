"""Micro-benchmarks of the pure-Python core (block pool, hashing, allocation): a table and JSON.

The benchmark lives in `pagedkv.bench.core`; see its docstring or `--help`.

Usage: python benchmarks/bench_core.py [--json-only] [--repeat N]
"""

from __future__ import annotations

import sys

from pagedkv.bench.core import main

if __name__ == "__main__":
    sys.exit(main())
