"""vAttention-style virtual KV memory (kv_cache_memory_mode="vmm") against the paged cache:
decode attention, allocation cost, memory waste, engine TTFT and decode steps.

The benchmark lives in `pagedkv.bench.vmm`; see its docstring or `--help`.

Usage: python benchmarks/bench_vmm.py [decode|alloc|waste|engine|all] [--json-out F]
"""

from __future__ import annotations

import sys

from pagedkv.bench.vmm import main

if __name__ == "__main__":
    sys.exit(main())
