"""Tier hits survive the queue (issue 9, item 3): a prompt whose prefix sits only in a slower
tier (disk, Redis) loads it however long it waited for a batch slot, and greedy outputs stay
those of an engine without tiers.

The engines are real (default model, real disk directory, real redis-server). A waiting
request is kept behind a long generation by stepping the engine by hand and pausing between
steps while something runs, so the queue time is longer than every tier timeout (answer
lifetime 1 s, deferral limit 5 s) on a machine of any speed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from core_utils import make_request
from redis_server import RedisServer

from pagedkv import LLM, RequestOutput, SamplingParams
from pagedkv.kv_transfer.offloading_connector import MAX_DEFERRAL_S, OffloadingConnector
from pagedkv.offload.base import OffloadKey
from pagedkv.offload.cpu_manager import CPUOffloadingManager
from pagedkv.offload.dual_queue_pool import DualQueueThreadPool
from pagedkv.offload.tiering import ChunkItems, SecondaryTier, TieringOffloadingManager
from pagedkv.offload.worker import HostChunkBuffer, OffloadingWorker
from pagedkv.ops.kv_cache import allocate_kv_cache

ENGINE = dict(num_kv_blocks=64, max_model_len=256)
PREFIX_PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
# 90 tokens: 5 full blocks; the last token is always computed, so a tier can give 80 of them.
PROMPT_LEN, TIER_TOKENS = 90, 80
PAUSE_S = 0.3  # per step while a request runs: ~MAX_DEFERRAL_S / PAUSE_S steps outlast the limit


def prompt(i: int) -> dict:
    return {"prompt_token_ids": [(97 * i + 13 * j + 7) % 40000 + 100 for j in range(PROMPT_LEN)]}


def short_prompt(i: int) -> dict:
    """Under one block: no lookup, so it is admitted in the step it is first considered."""
    return {"prompt_token_ids": [(31 * i + 5 * j + 3) % 40000 + 100 for j in range(12)]}


def long_params(steps: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)


def tier_spec(kind: str, tmp_path: Path, server: RedisServer | None) -> str:
    if kind == "disk":
        return f"cpu:64MiB,disk:{tmp_path / 'kv'}:256MiB"
    assert server is not None
    return f"cpu:64MiB,{server.url}"


@pytest.fixture(scope="module", params=["disk", "redis"])
def spec(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A tier spec whose slower tier holds the KV of ``prompt(0..4)``. Every test starts a
    fresh engine on it: an empty device cache and CPU tier, so those prefixes are only there."""
    server = RedisServer().start() if request.param == "redis" else None  # skips without redis
    try:
        s = tier_spec(request.param, tmp_path_factory.mktemp("tier"), server)
        first = LLM(**ENGINE, max_num_seqs=5, kv_offload=s)
        first.generate([prompt(i) for i in range(5)], PREFIX_PARAMS, use_tqdm=False)
        assert first.llm_engine.connector.manager.drain(30.0)
        first.llm_engine.shutdown()
        yield s
    finally:
        if server is not None:
            server.stop()


@pytest.fixture(scope="module")
def plain() -> LLM:
    """An engine without tiers: the reference outputs."""
    return LLM(**ENGINE, max_num_seqs=2)


def run_queued(llm: LLM, queue: list[tuple[dict, SamplingParams]]) -> list[RequestOutput]:
    """Add every request at once, then step; each step that runs a request takes PAUSE_S
    longer, as a slow batch would. Returns the outputs in queue order."""
    engine = llm.llm_engine
    for i, (p, sp) in enumerate(queue):
        engine.add_request(str(i), p, sp)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if engine.scheduler.num_running:
            time.sleep(PAUSE_S)
    engine.check_invariants()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_config.num_blocks - 1
    return [done[str(i)] for i in range(len(queue))]


