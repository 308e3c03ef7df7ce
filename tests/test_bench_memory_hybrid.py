"""The hybrid row of ``benchmarks/bench_memory.py``: KV bytes per token of context for a
Gemma-3-like (5 sliding : 1 global, window 1,024) and a Bamba-like (Mamba2 + 3 attention
layers) model against all-full-attention, checked against the published formulas by hand."""

from __future__ import annotations

import json

import pytest

from pagedkv.bench.memory import bamba_like_specs, hybrid_rows, main
from pagedkv.core.specs import MambaSpec, get_kv_cache_groups

CTX = [4096, 32768, 131072]
CHUNK = 8192
GEMMA_LAYER_TOKEN = 2 * 16 * 128 * 2  # K+V, 16 KV heads of 128, bf16
BAMBA_LAYER_TOKEN = 2 * 8 * 128 * 2
BAMBA_STATE = ((8192 + 256) * 3 + 128 * 64 * 128) * 2  # conv + SSM, bf16


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, int], dict]:
    return {(r["model"], r["context"]): r for r in hybrid_rows(CTX, 16, CHUNK)}


def test_gemma3_like_matches_the_window_formula(rows: dict) -> None:
    for ctx in CTX:
        r = rows["gemma3_like", ctx]
        # 10 global layers keep every token; 52 sliding layers keep the last 1,024.
        formula = (10 * ctx + 52 * min(1024, ctx)) * GEMMA_LAYER_TOKEN
        assert r["formula_bytes_per_token"] == formula / ctx
        assert r["full_attention_bytes_per_token"] == 62 * GEMMA_LAYER_TOKEN
        # The pool adds the window's partial block and pads the 8/9-layer sliding groups to
        # the 10-layer global group's block, never less than the formula, little more.
        assert formula / ctx <= r["measured_bytes_per_token"] <= 1.1 * formula / ctx
        assert r["measured_bytes_per_token"] <= r["planned_bytes_per_token"]
    big = rows["gemma3_like", 131072]
    assert big["saving_vs_full"] > 5.5 and big["num_groups"] == 7


def test_bamba_like_matches_the_state_formula(rows: dict) -> None:
    groups = get_kv_cache_groups(bamba_like_specs(16))
    mamba = [g for g in groups if isinstance(g.kv_cache_spec, MambaSpec)]
    assert sum(len(g.layer_names) for g in mamba) == 29
    for ctx in CTX:
        r = rows["bamba_like", ctx]
        formula = 3 * ctx * BAMBA_LAYER_TOKEN + 29 * BAMBA_STATE  # attention KV + constant states
        assert r["formula_bytes_per_token"] == formula / ctx
        assert r["full_attention_bytes_per_token"] == 32 * BAMBA_LAYER_TOKEN
        # Planned: attention blocks grown to the Mamba page, plus one state block per Mamba group.
        assert formula / ctx <= r["planned_bytes_per_token"] <= 1.1 * formula / ctx
        m = r["measured_bytes_per_token"]
        assert m is None or formula / ctx <= m <= r["planned_bytes_per_token"]
    assert rows["bamba_like", 131072]["saving_vs_full"] > 9


def test_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--num-requests", "5", "--block-sizes", "16", "--hybrid-contexts", "4096"]) == 0
    out = capsys.readouterr().out
    assert (
        "hybrid models: KV bytes per token" in out and "gemma3_like" in out and "bamba_like" in out
    )
    report = json.loads(out[out.index("{") :])
    assert [r["context"] for r in report["hybrid"]["rows"]] == [4096, 4096]
    assert main(["--hybrid-contexts", "x", "--json-only"]) == 2
    assert "hybrid-contexts" in capsys.readouterr().err
