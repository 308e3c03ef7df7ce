"""The end-to-end benchmarks at tiny sizes: JSON shape and sane numbers, never speed.

The memory benchmark is a deterministic simulation (no model), so its full-size figures are
checked too; the model benchmarks run a handful of tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.entrypoints.cli import main

ROOT = Path(__file__).resolve().parents[1]


def bench_json(capsys, *argv: str) -> dict:
    assert main(["bench", *argv, "--json-only"]) == 0
    return json.loads(capsys.readouterr().out)


# ---------------------------------------------------------------- one home


def test_every_benchmark_script_is_a_thin_entry_point() -> None:
    """The benchmarks live in `pagedkv.bench`; ``benchmarks/bench_<name>.py`` only calls
    ``pagedkv.bench.<name>.main``. The simulator's two scripts stay whole: they drive
    `pagedkv.sim` and `pagedkv.router` in-process, both above `pagedkv.bench` in the layers."""
    stay = {"sim", "sim_validate"}
    # Shared helpers, and parts of one benchmark kept in their own file (lossy_kv's methods,
    # offload's codecs).
    helpers = {
        "__init__",
        "common",
        "instances",
        "lossy_methods",
        "lossy_prefix_hit",
        "offload_codecs",
    }
    modules = {p.stem for p in (ROOT / "src" / "pagedkv" / "bench").glob("*.py")} - helpers
    scripts = {p.stem.removeprefix("bench_"): p for p in (ROOT / "benchmarks").glob("bench_*.py")}
    assert set(scripts) == modules | stay
    for name in modules:
        text = scripts[name].read_text()
        assert f"from pagedkv.bench.{name} import main\n" in text, scripts[name]
        assert len(text.splitlines()) <= 20, scripts[name]


# ---------------------------------------------------------------- memory (no model)


@pytest.mark.slow
def test_memory_full_trace_meets_target(capsys) -> None:
    r = bench_json(capsys, "memory")
    s = r["schemes"]
    assert set(s) == {"paged_8", "paged_16", "paged_32", "contiguous"}
    assert r["trace"]["num_requests"] == 200 and r["trace"]["max_model_len"] == 2048
    for x in s.values():
        assert 0 < x["utilisation"] <= 1 and 0 < x["mean_step_utilisation"] <= 1
        assert x["steps"] > 0 and x["mean_running"] > 0
    # Smaller blocks waste less; any paging beats reserving max_model_len per request.
    assert (
        s["paged_8"]["utilisation"] >= s["paged_16"]["utilisation"] >= s["paged_32"]["utilisation"]
    )
    assert s["paged_32"]["utilisation"] > 2 * s["contiguous"]["utilisation"]
    assert s["contiguous"]["preemptions"] == 0  # it reserved the worst case up front
    assert s["paged_16"]["mean_running"] > s["contiguous"]["mean_running"]
    assert s["paged_16"]["utilisation"] >= 0.95 and r["meets_target"] is True


def test_memory_script_runs_standalone_and_rejects_bad_options() -> None:
    script = ROOT / "benchmarks" / "bench_memory.py"
    res = subprocess.run(
        [sys.executable, str(script), "--num-requests", "20", "--block-sizes", "16", "--json-only"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr
    assert set(json.loads(res.stdout)["schemes"]) == {"paged_16", "contiguous"}
    bad = subprocess.run(
        [sys.executable, str(script), "--block-sizes", "sixteen"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert bad.returncode == 2 and "block-sizes" in bad.stderr and "Traceback" not in bad.stderr


# ---------------------------------------------------------------- model benchmarks (tiny)


@pytest.mark.slow
def test_prefix_cache_tiny(capsys) -> None:
    r = bench_json(
        capsys,
        "prefix-cache",
        "--num-requests",
        "3",
        "--prefix-len",
        "64",
        "--question-len",
        "4:8",
        "--max-tokens",
        "1",
    )
    on, off = r["caching_on"], r["caching_off"]
    assert on["mean_cached_tokens"] == 64 and off["mean_cached_tokens"] == 0
    assert 0 < on["hit_rate"] < 1 and off["hit_rate"] == 0
    for side in (on, off):
        t = side["ttft_s"]
        assert 0 < t["min"] <= t["p50"] <= t["max"] and t["min"] <= t["mean"] <= t["max"]
    assert r["speedup"]["p50"] == pytest.approx(off["ttft_s"]["p50"] / on["ttft_s"]["p50"])
    assert isinstance(r["meets_target"], bool)


@pytest.mark.slow
def test_throughput_tiny_with_hf(capsys, tmp_path) -> None:
    out_file = tmp_path / "tp.json"
    r = bench_json(
        capsys,
        "throughput",
        "--num-requests",
        "3",
        "--prompt-len",
        "8:16",
        "--output-len",
        "2:4",
        "--hf-batch-size",
        "2",
        "--batch1-prompt-len",
        "8",
        "--batch1-output-len",
        "4",
        "--matmul-seconds",
        "0.2",
        "--json-out",
        str(out_file),
    )
    assert json.loads(out_file.read_text()) == r
    w, ours, hf = r["workload"], r["pagedkv"], r["hf"]
    assert (
        w["num_requests"] == 3 and 24 <= w["prompt_tokens"] <= 48 and 6 <= w["output_tokens"] <= 12
    )
    for side in (ours, hf):
        assert side["elapsed_s"] > 0 and side["total_tok_s"] > side["output_tok_s"] > 0
        assert side["total_tok_s"] == pytest.approx(
            (w["prompt_tokens"] + w["output_tokens"]) / side["elapsed_s"]
        )
        assert side["batch1_decode_tok_s"] > 0
    # HF's static batches generate up to each batch's longest output; only requested tokens count.
    assert hf["generated_tokens_incl_waste"] >= w["output_tokens"]
    assert r["ratios"]["total_tok_s"] == pytest.approx(ours["total_tok_s"] / hf["total_tok_s"])
    m = r["machine"]
    assert m["matmul_gflops"] > 0 and m["gflop_per_token"] == pytest.approx(0.269, abs=0.01)
    assert m["ceiling_tok_s"] == pytest.approx(m["matmul_gflops"] / m["gflop_per_token"])
    # the ceiling is the faster library's rate (MKL, and oneDNN for float32 where torch has it)
    assert "mkl" in m["matmul_gflops_by_library"]
    assert m["matmul_gflops"] == max(m["matmul_gflops_by_library"].values())
    assert m["dense_linear"] in ("blas", "mkl_packed", "onednn")
    assert ours["fraction_of_ceiling"] == pytest.approx(ours["total_tok_s"] / m["ceiling_tok_s"])
    assert set(r["meets_targets"]) == {"vs_hf_total", "fraction_of_ceiling", "batch1_decode_tok_s"}


@pytest.mark.slow
def test_throughput_skip_hf_prints_table(capsys) -> None:
    """Without --json-only: the table, then the JSON; --skip-hf leaves the baseline out."""
    assert (
        main(
            [
                "bench",
                "throughput",
                "--skip-hf",
                "--num-requests",
                "2",
                "--prompt-len",
                "8",
                "--output-len",
                "2",
                "--batch1-prompt-len",
                "8",
                "--batch1-output-len",
                "3",
                "--matmul-seconds",
                "0.1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "total tok/s" in out and "fraction of ceiling" in out
    report = json.loads(out[out.index("\n{") + 1 :])
    assert report["hf"] is None and report["ratios"]["total_tok_s"] is None
    assert report["meets_targets"]["vs_hf_total"] is None
    assert report["workload"]["prompt_tokens"] == 16 and report["workload"]["output_tokens"] == 4


# ---------------------------------------------------------------- native kernels


@pytest.mark.slow
def test_native_script_reports_every_case() -> None:
    from pagedkv.ops import native

    if not native.available():
        pytest.skip("no C compiler: native kernels unavailable")
    script = ROOT / "benchmarks" / "bench_native.py"
    res = subprocess.run(
        [sys.executable, str(script), "--rounds", "1", "--step-tokens", "4", "--json-only"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr
    r = json.loads(res.stdout)
    assert {g["tensor"] for g in r["gemv"]} >= {"blk.0.ffn_up.weight", "token_embd.weight"}
    # The in-step GEMV figure: 4 native decode steps timed, 30 layers x 7 Q4_1 projections of
    # SmolLM2-135M (3,538,944 weights a layer, 20 bytes per 32).
    sg = r["step_gemv"]
    assert sg["steps"] == 4 and sg["weight_bytes"] == 30 * 3_538_944 * 20 // 32
    assert sg["proj_ms_per_step"] > 0 and 0 < sg["bandwidth_frac"]
    assert all(g["native_ms"] > 0 and g["blas_ms"] > 0 for g in r["gemv"])
    assert [d["sequences"] for d in r["decode_attention"]] == [1, 8, 64]
    assert all(d["native_ms_per_step"] > 0 and d["speedup"] > 0 for d in r["decode_attention"])


# ---------------------------------------------------------------- PD disaggregation


@pytest.mark.slow
def test_disagg_script_tiny_loses_no_request() -> None:
    """Colocated and PD (producer + consumer + proxy) on two tiny requests, and a 1 MiB
    transfer; no kill test (it restarts four instances: minutes on a small machine)."""
    script = ROOT / "benchmarks" / "bench_disagg.py"
    res = subprocess.run(
        [
            sys.executable,
            str(script),
            "--num-requests",
            "2",
            "--max-tokens",
            "2",
            "--long-len",
            "40:60",
            "--short-len",
            "4:8",
            "--num-kv-blocks",
            "64",
            "--max-model-len",
            "128",
            "--bandwidth-mib",
            "1",
            "--bandwidth-repeats",
            "1",
            "--kill-test",
            "0",
            "--json-only",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout)  # --json-only: nothing else on stdout (NIXL's INFO lines included)
    for setup in (r["colocated"], r["pd"]):
        assert setup["completed"] == 2 and setup["failed"] == 0 and setup["errors"] == []
        assert setup["output_tokens"] == 4 and setup["output_tok_s"] > 0
        for key in ("ttft_s", "itl_s", "e2e_s"):
            assert 0 < setup[key]["p50"] <= setup[key]["p99"]
    assert (
        r["pd"]["kv_transfers"] >= 2 and r["pd"]["kv_transfer_failures"] == 0
    )  # the KV really moved
    assert r["ratios"]["itl_p99"] == pytest.approx(
        r["pd"]["itl_s"]["p99"] / r["colocated"]["itl_s"]["p99"]
    )
    bw = r["bandwidth"]
    assert bw["verified"] is True and bw["agents"] == "two processes" and bw["bytes_moved"] >= 2**20
    assert bw["transfer_gbps"] > 0 and bw["memcpy_gbps"] > 0
    assert bw["ratio_vs_memcpy"] == pytest.approx(bw["transfer_gbps"] / bw["memcpy_gbps"])
    assert r["kill_test"] is None and r["meets_targets"]["kill_test"] is None
    pin = r["config"]["pinning"]
    assert (pin["note"] is None) == (pin["colocated"] is not None)


def test_disagg_kill_report_counts_lost_requests_by_kind() -> None:
    """The kill test's lost requests are grouped by kind (numbers masked) and the table prints
    the counts and the restart times: what a failed run needs to be read."""
    from pagedkv.bench import disagg as bench_disagg

    kinds = bench_disagg.error_kinds(
        [
            "could not resume it within 180 s",
            "ReadTimeout: ",
            "could not resume it within 90 s",
            None,
        ]
    )
    assert kinds == {
        "could not resume it within N s": 2,
        "ReadTimeout: ": 1,
        "no error recorded": 1,
    }
    assert list(kinds)[0] == "could not resume it within N s"  # most frequent first
    report = json.loads((ROOT / "benchmarks" / "results" / "disagg_kill_0.3rps.json").read_text())
    report["kill_test"].update(
        error_counts=kinds,
        pinning=dict(cores=[[0], [1], [0], [1]], note=None),
        kills=[
            dict(at_s=1.0, instance="kill-decode0", restart_s=20.0),
            dict(at_s=5.0, instance="kill-prefill1", restart_s=None),
        ],
    )
    text = bench_disagg.table(report)
    assert (
        "500 requests, 426 lost, 2 kills" in text and "restarts 20.0-20.0 s (median 20.0 s)" in text
    )
    assert "lost 2: could not resume it within N s" in text and "lost 1: ReadTimeout" in text
    assert "instances pinned to CPUs [[0], [1], [0], [1]]" in text


# ---------------------------------------------------------------- KV-aware routing


@pytest.mark.slow
def test_router_script_tiny_pools_repeats() -> None:
    """Two repeats of a 2 x 2 trace through kv and round-robin routers: every request served,
    the pooled figures are the repeats' requests, every predicted hit is the reported one."""
    script = ROOT / "benchmarks" / "bench_router.py"
    res = subprocess.run(
        [
            sys.executable,
            str(script),
            "--conversations",
            "2",
            "--turns",
            "2",
            "--repeats",
            "2",
            "--max-tokens",
            "2",
            "--think-s",
            "0",
            "--num-kv-blocks",
            "64",
            "--max-model-len",
            "256",
            "--policies",
            "kv,round-robin",
            "--json-only",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout)
    assert r["config"]["repeats"] == 2
    for policy in ("kv", "round-robin"):
        p = r["policies"][policy]
        assert p["completed"] == 8 and p["failed"] == 0 and p["errors"] == []
        assert len(p["repeats"]) == 2 and all(0.0 <= x["hit_rate"] < 1.0 for x in p["repeats"])
        assert p["prompt_tokens"] == 2 * (2 * 64 + 2 * 144)  # turn 0: 32 + 32, turn 1: + 48 + 32
        assert p["predictions"] == {"exact": 8.0}  # no cache pressure: the index is exact
        assert sum(p["decisions"].values()) == 8
    assert set(r["policies"]["kv"]["decisions"]) <= {"load", "kv_hit", "load_over_prefix"}
    assert r["policies"]["round-robin"]["decisions"] == {"round_robin": 8.0}


def test_vs_vllm_report_ratios_and_bandwidth_line() -> None:
    """bench_vs_vllm's report (without running either engine): ratios are pagedkv / vLLM, the
    ITL ratio is pagedkv's own, and the batch-1 bandwidth line appears with its fraction."""
    from pagedkv.bench import vs_vllm

    assert vs_vllm._cores("0-1") == 2 and vs_vllm._cores("0,2-4") == 4
    serve = [dict(concurrency=4, total_tok_s=100.0, median_tpot_ms=20.0, p99_itl_ms=40.0)]
    v = dict(offline_total_tok_s=100.0, offline_output_tok_s=50.0, batch1_decode_tok_s=20.0)
    p = dict(offline_total_tok_s=150.0, offline_output_tok_s=60.0, batch1_decode_tok_s=50.0)
    v["serving"] = serve
    p["serving"] = [dict(serve[0], total_tok_s=130.0, p99_itl_ms=50.0)]
    r = vs_vllm._ratios(p, v)
    assert r["offline_total_tok_s"] == pytest.approx(1.5)
    assert r["serving_total_tok_s_c4"] == pytest.approx(1.3)
    assert r["pagedkv_itl_p99_over_median_tpot_c4"] == pytest.approx(2.5)
    r["pagedkv_batch1_over_limit"] = 0.8
    bw = dict(weight_bytes_per_token=269e6, read_gb_s=18.0, batch1_limit_tok_s=62.5)
    rep = dict(cores="0-1", runs={"bfloat16": dict(vllm=v, pagedkv=p, ratio=r, bandwidth=bw)})
    text = vs_vllm.table(rep)
    assert "1.50x" in text and "1.30x" in text
    assert "62.5 tok/s (269 MB/token at 18.0 GB/s): pagedkv at 80%" in text


def test_vs_vllm_step_split_on_a_tiny_llama(tmp_path: Path) -> None:
    """The step split runs pagedkv alone: per rows, the parts add up to at most the step, the
    glue share is the rest's, and the projections run alone over exactly the model's linear
    weights (fused QKV and gate/up, as the step reads them)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedkv.bench import vs_vllm

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    rows = vs_vllm.step_split(str(tmp_path), "float32", "1,3", "4", str(64 << 20))
    assert [r["rows"] for r in rows] == [1, 3]
    per_layer = (64 + 2 * 32) * 64 + 64 * 64 + 2 * 128 * 64 + 64 * 128
    for r in rows:
        parts = r["projections_ms"] + r["attention_ms"] + r["lm_head_ms"]
        assert 0 < parts < r["step_ms"]
        assert r["glue_ms"] == pytest.approx(r["step_ms"] - parts, rel=1e-6)
        assert r["glue_frac"] == pytest.approx(r["glue_ms"] / r["step_ms"])
        assert r["projection_calls"] == 2 * 4 and r["projection_bytes"] == 2 * per_layer * 4
        # The tiny weights take about a call's fixed cost, so the difference may be ~0 either way.
        assert r["call_cost_us"] > 0
        assert r["projections_alone_ms"] + r["projection_calls"] * r["call_cost_us"] / 1e3 > 0
        r["projections_bandwidth_ms"] = r["projection_bytes"] / 20e9 * 1e3  # run_step_split's
    text = "\n".join(vs_vllm._split_rows("float32", rows))
    assert "  1 rows" in text and "  3 rows" in text


def test_structured_outputs_tiny(capsys) -> None:
    from pagedkv.bench.structured_outputs import CASES, main

    rc = main(["--rounds", "1", "--max-tokens", "12", "--batch", "2", "--json-only"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    for backend in ("xgrammar", "guidance"):
        res = r["library"][backend]
        if res is None:
            continue
        for case in CASES:
            c = res[case]
            assert c["tokens"] > 1 and c["compile_first_ms"] > 0
            assert 0 < c["mask_us_median"] <= c["mask_us_p99"] <= c["mask_us_max"]
    (row,) = r["engine"]["rows"]
    assert row["batch"] == 2 and row["plain_tok_s"] > 0 and row["json_schema_tok_s"] > 0
    assert row["ratio"] == pytest.approx(row["json_schema_tok_s"] / row["plain_tok_s"])
    assert row["mask_ms_per_step"] > 0
