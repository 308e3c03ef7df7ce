"""The KV transfer data plane (see `base`): one-sided reads of registered memory between
processes. `get_transfer_backend` picks NIXL (nixl.py, UCX) when it imports, else TCP (tcp.py,
pure Python).

Its own package below the two that use it: the NIXL connector of PD disaggregation
(`pagedkv.kv_transfer.nixl_connector`) and the P2P offload tier (`pagedkv.offload.p2p_tier`).
It imports nothing else of pagedkv.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from pagedkv.transfer.base import KVTransferBackend, MemoryRegion, XferState

__all__ = [
    "KVTransferBackend",
    "MemoryRegion",
    "XferState",
    "get_transfer_backend",
    "nixl_import_error",
]

logger = logging.getLogger(__name__)


def nixl_import_error() -> str | None:
    """Why ``nixl_cu12`` cannot be used here, or None when it imports."""
    # NIXL's logger writes INFO lines to stdout (it would corrupt JSON output): WARN unless
    # the user chose a level. Read when nixl_cu12 is first imported.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        import nixl_cu12  # noqa: F401  (lazy: an optional dependency, heavy native libs)
    except Exception as e:  # ImportError, or an OSError from a missing shared library
        return f"{type(e).__name__}: {e}"
    return None


def get_transfer_backend(
    name: str,
    preferred: str | None = None,
    *,
    nixl_progress_thread: bool = True,
    nixl_progress_delay_us: int | None = None,
    **kw: Any,
) -> KVTransferBackend:
    """A backend for agent ``name``: ``preferred`` "nixl" | "tcp", or None for NIXL when
    ``nixl_cu12`` imports, else TCP. ``kw`` goes to the backend (``timeout_s``; TCP ``host``);
    ``nixl_progress_thread`` and ``nixl_progress_delay_us`` (None: the backend's default) to NIXL
    only. "nixl" asked for explicitly but not importable raises ImportError."""
    if preferred not in (None, "nixl", "tcp"):
        raise ValueError(f"unknown KV transfer backend {preferred!r} (nixl | tcp)")
    reason = nixl_import_error() if preferred != "tcp" else None
    if preferred == "nixl" and reason is not None:
        raise ImportError(f"KV transfer backend nixl requested but not importable: {reason}")
    if preferred == "nixl" or (preferred is None and reason is None):
        from pagedkv.transfer.nixl import NixlBackend

        logger.info("KV transfer backend: nixl (UCX)")
        if nixl_progress_delay_us is not None:
            kw["progress_delay_us"] = nixl_progress_delay_us
        return NixlBackend(name, progress_thread=nixl_progress_thread, **kw)
    from pagedkv.transfer.tcp import TcpBackend

    if preferred is None:
        logger.info("KV transfer backend: tcp (NIXL not importable: %s)", reason)
    else:
        logger.info("KV transfer backend: tcp")
    return TcpBackend(name, **kw)
