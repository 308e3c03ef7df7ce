"""Image inputs: TTFT of a repeated image with and without the encoder cache, and
encoder/prefill/decode disaggregation (EPD) against one colocated instance under a mixed
image/text load.

The benchmark lives in `pagedkv.bench.epd`; see its docstring or `--help`.

Usage: python benchmarks/bench_epd.py [cache|serving|all] [--requests 40] [--rate 1.0] [--json-out F]
"""

from __future__ import annotations

import sys

from pagedkv.bench.epd import main

if __name__ == "__main__":
    sys.exit(main())
