"""KV offloading: tier bandwidth against memcpy / sequential reads, and multi-turn TTFT with
and without tiers.

The benchmark lives in `pagedkv.bench.offload`; see its docstring or `--help`.

Usage: python benchmarks/bench_offload.py [bandwidth|multiturn|all] [--conversations 50 --turns 5]
"""

from __future__ import annotations

import sys

from pagedkv.bench.offload import main

if __name__ == "__main__":
    sys.exit(main())
