"""`KVConnectorStats`: a connector's counters in one typed snapshot (vLLM's
``SchedulerStats.kv_connector_stats``); `engine.stats.SchedulerStats` carries it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pagedkv.offload.base import TierStats

# Upper bounds (seconds) of the transfer latency histogram (Prometheus ``le`` buckets).
TRANSFER_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


@dataclass(slots=True)
class KVTransferStats:
    """Counters of a PD connector's transfers (cumulative): completed transfers, their blocks,
    bytes and latency histogram (one count per `TRANSFER_LATENCY_BUCKETS` bound, then +Inf),
    failed transfers (each one recomputed or failed per ``kv_load_failure_policy``), and
    producer leases that expired with no consumer."""

    role: str = ""
    num_transfers: int = 0
    num_blocks: int = 0
    num_bytes: int = 0
    num_failed: int = 0
    num_leases_expired: int = 0
    latency_sum_s: float = 0.0
    latency_buckets: list[int] = field(
        default_factory=lambda: [0] * (len(TRANSFER_LATENCY_BUCKETS) + 1)
    )
    transfers_in_flight: int = 0
    peers: list[str] = field(default_factory=list)

    def record(self, num_blocks: int, num_bytes: int, latency_s: float) -> None:
        self.num_transfers += 1
        self.num_blocks += num_blocks
        self.num_bytes += num_bytes
        self.latency_sum_s += latency_s
        i = next(
            (i for i, b in enumerate(TRANSFER_LATENCY_BUCKETS) if latency_s <= b),
            len(TRANSFER_LATENCY_BUCKETS),
        )
        self.latency_buckets[i] += 1

    def copy(self) -> KVTransferStats:
        return replace(self, latency_buckets=list(self.latency_buckets), peers=list(self.peers))


@dataclass(slots=True)
class KVConnectorStats:
    """The KV connector's counters (vLLM's ``SchedulerStats.kv_connector_stats``): tokens loaded
    from the offload tiers into the device cache, blocks stored into them, and one `TierStats`
    per tier (CPU first, then disk, Redis), each a copy."""

    loaded_tokens: int = 0
    stored_blocks: int = 0
    tiers: list[TierStats] = field(default_factory=list)
    transfer: KVTransferStats | None = None  # a PD connector's transfers (None: an offloading one)

    def tier_dicts(self) -> dict[str, dict[str, Any]]:
        """Tier name → its counters as a dict (every `TierStats` field), in tier order."""
        return {t.name: asdict(t) for t in self.tiers}

    def to_dict(self) -> dict[str, Any]:
        """``stats()["offload"]``: `tier_dicts` plus ``loaded_tokens`` and ``stored_blocks``."""
        out: dict[str, Any] = self.tier_dicts()
        out["loaded_tokens"] = self.loaded_tokens
        out["stored_blocks"] = self.stored_blocks
        if self.transfer is not None:
            out["transfer"] = asdict(self.transfer)
        return out

    @classmethod
    def from_tiers(
        cls, tiers: dict[str, TierStats], loaded_tokens: int, stored_blocks: int
    ) -> KVConnectorStats:
        """A snapshot of ``tiers`` (a connector's ``get_stats()``, which may hand out the live
        objects): each `TierStats` is copied, named by its key."""
        return cls(
            loaded_tokens=loaded_tokens,
            stored_blocks=stored_blocks,
            tiers=[replace(st, name=name) for name, st in tiers.items()],
        )
