"""Prefill/decode disaggregation: colocated vs PD serving, KV transfer bandwidth vs memcpy, a
kill test.

The benchmark lives in `pagedkv.bench.disagg` (also `pagedkv bench disagg`); see its docstring
or `--help`.

Usage: python benchmarks/bench_disagg.py [--num-requests 32] [--rate 2] [--max-tokens 32]
       [--backend nixl|tcp] [--bandwidth-mib 64] [--kill-test 20] [--json-only] [--json-out FILE]
"""

from __future__ import annotations

import sys

from pagedkv.bench.disagg import main

if __name__ == "__main__":
    sys.exit(main())
