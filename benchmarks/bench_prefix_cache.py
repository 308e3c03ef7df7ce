"""Prefix caching: time to first token with a shared system prompt, caching on vs off.

The benchmark lives in `pagedkv.bench.prefix_cache` (also `pagedkv bench prefix-cache`); see its docstring
or `--help` for the workload, the baselines and the targets.

Usage: python benchmarks/bench_prefix_cache.py [--json-only] [--json-out FILE] ...
"""

from __future__ import annotations

import sys

from pagedkv.bench.prefix_cache import main

if __name__ == "__main__":
    sys.exit(main())
