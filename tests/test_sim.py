"""`pagedkv simulate`: the simulator's replicas are the real KV cache manager; these tests check
that its numbers are the manager's numbers (exact replay), that routing, preemption, the CPU tier
and decode runs behave, and the report/CLI shapes. Small sizes, no torch."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from pagedkv.core.hashing import get_hash_fn_by_name
from pagedkv.core.kv_cache_manager import KVCacheManager
from pagedkv.core.request import KVCacheRequest, get_request_block_hasher
from pagedkv.core.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.sim.cost import GPU_TABLE, CostModel
from pagedkv.sim.fleet import Fleet, FleetConfig, simulate
from pagedkv.sim.hashes import PrefixHasher
from pagedkv.sim.replica import ReplicaConfig
from pagedkv.sim.trace import (
    TraceRequest,
    gen_agentic,
    gen_chat,
    gen_system_prompt,
    read_trace,
    write_trace,
)

COST = GPU_TABLE["h100-llama3-8b"]


def _sequential(trace: list[TraceRequest], gap: float = 1000.0) -> list[TraceRequest]:
    """The same requests, each arriving after the previous one surely finished."""
    for i, r in enumerate(trace):
        r.arrival = i * gap
    return trace


def _direct_replay(
    trace: list[TraceRequest], num_blocks: int, block_size: int = 16
) -> tuple[int, int]:
    """(query tokens, hit tokens) of a plain KVCacheManager serving ``trace`` one request at a
    time: prefix lookup, allocate the prompt, then one slot per output token (distinct output
    tokens per request), free. What the simulator must reproduce exactly."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float16")
    mgr = KVCacheManager(KVCacheConfig(num_blocks, [KVCacheGroupSpec(["l"], spec)], 1), 1 << 20)
    hasher = get_request_block_hasher(block_size, get_hash_fn_by_name("sha256_cbor"))
    for i, tr in enumerate(trace):
        req = KVCacheRequest(tr.request_id, tr.token_ids(), block_hasher=hasher)
        hits, n_hit = mgr.get_computed_blocks(req)
        assert mgr.allocate_slots(req, req.num_tokens - n_hit, n_hit, hits) is not None
        req.num_computed_tokens = req.num_tokens
        for j in range(tr.output_len - 1):  # the last sampled token is never computed
            req.append_output_token_ids(-(i * 10_000 + j) - 1)  # ids no prompt uses
            assert mgr.allocate_slots(req, 1) is not None
            req.num_computed_tokens += 1
        mgr.free(req)
    st = mgr.total_prefix_cache_stats
    return st.queries, st.hits


@pytest.mark.parametrize("num_blocks", [40, 400])
def test_sim_prefix_hits_equal_direct_kv_cache_manager_replay(num_blocks: int) -> None:
    trace = _sequential(
        gen_chat(
            30,
            1.0,
            seed=3,
            num_system_prompts=2,
            system_len=100,
            turns=3,
            user_len=20,
            output_len=20,
        )
    )
    queries, hits = _direct_replay(trace, num_blocks)
    rep = simulate(
        trace,
        FleetConfig(
            replicas=1,
            replica=ReplicaConfig(num_blocks=num_blocks),
            policy="round-robin",
            hash_mode="real",
            reply_hashes=False,
        ),
        COST,
    )
    assert rep["hit_rate"]["queries_tokens"] == queries
    assert rep["hit_rate"]["device_hit_tokens"] == hits
    assert hits > 0  # the trace shares prefixes


def test_fast_and_real_hashes_give_the_same_hits() -> None:
    trace = gen_chat(
        120, 20.0, seed=1, num_system_prompts=3, system_len=64, user_len=24, output_len=12
    )
    reps = [
        simulate(
            trace,
            FleetConfig(
                replicas=2, replica=ReplicaConfig(num_blocks=120), policy="kv", hash_mode=m
            ),
            COST,
        )
        for m in ("fast", "real")
    ]
    assert reps[0]["hit_rate"]["device_hit_tokens"] == reps[1]["hit_rate"]["device_hit_tokens"]
    assert reps[0]["latency_s"] == reps[1]["latency_s"]


