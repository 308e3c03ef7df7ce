"""KV-aware routing: `pagedkv router` with --policy kv vs round-robin vs load over three
replicas, on one multi-turn trace.

The benchmark lives in `pagedkv.bench.router` (also `pagedkv bench router`); see its docstring
or `--help`.

Usage: python benchmarks/bench_router.py [--conversations 12] [--turns 5] [--repeats 3]
       [--policies kv,round-robin,load] [--json-only] [--json-out FILE]
"""

from __future__ import annotations

import sys

from pagedkv.bench.router import main

if __name__ == "__main__":
    sys.exit(main())
