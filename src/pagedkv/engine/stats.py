"""Typed engine statistics (vLLM's ``SchedulerStats``), read by the Prometheus metrics, the
stats line, the dashboard and `LLM.stats()`.

`LLMEngine.make_stats` takes one snapshot on the engine thread, between two steps. A snapshot
owns copies of every counter (the prefix-cache totals and each tier's `TierStats` keep changing
inside the engine), so other threads may read it while the engine steps on: `AsyncLLM` keeps
the latest one in ``last_stats`` for scrapes and the stats line.

`SchedulerStats.to_dict` is the dict that `LLM.stats()` and `LLMEngine.stats()` return, with
the keys they have always had (``num_running``, ``prefix_cache_hits``, ``offload`` ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedkv.core.kv_cache_manager import PrefixCacheStats
from pagedkv.kv_transfer.stats import KVConnectorStats
from pagedkv.offload.base import TierStats


@dataclass(slots=True)
class SchedulerStats:
    """One snapshot of the engine (vLLM's ``SchedulerStats``, plus the block and token counts
    pagedkv's metrics export). Counters are cumulative since the engine started: readers that
    want a rate (the stats line) subtract two snapshots.

    ``num_blocks`` counts the whole pool, the null block (block 0) included; ``num_free_blocks``
    includes cached, evictable blocks. ``prefix_cache_stats`` holds the totals in tokens
    (queries, hits, external hits from offload tiers); ``kv_connector_stats`` is None without a
    KV connector."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_blocks: int = 0
    block_size: int = 0
    num_free_blocks: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    kv_connector_stats: KVConnectorStats | None = None

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: the pool without the null block."""
        return max(self.num_blocks - 1, 0)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests (usable blocks that are not free)."""
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def tier_stats(self) -> list[TierStats]:
        """Each offload tier's counters; empty without a KV connector."""
        return self.kv_connector_stats.tiers if self.kv_connector_stats is not None else []

    def to_dict(self) -> dict[str, Any]:
        """The dict form `LLM.stats()` returns (its keys predate this class: ``num_running``,
        ``num_waiting``, ``prefix_cache_queries`` ...; ``offload`` is ``{}`` without tiers)."""
        pc = self.prefix_cache_stats
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_free_blocks": self.num_free_blocks,
            "kv_cache_usage": self.kv_cache_usage,
            "prefix_cache_queries": pc.queries,
            "prefix_cache_hits": pc.hits,
            "prefix_cache_hit_rate": pc.hit_rate,
            "external_cache_hits": pc.external_hits,
            "num_preemptions": self.num_preemptions,
            "num_running": self.num_running_reqs,
            "num_waiting": self.num_waiting_reqs,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "offload": self.kv_connector_stats.to_dict()
            if self.kv_connector_stats is not None
            else {},
        }


__all__ = ["KVConnectorStats", "PrefixCacheStats", "SchedulerStats", "TierStats"]