def test_real_hashes_are_the_engines_and_the_routers() -> None:
    from pagedkv.router.hashing import prompt_block_hashes, to_external

    tr = gen_chat(3, 1.0, seed=2)[2]
    ours = PrefixHasher(16, "real").hashes(tr)
    assert [to_external(h) for h in ours] == prompt_block_hashes(
        tr.token_ids(), 16, "sha256_cbor", None
    )


def _modal_share(fleet: Fleet) -> float:
    """Mean over system prompts of the share of their requests on their most used replica."""
    by_system: dict[int, list[int]] = {}
    for rep in fleet.replicas:
        for r in rep.finished:
            by_system.setdefault(r.trace.segments[0][0], []).append(r.replica)
    return sum(max(v.count(x) for x in set(v)) / len(v) for v in by_system.values()) / len(
        by_system
    )


def test_kv_routing_concentrates_shared_prefixes() -> None:
    """12 system prompts of 32 blocks, 4 replicas of 159 usable blocks: round-robin makes every
    replica cache every prompt (and evict them); kv routing (fed by the replicas' KV events)
    sends a prompt back where it is cached."""
    trace = gen_system_prompt(
        400,
        5.0,
        seed=0,
        num_system_prompts=12,
        system_len=512,
        user_len=32,
        output_len=16,
        zipf_s=0.5,
    )
    cfg = dict(replicas=4, replica=ReplicaConfig(num_blocks=160))
    kv, rr = (
        Fleet(FleetConfig(policy="kv", **cfg), COST),
        Fleet(FleetConfig(policy="round-robin", **cfg), COST),
    )
    kv_rep, rr_rep = kv.run(trace), rr.run(trace)
    assert kv_rep["hit_rate"]["device"] > rr_rep["hit_rate"]["device"] + 0.2
    assert _modal_share(kv) > _modal_share(rr) + 0.15
    assert kv_rep["routing"].get("kv_hit", 0) > 300
    assert kv_rep["hit_rate"]["router_predicted"] > 0.5  # the index saw the replicas' blocks
    assert len(kv.index) > 0


def test_preemption_when_blocks_are_scarce_and_all_finish() -> None:
    trace = gen_system_prompt(
        40, 1000.0, seed=0, num_system_prompts=40, system_len=200, user_len=20, output_len=300
    )
    fleet = Fleet(
        FleetConfig(replicas=1, replica=ReplicaConfig(num_blocks=120), policy="round-robin"), COST
    )
    rep = fleet.run(trace)
    assert rep["preemptions"] > 0
    assert rep["requests"]["finished"] == 40
    assert rep["hit_rate"]["preempted_recompute_queries"] > 0
    mgr = fleet.replicas[0].mgr
    mgr.check_invariants()
    assert mgr.num_free_blocks == 119  # everything freed


def test_decode_runs_change_nothing() -> None:
    """Round-robin: routing cannot see the (one step later) registration of a block filled by
    a run's last step, so the two must agree exactly; with kv routing they agree closely."""
    cost = CostModel("flat", 0.004, 5e-5, 4e-5, 0.0, block_bytes=1 << 17)  # no context term: exact
    trace = gen_chat(200, 30.0, seed=4, system_len=128, user_len=40, output_len=50)
    reps = [
        simulate(
            trace,
            FleetConfig(
                replicas=3,
                replica=ReplicaConfig(num_blocks=300, decode_runs=runs),
                policy="round-robin",
            ),
            cost,
        )
        for runs in (True, False)
    ]
    fast, slow = reps
    assert fast["perf"]["decode_runs"] > 0 and slow["perf"]["decode_runs"] == 0
    assert fast["perf"]["events"] < slow["perf"]["events"]
    assert fast["hit_rate"] == slow["hit_rate"]
    assert fast["preemptions"] == slow["preemptions"]
    assert fast["perf"]["engine_steps"] == slow["perf"]["engine_steps"]
    for name in ("ttft", "e2e"):
        for k, v in fast["latency_s"][name].items():
            assert v == pytest.approx(slow["latency_s"][name][k], rel=1e-9, abs=1e-12)
    kv = [
        simulate(
            trace,
            FleetConfig(
                replicas=3, replica=ReplicaConfig(num_blocks=300, decode_runs=runs), policy="kv"
            ),
            cost,
        )
        for runs in (True, False)
    ]
    assert kv[0]["hit_rate"]["device"] == pytest.approx(kv[1]["hit_rate"]["device"], abs=0.005)


