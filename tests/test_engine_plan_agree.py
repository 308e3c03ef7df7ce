"""`pagedkv plan` and the engine size the KV cache with the same planning code, and the engine
refuses, as vLLM does, a cache that cannot hold one request of ``max_model_len`` tokens."""

from __future__ import annotations

import json

import pytest

from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.entrypoints.cli import main
from pagedkv.entrypoints.cli.plan import engine_summary_line

SMOL_FP32_BYTES_PER_BLOCK = (
    16 * 2 * 30 * 3 * 64 * 4
)  # block 16, K+V, 30 layers, 3 KV heads, head 64, fp32


@pytest.mark.parametrize("memory,block_size", [(256 << 20, 16), (100 << 20, 32)])
def test_plan_and_engine_agree_on_blocks(capsys, memory, block_size):
    from pagedkv import LLM

    assert (
        main(
            [
                "plan",
                "--memory",
                str(memory),
                "--block-size",
                str(block_size),
                "--dtype",
                "float32",
                "--context",
                "2048",
                "--json",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)["selected"]
    llm = LLM(kv_cache_memory=memory, block_size=block_size, dtype="float32", max_model_len=2048)
    cfg = llm.llm_engine.kv_cache_config
    assert cfg.num_blocks == plan["num_blocks"]
    assert cfg.bytes_per_block == plan["bytes_per_block"]
    assert llm.llm_engine.num_usable_kv_tokens == plan["max_tokens"]
    assert llm.llm_engine.kv_buffer.numel() * 4 == cfg.num_blocks * cfg.bytes_per_block


@pytest.mark.slow
def test_plan_without_flags_is_what_the_default_engine_allocates(capsys):
    """The issue's 2x: `plan --memory 1GiB` said 2,912 blocks (bf16) while the engine allocated
    1,456 (fp32, 1 GiB on CPU). With no flags, plan now uses the engine's defaults."""
    from pagedkv import LLM

    assert main(["plan", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    engine = LLM().llm_engine
    cfg = engine.kv_cache_config
    assert plan["dtype"] == "float32" and plan["memory"]["kv_cache"] == 1 << 30
    assert (
        cfg.num_blocks
        == plan["selected"]["num_blocks"]
        == (1 << 30) // SMOL_FP32_BYTES_PER_BLOCK
        == 1456
    )
    assert cfg.bytes_per_block == plan["selected"]["bytes_per_block"]
    assert plan["context"] == engine.max_model_len
    assert plan["summary"] == engine_summary_line(engine)
    assert "1,456 blocks" in plan["summary"] and "23,280 tokens" in plan["summary"]


@pytest.mark.slow
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


@pytest.mark.parametrize(
    "kv_cache_dtype,content",
    [
        ("bfloat16", 256),
        ("fp8", 128),
        ("fp8_e5m2", 128),
        ("int8", 132),
        ("int8_per_token_head", 136),
        ("fp8_per_token_head", 136),
        ("fp8_per_token_head_f16", 132),
        ("int4_per_token_head", 72),
        ("int4", 74),
        ("int3", 56),
        ("int2", 40),
    ],
)
@pytest.mark.slow
def test_plan_and_engine_agree_for_every_kv_cache_dtype(capsys, kv_cache_dtype, content):
    """Quantized pages: the planner, the engine's allocation and the byte format agree (per
    token-head: K|scale|V|scale, reference digest §1.2: 256 / 136 / 72 B at head size 64; fp16
    scales ("int8" = int8_per_token_head_f16): 132; int4 groups: 32 + 4·2 + 32 + 2)."""
    from pagedkv import LLM

    memory = 64 << 20
    assert (
        main(
            [
                "plan",
                "--memory",
                str(memory),
                "--dtype",
                "float32",
                "--kv-cache-dtype",
                kv_cache_dtype,
                "--context",
                "1024",
                "--json",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)["selected"]
    assert plan["bytes_per_block"] == 16 * 30 * 3 * content
    llm = LLM(
        kv_cache_memory=memory, dtype="float32", max_model_len=1024, kv_cache_dtype=kv_cache_dtype
    )
    engine = llm.llm_engine
    cfg = engine.kv_cache_config
    assert (cfg.num_blocks, cfg.bytes_per_block) == (plan["num_blocks"], plan["bytes_per_block"])
    buf = engine.kv_buffer
    assert buf.numel() * buf.element_size() == cfg.num_blocks * cfg.bytes_per_block
    assert engine.num_usable_kv_tokens == plan["max_tokens"]
    out = llm.generate(
        ["The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 4
