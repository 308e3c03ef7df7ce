"""``pagedkv plan``: in-process (main(argv)) and as a subprocess; numbers recomputed by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedkv.engine.config import EngineConfig
from pagedkv.entrypoints.cli import main
from pagedkv.entrypoints.cli.plan import parse_size

GiB, MiB = 1 << 30, 1 << 20
SMOL_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2  # K+V, 30 layers, 3 KV heads, head 64, bf16


def run_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_default_model_8gib(capsys) -> None:
    plan = run_json(
        capsys, "--memory", "8GiB", "--block-size", "16", "--context", "4096", "--dtype", "bfloat16"
    )
    sel = plan["selected"]
    bpb = 16 * SMOL_BYTES_PER_TOKEN
    assert sel["bytes_per_token"] == SMOL_BYTES_PER_TOKEN and sel["bytes_per_block"] == bpb
    assert sel["num_blocks"] == 8 * GiB // bpb
    assert sel["num_usable_blocks"] == sel["num_blocks"] - 1
    assert sel["max_tokens"] == (sel["num_blocks"] - 1) * 16
    assert sel["max_concurrency"] == pytest.approx((sel["num_blocks"] - 1) / (4096 // 16))
    assert plan["model"]["num_layers"] == 30 and plan["context"] == 4096


def test_every_quant_mode_side_by_side(capsys) -> None:
    plan = run_json(capsys, "--memory", "1GiB", "--context", "2048", "--dtype", "bfloat16")
    rows = {r["mode"]: r for r in plan["modes"]}
    per_layer_head = {
        "float32": 2 * 64 * 4,
        "auto": 2 * 64 * 2,
        "fp8_per_tensor": 2 * 64,
        "fp8_per_token_head": 2 * 64 + 8,
        "int8_per_token_head": 2 * 64 + 8,
        "fp8_per_token_head_f16": 2 * 64 + 4,
        "int8_per_token_head_f16": 2 * 64 + 4,
        "int4_per_token_head": 64 + 8,
        "int4_per_token_group": 32 + 4 * 2 + 32 + 2,  # K: 4 groups of 16, V: 1
        "int3_per_token_group": 2 * (24 + 2 * 2),  # 3-bit codes, groups of 32
        "int2_per_token_group": 2 * (16 + 2 * 2),
        "int3_kivi": 24 + 64 // 16 * 2 + 24 + 2,  # K channel scales spread over the block
        "int2_kivi": 16 + 64 // 16 * 2 + 16 + 2 * 2,
    }
    assert set(rows) == set(per_layer_head)
    seqs = EngineConfig.__dataclass_fields__["max_num_seqs"].default
    for mode, content in per_layer_head.items():
        r = rows[mode]
        assert r["bytes_per_token"] == 30 * 3 * content, mode
        # KIVI: a residual per max_num_seqs row (36 int8 tokens a layer) comes off the budget
        residual = 30 * 36 * 3 * 2 * (64 + 2) if "kivi" in mode else 0
        assert r["kivi_residual_bytes_per_request"] == residual
        # and the sink store once: 64 first blocks' 4 int8 sink tokens
        sinks = 64 * 30 * 4 * 3 * 2 * (64 + 2) if "kivi" in mode else 0
        assert r["kivi_sink_store_bytes"] == sinks
        assert r["num_blocks"] == (GiB - seqs * residual - sinks) // (16 * 30 * 3 * content), mode
    assert rows["int4_per_token_head"]["max_tokens"] > rows["int8_per_token_head"]["max_tokens"]


def test_text_output_subprocess() -> None:
    """The issue's example, through a real process (console script if installed)."""
    script = os.path.join(os.path.dirname(sys.executable), "pagedkv")
    cmd = [script] if os.path.exists(script) else [sys.executable, "-m", "pagedkv.entrypoints.cli"]
    res = subprocess.run(
        [
            *cmd,
            "plan",
            "--memory",
            "8GiB",
            "--block-size",
            "16",
            "--context",
            "4096",
            "--dtype",
            "bfloat16",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    blocks = 8 * GiB // (16 * SMOL_BYTES_PER_TOKEN)
    assert f"{SMOL_BYTES_PER_TOKEN:,}" in res.stdout
    assert f"{blocks:,} ({blocks - 1:,} usable + 1 null)" in res.stdout
    assert f"{(blocks - 1) / 256:.2f}" in res.stdout
    for mode in ("fp8_per_tensor", "int8_per_token_head", "int4_per_token_head"):
        assert mode in res.stdout


def test_too_small_is_exit_2_with_the_length_that_fits() -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv.entrypoints.cli",
            "plan",
            "--memory",
            "100MiB",
            "--context",
            "8192",
            "--dtype",
            "bfloat16",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert res.stdout == "" and "Traceback" not in res.stderr
    usable = 100 * MiB // (16 * SMOL_BYTES_PER_TOKEN) - 1
    assert f"estimated maximum model length is {usable * 16}" in res.stderr


def test_too_small_in_process(capsys) -> None:
    assert (
        main(
            [
                "plan",
                "--memory",
                "1MiB",
                "--num-layers",
                "4",
                "--num-kv-heads",
                "2",
                "--head-dim",
                "64",
                "--context",
                "100000",
                "--dtype",
                "bfloat16",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    # bf16: 4 layers * 2 * 2 heads * 64 * 2 B = 2048 B/token → 32 KiB blocks → 32 blocks, 31 usable.
    assert "estimated maximum model length is 496" in err


def test_flags_only_model(capsys) -> None:
    plan = run_json(
        capsys,
        "--num-layers",
        "2",
        "--num-kv-heads",
        "1",
        "--head-dim",
        "8",
        "--memory",
        "1MiB",
        "--block-size",
        "4",
        "--context",
        "64",
        "--dtype",
        "float16",
    )
    sel = plan["selected"]
    assert plan["model"]["name"] == "custom (flags)"
    assert sel["bytes_per_token"] == 2 * 2 * 1 * 8 * 2
    assert sel["num_blocks"] == MiB // (4 * 64)


def test_flags_override_loaded_model(capsys) -> None:
    plan = run_json(
        capsys, "--memory", "1GiB", "--num-layers", "10", "--context", "1024", "--dtype", "bfloat16"
    )
    assert plan["model"]["num_layers"] == 10 and plan["model"]["num_kv_heads"] == 3
    assert plan["selected"]["bytes_per_token"] == SMOL_BYTES_PER_TOKEN // 3


def test_device_memory_breakdown(capsys) -> None:
    plan = run_json(
        capsys,
        "--device-memory",
        "24GiB",
        "--runtime-memory",
        "1GiB",
        "--headroom",
        "0.1",
        "--weight-dtype",
        "float32",
        "--context",
        "8192",
        "--dtype",
        "bfloat16",
    )
    mem, sel = plan["memory"], plan["selected"]
    n = plan["model"]["num_params"]
    assert mem["weights"] == n * 4 and mem["runtime"] == GiB
    assert mem["headroom"] == int(24 * GiB * 0.1)
    kv = 24 * GiB - n * 4 - GiB - int(24 * GiB * 0.1)
    assert mem["kv_cache"] == kv
    assert mem["c_tokens"] == kv // SMOL_BYTES_PER_TOKEN
    assert sel["num_blocks"] == kv // (16 * SMOL_BYTES_PER_TOKEN)


def test_device_memory_text_and_runtime_estimate(capsys) -> None:
    assert main(["plan", "--device-memory", "8GiB", "--context", "2048"]) == 0
    out = capsys.readouterr().out
    for term in (
        "M_HBM",
        "M_weights",
        "M_runtime",
        "M_headroom",
        "= KV cache",
        "(estimate)",
        "C_tokens",
    ):
        assert term in out


def test_device_too_small(capsys) -> None:
    assert main(["plan", "--device-memory", "200MiB", "--context", "2048"]) == 2
    assert "No available memory for the cache blocks" in capsys.readouterr().err


def test_hf_config_and_hybrid_flags(tmp_path, capsys) -> None:
    cfg = {
        "model_type": "llama",
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    plan = run_json(capsys, "--model", str(tmp_path), "--memory", "64MiB", "--dtype", "float16")
    assert plan["context"] == 4096
    assert plan["selected"]["bytes_per_token"] == 4 * 2 * 2 * 64 * 2
    hybrid = run_json(
        capsys,
        "--model",
        str(tmp_path),
        "--memory",
        "64MiB",
        "--sliding-window",
        "256",
        "--full-attention-every",
        "2",
        "--context",
        "4096",
    )
    assert hybrid["selected"]["num_groups"] == 2
    # A sliding group needs far fewer blocks than a full one, so a request needs < 2x full.
    assert hybrid["selected"]["blocks_per_request"] < 2 * (4096 // 16)


@pytest.mark.parametrize(
    "text,want",
    [
        ("8GiB", 8 * GiB),
        ("8 GB", 8 * 10**9),
        ("1.5MiB", 3 * MiB // 2),
        ("512", 512),
        ("2TiB", 2 << 40),
        ("3kb", 3000),
        ("7B", 7),
    ],
)
def test_parse_size(text: str, want: int) -> None:
    assert parse_size(text) == want


def test_bad_arguments_exit_2(capsys) -> None:
    for argv in (
        ["plan", "--memory", "8GX"],
        ["plan", "--memory", "1GiB", "--device-memory", "2GiB"],
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
    assert main([]) == 2
    assert (
        main(["plan", "--memory", "1GiB", "--weight-dtype", "q9"]) == 0
    )  # unused without --device-memory
    assert main(["plan", "--device-memory", "8GiB", "--weight-dtype", "q9"]) == 2
    assert "unknown --weight-dtype" in capsys.readouterr().err
