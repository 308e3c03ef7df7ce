"""`KVTransferConfig`: which KV connector an engine runs, and in which role (vLLM's
``config/kv_transfer.py`` fields and defaults).

Given as ``LLM(kv_transfer_config=KVTransferConfig(...) | dict)`` or on the command line as
``--kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", ...}'``.
``--kv-offload SPEC`` is the short form of the offloading connector's config: it is parsed once,
here, into a typed `OffloadConfig` that the connector receives in
``kv_connector_extra_config["offload_config"]``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

from pagedkv.offload.spec import OffloadConfig, parse_offload_spec

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# Per-request ``kv_transfer_params`` keys a connector reads (`SamplingParams.kv_transfer_params`):
# the offloading connector's, and vLLM's prefill/decode disaggregation keys (pd-disaggregation §4).
OFFLOAD_PARAM_KEYS = frozenset(
    {"max_offload_tokens", "offload_policy", "skip_reading_prefix_cache"}
)
PD_PARAM_KEYS = frozenset(
    {
        "do_remote_decode",
        "do_remote_prefill",
        "remote_engine_id",
        "remote_block_ids",
        "remote_host",
        "remote_port",
        "remote_request_id",
        "remote_num_tokens",
        "remote_blocks_expiry_time",
        "transfer_mode",
        "tp_size",
        "dcp_size",
        "pp_size",
        "remote_registration_generation",
    }
)
KV_TRANSFER_PARAM_KEYS = OFFLOAD_PARAM_KEYS | PD_PARAM_KEYS
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
OFFLOADING_CONNECTOR = "OffloadingConnector"


@dataclass(slots=True)
class KVTransferConfig:
    """vLLM's fields. ``kv_role``: ``kv_producer`` (computes KV for others: a prefill
    instance), ``kv_consumer`` (receives it: a decode instance) or ``kv_both``; required with a
    connector. ``kv_load_failure_policy``: a failed load is ``"recompute"``d locally (pagedkv's
    default: a dead producer costs time, never a request) or ``"fail"``s the request (vLLM 0.33's
    default). ``engine_id`` defaults to a fresh uuid4. ``kv_ip`` /
    ``kv_port``: where a connector's side channel listens (PD disaggregation).
    ``kv_connector_module_path``: a module that defines a `KVConnectorBase` subclass named
    ``kv_connector`` (connectors outside pagedkv, as in vLLM)."""

    kv_connector: str | None = None
    kv_role: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: str = "recompute"
    engine_id: str | None = None
    kv_connector_module_path: str | None = None
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"invalid kv_transfer_config {name}={getattr(self, name)!r}: {why}")

        if self.engine_id is None:
            self.engine_id = str(uuid.uuid4())
        if self.kv_connector is not None and not isinstance(self.kv_connector, str):
            raise bad("kv_connector", "must be a connector name")
        if self.kv_connector is not None and self.kv_role is None:
            raise bad("kv_role", f"a connector needs a role, one of {list(KV_ROLES)}")
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise bad("kv_role", f"choose one of {list(KV_ROLES)}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise bad("kv_load_failure_policy", f"choose one of {list(KV_LOAD_FAILURE_POLICIES)}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise bad("kv_connector_extra_config", "must be a JSON object")
        if not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise bad("kv_port", "must be a port number")

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any = None) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVTransferConfig:
        """From a JSON object; unknown keys are an error that names them."""
        if not isinstance(data, dict):
            raise ValueError(f"kv_transfer_config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown kv_transfer_config field(s) {unknown}; known: {sorted(known)}"
            )
        data = dict(data)
        if isinstance(data.get("kv_connector_extra_config"), dict):  # never share the caller's dict
            data["kv_connector_extra_config"] = dict(data["kv_connector_extra_config"])
        return cls(**data)

    @classmethod
    def from_cli(cls, text: str) -> KVTransferConfig:
        """``--kv-transfer-config JSON``."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"--kv-transfer-config is not valid JSON ({e.msg} at char {e.pos}): {text!r}"
            ) from None
        return cls.from_dict(data)


def offloading_transfer_config(
    spec: str | OffloadConfig,
    *,
    cache_policy: str = "lru",
    store_threshold: int = 0,
    preemption_mode: str = "recompute",
) -> KVTransferConfig:
    """The `KVTransferConfig` that ``--kv-offload SPEC`` stands for. The spec is parsed here,
    once; a failed load from a tier is recomputed (a dead tier costs time, never a request)."""
    offload = spec if isinstance(spec, OffloadConfig) else parse_offload_spec(spec)
    return KVTransferConfig(
        kv_connector=OFFLOADING_CONNECTOR,
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "offload_config": offload,
            "cache_policy": cache_policy,
            "store_threshold": store_threshold,
            "preemption_mode": preemption_mode,
        },
    )


def resolve_offload_config(config: KVTransferConfig) -> OffloadConfig | None:
    """The offloading connector's typed tiers: ``extra["offload_config"]`` (an `OffloadConfig`,
    or a dict/JSON form of the spec string under ``"kv_offload"``, parsed once and stored back).
    None for other connectors."""
    if config.kv_connector != OFFLOADING_CONNECTOR:
        return None
    extra = config.kv_connector_extra_config
    oc = extra.get("offload_config")
    if isinstance(oc, OffloadConfig):
        return oc
    spec = extra.get("kv_offload")
    if not isinstance(spec, str):
        raise ValueError(
            "the OffloadingConnector needs kv_connector_extra_config.kv_offload, a tier spec "
            "such as 'cpu:4GiB,disk:/var/cache/pagedkv:20GiB'"
        )
    extra["offload_config"] = oc = parse_offload_spec(spec)
    return oc
