"""The environment-variable table: from ``pagedkv.envs.describe()`` when that module exists,
else a static table of the variables pagedkv reads today."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from md import cell, code, table

# Used only while pagedkv.envs does not exist (it is the one reader of PAGEDKV_* variables).
STATIC_ENV: list[tuple[str, str, str]] = [
    (
        "PAGEDKV_NATIVE",
        "auto",
        (
            "Native C kernels: `0`/`off` disables them (torch paths only); `1`/`on` makes a failed "
            "build an error (CI sets it); `auto` falls back with a warning."
        ),
    ),
    (
        "PAGEDKV_NATIVE_ISA",
        "native",
        (
            "Build a narrower SIMD path than the CPU has: `avx2` or `portable` (to compare paths on "
            "one machine)."
        ),
    ),
    ("PAGEDKV_NATIVE_STEP", "1", "`0` turns off the fused native decode step (per-op path)."),
    (
        "PAGEDKV_DENSE_LINEAR",
        "blas",
        (
            "Float32 linears above 16 rows: `blas` (MKL), `onednn`, or `auto` (the faster, measured "
            "once per process)."
        ),
    ),
    ("PAGEDKV_CACHE_DIR", "~/.cache/pagedkv", "Where the compiled native kernels are cached."),
    ("PAGEDKV_THP", "1", "`0`: no `madvise(MADV_HUGEPAGE)` on CPU KV buffers."),
    ("PAGEDKV_TRITON", "1", "`0` sends CUDA tensors to the torch paths instead of Triton."),
    ("PAGEDKV_API_KEY", "", "Default of `pagedkv serve --api-key`."),
    (
        "PAGEDKV_KV_EVENTS_USE_INT_BLOCK_HASHES",
        "",
        (
            "When set, KV events carry block hashes as 64-bit ints (for routers that key by int) "
            "instead of bytes."
        ),
    ),
]


def _field(item: Any, *names: str) -> Any:
    for n in names:
        if isinstance(item, dict) and n in item:
            return item[n]
        if hasattr(item, n):
            return getattr(item, n)
    return None


def _env_rows(described: Any) -> list[list[str]]:
    """Rows from whatever shape ``describe()`` returns: a mapping name -> info, or an iterable
    of dicts / objects / tuples ``(name, default, help)``."""
    items = described.items() if isinstance(described, dict) else enumerate(described)
    rows = []
    for key, item in items:
        if isinstance(item, (tuple, list)):
            name, default, doc = (list(item) + [None, None, None])[:3]
        elif isinstance(item, str):
            name, default, doc = key, None, item
        else:
            name = _field(item, "name", "var", "env") or key
            default = _field(item, "default")
            doc = _field(item, "help", "doc", "description", "meaning")
            choices = _field(item, "choices")
            if choices:
                doc = f"{doc or ''} One of: {', '.join(map(str, choices))}."
        rows.append([code(name), code(default) if default not in (None, "") else "", cell(doc)])
    return rows


def render_env() -> str:
    try:
        envs = importlib.import_module("pagedkv.envs")
    except ImportError:
        envs = None
    describe: Callable[[], Any] | None = getattr(envs, "describe", None)
    if describe is not None:
        rows = _env_rows(describe())
        source = "generated from `pagedkv.envs.describe()`"
    else:
        rows = [[code(n), code(d) if d else "", doc] for n, d, doc in STATIC_ENV]
        source = "static table (this checkout has no `pagedkv.envs` yet)"
    return table(["variable", "default", "meaning"], rows) + f"\n*Source: {source}.*\n"
