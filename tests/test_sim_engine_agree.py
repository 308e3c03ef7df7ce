"""The simulator schedules as the engine does: one policy, two hosts.

`pagedkv.core.scheduling.SchedulingPolicy` decides every batch of both the engine's `Scheduler`
and the simulator's `Replica`; these tests fail if the two drift apart: a host overriding a
decision, or a hook of one host changing what the policy sees (its external tokens, what a
preemption or a stop leaves in the queues and the pool). The same request trace runs step by
step through the engine's scheduler (a fake runner: one token per sampling row) and through a
replica (decode runs off, so one call is one step); every step's batch, queues, preemptions,
free blocks and prefix-cache counters must be equal. The configurations force chunked prefill,
``max_num_seqs`` limits, preemption and a sequence outgrowing the whole cache. Torch-free.
"""

from __future__ import annotations

import random

import pytest

from pagedkv.core.hashing import get_hash_fn_by_name
from pagedkv.core.request import get_request_block_hasher
from pagedkv.core.scheduling import SchedulingPolicy
from pagedkv.core.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.engine.request import Request
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.scheduler_output import ModelRunnerOutput
from pagedkv.sim.cost import GPU_TABLE
from pagedkv.sim.hashes import PrefixHasher
from pagedkv.sim.replica import Replica, ReplicaConfig, make_sim_request
from pagedkv.sim.trace import TraceRequest

BS = 16
DECISIONS = ("build_batch", "_schedule_running", "_schedule_waiting", "_admit")


def test_neither_host_overrides_a_decision() -> None:
    for host in (Scheduler, Replica):
        assert issubclass(host, SchedulingPolicy)
        for name in DECISIONS:
            assert getattr(host, name) is getattr(SchedulingPolicy, name), f"{host.__name__}.{name}"


def _trace(seed: int, n: int, max_prompt: int, max_output: int) -> list[tuple[int, TraceRequest]]:
    """(arrival step, request): prompts share one of three system prompts, then a unique part."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        system = rng.randrange(3)
        sys_len = rng.choice((0, 16, 40, 48))
        tail = rng.randrange(1, max_prompt - sys_len)
        segments = ([(system, sys_len)] if sys_len else []) + [(1000 + i, tail)]
        req = TraceRequest(f"r{i}", 0.0, rng.randrange(1, max_output), segments=segments)
        out.append((rng.randrange(40), req))
    out.sort(key=lambda x: x[0])
    return out


def _engine_request(tr: TraceRequest) -> Request:
    p = SamplingParams(max_tokens=tr.output_len, ignore_eos=True)
    return Request(
        request_id=tr.request_id,
        prompt_token_ids=tr.token_ids(),
        sampling_params=p,
        block_hasher=get_request_block_hasher(BS, get_hash_fn_by_name("sha256_cbor")),
        parent_id=tr.request_id,
        max_tokens=tr.output_len,
    )


def _output_token(req: Request) -> int:
    """A token no other request and no prompt produces (the simulator's output blocks get hashes
    nothing else matches)."""
    return 1_000_000 + int(req.request_id[1:]) * 10_000 + req.num_output_tokens


# (num_blocks, max_num_seqs, max_num_batched_tokens, max_model_len, max_prompt, max_output)
CONFIGS = {
    "preemption": (24, 8, 64, 256, 100, 60),
    "max-num-seqs": (64, 3, 32, 256, 100, 30),
    "outgrows-the-cache": (8, 4, 48, 512, 90, 80),
    "roomy": (200, 16, 128, 512, 120, 40),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_engine_scheduler_and_sim_replica_take_the_same_decisions(config: str, seed: int) -> None:
    num_blocks, seqs, budget, max_len, max_prompt, max_output = CONFIGS[config]
    trace = _trace(seed, 40, max_prompt, max_output)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype="float16")
    kv_config = KVCacheConfig(num_blocks, [KVCacheGroupSpec(["l"], spec)], 1)
    sched = Scheduler(kv_config, seqs, budget, max_len)
    rep = Replica(
        "r0",
        ReplicaConfig(
            num_blocks=num_blocks,
            block_size=BS,
            max_num_seqs=seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_len,
            decode_runs=False,
        ),
        GPU_TABLE["h100-llama3-8b"],
    )
    hasher = PrefixHasher(BS, "real")
    eng_pool, sim_pool = sched.kv_cache_manager, rep.mgr
    i = step = 0
    finished_engine: list[str] = []
    while i < len(trace) or sched.has_unfinished_requests() or rep.waiting or rep.running:
        while i < len(trace) and trace[i][0] <= step:
            tr = trace[i][1]
            sched.add_request(_engine_request(tr))
            rep.add(make_sim_request(tr, hasher.hashes(tr), [], external=False))
            i += 1
        so = sched.schedule()
        end = rep.schedule(float(step))
        where = f"{config} seed {seed} step {step}"
        sim_batch = [(c.request.trace.request_id, c.start, c.n) for c in rep.batch]
        assert [(s.request.request_id, s.start, s.num_tokens) for s in so.scheduled] == (
            sim_batch if end is not None else []
        ), where
        assert sched.num_preemptions == rep.stats.preemptions, where
        for engine_q, sim_q in ((sched.running, rep.running), (sched.waiting, rep.waiting)):
            assert [r.request_id for r in engine_q] == [r.trace.request_id for r in sim_q], where
        assert (
            eng_pool.block_pool.get_num_free_blocks() == sim_pool.block_pool.get_num_free_blocks()
        ), where
        e_stats, s_stats = eng_pool.total_prefix_cache_stats, sim_pool.total_prefix_cache_stats
        assert (e_stats.queries, e_stats.hits) == (s_stats.queries, s_stats.hits), where
        rows = [s.request for s in so.scheduled if s.samples]
        runner = ModelRunnerOutput([r.request_id for r in rows], [_output_token(r) for r in rows])
        outs = sched.update_from_output(so, runner)
        finished_engine += [o.request_id for o in outs.outputs if o.finish_reason is not None]
        if end is not None:
            rep.finish_step(end)
        assert sorted(finished_engine) == sorted(r.trace.request_id for r in rep.finished), where
        step += 1
        assert step < 10_000
    assert len(finished_engine) == len(trace)
    if config == "preemption":
        assert rep.stats.preemptions > 0
    if config == "outgrows-the-cache":
        assert rep.stats.length_capped > 0