def reference(plain: LLM, queue: list[tuple[dict, SamplingParams]]) -> list[list[int]]:
    outs = plain.generate([p for p, _ in queue], [sp for _, sp in queue], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
def test_prefix_on_a_tier_loads_after_queueing_behind_a_long_generation(spec: str, plain: LLM):
    # [A, B], one slot: A asks its tier (RETRY), so B, which needs no lookup, takes the slot
    # and generates for longer than the deferral limit and the answer lifetime. A then waits
    # unconsidered; before the fix its stale answer and the elapsed queue time made it
    # recompute its whole prompt.
    steps = int(MAX_DEFERRAL_S / PAUSE_S) + 4
    queue = [(prompt(0), PREFIX_PARAMS), (short_prompt(0), long_params(steps))]
    llm = LLM(**ENGINE, max_num_seqs=1, kv_offload=spec)
    a, b = run_queued(llm, queue)
    assert b.metrics.finished_time <= a.metrics.first_scheduled_time  # A really waited for B
    assert a.metrics.first_scheduled_time - a.metrics.arrival_time > MAX_DEFERRAL_S
    assert a.num_cached_tokens == TIER_TOKENS
    assert llm.stats()["offload"]["loaded_tokens"] == TIER_TOKENS
    assert [a.outputs[0].token_ids, b.outputs[0].token_ids] == reference(plain, queue)
    # What A loads when nothing is in its way (device cache and CPU tier emptied first, so
    # its prefix is again only in the slower tier): the same prefix.
    manager = llm.llm_engine.connector.manager
    assert manager.drain(30.0)  # write-backs in flight pin their CPU slots
    assert llm.reset_prefix_cache() and manager.reset_cache()
    [a_alone] = run_queued(llm, [(prompt(0), PREFIX_PARAMS)])
    assert a_alone.num_cached_tokens == a.num_cached_tokens
    assert a_alone.outputs[0].token_ids == a.outputs[0].token_ids
    llm.llm_engine.shutdown()


@pytest.mark.slow
def test_every_queued_prefix_loads_in_a_loaded_batch(spec: str, plain: LLM):
    # Two slots, always full of generations that need no lookup, with prompts whose prefixes
    # sit on the tier queued between them: each of those is passed over at least once (its
    # tier answer is pending while a slot is free) and then waits longer than every timeout.
    steps = int(MAX_DEFERRAL_S / PAUSE_S) + 4
    queue = [
        (prompt(0), PREFIX_PARAMS),
        (short_prompt(0), long_params(steps)),
        (prompt(1), PREFIX_PARAMS),
        (short_prompt(1), long_params(steps + 6)),
        (prompt(2), PREFIX_PARAMS),
        (short_prompt(2), long_params(steps // 2)),
        (prompt(3), PREFIX_PARAMS),
        (prompt(4), PREFIX_PARAMS),
    ]
    llm = LLM(**ENGINE, max_num_seqs=2, kv_offload=spec)
    outs = run_queued(llm, queue)
    tiered = [o for o, (p, _) in zip(outs, queue) if len(p["prompt_token_ids"]) == PROMPT_LEN]
    assert (
        max(o.metrics.first_scheduled_time - o.metrics.arrival_time for o in tiered)
        > MAX_DEFERRAL_S
    )
    assert [o.num_cached_tokens for o in tiered] == [TIER_TOKENS] * 5
    assert llm.stats()["offload"]["loaded_tokens"] == 5 * TIER_TOKENS
    assert [o.outputs[0].token_ids for o in outs] == reference(plain, queue)
    llm.llm_engine.shutdown()


class HungTier(SecondaryTier):
    """A tier whose existence checks do not come back until ``release`` is set (a server
    that accepts connections and never answers)."""

    def __init__(self) -> None:
        super().__init__("hung", "STORAGE")
        self.release = threading.Event()
        self.pool = DualQueueThreadPool(1)

    def exists_batch(self, keys: Sequence[OffloadKey]) -> list[bool]:
        self.release.wait(60)
        return [False] * len(keys)

    def store_batch(self, items: ChunkItems) -> list[bool]:
        return [False] * len(items)

    def load_batch(self, items: ChunkItems) -> list[bool]:
        return [False] * len(items)


def test_deferral_clock_counts_only_steps_that_consider_the_request():
    buf, _ = allocate_kv_cache("LBNHC", 2, 16, 16, 2, 16, torch.float32)
    host = HostChunkBuffer.for_kv_cache(buf, "LBNHC", 1 << 20)
    tier = HungTier()
    manager = TieringOffloadingManager(
        CPUOffloadingManager(host.num_chunks, chunk_bytes=host.chunk_bytes),
        host,
        [tier],
        lookup_timeout_s=120.0,
    )
    conn = OffloadingConnector.from_parts(
        manager, OffloadingWorker(buf, "LBNHC", host), block_size=16
    )
    conn.max_deferral_s = 0.3
    try:

        def ask(req) -> int | None:
            conn.on_schedule_start()
            n, load_async = conn.get_num_new_matched_tokens(req, 0)
            assert not load_async  # the tiers load synchronously
            return n

        # Asked once, then passed over (not considered) for longer than the limit: the time
        # it was not considered is not charged, so it is still waiting for its answer.
        req = make_request(list(range(80)))
        assert ask(req) is None
        for _ in range(6):
            conn.on_schedule_start()  # steps that do not consider it (the batch is full)
            time.sleep(0.1)
        assert ask(req) is None
        # Considered in consecutive steps, blocked all along: admitted without the pending
        # hits once it was blocked for the limit (a hung tier delays, never starves).
        start, n = time.monotonic(), None
        while n is None and time.monotonic() - start < 30:
            time.sleep(0.02)
            n = ask(req)
        assert n == 0 and time.monotonic() - start >= conn.max_deferral_s * 0.9
        # Passed over after every blocked answer: bounded by the number of episodes.
        conn.max_deferral_s = 3600.0
        other = make_request(list(range(1000, 1080)))
        answers = []
        for _ in range(conn.max_deferral_episodes + 1):
            answers.append(ask(other))
            conn.on_schedule_start()
        assert answers == [None] * conn.max_deferral_episodes + [0]
    finally:
        tier.release.set()
        manager.shutdown()
