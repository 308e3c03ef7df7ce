"""Batch-1 latency: pagedkv vs llama.cpp (llama-cpp-python) on the same GGUF, in one run.

The benchmark lives in `pagedkv.bench.latency`; see its docstring or `--help` for what is
measured, how llama.cpp is built (`--setup`, into .bench/llamacpp-venv) and the targets.

Usage: python benchmarks/bench_latency.py [--setup] [--dtype bfloat16] [--cores 0,1] [--json-only] ...
"""

from __future__ import annotations

import sys

from pagedkv.bench.latency import main

if __name__ == "__main__":
    sys.exit(main())
