"""Tensor and decode context parallelism on real worker processes (gloo on CPU), against the
one-process engine.

TP and DCP change summation order, so outputs are compared as vLLM compares them: every
position's logprob within 1e-4 of TP=1 in float32, greedy tokens identical except at a near-tie
(the reference's top-2 gap under 1e-4: the comparison stops there and the tie is reported).
Every process a test starts is stopped by pid, also on failure (the engine's executor does it;
the tests check that none is left).
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedkv.engine.executor import WorkerDiedError
from pagedkv.engine.llm import LLM
from pagedkv.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # multi-process engines: each start loads the model per rank

TOL = 1e-4
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
]
SMALL = dict(kv_cache_memory=64 << 20, max_model_len=1024)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purposes only once reaped; /proc says which
    try:
        return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0
    except FileNotFoundError:
        return False


def assert_close(ref: list[Any], out: list[Any], ties: list[str] | None = None) -> None:
    """Per sample: logprobs within TOL, tokens equal up to a reported near-tie."""
    for r, o in zip(ref, out, strict=True):
        for a, b in zip(r.outputs, o.outputs, strict=True):
            for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
                ref_lp, out_lp = a.logprobs[i], b.logprobs[i]
                if ta != tb:
                    gap = abs(ref_lp[ta].logprob - ref_lp[tb].logprob) if tb in ref_lp else 1.0
                    assert gap < TOL, f"{r.request_id}: token {i} differs ({ta} vs {tb}), gap {gap}"
                    if ties is not None:
                        ties.append(f"{r.request_id}@{i}: gap {gap:.2e}")
                    break
                assert abs(ref_lp[ta].logprob - out_lp[ta].logprob) < TOL, (r.request_id, i)
            else:
                assert len(a.token_ids) == len(b.token_ids)


GREEDY = SamplingParams(max_tokens=16, temperature=0, logprobs=2)


@pytest.fixture(scope="module")
def reference() -> list[Any]:
    llm = LLM(**SMALL)
    try:
        return llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("tp", [2, 3])
def test_tp_matches_one_process(tp: int, reference: list[Any]) -> None:
    """TP=2 (SmolLM2's 3 KV heads split 2 + 1) and TP=3 (one each) give TP=1's logprobs; each
    rank holds only its heads' KV cache, so the same memory holds more blocks."""
    llm = LLM(tensor_parallel_size=tp, **SMALL)
    engine = llm.llm_engine
    pids = engine.executor.worker_pids
    try:
        assert len(pids) == tp - 1 and all(_pid_alive(p) for p in pids)
        ties: list[str] = []
        assert_close(reference, llm.generate(PROMPTS, GREEDY, use_tqdm=False), ties)
        print("near-ties:", ties)
        # rank 0 holds ceil(3 / tp) of the 3 KV heads: 3 / 2 the blocks at TP=2, 3x at TP=3
        one = LLM(**SMALL).llm_engine
        ratio = 3 / -(-3 // tp)
        assert engine.kv_cache_config.num_blocks == int(one.kv_cache_config.num_blocks * ratio)
        one.shutdown()
        # GGUF rows stay quantized under TP: column splits of ggml rows, row splits at blocks
        attn = engine.model.model.layers[0].self_attn
        assert attn.qkv_proj.qsegments and attn.o_proj.qsegments
        assert (attn.num_heads, attn.num_kv_heads) == ((6, 2) if tp == 2 else (3, 1))
    finally:
        engine.shutdown()
    assert not any(_pid_alive(p) for p in pids)


def test_tp_scheduling_paths_match_one_process() -> None:
    """Chunked prefill, prefix hits, preemption and n > 1 under TP=2 give TP=1's outputs."""
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 6
    prompts = [shared + q for q in ("What is 2+2?", "Name a color.", "Say hi.", "Count to 3.")]
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=2, n=2)
    kw = dict(num_kv_blocks=12, max_model_len=160, max_num_batched_tokens=48, max_num_seqs=8)
    outs, stats = [], []
    for tp in (1, 2):
        llm = LLM(tensor_parallel_size=tp, **kw)
        try:
            outs.append(llm.generate(prompts, params, use_tqdm=False))
            stats.append(llm.stats())
        finally:
            llm.llm_engine.shutdown()
    assert_close(outs[0], outs[1])
    for s in stats:
        assert s["num_preemptions"] > 0 and s["prefix_cache_hits"] > 0


def test_a_killed_worker_fails_the_engine_and_stops_every_process() -> None:
    from pagedkv.distributed.parallel_state import get_open_port

    # an explicit rendezvous, as two machines would use (two processes stand in for them)
    url = f"tcp://127.0.0.1:{get_open_port()}"
    llm = LLM(tensor_parallel_size=2, distributed_init_method=url, **SMALL)
    engine = llm.llm_engine
    (pid,) = engine.executor.worker_pids
    try:
        engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=200, temperature=0))
        engine.step()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(
            WorkerDiedError, match=rf"rank 1 \(pid {pid}\) died \(killed by signal 9\)"
        ):
            for _ in range(50):
                engine.step()
        with pytest.raises(WorkerDiedError):  # and stays failed, with nothing left running
            engine.step()
        assert not _pid_alive(pid)
    finally:
        engine.shutdown()


