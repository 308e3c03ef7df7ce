"""What idle NIXL agents cost the engine's compute, by progress-thread delay: a table and JSON.

The benchmark lives in `pagedkv.bench.nixl_progress`; see its docstring or `--help`.

Usage: python benchmarks/bench_nixl_progress.py [--agents N] [--iters N] [--json-only]
"""

from __future__ import annotations

import sys

from pagedkv.bench.nixl_progress import main

if __name__ == "__main__":
    sys.exit(main())