def test_cpu_tier_serves_what_the_device_evicted() -> None:
    trace = gen_agentic(
        200,
        10.0,
        seed=0,
        num_system_prompts=4,
        system_len=256,
        task_len=64,
        tool_len=64,
        steps=5,
        output_len=16,
    )
    base = dict(replicas=2, policy="kv")
    no_tier = simulate(trace, FleetConfig(replica=ReplicaConfig(num_blocks=80), **base), COST)
    tier = simulate(
        trace, FleetConfig(replica=ReplicaConfig(num_blocks=80, cpu_tier_blocks=4000), **base), COST
    )
    assert no_tier["hit_rate"]["cpu_tier"] == 0
    assert tier["hit_rate"]["cpu_tier"] > 0.05
    assert tier["hit_rate"]["total"] > no_tier["hit_rate"]["total"]
    assert tier["memory"]["cpu_tier"]["loaded_blocks"] > 0
    assert tier["memory"]["cpu_tier"]["peak_stored_blocks_max"] <= 4000


def test_pd_split_prefills_on_prefill_replicas_and_decodes_on_decode_replicas() -> None:
    trace = gen_chat(150, 20.0, seed=5, system_len=256, user_len=32, output_len=24)
    fleet = Fleet(
        FleetConfig(replicas=4, pd_prefill=2, replica=ReplicaConfig(num_blocks=400)), COST
    )
    rep = fleet.run(trace)
    assert rep["requests"]["finished"] == 150
    assert [len(r.finished) for r in fleet.replicas[:2]] == [
        0,
        0,
    ]  # handed over, none finished there
    assert all(len(r.finished) > 0 for r in fleet.replicas[2:])
    assert rep["pd"]["transferred_blocks"] == sum(-(-t.prompt_len // 16) for t in trace)
    assert rep["hit_rate"]["device"] > 0.3  # prefill replicas' prefix cache
    for r in fleet.replicas:
        assert r.mgr.num_free_blocks == 399 and not r.running and not r.waiting
    # Decode replicas hit their own cache or load the rest of the prompt's KV (external):
    # every prompt token, none recomputed.
    d_stats = [r.mgr.total_prefix_cache_stats for r in fleet.replicas[2:]]
    assert sum(s.hits + s.external_hits for s in d_stats) == sum(t.prompt_len for t in trace)
    assert sum(s.external_hits for s in d_stats) > 0
    for r in [x for rep_ in fleet.replicas[2:] for x in rep_.finished]:
        assert r.num_output == r.output_len and r.first_token < r.finish


def test_shared_host_cores_slow_concurrent_steps() -> None:
    trace = gen_chat(90, 30.0, seed=6, system_len=128, user_len=32, output_len=16)
    base = dict(replicas=3, policy="round-robin", replica=ReplicaConfig(num_blocks=300))
    alone = simulate(trace, FleetConfig(**base), COST)
    shared = simulate(trace, FleetConfig(host_cores=1, **base), COST)
    assert shared["latency_s"]["e2e"]["mean"] > 1.2 * alone["latency_s"]["e2e"]["mean"]
    assert shared["hit_rate"]["device"] == pytest.approx(alone["hit_rate"]["device"], abs=0.05)


def test_a_tp_replica_is_one_replica_using_its_ranks_cores() -> None:
    """Two TP=2 replicas are two replicas (one router target each) that each occupy two of
    the host's cores while they step: on 2 shared cores they run as two TP=1 replicas on 1,
    slower than two TP=1 replicas on 2."""
    trace = gen_chat(90, 30.0, seed=6, system_len=128, user_len=32, output_len=16)
    base = dict(replicas=2, policy="round-robin")
    tp2 = simulate(
        trace,
        FleetConfig(
            host_cores=2, replica=ReplicaConfig(num_blocks=300, tensor_parallel_size=2), **base
        ),
        COST,
    )
    tp1 = simulate(
        trace, FleetConfig(host_cores=1, replica=ReplicaConfig(num_blocks=300), **base), COST
    )
    roomy = simulate(
        trace, FleetConfig(host_cores=2, replica=ReplicaConfig(num_blocks=300), **base), COST
    )
    assert tp2["fleet"]["replicas"] == 2
    assert tp2["latency_s"]["e2e"]["mean"] == pytest.approx(tp1["latency_s"]["e2e"]["mean"])
    assert tp2["latency_s"]["e2e"]["mean"] > roomy["latency_s"]["e2e"]["mean"]


def test_report_fields_and_json(tmp_path) -> None:
    trace = gen_chat(60, 10.0, seed=0)
    rep = simulate(trace, FleetConfig(replicas=2, replica=ReplicaConfig(num_blocks=500)), COST)
    json.dumps(rep)
    assert set(rep) >= {
        "requests",
        "fleet",
        "hit_rate",
        "latency_s",
        "throughput",
        "preemptions",
        "memory",
        "perf",
    }
    assert set(rep["hit_rate"]) >= {"device", "cpu_tier", "total"}
    for name in ("ttft", "itl", "e2e"):
        s = rep["latency_s"][name]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"]
    assert rep["requests"]["finished"] == 60
    assert rep["throughput"]["output_tokens_per_s"] > 0
    assert rep["perf"]["events"] >= 60


def test_trace_jsonl_roundtrip(tmp_path) -> None:
    trace = gen_chat(20, 5.0, seed=7)
    trace.append(TraceRequest("explicit", 99.0, 4, prompt_token_ids=[5, 6, 7] * 20))
    path = tmp_path / "t.jsonl"
    assert write_trace(path, trace) == 21
    back = read_trace(path)
    assert [(r.request_id, r.prompt_len, r.token_ids()) for r in back] == [
        (r.request_id, r.prompt_len, r.token_ids()) for r in sorted(trace, key=lambda r: r.arrival)
    ]


def _cli(argv: list[str]) -> int:
    from pagedkv.sim import cli

    p = argparse.ArgumentParser()
    cli.add_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(argv)
    return args.func(args)


@pytest.mark.slow
def test_cli_generate_run_and_sweep(tmp_path, capsys) -> None:
    trace = tmp_path / "chat.jsonl"
    assert (
        _cli(
            [
                "simulate",
                "generate",
                "--generator",
                "chat",
                "--num-requests",
                "80",
                "--rate",
                "20",
                "--out",
                str(trace),
            ]
        )
        == 0
    )
    out = tmp_path / "run.json"
    assert (
        _cli(
            [
                "simulate",
                "run",
                "--trace",
                str(trace),
                "--replicas",
                "2",
                "--num-blocks",
                "300",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads(out.read_text())["requests"]["finished"] == 80
    assert "hit rate" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    prefix = tmp_path / "sweep"
    assert (
        _cli(
            [
                "simulate",
                "sweep",
                "--trace",
                str(trace),
                "--replicas",
                "2",
                "--sweep",
                "num-blocks=100,400",
                "--policies",
                "kv,round-robin",
                "--out",
                str(prefix),
            ]
        )
        == 0
    )
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert len(data["points"]) == 4
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sim_does_not_import_torch() -> None:
    import subprocess

    code = (
        "import sys; from pagedkv.sim import cli, fleet, replica, trace, cost, report, hashes; "
        "from pagedkv.sim.fleet import simulate; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
