"""Paged attention on CPU: µs per layer call for the engine's typical steps.

The benchmark lives in `pagedkv.bench.attention`; see its docstring or `--help`.

Usage: python benchmarks/bench_attention.py [--layouts LBNHC] [--dtype bf16] [--cases decode]
       [--rounds 8]
"""

from __future__ import annotations

import sys

from pagedkv.bench.attention import main

if __name__ == "__main__":
    sys.exit(main())
