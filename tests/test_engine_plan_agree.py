"""`pagedkv plan` and the engine size the KV cache with the same planning code, and the engine
refuses, as vLLM does, a cache that cannot hold one request of ``max_model_len`` tokens."""

from __future__ import annotations

import json

import pytest

from pagedkv.entrypoints.cli import main
from pagedkv.entrypoints.plan import engine_summary_line

SMOL_FP32_BYTES_PER_BLOCK = 16 * 2 * 30 * 3 * 64 * 4  # block 16, K+V, 30 layers, 3 KV heads, head 64, fp32


@pytest.mark.parametrize("memory,block_size", [(256 << 20, 16), (100 << 20, 32)])
def test_plan_and_engine_agree_on_blocks(capsys, memory, block_size):
    from pagedkv import LLM

    assert main(["plan", "--memory", str(memory), "--block-size", str(block_size), "--dtype",
                 "float32", "--context", "2048", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["selected"]
    llm = LLM(kv_cache_memory=memory, block_size=block_size, dtype="float32", max_model_len=2048)
    cfg = llm.llm_engine.kv_cache_config
    assert cfg.num_blocks == plan["num_blocks"]
    assert cfg.bytes_per_block == plan["bytes_per_block"]
    assert llm.llm_engine.num_usable_kv_tokens == plan["max_tokens"]
    assert llm.llm_engine.kv_buffer.numel() * 4 == cfg.num_blocks * cfg.bytes_per_block


def test_plan_without_flags_is_what_the_default_engine_allocates(capsys):
    """The issue's 2x: `plan --memory 1GiB` said 2,912 blocks (bf16) while the engine allocated
    1,456 (fp32, 1 GiB on CPU). With no flags, plan now uses the engine's defaults."""
    from pagedkv import LLM

    assert main(["plan", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    engine = LLM().llm_engine
    cfg = engine.kv_cache_config
    assert plan["dtype"] == "float32" and plan["memory"]["kv_cache"] == 1 << 30
    assert cfg.num_blocks == plan["selected"]["num_blocks"] == (1 << 30) // SMOL_FP32_BYTES_PER_BLOCK == 1456
    assert cfg.bytes_per_block == plan["selected"]["bytes_per_block"]
    assert plan["context"] == engine.max_model_len
    assert plan["summary"] == engine_summary_line(engine)
    assert "1,456 blocks" in plan["summary"] and "23,280 tokens" in plan["summary"]


def test_engine_refuses_a_cache_too_small_for_one_max_model_len_request():
    """`num_kv_blocks=40` with the default max_model_len (8192, 512 blocks) used to start and
    thrash later; now it is refused, naming the largest length that fits: 39 usable blocks x 16
    tokens = 624, and the options (and flags) to change. That length then starts."""
    from pagedkv import LLM

    with pytest.raises(ValueError) as e:
        LLM(num_kv_blocks=40)
    msg = str(e.value)
    assert "max seq len (8192)" in msg and "512 KV blocks are needed" in msg
    assert "estimated maximum model length is 624." in msg
    assert "--max-model-len" in msg and "--num-kv-blocks" in msg
    llm = LLM(num_kv_blocks=40, max_model_len=624)
    assert llm.llm_engine.max_model_len == 624 and llm.llm_engine.kv_cache_config.num_blocks == 40
