"""Triton kernels for CUDA tensors (vLLM's ``triton_unified_attention`` shape).

``triton`` is an optional extra: nothing here is imported unless a CUDA tensor reaches a
dispatching op (``ops/attention.py``, ``ops/cache.py``, ``ops/kv_cache.py``) or a test imports
it. Tests run the same kernels on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from functools import cache

from pagedkv import envs


@cache
def available() -> bool:
    """True when ``triton`` imports and ``PAGEDKV_TRITON`` is not ``0`` (checked once; the
    variable lets a CUDA run fall back to the torch paths for comparison)."""
    if not envs.PAGEDKV_TRITON:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
