"""`pagedkv plan` and the engine size the KV cache with the same planning code."""

from __future__ import annotations

import json

import pytest

from pagedkv.entrypoints.cli import main


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
