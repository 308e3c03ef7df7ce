"""Every ``PAGEDKV_*`` environment variable pagedkv reads, in one table (vLLM's ``envs.py``).

``from pagedkv import envs; envs.PAGEDKV_NATIVE_STEP`` reads the variable *now* (a module
``__getattr__``), so a test that sets it with ``monkeypatch.setenv`` sees its value on the next
access; callers that want a value once per process cache it themselves (``functools.cache``),
as they did before. Each entry is (default, parser, doc): the parser turns the raw text
(None: unset) into the typed value and owns the meaning of "set", "0", "off"...
`describe` lists the table for the docs.

This module is layer 0 beside ``core``: no torch, nothing imported from pagedkv.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ENV_VARS", "EnvVar", "describe", "get", "is_set"]

# The spellings of "off" and "on" the switches accept (case-insensitive).
OFF = ("0", "off", "false", "no")
ON = ("1", "on", "true", "yes")


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One variable: ``default`` is the documented default (text, as a user would set it),
    ``parse(raw)`` the typed value of the raw text (None when unset), ``doc`` one paragraph."""

    name: str
    default: str
    parse: Callable[[str | None], Any]
    doc: str


def _cache_dir(raw: str | None) -> Path:
    return Path(raw) if raw is not None else Path.home() / ".cache" / "pagedkv"


def _native_mode(raw: str | None) -> str:
    """``"off"``, ``"on"`` or ``"auto"`` (unset or any other text: try, fall back quietly)."""
    v = (raw if raw is not None else "auto").lower()
    return "off" if v in OFF else "on" if v in ON else "auto"


def _lower(default: str) -> Callable[[str | None], str]:
    def parse(raw: str | None) -> str:
        return (raw if raw is not None else default).lower()

    return parse


def _switch_default_on(raw: str | None) -> bool:
    """On unless set to one of `OFF`."""
    return (raw if raw is not None else "1").lower() not in OFF


def _off_only_if_zero(raw: str | None) -> bool:
    """On unless set to exactly ``0``."""
    return raw != "0"


def _non_empty(raw: str | None) -> bool:
    """True when set to any non-empty text (``0`` included)."""
    return bool(raw)


def _text_or_none(raw: str | None) -> str | None:
    return raw or None


_TABLE: list[EnvVar] = [
    EnvVar(
        "PAGEDKV_CACHE_DIR",
        "~/.cache/pagedkv",
        _cache_dir,
        "Where pagedkv caches files it builds: the native CPU kernels go to its native/ "
        "subdirectory, under a name hashing the source, the compiler flags and the CPU.",
    ),
    EnvVar(
        "PAGEDKV_NATIVE",
        "auto",
        _native_mode,
        "The native CPU kernels (ops/csrc, built with cc at first use): 0/off/false/no "
        "turns them off (pure torch paths); 1/on/true/yes makes a failed build an error "
        "(CI sets it); auto (or anything else) uses them when they build and warns once "
        "otherwise.",
    ),
    EnvVar(
        "PAGEDKV_NATIVE_ISA",
        "native",
        _lower(""),
        "Which SIMD build of the native kernels to load: native (the widest this CPU has), "
        "avx2 or portable (to compare paths, or to sidestep one).",
    ),
    EnvVar(
        "PAGEDKV_NATIVE_STEP",
        "1",
        _switch_default_on,
        "The native decode step (a whole float32 Llama-family layer stack in C): "
        "0/off/false/no keeps the per-op torch path.",
    ),
    EnvVar(
        "PAGEDKV_DENSE_LINEAR",
        "auto",
        _lower("auto"),
        "The library behind float32 dense linears above 16 rows: auto (the fastest here, "
        "timed once per process), blas (MKL's sgemm, bit-identical to HF's matmuls), "
        "mkl_packed (MKL's packed GEMM, same sums, a reordered copy of each weight) or onednn "
        "(oneDNN's linear, logits within ~2e-4 of HF's).",
    ),
    EnvVar(
        "PAGEDKV_TRITON",
        "1",
        _off_only_if_zero,
        "0 makes CUDA tensors take the torch paths instead of the Triton kernels (for comparison).",
    ),
    EnvVar(
        "PAGEDKV_THP",
        "1",
        _off_only_if_zero,
        "0 stops the CPU KV cache from asking Linux for transparent huge pages "
        "(madvise MADV_HUGEPAGE).",
    ),
    EnvVar(
        "PAGEDKV_KV_EVENTS_USE_INT_BLOCK_HASHES",
        "",
        _non_empty,
        "Set (to any non-empty value): KV events carry block hashes as 64-bit ints "
        "instead of bytes, for routers that key by int (vLLM's "
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).",
    ),
    EnvVar(
        "PAGEDKV_BENCH_DIR",
        "",
        _text_or_none,
        "Where benchmarks put their scratch files (the offload benchmark's disk tier); "
        "default: the system's temporary directory.",
    ),
    EnvVar(
        "PAGEDKV_API_KEY",
        "",
        _text_or_none,
        "The default of pagedkv serve --api-key: when set, /v1/* and /reset_prefix_cache "
        "require 'Authorization: Bearer KEY'.",
    ),
]

ENV_VARS: dict[str, EnvVar] = {v.name: v for v in _TABLE}


def get(name: str) -> Any:
    """The typed value of ``name`` as the environment holds it now. KeyError for a name
    that is not in the table (a typo must not read as "unset")."""
    var = ENV_VARS[name]
    return var.parse(os.environ.get(name))


def is_set(name: str) -> bool:
    """Whether ``name`` (a table entry) is in the environment at all."""
    if name not in ENV_VARS:
        raise KeyError(name)
    return name in os.environ


def describe() -> list[dict[str, str]]:
    """Rows ``{name, default, doc}`` in table order, for the docs' generated page."""
    return [dict(name=v.name, default=v.default, doc=v.doc) for v in _TABLE]


def __getattr__(name: str) -> Any:
    # Module attribute access (``envs.PAGEDKV_NATIVE``) reads the environment at call time.
    if name in ENV_VARS:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, *ENV_VARS])