def test_dropping_the_engine_stops_its_workers() -> None:
    llm = LLM(tensor_parallel_size=2, **SMALL)
    pids = llm.llm_engine.executor.worker_pids
    threads_before = torch.get_num_threads()
    del llm
    gc.collect()
    assert not any(_pid_alive(p) for p in pids)
    assert torch.get_num_threads() >= 1 and threads_before >= 1


def test_bad_parallel_sizes_are_refused_before_any_process_starts() -> None:
    with pytest.raises(ValueError, match="not a multiple of them"):
        LLM(tensor_parallel_size=4, **SMALL)  # 3 KV heads: 4 ranks cannot replicate them
    with pytest.raises(ValueError, match="copies of the same KV heads"):
        LLM(tensor_parallel_size=3, decode_context_parallel_size=3, **SMALL)
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        LLM(tensor_parallel_size=2, distributed_executor_backend="uni", **SMALL)
    with pytest.raises(ValueError, match="kv_connector='MyConnector' is not supported"):
        LLM(
            tensor_parallel_size=2,
            kv_transfer_config={
                "kv_connector": "MyConnector",
                "kv_role": "kv_both",
                "kv_connector_module_path": "my_connectors",
            },
            **SMALL,
        )
    with pytest.raises(ValueError, match="p2p tier in kv_offload"):
        LLM(tensor_parallel_size=2, kv_offload="cpu:64MiB,p2p:127.0.0.1:9", **SMALL)
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        LLM(tensor_parallel_size=2, distributed_init_method="127.0.0.1:1234", **SMALL)


# ---- offload tiers under TP: one shared host buffer, one tier namespace per distinct shard ----

LONG = [PROMPTS[0] * 10, PROMPTS[1] * 9]  # several full blocks each
FRESH = PROMPTS[2] * 8
SHORT_GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=2)


def _namespaces(root: Path) -> list[str]:
    return sorted(p.name.split("@", 1)[1] if "@" in p.name else "" for p in root.iterdir())


def test_offload_tiers_round_trip_under_tp(tmp_path: Path) -> None:
    """TP=2 (SmolLM2's 3 KV heads: 2 + 1): every rank stores its part and loads it back, from
    the CPU tier (in-step stores, and REQUEST_LEVEL stores made between steps) and from disk
    in a new engine; each rank's files sit in its own namespace, and a TP=1 engine on the
    same directory finds nothing (another fingerprint) and still answers right."""
    ref_llm = LLM(**SMALL)
    ref = ref_llm.generate([*LONG, FRESH], SHORT_GREEDY, use_tqdm=False)
    ref_llm.llm_engine.shutdown()
    spec = f"cpu:64MiB,disk:{tmp_path}:256MiB"
    llm = LLM(tensor_parallel_size=2, kv_offload=spec, **SMALL)
    conn = llm.llm_engine.connector
    try:
        assert_close(ref[:2], llm.generate(LONG, SHORT_GREEDY, use_tqdm=False))
        assert conn.num_stored_blocks > 0 and conn.num_loaded_tokens == 0
        llm.reset_prefix_cache()  # the device cache forgets: the CPU tier answers
        assert_close(ref[:2], llm.generate(LONG, SHORT_GREEDY, use_tqdm=False))
        assert conn.num_loaded_tokens > 0
        # stores made when a request finishes, between steps: rank 1 copies them next step
        # (a prompt never stored before, so only those stores can answer the load)
        at_finish = SamplingParams(
            max_tokens=2, temperature=0, kv_transfer_params={"offload_policy": "REQUEST_LEVEL"}
        )
        stored = conn.num_stored_blocks
        llm.generate([FRESH], at_finish, use_tqdm=False)
        llm.reset_prefix_cache()
        loaded = conn.num_loaded_tokens
        assert_close(ref[2:], llm.generate([FRESH], SHORT_GREEDY, use_tqdm=False))
        assert conn.num_stored_blocks > stored  # completed once rank 1 copied them
        assert conn.num_loaded_tokens > loaded
    finally:
        llm.llm_engine.shutdown()
    assert _namespaces(tmp_path) == ["tp_rank:0@dcp0", "tp_rank:1@dcp0"]
    again = LLM(tensor_parallel_size=2, kv_offload=spec, **SMALL)
    try:
        assert_close(ref[:2], again.generate(LONG, SHORT_GREEDY, use_tqdm=False))
        assert again.llm_engine.connector.num_loaded_tokens > 0  # from disk
    finally:
        again.llm_engine.shutdown()
    one = LLM(kv_offload=spec, **SMALL)
    try:
        assert_close(ref[:2], one.generate(LONG, SHORT_GREEDY, use_tqdm=False))
        assert one.llm_engine.connector.num_loaded_tokens == 0  # TP=2's parts: a miss
    finally:
        one.llm_engine.shutdown()


