"""Decode attention over a quantized KV cache: time per step for every KV cache mode.

The benchmark lives in `pagedkv.bench.kv_quant_attention`; see its docstring or `--help`.

Usage: python benchmarks/bench_kv_quant_attention.py [--seqs 64] [--tokens 2048] [--rounds 5]
"""

from __future__ import annotations

import sys

from pagedkv.bench.kv_quant_attention import main

if __name__ == "__main__":
    sys.exit(main())
