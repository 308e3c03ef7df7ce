"""Quantized KV caches: accuracy (teacher-forced top-1 agreement, KL, perplexity, greedy output)
and capacity (concurrent 2k-token requests in one memory budget) of every KV cache mode against
the float32 cache, measured in the same run.

The benchmark lives in `pagedkv.bench.kv_quant`; see its docstring or `--help` for the corpora,
the scoring, the capacity method and the targets.

Usage: python benchmarks/bench_kv_quant.py [--only all|accuracy|capacity|speed] [--modes a,b] [--tokens N] [--quick]
"""

from __future__ import annotations

import sys

from pagedkv.bench.kv_quant import main

if __name__ == "__main__":
    sys.exit(main())