# ---- PD under TP: the driver's agent moves every rank's blocks (CPU, one host) --------------


def _pd_engine(role: str, tp: int, backend: str) -> LLM:
    from redis_server import free_port

    extra = {"side_channel_port": free_port(), "backend": backend, "handshake_timeout_s": 2.0}
    cfg = {"kv_connector": "NixlConnector", "kv_role": role, "kv_connector_extra_config": extra}
    return LLM(kv_transfer_config=cfg, tensor_parallel_size=tp, **SMALL)


def _pd_backends() -> list[str]:
    from pagedkv.transfer import nixl_import_error

    return ["tcp"] if nixl_import_error() else ["nixl", "tcp"]


@pytest.mark.parametrize("backend", _pd_backends())
def test_pd_transfer_between_tp2_engines_and_refused_across_tp_sizes(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A TP=2 producer hands a TP=2 consumer the KV of both ranks (each rank's blocks land in
    the same rank's cache: the consumer decodes from them); a TP=1 consumer refuses a TP=2
    producer (and a TP=2 consumer a TP=1 one) at the handshake, naming ``tp_size``, and
    recomputes (same tokens)."""
    ref_llm = LLM(**SMALL)
    ref = ref_llm.generate(LONG, SHORT_GREEDY, use_tqdm=False)
    ref_llm.llm_engine.shutdown()
    hand_off = SamplingParams(
        temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    for producer_tp, consumer_tp in ((2, 2), (2, 1), (1, 2)):
        p = _pd_engine("kv_producer", producer_tp, backend)
        d = _pd_engine("kv_consumer", consumer_tp, backend)
        try:
            params = [o.kv_transfer_params for o in p.generate(LONG, hand_off, use_tqdm=False)]
            decode = [
                SamplingParams(temperature=0, max_tokens=8, logprobs=2, kv_transfer_params=x)
                for x in params
            ]
            outs = d.generate(LONG, decode, use_tqdm=False)
            assert_close(ref, outs)
            conn = d.llm_engine.connector
            if producer_tp == consumer_tp:
                assert conn.num_transfers == len(LONG) and conn.num_failed_transfers == 0
                assert all(o.num_cached_tokens > 0 for o in outs)  # decoded from the transfer
            else:
                assert conn.num_transfers == 0 and conn.num_failed_transfers == len(LONG)
                why = f"tp_size differs (local {consumer_tp}, remote {producer_tp})"
                assert why in caplog.text
        finally:
            p.llm_engine.shutdown()
            d.llm_engine.shutdown()


def _plan(argv: list[str]) -> dict[str, Any]:
    from pagedkv.entrypoints.cli import plan

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    plan.add_parser(sub)
    return plan.make_plan(parser.parse_args(["plan", *argv]))


def test_plan_prints_what_each_rank_allocates() -> None:
    p = _plan(["-tp", "2", "--memory", "64MiB", "--context", "1024"])
    llm = LLM(tensor_parallel_size=2, **SMALL)
    try:
        engine = llm.llm_engine
        assert p["selected"]["num_blocks"] == engine.kv_cache_config.num_blocks
        assert [r["kv_cache_bytes"] for r in p["parallel"]["ranks"]] == (
            engine.executor.kv_cache_bytes()
        )
    finally:
        llm.llm_engine.shutdown()


# ---- decode context parallelism on a tiny MQA model (TP replicates its one KV head) ----------


@pytest.fixture(scope="module")
def mqa_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=128,
        vocab_size=256,
        num_hidden_layers=2,
        max_position_embeddings=512,
    )
    path = tmp_path_factory.mktemp("tiny_mqa")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


MQA = dict(block_size=4, max_model_len=256, max_num_batched_tokens=32)


def _mqa_prompts() -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(1)
    return [
        {"prompt_token_ids": torch.randint(0, 256, (n,), generator=g).tolist()} for n in (5, 37, 70)
    ]


def _mqa_reference(mqa_dir: Path, params: SamplingParams) -> list[Any]:
    """The one-process engine's outputs for `_mqa_prompts`."""
    llm = LLM(str(mqa_dir), num_kv_blocks=200, **MQA)
    try:
        return llm.generate(_mqa_prompts(), params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(("tp", "dcp", "interleave"), [(2, 1, 1), (2, 2, 1), (4, 2, 2)])
def test_dcp_matches_one_process(mqa_dir: Path, tp: int, dcp: int, interleave: int) -> None:
    params = SamplingParams(max_tokens=30, temperature=0, logprobs=2, ignore_eos=True)
    ref = _mqa_reference(mqa_dir, params)
    llm = LLM(
        str(mqa_dir),
        num_kv_blocks=200,
        tensor_parallel_size=tp,
        decode_context_parallel_size=dcp,
        cp_kv_cache_interleave_size=interleave,
        **MQA,
    )
    try:
        assert llm.llm_engine.block_size == 4 * dcp  # the scheduler's virtual blocks
        assert_close(ref, llm.generate(_mqa_prompts(), params, use_tqdm=False))
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(
    ("tp", "dcp", "spaces"),
    [(2, 1, ["tp_rank:0@dcp0"]), (2, 2, ["tp_rank:0@dcp0", "tp_rank:1@dcp1"])],
)
def test_offload_stores_each_distinct_shard_once(
    mqa_dir: Path, tmp_path: Path, tp: int, dcp: int, spaces: list[str]
) -> None:
    """One KV head at TP=2: both ranks hold it, so one part is stored (rank 0 writes, rank 1
    reads); under DCP=2 the ranks hold different tokens of it: two parts. Loads restore it."""
    from pagedkv.core.events import BlockStored

    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
    ref = _mqa_reference(mqa_dir, params)
    llm = LLM(
        str(mqa_dir),
        num_kv_blocks=200,
        tensor_parallel_size=tp,
        decode_context_parallel_size=dcp,
        kv_offload=f"cpu:8MiB,disk:{tmp_path}:64MiB",
        enable_kv_cache_events=True,
        **MQA,
    )
    conn = llm.llm_engine.connector
    try:
        assert_close(ref, llm.generate(_mqa_prompts(), params, use_tqdm=False))
        assert len(conn._sharded.shards) == len(spaces)
        # events name the ranks whose share each medium holds: all of them on the device, the
        # writers of the distinct shards in the CPU tier
        # (a CPU engine's pool is medium CPU too: a tier's events carry no tokens)
        events = [e for e in llm.llm_engine.take_kv_events() if isinstance(e, BlockStored)]
        device = [e for e in events if e.token_ids]
        tier = [e for e in events if not e.token_ids]
        assert device and all(e.tp_ranks == list(range(tp)) for e in device)
        assert tier and all(e.tp_ranks == list(range(len(spaces))) for e in tier)
        llm.reset_prefix_cache()
        assert_close(ref, llm.generate(_mqa_prompts(), params, use_tqdm=False))
        assert conn.num_loaded_tokens > 0
    finally:
        llm.llm_engine.shutdown()
    assert _namespaces(tmp_path) == spaces


def test_dcp_doubles_what_the_same_memory_runs_at_once(mqa_dir: Path) -> None:
    """Same KV memory per rank (64 blocks of 4 tokens): four requests of 120 tokens all run at
    once under DCP=2 (virtual blocks of 8 tokens); one process runs two at a time."""
    g = torch.Generator().manual_seed(2)
    prompts = [
        {"prompt_token_ids": torch.randint(0, 256, (100,), generator=g).tolist()} for _ in range(4)
    ]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    seen = {}
    for tp, dcp in ((1, 1), (2, 2)):
        llm = LLM(
            str(mqa_dir),
            kv_cache_memory=64 * 1024,  # 2 layers x 4 tokens x 1 KV head x (16 + 16) x 4 B
            tensor_parallel_size=tp,
            decode_context_parallel_size=dcp,
            max_num_seqs=64,
            **{**MQA, "max_model_len": 240},
        )
        engine = llm.llm_engine
        try:
            assert engine.kv_cache_config.num_blocks == 64
            for i, p in enumerate(prompts):
                engine.add_request(str(i), p, params)
            peak = 0
            while engine.has_unfinished_requests():
                engine.step()
                peak = max(peak, engine.scheduler.num_running)
            seen[dcp] = (engine.num_usable_kv_tokens, peak, engine.scheduler.num_preemptions)
        finally:
            engine.shutdown()
    assert seen[1][0] * 2 == seen[2][0]
    assert seen[2][1:] == (4, 0), seen  # all four at once, never preempted
    assert seen[1][1] == 2, seen  # one process holds two of them at a time


# ---- the Ray backend, on a local `ray start --head` cluster bound to 127.0.0.1 -------------


@pytest.fixture(scope="module")
def ray_cluster() -> Any:
    ray = pytest.importorskip("ray")  # installed by `make test` (the project's ray extra)
    import shutil
    import subprocess

    from pagedkv.distributed.parallel_state import get_open_port

    exe = shutil.which("ray", path=str(Path(os.sys.executable).parent))
    port = get_open_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    start = [exe, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port)]
    start += ["--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats"]
    subprocess.run(start, check=True, env=env, capture_output=True, timeout=120)
    old = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    try:
        yield ray
    finally:
        ray.shutdown()
        subprocess.run([exe, "stop", "--force"], env=env, capture_output=True, timeout=120)
        if old is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = old


def test_ray_backend_matches_one_process(ray_cluster: Any, reference: list[Any]) -> None:
    llm = LLM(
        tensor_parallel_size=2, distributed_executor_backend="ray", kv_offload="cpu:64MiB", **SMALL
    )
    engine = llm.llm_engine
    pids = engine.executor.worker_pids
    try:
        assert len(pids) == 1 and all(_pid_alive(p) for p in pids)
        assert_close(reference, llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        one, two = engine.executor.kv_cache_bytes()
        assert one == 2 * two  # rank 0 holds 2 of the 3 KV heads, rank 1 one
        # the actor copies its part of the CPU tier too
        first = llm.generate(LONG, SHORT_GREEDY, use_tqdm=False)
        llm.reset_prefix_cache()
        assert_close(first, llm.generate(LONG, SHORT_GREEDY, use_tqdm=False))
        assert engine.connector.num_loaded_tokens > 0
    finally:
        engine.shutdown()
    assert not any(_pid_alive(p) for p in pids)


# ---- MLA (DeepSeek-V2/V3, with DeepSeekMoE): heads split, the latent cache replicated --------


@pytest.fixture(scope="module")
def mla_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from test_mla import build, v2_config, v3_config

    dirs = {}
    for name, cfg in (("v3", v3_config()), ("v2", v2_config())):
        path = tmp_path_factory.mktemp(f"tiny_deepseek_{name}")
        build(cfg).save_pretrained(path)
        dirs[name] = path
    return dirs


@pytest.mark.parametrize(
    ("model", "tp", "dcp"), [("v3", 2, 1), ("v3", 2, 2), ("v3", 4, 2), ("v2", 2, 2)]
)
def test_mla_tp_and_dcp_match_one_process(
    mla_dirs: dict[str, Path], model: str, tp: int, dcp: int
) -> None:
    """MLA splits query heads, kv_b_proj and o_proj (and each expert's rows) across ranks; the
    one latent "KV head" is replicated, so DCP splits its tokens (absorbed attention, merged by
    LSE). Routed experts, shared experts and the dense first layer are all-reduced."""
    g = torch.Generator().manual_seed(1)
    prompts = [
        {"prompt_token_ids": torch.randint(0, 128, (n,), generator=g).tolist()} for n in (5, 37, 70)
    ]
    params = SamplingParams(max_tokens=20, temperature=0, logprobs=2, ignore_eos=True)
    kw = dict(block_size=4, num_kv_blocks=200, max_model_len=200, max_num_batched_tokens=32)
    path = str(mla_dirs[model])
    ref_llm = LLM(path, **kw)
    ref = ref_llm.generate(prompts, params, use_tqdm=False)
    ref_llm.llm_engine.shutdown()
    llm = LLM(path, tensor_parallel_size=tp, decode_context_parallel_size=dcp, **kw)
    try:
        assert llm.llm_engine.model.model.layers[0].self_attn.num_heads == 4 // tp
        assert_close(ref, llm.generate(prompts, params, use_tqdm=False))
    finally:
        llm.llm_engine.shutdown()


# ---- serving and events at TP=2: one engine, one replica, one event stream ----------------------


def test_openai_server_at_tp2_answers_like_tp1(reference: list[Any]) -> None:
    from server_utils import client, running_server

    from pagedkv.engine.config import EngineConfig

    config = EngineConfig(tensor_parallel_size=2, enable_kv_cache_events=True, **SMALL)
    with running_server(config) as srv, client(srv) as c:
        engine = srv.app.state.pagedkv.async_llm.engine
        pids = engine.executor.worker_pids
        r = c.post(
            "/v1/completions",
            json={"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference[0].outputs[0].text
        assert c.get("/health").status_code == 200
    assert not any(_pid_alive(p) for p in pids)  # the server's shutdown stopped the workers


def test_kv_events_come_from_the_one_scheduler() -> None:
    import msgspec

    from pagedkv.core.events import BlockStored, KVEventBatch

    llm = LLM(tensor_parallel_size=2, enable_kv_cache_events=True, **SMALL)
    try:
        llm.generate(PROMPTS[1] * 8, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        stored = [e for e in llm.llm_engine.take_kv_events() if isinstance(e, BlockStored)]
        # the block pool lives in the driver's scheduler: each full block is announced once,
        # whatever the number of ranks holding its heads, naming them
        hashes = [h for e in stored for h in e.block_hashes]
        assert hashes and len(hashes) == len(set(hashes))
        assert all(e.tp_ranks == [0, 1] for e in stored)
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(KVEventBatch(0.0, stored)))
        assert all(e["tp_ranks"] == [0, 1] for e in wire[1])
    finally:
        llm.llm_engine.shutdown()


# ---- a Mamba hybrid (Bamba): mixers split by SSM heads and B/C groups ------------------------


@pytest.fixture(scope="module")
def bamba_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    from test_bamba import tiny_config
    from transformers import BambaForCausalLM

    dirs = {}
    for groups in (1, 4):
        torch.manual_seed(0)
        hf = BambaForCausalLM(tiny_config(mamba_n_groups=groups)).eval()
        with torch.no_grad():  # HF initialises these to constants: make them matter
            for layer in hf.model.layers:
                if hasattr(layer, "mamba"):
                    layer.mamba.D.normal_(0, 1)
                    layer.mamba.dt_bias.normal_(0, 1)
                    layer.mamba.norm.weight.normal_(1, 0.3)
        path = tmp_path_factory.mktemp(f"tiny_bamba_g{groups}")
        hf.save_pretrained(path)
        dirs[groups] = path
    return dirs


@pytest.mark.parametrize(("groups", "tp"), [(1, 2), (4, 2), (4, 4)])
def test_bamba_tp_matches_one_process(bamba_dirs: dict[int, Path], groups: int, tp: int) -> None:
    """16 SSM heads split across ranks with their conv channels and states; one B/C group is
    replicated (its gated norm's sum of squares all-reduced), four are split. Attention layers
    (2 KV heads) split at TP=2 and replicate at TP=4. Each rank's Mamba state pages hold only
    its heads: the hybrid block size is what the largest rank needs."""
    g = torch.Generator().manual_seed(1)
    prompts = [
        {"prompt_token_ids": torch.randint(0, 128, (n,), generator=g).tolist()} for n in (5, 37, 70)
    ]
    params = SamplingParams(max_tokens=20, temperature=0, logprobs=2, ignore_eos=True)
    kw = dict(num_kv_blocks=64, max_model_len=200, max_num_batched_tokens=32)
    path = str(bamba_dirs[groups])
    ref_llm = LLM(path, **kw)
    ref = ref_llm.generate(prompts, params, use_tqdm=False)
    ref_llm.llm_engine.shutdown()
    llm = LLM(path, tensor_parallel_size=tp, **kw)
    try:
        mixer = llm.llm_engine.model.model.layers[0].mamba
        assert mixer.num_heads == 16 // tp and (mixer.split_group is not None) == (groups < tp)
        assert_close(ref, llm.generate(prompts, params, use_tqdm=False))
    finally:
        llm.llm_engine.shutdown()


def test_dcp_on_a_hybrid_is_refused_before_any_process_starts(bamba_dirs: dict[int, Path]) -> None:
    with pytest.raises(ValueError, match="full-attention models only"):
        LLM(str(bamba_dirs[1]), tensor_parallel_size=4, decode_context_parallel_size=2)
