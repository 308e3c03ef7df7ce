"""Structured outputs: compile and per-token mask cost of xgrammar and llguidance, and the
decode throughput of JSON-Schema requests against plain ones in the same run.

The benchmark lives in `pagedkv.bench.structured_outputs`; see its docstring or `--help`.

Usage: python benchmarks/bench_structured_outputs.py [--only all|library|engine] [--json-only] [--json-out FILE]
"""

from __future__ import annotations

import sys

from pagedkv.bench.structured_outputs import main

if __name__ == "__main__":
    sys.exit(main())
