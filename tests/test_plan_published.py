"""``pagedkv plan`` from published ``config.json`` files of hybrid-attention models (written
here as released): Gemma-3-27B (5 sliding-window layers of 1,024 to 1 global) and
Llama-4-Scout-17B-16E (3 chunked-local layers of 8,192 to 1 NoPE global). The memory per token
and per request of every KV cache group is checked against the published formulas by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pagedkv.core.specs import ChunkedLocalAttentionSpec
from pagedkv.entrypoints.cli import main
from pagedkv.models.config import ModelConfig

GiB = 1 << 30
BS = 16
MNBT = 2048


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def gemma3_27b_config() -> dict[str, Any]:
    """google/gemma-3-27b-it ``config.json`` (vision part left out): its text_config is sparse,
    so the vocabulary, RoPE thetas, tied head and layer pattern are transformers' defaults."""
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "boi_token_index": 255999,
        "eoi_token_index": 256000,
        "eos_token_id": [1, 106],
        "image_token_index": 262144,
        "initializer_range": 0.02,
        "mm_tokens_per_image": 256,
        "model_type": "gemma3",
        "text_config": {
            "head_dim": 128,
            "hidden_size": 5376,
            "intermediate_size": 21504,
            "model_type": "gemma3_text",
            "num_attention_heads": 32,
            "num_hidden_layers": 62,
            "num_key_value_heads": 16,
            "query_pre_attn_scalar": 168,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0",
    }


def scout_config() -> dict[str, Any]:
    """meta-llama/Llama-4-Scout-17B-16E ``config.json`` (vision part left out)."""
    text = {
        "attention_bias": False,
        "attention_chunk_size": 8192,
        "attention_dropout": 0.0,
        "attn_scale": 0.1,
        "attn_temperature_tuning": 4,
        "bos_token_id": 200000,
        "eos_token_id": [200001, 200007, 200008],
        "floor_scale": 8192,
        "for_llm_compressor": False,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "initializer_range": 0.02,
        "interleave_moe_layer_step": 1,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "max_position_embeddings": 10485760,
        "model_type": "llama4_text",
        "moe_layers": list(range(48)),
        "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(48)],
        "num_attention_heads": 40,
        "num_experts_per_tok": 1,
        "num_hidden_layers": 48,
        "num_key_value_heads": 8,
        "num_local_experts": 16,
        "output_router_logits": False,
        "pad_token_id": 200018,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 16.0,
            "high_freq_factor": 1.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_qk_norm": True,
        "vocab_size": 202048,
    }
    return {
        "architectures": ["Llama4ForConditionalGeneration"],
        "model_type": "llama4",
        "boi_token_index": 200080,
        "eoi_token_index": 200081,
        "image_token_index": 200092,
        "text_config": text,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0.dev0",
    }


def plan(
    capsys: pytest.CaptureFixture[str], path: Path, context: int, memory: str = "80GiB"
) -> dict[str, Any]:
    assert (
        main(
            [
                "plan",
                "--model",
                str(path),
                "--memory",
                memory,
                "--block-size",
                str(BS),
                "--context",
                str(context),
                "--dtype",
                "auto",
                "--max-num-batched-tokens",
                str(MNBT),
                "--json",
            ]
        )
        == 0
    )
    return json.loads(capsys.readouterr().out)


def write(tmp_path: Path, d: dict[str, Any]) -> Path:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(d))
    return p


def test_gemma3_27b_config_defaults() -> None:
    cfg = ModelConfig.from_hf_dict(gemma3_27b_config())
    assert (cfg.architecture, cfg.vocab_size, cfg.dtype) == ("gemma3_text", 262208, "bfloat16")
    assert cfg.tie_word_embeddings
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.sliding_window) == (1e6, 1e4, 1024)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == list(
        range(5, 62, 6)
    )


