"""The engine with KV offloading tiers: prefixes evicted from a tiny device cache come back
from CPU, disk and Redis instead of being recomputed, and greedy outputs stay exactly those of
an engine without tiers. Also: crash safety of the disk tier (kill -9 while writing, flipped
bytes), Redis outages, a full disk. After every engine run the device pool is all free."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from redis_server import REDIS_SERVER, SKIP_REASON, RedisServer

from pagedkv import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# 4 prompts of 9 blocks each: 36 blocks, while the device holds 24 usable blocks.
PROMPTS = [
    {"prompt_token_ids": [(97 * i + 13 * j) % 40000 + 100 for j in range(140)]} for i in range(4)
]
ENGINE = dict(num_kv_blocks=25, max_model_len=256, max_num_seqs=2)


def outputs(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    engine = llm.llm_engine
    engine.check_invariants()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_config.num_blocks - 1
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return outputs(LLM(**ENGINE))


def drain(llm: LLM) -> None:
    mgr = llm.llm_engine.connector.manager
    if hasattr(mgr, "drain"):
        assert mgr.drain(20.0)


@pytest.mark.slow
def test_cpu_tier_serves_evicted_prefixes_exactly(reference):
    llm = LLM(**ENGINE, kv_offload="cpu:256MiB")
    assert outputs(llm) == reference
    assert outputs(llm) == reference  # the device cache has evicted most prefixes by now
    stats = llm.stats()
    assert stats["external_cache_hits"] > 0 and stats["offload"]["loaded_tokens"] > 0
    assert stats["offload"]["cpu"]["bytes_read"] > 0


@pytest.mark.slow
def test_swap_preemption_and_request_level_policy(reference):
    llm = LLM(**ENGINE, kv_offload="cpu:256MiB", preemption_mode="swap")
    assert outputs(llm) == reference
    params = SamplingParams(
        temperature=0,
        max_tokens=6,
        ignore_eos=True,
        kv_transfer_params={"offload_policy": "REQUEST_LEVEL", "max_offload_tokens": 64},
    )
    llm.llm_engine.connector.manager.reset_cache()
    before = llm.llm_engine.connector.num_stored_blocks
    outs = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == reference[0]
    assert (
        llm.llm_engine.connector.num_stored_blocks - before == 4
    )  # 64 tokens = 4 blocks, at finish
    with pytest.raises(ValueError, match="kv_transfer_params"):
        SamplingParams(kv_transfer_params={"offload_policy": "SOMETIMES"})


@pytest.mark.slow
def test_skip_reading_prefix_cache_never_loads(reference):
    llm = LLM(**ENGINE, kv_offload="cpu:256MiB")
    outputs(llm)
    loaded = llm.llm_engine.connector.num_loaded_tokens
    params = SamplingParams(
        temperature=0,
        max_tokens=6,
        ignore_eos=True,
        kv_transfer_params={"skip_reading_prefix_cache": True},
    )
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.llm_engine.connector.num_loaded_tokens == loaded
    assert all(o.num_cached_tokens == 0 for o in outs)


@pytest.mark.slow  # 3+ engines over 36 blocks of prompts: 2-3x this file's other tests
def test_disk_tier_restart_reuses_blocks_and_detects_corruption(reference, tmp_path):
    spec = f"cpu:64MiB,disk:{tmp_path}:256MiB"
    first = LLM(**ENGINE, kv_offload=spec)
    assert outputs(first) == reference
    drain(first)
    first.llm_engine.shutdown()
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p.suffix != ".json"]
    assert len(files) >= 30
    # A restarted engine (empty CPU tier) finds the blocks on disk: warm restart.
    second = LLM(**ENGINE, kv_offload=spec)
    assert outputs(second) == reference
    disk = second.stats()["offload"]["disk"]
    assert disk["hits"] > 0 and disk["bytes_read"] > 0
    second.llm_engine.shutdown()
    # Flip bytes in every cache file: each corrupt file is detected, dropped and recomputed.
    for p in files:
        if p.exists():
            data = bytearray(p.read_bytes())
            data[len(data) // 2] ^= 0xFF
            p.write_bytes(bytes(data))
    third = LLM(**ENGINE, kv_offload=spec)
    assert outputs(third) == reference
    disk = third.stats()["offload"]["disk"]
    assert disk["corrupted"] > 0
    assert third.stats()["offload"]["loaded_tokens"] == 0 or disk["hits"] == 0
    third.llm_engine.shutdown()


CRASHER = textwrap.dedent("""
    import sys
    from pagedkv import LLM, SamplingParams
    prompts = [{"prompt_token_ids": [(31 * i + 7 * j) % 40000 + 100 for j in range(200)]} for i in range(40)]
    llm = LLM(num_kv_blocks=40, max_model_len=256, kv_offload=f"cpu:32MiB,disk:{sys.argv[1]}:512MiB")
    print("ready", flush=True)
    for p in prompts:
        llm.generate([p], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
        print("done", flush=True)
""")


@pytest.mark.slow
def test_kill_9_while_writing_then_restart_is_exact(tmp_path):
    script = tmp_path / "crasher.py"
    script.write_text(CRASHER)
    cache = tmp_path / "cache"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(cache)], stdout=subprocess.PIPE, text=True
    )
    done = 0
    deadline = time.monotonic() + 240
    while done < 6 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        done += line.strip() == "done"
    os.kill(proc.pid, signal.SIGKILL)  # mid-run: write-back to disk is in flight
    proc.wait()
    assert done >= 6
    prompts = [
        {"prompt_token_ids": [(31 * i + 7 * j) % 40000 + 100 for j in range(200)]}
        for i in range(done)
    ]
    ref = outputs(LLM(num_kv_blocks=40, max_model_len=256), prompts)
    llm = LLM(num_kv_blocks=40, max_model_len=256, kv_offload=f"cpu:32MiB,disk:{cache}:512MiB")
    assert outputs(llm, prompts) == ref
    disk = llm.stats()["offload"]["disk"]
    assert disk["hits"] > 0  # complete blocks written before the kill are reused
    assert not list(Path(cache).rglob("*.tmp*"))  # torn temp files were cleaned up at start
    llm.llm_engine.shutdown()


@pytest.mark.slow  # 3+ engines over 36 blocks of prompts: 2-3x this file's other tests
@pytest.mark.skipif(REDIS_SERVER is None, reason=SKIP_REASON)
def test_redis_tier_shared_between_instances_and_outage(reference, tmp_path):
    server = RedisServer().start()
    try:
        spec = f"cpu:64MiB,{server.url}"
        first = LLM(**ENGINE, kv_offload=spec)
        assert outputs(first) == reference
        drain(first)
        first.llm_engine.shutdown()
        # Another instance computes nothing it can load from Redis.
        second = LLM(**ENGINE, kv_offload=spec)
        assert outputs(second) == reference
        assert second.stats()["offload"]["redis"]["hits"] > 0
        # Redis stops mid-run: every request still completes, exactly.
        server.stop()
        more = [
            {"prompt_token_ids": [(53 * i + 11 * j) % 40000 + 100 for j in range(140)]}
            for i in range(3)
        ]
        ref_more = outputs(LLM(**ENGINE), more)
        assert outputs(second, more) == ref_more
        # Redis comes back: the tier recovers and stores again.
        server.start()
        deadline = time.monotonic() + 60
        stored_before = second.stats()["offload"]["redis"]["stores"]
        while time.monotonic() < deadline:
            more2 = [
                {
                    "prompt_token_ids": [
                        (71 * i + 5 * j + int(time.monotonic() * 1000)) % 40000 + 100
                        for j in range(40)
                    ]
                }
                for i in range(2)
            ]
            second.generate(more2, PARAMS, use_tqdm=False)
            drain(second)
            st = second.stats()["offload"]["redis"]
            if st["healthy"] and st["stores"] > stored_before:
                break
            time.sleep(0.5)
        st = second.stats()["offload"]["redis"]
        assert st["healthy"] and st["stores"] > stored_before
        second.llm_engine.shutdown()
    finally:
        server.stop()


@pytest.mark.slow
def test_all_tiers_together(reference, tmp_path):
    if REDIS_SERVER is None:
        pytest.skip(SKIP_REASON)
    server = RedisServer().start()
    try:
        spec = f"cpu:16MiB,disk:{tmp_path}:256MiB,{server.url}"
        llm = LLM(**ENGINE, kv_offload=spec)
        assert outputs(llm) == reference
        drain(llm)
        assert outputs(llm) == reference
        st = llm.stats()["offload"]
        assert st["loaded_tokens"] > 0, st
        assert st["disk"]["stores"] > 0 and st["redis"]["stores"] > 0, st
        llm.llm_engine.shutdown()
    finally:
        server.stop()


@pytest.mark.slow
def test_full_disk_drops_stores_and_serving_goes_on(reference, tmp_path, caplog):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True
        ).returncode
        == 0
    )
    if not mounted:
        pytest.skip("cannot mount a tiny tmpfs here")
    try:
        llm = LLM(**ENGINE, kv_offload=f"cpu:64MiB,disk:{mnt}:256MiB")
        assert outputs(llm) == reference
        drain(llm)
        assert outputs(llm) == reference
        disk = llm.stats()["offload"]["disk"]
        assert disk["store_failures"] > 0 and disk["stores"] >= 1
        llm.llm_engine.shutdown()
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


@pytest.mark.slow
def test_tier_events_are_published_with_the_pools_and_drained_when_events_are_off(reference):
    """`LLMEngine.take_kv_events` adds the tiers' events (medium CPU) to the device pool's;
    with events off, the connector's events are dropped every step (they used to pile up)."""
    from pagedkv.core.events import BlockStored

    llm = LLM(**ENGINE, kv_offload="cpu:256MiB", enable_kv_cache_events=True)
    assert outputs(llm) == reference
    drain(llm)
    llm.llm_engine.step()  # the stores' completions reach the tier manager
    stored = [ev for ev in llm.llm_engine.take_kv_events() if isinstance(ev, BlockStored)]
    assert any(ev.token_ids for ev in stored)  # the device pool's (medium CPU on this machine)
    assert any(ev.medium == "CPU" and not ev.token_ids for ev in stored)  # the tier's: hashes only
    quiet = LLM(**ENGINE, kv_offload="cpu:256MiB")
    assert outputs(quiet) == reference
    drain(quiet)
    quiet.llm_engine.step()
    quiet.llm_engine.step()
    assert quiet.llm_engine.connector.take_events() == []


def test_a_cpu_tier_smaller_than_a_request_is_named_at_start(tmp_path, caplog):
    """Loads from disk pass through the CPU tier, so one smaller than a max_model_len request
    makes long prefixes unloadable: the engine says so at start-up, with the size it needs."""
    import logging

    with caplog.at_level(logging.WARNING, logger="pagedkv.engine.llm_engine"):
        small = LLM(
            max_model_len=512, num_kv_blocks=64, kv_offload=f"cpu:2MiB,disk:{tmp_path}:64MiB"
        )
    assert "fewer than max_model_len 512" in caplog.text and "give it at least" in caplog.text
    small.llm_engine.shutdown()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedkv.engine.llm_engine"):
        big = LLM(
            max_model_len=512, num_kv_blocks=64, kv_offload=f"cpu:64MiB,disk:{tmp_path}:64MiB"
        )
        plain = LLM(max_model_len=512, num_kv_blocks=64, kv_offload="cpu:2MiB")  # no tier behind
    assert "fewer than max_model_len" not in caplog.text
    big.llm_engine.shutdown()
    plain.llm_engine.shutdown()
