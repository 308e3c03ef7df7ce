"""Online serving benchmark: Poisson arrivals against ``pagedkv serve``, a saturation run, and
offline ``LLM.generate`` on the same requests in the same run.

The benchmark lives in `pagedkv.bench.serving` (also `pagedkv bench serve`); see its docstring
or `--help` for the workload, the runs and the target.

Usage: python benchmarks/bench_serving.py [--num-requests 48] [--request-rate 4] [--json-out FILE]
"""

from __future__ import annotations

import sys

from pagedkv.bench.serving import main

if __name__ == "__main__":
    sys.exit(main())
