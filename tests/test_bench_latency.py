"""bench_latency.py at a tiny size: the report's shape, the per-op timeline's arithmetic, the
timers put every patched function back, and (where `benchmarks/llamacpp/setup.sh` has built
llama-cpp-python) the llama.cpp worker on the same GGUF. Never speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.bench import latency

ROOT = Path(__file__).resolve().parents[1]


def test_timers_time_calls_and_restore_the_originals() -> None:
    before = [
        (o, a, (o.__dict__.get(a) if isinstance(o, type) else getattr(o, a)))
        for _, o, a in latency._timer_targets()
    ]
    t = latency._Timers()
    import torch

    from pagedkv.models import layers

    lin = layers.Linear(8, 4)
    lin.weight.data.normal_()
    lin(torch.ones(2, 8))
    assert t.calls["linear (GEMV/GEMM)"] == 1 and t.total["linear (GEMV/GEMM)"] > 0
    t.restore()
    after = [
        (o, a, (o.__dict__.get(a) if isinstance(o, type) else getattr(o, a))) for o, a, _ in before
    ]
    assert all(x[2] is y[2] for x, y in zip(before, after))
    lin(torch.ones(2, 8))
    assert t.calls["linear (GEMV/GEMM)"] == 1  # no longer timed


@pytest.mark.slow
@pytest.mark.parametrize("native_step,act", [("0", "float32"), ("1", "float32"), ("1", "q8")])
def test_latency_script_pagedkv_side_and_timeline(
    tmp_path: Path, native_step: str, act: str
) -> None:
    """The Python path's timeline counts every op; the native step's splits its one call into the
    kernel's sections. Either way the overhead is the step minus matmuls and attention. The
    batched figure runs every prompt at once; ``--gguf-activations q8`` is recorded."""
    import os

    from pagedkv.ops import native

    if native_step == "1" and native.lib() is None:
        pytest.skip("native kernels not built here")
    out = tmp_path / "r.json"
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_latency.py"),
            "--skip-llamacpp",
            "--repeats",
            "1",
            "--prompt-lens",
            "8,24",
            "--max-tokens",
            "6",
            "--sequential",
            "2",
            "--sequential-max-tokens",
            "3",
            "--batched",
            "3",
            "--batched-prompt-len",
            "5",
            "--batched-max-tokens",
            "4",
            "--gguf-activations",
            act,
            "--json-only",
            "--json-out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PAGEDKV_NATIVE_STEP=native_step),
    )
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert set(r["pagedkv"]["batch1"]) == {"8", "24"}
    for v in r["pagedkv"]["batch1"].values():
        assert v["ttft_ms"] > 0 and v["decode_tok_s"] > 0 and v["runs"] == 1
    assert r["pagedkv"]["sequential_tok_s"] > 0 and r["llamacpp"] is None
    assert r["pagedkv"]["batched_tok_s"] > 0 and r["pagedkv"]["batched_decode_tok_s"] > 0
    assert "batched_outputs" not in r["pagedkv"] and r["gguf_activations"] == act
    tl = r["timeline"]
    assert tl["steps"] == 6
    ops = tl["ops"]
    if native_step == "0":
        assert not tl["native_step"]
        # 30 layers x (qkv, o, gate_up, down) linear calls and one attention per layer per step.
        assert (
            ops["linear (GEMV/GEMM)"]["calls_per_step"] == 120
            and ops["attention"]["calls_per_step"] == 30
        )
        compute = sum(ops[k]["ms_per_step"] for k in ("linear (GEMV/GEMM)", "lm_head", "attention"))
    else:
        assert tl["native_step"] and "linear (GEMV/GEMM)" not in ops and "attention" not in ops
        assert (
            ops["native: qkv_proj"]["calls_per_step"] == 1
            and ops["native: qkv_proj"]["ms_per_step"] > 0
        )
        compute = ops["lm_head"]["ms_per_step"] + sum(
            ops[f"native: {k}"]["ms_per_step"] for k in latency.NATIVE_COMPUTE
        )
    assert tl["overhead_outside_matmul_attention_ms"] == pytest.approx(tl["step_ms"] - compute)
    assert r["meets_targets"]["decode_vs_llamacpp"] is None


@pytest.mark.slow
def test_latency_rejects_bad_options() -> None:
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_latency.py"),
            "--skip-llamacpp",
            "--prompt-lens",
            "0",
            "--no-timeline",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2 and "--prompt-lens" in p.stderr


@pytest.mark.skipif(
    not latency.llamacpp_available(latency.DEFAULT_VENV),
    reason="llama-cpp-python not built (benchmarks/llamacpp/setup.sh)",
)
def test_llamacpp_worker_runs_the_same_gguf_greedy() -> None:
    from pagedkv.models.loader import resolve_model_path

    job = dict(
        model=str(resolve_model_path(None)),
        threads=2,
        n_ctx=64,
        warmup=[],
        runs=[dict(tokens=[1, 504, 3458, 314], max_tokens=5)] * 2,
    )
    res = latency._run_worker(latency.DEFAULT_VENV / "bin" / "python", job)
    assert len(res) == 2 and all(len(r["output"]) == 5 and r["ttft_s"] > 0 for r in res)
    assert (
        res[0]["output"] == res[1]["output"]
    )  # reset between runs: same prompt, same greedy output


@pytest.mark.skipif(
    not latency.llamacpp_available(latency.DEFAULT_VENV),
    reason="llama-cpp-python not built (benchmarks/llamacpp/setup.sh)",
)
def test_llamacpp_batched_worker_decodes_each_sequence_as_alone() -> None:
    """The batched job (one context, a sequence a prompt, one llama_decode a step) gives each
    prompt the greedy output a run of it alone gives: the sequences do not see each other."""
    from pagedkv.models.loader import resolve_model_path

    prompts = [[1, 504, 3458, 314], [1, 2683, 314, 253, 1023, 28]]
    model = str(resolve_model_path(None))
    py = latency.DEFAULT_VENV / "bin" / "python"
    alone = latency._run_worker(
        py,
        dict(
            model=model,
            threads=2,
            n_ctx=64,
            warmup=[],
            runs=[dict(tokens=p, max_tokens=6) for p in prompts],
        ),
    )
    job = dict(model=model, threads=2, batched=dict(prompts=prompts, max_tokens=6))
    (b,) = latency._run_worker(py, job, one=True)
    assert b["outputs"] == [r["output"] for r in alone]
    assert 0 < b["prefill_s"] < b["wall_s"]
