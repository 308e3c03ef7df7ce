"""The forward context: what the attention layers of the running forward pass may need besides
their inputs — today the KV connector's per-layer hooks (vLLM's ``forward_context``).

`ModelRunner` sets it around a forward pass that has a connector; an attention layer calls
`wait_for_kv_layer_load` before it reads its cache and `save_kv_layer` after it wrote this
step's KV. Without a connector both are a single global read. One engine thread runs forward
passes, so a module global is enough.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_kv_connector: Any = None  # the `KVConnectorBase` of the running forward pass, or None


@contextmanager
def set_forward_context(kv_connector: Any) -> Iterator[None]:
    global _kv_connector
    _kv_connector = kv_connector
    try:
        yield
    finally:
        _kv_connector = None


def wait_for_kv_layer_load(layer_name: str) -> None:
    if _kv_connector is not None:
        _kv_connector.wait_for_layer_load(layer_name)


def save_kv_layer(layer_name: str, kv_cache: Any, attn_metadata: Any) -> None:
    if _kv_connector is not None:
        _kv_connector.save_kv_layer(layer_name, kv_cache, attn_metadata)
