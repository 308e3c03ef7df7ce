"""KV memory utilisation: paged blocks vs contiguous per-request reservation, on one trace.

The benchmark lives in `pagedkv.bench.memory` (also `pagedkv bench memory`); see its docstring
or `--help` for the workload, the baselines and the targets.

Usage: python benchmarks/bench_memory.py [--json-only] [--json-out FILE] ...
"""

from __future__ import annotations

import sys

from pagedkv.bench.memory import main

if __name__ == "__main__":
    sys.exit(main())
