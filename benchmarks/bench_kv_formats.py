"""Which 2–3-bit KV format could meet issue 36's bars: candidate layouts emulated (fake
quantization in transformers' float32 model), scored teacher-forced against the exact model,
with their bytes and capacity computed.

The benchmark lives in `pagedkv.bench.kv_formats`; see its docstring or `--help`.

Usage: python benchmarks/bench_kv_formats.py [--formats a,b] [--tokens N] [--window N] [--quick]
"""

from __future__ import annotations

import sys

from pagedkv.bench.kv_formats import main

if __name__ == "__main__":
    sys.exit(main())