@pytest.mark.parametrize("context", [4096, 131072])
def test_plan_gemma3_27b_per_group(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, context: int
) -> None:
    """62 layers × 16 KV heads × 128 × 2 (K, V) × 2 B = 507,904 B per token as full attention;
    10 global layers in one group, 52 sliding ones dealt into 6 groups (9, 9, 9, 9, 8, 8), each
    holding ``cdiv(min(1023 + in-flight, context), 16) + 1`` blocks per request."""
    p = plan(capsys, write(tmp_path, gemma3_27b_config()), context)
    sel, layer = p["selected"], 2 * 16 * 128 * 2
    assert p["dtype"] == "bfloat16" and sel["bytes_per_token"] == 62 * layer
    assert sel["bytes_per_block"] == 10 * BS * layer and sel["num_blocks"] == 80 * GiB // (
        10 * BS * layer
    )
    groups = sel["groups"]
    full = [g for g in groups if g["kind"] == "full_attention"]
    swa = [g for g in groups if g["kind"] == "sliding_window"]
    assert [g["num_layers"] for g in full] == [10] and sorted(g["num_layers"] for g in swa) == [
        8,
        8,
        9,
        9,
        9,
        9,
    ]
    assert full[0]["bytes_per_token"] == 10 * layer
    assert full[0]["blocks_per_request"] == cdiv(context, BS)
    for g in swa:
        assert g["sliding_window"] == 1024 and g["bytes_per_token"] == g["num_layers"] * layer
        assert g["blocks_per_request"] == cdiv(min(1023 + MNBT, context), BS) + 1
        assert g["bytes_per_request"] == g["blocks_per_request"] * sel["bytes_per_block"]
    assert sel["blocks_per_request"] == sum(g["blocks_per_request"] for g in groups)


@pytest.mark.parametrize("context", [8192, 131072])
def test_plan_llama4_scout_per_group(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, context: int
) -> None:
    """48 layers × 8 KV heads × 128 × 2 × 2 B = 196,608 B per token; 12 NoPE global layers in
    one full group, 36 chunked layers in 3 groups of 12, each holding ``cdiv(min(8192 +
    in-flight, context), 16)`` blocks per request (vLLM's ChunkedLocalAttentionSpec)."""
    p = plan(capsys, write(tmp_path, scout_config()), context)
    sel, layer = p["selected"], 2 * 8 * 128 * 2
    assert sel["bytes_per_token"] == 48 * layer and sel["bytes_per_block"] == 12 * BS * layer
    groups = sel["groups"]
    assert sorted(g["kind"] for g in groups) == ["chunked_local_attention"] * 3 + ["full_attention"]
    for g in groups:
        assert g["num_layers"] == 12 and g["bytes_per_token"] == 12 * layer
        if g["kind"] == "full_attention":
            assert g["blocks_per_request"] == cdiv(context, BS)
        else:
            assert g["attention_chunk_size"] == 8192
            assert g["blocks_per_request"] == cdiv(min(8192 + MNBT, context), BS)
    # At 128k a request holds 31% of the blocks all-full attention would: 3 × 640 + 8192
    # instead of 4 × 8192.
    if context == 131072:
        assert sel["blocks_per_request"] == 3 * 640 + 8192


def test_plan_text_lists_the_groups(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert (
        main(
            [
                "plan",
                "--model",
                str(write(tmp_path, scout_config())),
                "--memory",
                "80GiB",
                "--context",
                "131072",
                "--dtype",
                "auto",
                "--max-num-batched-tokens",
                str(MNBT),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        out.count(
            "chunked_local_attention 8192 x 12 layers, 49,152 B/token, 640 blocks per request"
        )
        == 3
    )
    assert "full_attention x 12 layers, 49,152 B/token, 8,192 blocks per request" in out


def test_published_scout_config() -> None:
    """Scout's text_config as published (no ``layer_types``; MoE on every layer; every 4th
    layer NoPE): 36 chunked layers of 8192 and 12 global ones; the parameter count is the text
    model's, by hand."""
    cfg = ModelConfig.from_hf_dict(scout_config())
    assert (
        cfg.architecture == "llama4_text"
        and cfg.attention_chunk_size == 8192
        and cfg.dtype == "bfloat16"
    )
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == list(
        range(3, 48, 4)
    )
    chunked = [
        s for s in cfg.kv_cache_specs(16).values() if isinstance(s, ChunkedLocalAttentionSpec)
    ]
    assert len(chunked) == 36 and all(s.attention_chunk_size == 8192 for s in chunked)
    assert cfg.kv_bytes_per_token() == 48 * 2 * 8 * 128 * 2
    # Embeddings + head, and per layer attention, 2 norms, router and 16 routed + 1 shared
    # SwiGLU experts of 8192: 107.8B (Scout's "109B" adds the vision tower).
    h, per_layer = (
        5120,
        5120 * (40 + 2 * 8 + 40) * 128 + 2 * 5120 + 5120 * 16 + 17 * 3 * 5120 * 8192,
    )
    assert cfg.num_params == 2 * 202048 * h + 48 * per_layer + h
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.llama4.attn_temperature_tuning is True
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg  # the nested Llama 4 facts round-trip
