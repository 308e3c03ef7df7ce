"""``pagedkv bench serve``: vLLM users type ``vllm bench serve``; the same benchmark as
benchmarks/bench_serving.py, through the CLI, for real (a server subprocess, streamed requests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = os.path.join(os.path.dirname(sys.executable), "pagedkv")
CMD = [SCRIPT] if os.path.exists(SCRIPT) else [sys.executable, "-m", "pagedkv.entrypoints.cli"]


@pytest.mark.slow
def test_bench_serve_tiny_run_reports_progress(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    res = subprocess.run(
        [
            *CMD,
            "bench",
            "serve",
            "--num-requests",
            "3",
            "--request-rate",
            "50",
            "--input-len",
            "16",
            "--prefix-len",
            "8",
            "--output-len",
            "2",
            "--no-saturation",
            "--num-kv-blocks",
            "64",
            "--max-model-len",
            "256",
            "--json-out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["runs"]] == ["rate=50"]
    (run,) = report["runs"]
    assert run["completed"] == 3 and run["failed"] == 0 and run["output_tokens"] == 6
    printed = json.loads(res.stdout[res.stdout.index("\n{") + 1 :])  # the table, then the JSON
    assert printed["config"] == report["config"] and printed["runs"][0]["completed"] == 3
    # Progress on stderr: the server start and each run, with its outcome.
    assert "starting pagedkv serve ..." in res.stderr
    assert "run rate=50: 3 requests ..." in res.stderr
    assert "run rate=50: done in " in res.stderr and "(3 ok, 0 failed)" in res.stderr
