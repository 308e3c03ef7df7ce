"""`KVConnectorFactory`: a `KVTransferConfig` → its connector (vLLM's factory and names).

Built-in connectors are registered by name and imported lazily (a connector's dependencies,
such as NIXL, load only when it is used). A connector outside pagedkv is named by
``kv_connector`` and found in ``kv_connector_module_path``, as in vLLM.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedkv.kv_transfer.base import KVConnectorBase, KVConnectorRole
from pagedkv.kv_transfer.config import KVTransferConfig

if TYPE_CHECKING:
    from pagedkv.core.specs import KVCacheConfig


class KVConnectorFactory:
    _registry: dict[str, Callable[[], type[KVConnectorBase]]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        """Register ``module_path.class_name`` as ``name`` (imported on first use)."""
        if name in cls._registry:
            raise ValueError(f"KV connector {name!r} is already registered")

        def loader() -> type[KVConnectorBase]:
            return getattr(importlib.import_module(module_path), class_name)

        cls._registry[name] = loader

    @classmethod
    def get_connector_class(cls, config: KVTransferConfig) -> type[KVConnectorBase]:
        name = config.kv_connector
        if name is None:
            raise ValueError("kv_transfer_config names no kv_connector")
        if config.kv_connector_module_path:
            try:
                module = importlib.import_module(config.kv_connector_module_path)
            except ImportError as e:
                raise ValueError(
                    f"cannot import kv_connector_module_path "
                    f"{config.kv_connector_module_path!r}: {e}"
                ) from None
            connector = getattr(module, name, None)
        elif name in cls._registry:
            connector = cls._registry[name]()
        else:
            raise ValueError(
                f"unknown kv_connector {name!r}; built in: {sorted(cls._registry)} "
                "(or give kv_connector_module_path)"
            )
        if not (isinstance(connector, type) and issubclass(connector, KVConnectorBase)):
            raise ValueError(f"kv_connector {name!r} is not a KVConnectorBase subclass")
        return connector

    @classmethod
    def create_connector(
        cls,
        config: KVTransferConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        model_identity: str = "",
        hash_seed: str = "",
    ) -> KVConnectorBase:
        """The connector ``config`` names, built for ``role`` (scheduler side; the worker side
        is ready once the runner called `register_kv_caches`)."""
        return cls.get_connector_class(config)(
            config, role, kv_cache_config, model_identity=model_identity, hash_seed=hash_seed
        )


KVConnectorFactory.register_connector(
    "OffloadingConnector", "pagedkv.kv_transfer.offloading_connector", "OffloadingConnector"
)
KVConnectorFactory.register_connector(
    "NixlConnector", "pagedkv.kv_transfer.nixl_connector", "NixlConnector"
)
