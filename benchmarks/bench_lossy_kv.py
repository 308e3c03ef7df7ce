"""Lossy KV memory: passkey grid, a recall task through prompt_logprobs, and teacher-forced
agreement of each method against the exact cache in the same run.

The benchmark lives in `pagedkv.bench.lossy_kv`; see its docstring or `--help`.

Usage: python benchmarks/bench_lossy_kv.py [--methods int8,int4] [--only all|passkey|recall|teacher] [--quick]
"""

from __future__ import annotations

import sys

from pagedkv.bench.lossy_kv import main

if __name__ == "__main__":
    sys.exit(main())
