"""Encoder-cache transfer (EPD: encoder / prefill / decode disaggregation; vLLM's EC connectors
and ``ECTransferConfig``; seed ``000``: "Encoder Cache 传输").

An *encoder* instance (``ec_role="ec_producer"``) runs only a vision-language model's image
encoder: `/v1/encode` computes each image's encoder output, keeps it in registered memory,
*reserved* for ``lease_s`` seconds (a consumer's read releases it early; either way it then
stays, least recently used, until its room is needed), and answers ``ec_transfer_params``:
where it lies (``ec_host``, ``ec_port``) and which images (content hashes). A *prefill* or
colocated instance (``ec_role="ec_consumer"``) given those params reads the outputs before it
schedules the request, and its runner finds them in its encoder cache instead of encoding.

The transfer is the P2P tier's machinery (`offload.p2p_tier.P2PTier`): a ZMQ control plane
(handshake comparing model, encoder geometry and dtype; lookups that lease what they find;
releases) and the data plane of a `KVTransferBackend` (NIXL, or the TCP backend), checksummed.
Anything that goes wrong — a dead or refusing producer, an evicted output, a checksum
mismatch — leaves the image to be encoded locally, with the same tokens.

``ec_transfer_config`` (an `EngineConfig` field; vLLM's names): ``ec_role``
(``ec_producer`` / ``ec_consumer`` / ``ec_both``) and ``ec_connector_extra_config``:
``ec_host`` / ``ec_port`` (where a producer listens; port 0: a free one), ``backend``
(``nixl`` / ``tcp``; default NIXL when it imports), ``capacity`` (bytes of outputs a producer
keeps, default 256 MiB), ``lease_s`` (default 30), ``timeout_s`` (a consumer's wait, default 5).
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

EC_ROLES = ("ec_producer", "ec_consumer", "ec_both")
DEFAULT_CAPACITY = 256 << 20


@dataclass(frozen=True, slots=True)
class ECTransferConfig:
    """vLLM's ``ECTransferConfig`` subset pagedkv uses (see the module docstring)."""

    ec_role: str
    ec_connector: str = "ECP2PConnector"
    ec_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_value(cls, value: Any) -> ECTransferConfig | None:
        """From a dict (or an instance); ValueError naming what is wrong."""
        if value is None or isinstance(value, ECTransferConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError("ec_transfer_config must be an object")
        unknown = set(value) - {"ec_role", "ec_connector", "ec_connector_extra_config"}
        if unknown:
            raise ValueError(f"ec_transfer_config: unknown keys {sorted(unknown)}")
        cfg = cls(
            value.get("ec_role", ""),
            value.get("ec_connector", "ECP2PConnector"),
            dict(value.get("ec_connector_extra_config") or {}),
        )
        if cfg.ec_role not in EC_ROLES:
            raise ValueError(f"ec_transfer_config.ec_role must be one of {', '.join(EC_ROLES)}")
        if cfg.ec_connector != "ECP2PConnector":
            raise ValueError("ec_transfer_config.ec_connector: only ECP2PConnector is built")
        extra = cfg.ec_connector_extra_config
        bad = set(extra) - {"ec_host", "ec_port", "backend", "capacity", "lease_s", "timeout_s"}
        if bad:
            raise ValueError(f"ec_connector_extra_config: unknown keys {sorted(bad)}")
        return cfg

    @property
    def is_producer(self) -> bool:
        return self.ec_role in ("ec_producer", "ec_both")

    @property
    def is_consumer(self) -> bool:
        return self.ec_role in ("ec_consumer", "ec_both")


def _key(identifier: str) -> bytes:
    return (
        bytes.fromhex(identifier)
        if len(identifier) == 64
        else hashlib.sha256(identifier.encode()).digest()
    )


@dataclass(slots=True)
class ECStats:
    """What ``/metrics`` reports: outputs published and fetched, bytes, fetch seconds."""

    published: int = 0
    fetched: int = 0
    fetch_failures: int = 0
    bytes_received: int = 0
    fetch_seconds: float = 0.0


class ECConnector:
    """One engine's side of EPD. ``rows × hidden`` outputs of ``dtype`` (one image each);
    ``identity``: the model (file and geometry), compared in the handshake."""

    def __init__(
        self, config: ECTransferConfig, identity: str, rows: int, hidden: int, dtype: torch.dtype
    ):
        from pagedkv.offload.p2p_tier import P2PTier

        self.config = config
        extra = config.ec_connector_extra_config
        self.rows, self.hidden, self.dtype = rows, hidden, dtype
        self.item_bytes = rows * hidden * torch.empty(0, dtype=dtype).element_size()
        self.fingerprint = hashlib.sha256(
            f"{identity}|{rows}x{hidden}|{dtype}".encode()
        ).hexdigest()
        self.backend = extra.get("backend")
        self.timeout_s = float(extra.get("timeout_s", 5.0))
        self.lease_s = float(extra.get("lease_s", 30.0))
        self.stats = ECStats()
        self._lock = threading.Lock()
        self._readers: dict[tuple[str, int], Any] = {}
        self.producer: Any = None
        self.host = str(extra.get("ec_host", "127.0.0.1"))
        self.port = 0
        if config.is_producer:
            self.port = int(extra.get("ec_port", 0)) or _free_port(self.host)
            self.producer = P2PTier(
                [],
                self.fingerprint,
                "ec",
                self.item_bytes,
                listen_host=self.host,
                listen_port=self.port,
                capacity_bytes=int(extra.get("capacity", DEFAULT_CAPACITY)),
                backend=self.backend,
                lease_s=self.lease_s,
                name="ec-producer",
            )

    # ---- producer ------------------------------------------------------------------------

    def publish(self, outputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Keep each image's output (by content hash), reserved for ``lease_s``; the
        ``ec_transfer_params`` a consumer needs to read them."""
        assert self.producer is not None, "publish needs ec_role ec_producer or ec_both"
        items = []
        for ident, out in outputs.items():
            data = out.detach().to(self.dtype).contiguous().view(torch.uint8).numpy()
            items.append((_key(ident), memoryview(data).cast("B")))
        ok = self.producer.store_batch(items)
        keys = [k for (k, _), good in zip(items, ok) if good]
        self.producer.store.lookup(keys, pin_s=self.lease_s)  # the reservation
        with self._lock:
            self.stats.published += len(keys)
        return {
            "ec_host": self.host,
            "ec_port": self.port,
            "items": [i for i, good in zip(outputs, ok) if good],
        }

    # ---- consumer ------------------------------------------------------------------------

    def fetch(self, params: dict[str, Any], identifiers: list[str]) -> dict[str, torch.Tensor]:
        """Read the outputs ``params`` offers for ``identifiers`` (those it lists); what fails
        is left out (encoded locally). Never raises for a peer's fault."""
        from pagedkv.offload.p2p_tier import P2PTier

        want = [i for i in identifiers if i in set(params.get("items") or [])]
        if not want:
            return {}
        try:
            addr = (str(params["ec_host"]), int(params["ec_port"]))
        except (KeyError, TypeError, ValueError):
            logger.warning("ec_transfer_params without a valid ec_host/ec_port: encoding locally")
            return {}
        t0 = time.perf_counter()
        with self._lock:
            reader = self._readers.get(addr)
            if reader is None:
                reader = self._readers[addr] = P2PTier(
                    [addr],
                    self.fingerprint,
                    "ec",
                    self.item_bytes,
                    backend=self.backend,
                    timeout_s=self.timeout_s,
                    lease_s=self.lease_s,
                    name="ec-consumer",
                )
        bufs = [torch.empty(self.rows, self.hidden, dtype=self.dtype) for _ in want]
        dsts = [memoryview(b.view(torch.uint8).numpy()).cast("B") for b in bufs]
        try:
            ok = reader.load_batch([(_key(i), d) for i, d in zip(want, dsts)])
        except Exception as e:  # noqa: BLE001 - a transfer fault means local encoding
            logger.warning("encoder cache fetch from %s:%d failed (%s): encoding locally", *addr, e)
            ok = [False] * len(want)
        got = {i: b for i, b, good in zip(want, bufs, ok) if good}
        with self._lock:
            self.stats.fetched += len(got)
            self.stats.fetch_failures += len(want) - len(got)
            self.stats.bytes_received += len(got) * self.item_bytes
            self.stats.fetch_seconds += time.perf_counter() - t0
        return got

    def shutdown(self) -> None:
        if self.producer is not None:
            self.producer.shutdown()
        for r in self._readers.values():
            r.shutdown()
        self._readers.clear()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
