"""Typed engine statistics (`pagedkv.engine.stats`): `LLMEngine.make_stats` snapshots share no
state with the engine, `LLM.stats()` is their dict form with the keys it always had, and the
stats line reads two snapshots. The engine tests run the real default model with a CPU tier."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.engine.stats import KVConnectorStats, PrefixCacheStats, SchedulerStats, TierStats
from pagedkv.entrypoints.stat_logger import LoggingStatLogger

# The keys of `LLM.stats()` before the dataclasses: the dict form must keep every one of them.
LEGACY_KEYS = {
    "num_blocks",
    "block_size",
    "num_free_blocks",
    "kv_cache_usage",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prefix_cache_hit_rate",
    "external_cache_hits",
    "num_preemptions",
    "num_running",
    "num_waiting",
    "prompt_tokens",
    "generation_tokens",
    "offload",
}
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = {
    "prompt_token_ids": [(31 * j) % 30000 + 100 for j in range(70)]
}  # 4 full blocks + 6 tokens


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=32, block_size=16, max_model_len=256, kv_offload="cpu:16MiB")


# ---- without a model ------------------------------------------------------------------------------


def test_connector_stats_are_copies_in_the_legacy_dict_layout():
    live = TierStats("cpu", "CPU", capacity_bytes=1 << 20, hits=3, stores=2)
    snap = KVConnectorStats.from_tiers({"cpu": live}, loaded_tokens=48, stored_blocks=2)
    live.hits += 10  # the tier keeps counting after the snapshot
    live.stores += 1
    assert snap.tiers[0].hits == 3 and snap.tiers[0].stores == 2
    offload = snap.to_dict()
    assert list(offload) == ["cpu", "loaded_tokens", "stored_blocks"]
    assert offload["loaded_tokens"] == 48 and offload["stored_blocks"] == 2
    assert (
        set(offload["cpu"]) == {f.name for f in fields(TierStats)} and offload["cpu"]["hits"] == 3
    )


def test_scheduler_stats_dict_and_block_counts():
    stats = SchedulerStats(
        num_running_reqs=2,
        num_waiting_reqs=1,
        kv_cache_usage=0.5,
        num_blocks=9,
        block_size=16,
        num_free_blocks=4,
        prefix_cache_stats=PrefixCacheStats(requests=2, queries=64, hits=16, external_hits=8),
    )
    assert stats.num_usable_blocks == 8 and stats.num_used_blocks == 4 and stats.tier_stats == []
    d = stats.to_dict()
    assert set(d) == LEGACY_KEYS and d["offload"] == {}
    assert (
        d["num_running"],
        d["num_waiting"],
        d["prefix_cache_queries"],
        d["prefix_cache_hits"],
    ) == (2, 1, 64, 16)
    assert d["prefix_cache_hit_rate"] == 0.25 and d["external_cache_hits"] == 8


@dataclass
class _Holder:
    """What `LoggingStatLogger` reads of `AsyncLLM`: the latest snapshot."""

    last_stats: SchedulerStats
    is_healthy: bool = True


def test_stats_line_reads_the_interval_between_two_snapshots(caplog):
    holder = _Holder(
        SchedulerStats(
            generation_tokens=100, prefix_cache_stats=PrefixCacheStats(queries=1000, hits=900)
        )
    )
    sl = LoggingStatLogger(holder, interval_s=10)  # type: ignore[arg-type]
    holder.last_stats = SchedulerStats(
        num_running_reqs=3,
        num_waiting_reqs=1,
        kv_cache_usage=0.25,
        generation_tokens=150,
        prefix_cache_stats=PrefixCacheStats(queries=1200, hits=950),
    )
    with caplog.at_level(logging.INFO, logger="pagedkv.entrypoints.stat_logger"):
        line = sl.log(now=sl._last_time + 10)
    # 50 tokens in 10 s; 50 hits of 200 queries in the interval (not the cumulative 950 / 1200).
    assert (
        "Avg generation throughput: 5.0 tokens/s" in line and "Prefix cache hit rate: 25.0%" in line
    )
    assert "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%" in line and line in caplog.text
    line = sl.log(now=sl._last_time + 10)  # no query in this interval: the cumulative rate
    assert (
        "Avg generation throughput: 0.0 tokens/s" in line and "Prefix cache hit rate: 79.2%" in line
    )


# ---- the real engine --------------------------------------------------------------------------------


@pytest.mark.slow
def test_make_stats_snapshots_share_no_state_with_the_engine(llm):
    before = llm.make_stats()
    queries, hits = before.prefix_cache_stats.queries, before.prefix_cache_stats.hits
    cpu_stores = {t.name: t.stores for t in before.tier_stats}["cpu"]
    llm.generate([PROMPT, PROMPT], PARAMS, use_tqdm=False)
    llm.generate(PROMPT, PARAMS, use_tqdm=False)  # a prefix-cache hit
    after = llm.make_stats()
    # The old snapshot did not move with the engine...
    assert (before.prefix_cache_stats.queries, before.prefix_cache_stats.hits) == (queries, hits)
    assert {t.name: t.stores for t in before.tier_stats}["cpu"] == cpu_stores
    # ... while the new one counted the requests, their tokens and the CPU tier's stores.
    assert after.prefix_cache_stats.queries > queries and after.prefix_cache_stats.hits > hits
    assert after.generation_tokens == before.generation_tokens + 3 * PARAMS.max_tokens
    assert {t.name: t.stores for t in after.tier_stats}["cpu"] > cpu_stores
    assert after.num_running_reqs == after.num_waiting_reqs == 0
    assert (
        after.num_free_blocks
        == after.num_usable_blocks
        == llm.llm_engine.kv_cache_config.num_blocks - 1
    )


def test_llm_stats_is_the_dict_form_of_make_stats(llm):
    llm.generate(PROMPT, PARAMS, use_tqdm=False)
    llm.generate(PROMPT, PARAMS, use_tqdm=False)  # a prefix-cache hit
    stats = llm.stats()
    assert set(stats) == LEGACY_KEYS
    assert stats == llm.make_stats().to_dict()  # idle engine: two snapshots agree
    assert set(stats["offload"]) == {"cpu", "loaded_tokens", "stored_blocks"}
    assert stats["offload"]["cpu"]["stores"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["num_blocks"] == 32 and stats["block_size"] == 16
