"""The first hour with the CLI: help written for users, ``--version``, and every user error as
one line on stderr with exit code 2 (never a traceback). Real processes where it matters."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.entrypoints.cli import main

SCRIPT = os.path.join(os.path.dirname(sys.executable), "pagedkv")
CMD = [SCRIPT] if os.path.exists(SCRIPT) else [sys.executable, "-m", "pagedkv.entrypoints.cli"]


def pagedkv(*argv: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CMD, *argv], capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(res: subprocess.CompletedProcess, *needles: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- help and version

HELP_COMMANDS = [
    [],
    ["plan"],
    ["generate"],
    ["chat"],
    ["serve"],
    ["events"],
    ["bench"],
    ["bench", "throughput"],
    ["bench", "prefix-cache"],
    ["bench", "memory"],
    ["bench", "serve"],
    ["bench", "disagg"],
    ["bench", "router"],
    ["proxy"],
    ["router"],
    ["simulate"],
    ["simulate", "run"],
    ["simulate", "sweep"],
]


@pytest.mark.parametrize("argv", HELP_COMMANDS, ids=lambda a: " ".join(a) or "pagedkv")
def test_help_is_written_for_users(capsys, argv: list[str]) -> None:
    """No module docstrings (reST double backticks, source file names, "Usage: python ...")."""
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: pagedkv")
    assert "``" not in out
    assert ".py" not in out, [line for line in out.splitlines() if ".py" in line]
    assert "Usage: python" not in out and "docstring" not in out
    if argv:
        assert len(out.split("\n\n")[1]) > 40  # a description, not just the usage line


def test_version() -> None:
    from importlib.metadata import version

    res = pagedkv("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"pagedkv {version('pagedkv')}"


# ---------------------------------------------------------------- one-line errors


def test_plan_with_a_config_missing_keys(tmp_path: Path) -> None:
    """Was a KeyError traceback."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    assert_one_line_error(
        pagedkv("plan", "--model", str(cfg)),
        "pagedkv plan: error:",
        str(cfg),
        "num_attention_heads",
    )


@pytest.mark.slow
def test_generate_with_a_model_dir_whose_config_is_broken(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    assert_one_line_error(
        pagedkv("generate", "hi", "--model", str(tmp_path)),
        "pagedkv generate: error:",
        "num_attention_heads",
    )
    (tmp_path / "config.json").write_text("{not json")
    assert_one_line_error(
        pagedkv("generate", "hi", "--model", str(tmp_path)), "pagedkv generate: error:"
    )


@pytest.mark.parametrize("endpoint", ["foo", "tcp://127.0.0.1"])
def test_events_with_a_bad_endpoint(endpoint: str) -> None:
    """Was a ZMQError traceback."""
    assert_one_line_error(
        pagedkv("events", "--endpoint", endpoint, "--idle-timeout", "1"),
        "pagedkv events: error:",
        repr(endpoint),
        "tcp://",
    )


def test_plan_into_a_closed_pipe_is_quiet() -> None:
    """``pagedkv plan --json | head -c 10`` was a BrokenPipeError traceback. The reader goes
    away before plan writes: plan stops quietly with 141 (128 + SIGPIPE), as cat does."""
    proc = subprocess.Popen(
        [*CMD, "plan", "--memory", "1GiB", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # the reader is gone before the first write
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141, err
    assert err == ""


@pytest.mark.slow
def test_serve_refuses_a_kv_cache_too_small_before_loading_the_model() -> None:
    """`serve --num-kv-blocks 40` used to start and thrash later. Now one line, exit 2, naming
    the length that fits (39 usable blocks x 16 = 624) and the flags, before the weights load."""
    port = str(free_port())
    res = pagedkv("serve", "--num-kv-blocks", "40", "--port", port)
    assert_one_line_error(
        res,
        "pagedkv serve: error:",
        "estimated maximum model length is 624",
        "--max-model-len",
        "--num-kv-blocks",
    )
    assert "loading model" not in res.stderr
    res = pagedkv("generate", "hi", "--kv-cache-memory", "16MiB")
    assert_one_line_error(res, "estimated maximum model length is 336", "--kv-cache-memory")


def test_bench_serve_bad_option_is_one_line() -> None:
    assert_one_line_error(
        pagedkv("bench", "serve", "--input-len", "8", "--prefix-len", "9"), "--prefix-len"
    )


# ---------------------------------------------------------------- events: silence


@pytest.mark.slow
def test_events_says_when_nothing_arrives() -> None:
    res = pagedkv(
        "events",
        "--endpoint",
        f"tcp://127.0.0.1:{free_port()}",
        "--silence-warning",
        "1",
        "--idle-timeout",
        "3",
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert lines == [
        "pagedkv events: no events in 1 s: is the server running with KV events enabled "
        "(pagedkv serve --enable-kv-cache-events) on this endpoint?"
    ]


# ---------------------------------------------------------------- plan defaults


def test_plan_needs_no_memory_and_defaults_to_the_engine(capsys) -> None:
    """Defaults: float32 and 1 GiB (the engine's on CPU), so no --memory is needed; the summary
    line the engine prints at start is in the text output."""
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "KV cache memory: 1.00 GiB (the engine's default on CPU)" in out
    assert (
        "KV cache: 1,456 blocks of 16 tokens x 737,280 B = 1023.75 MiB, 23,280 tokens, "
        "max 2.84 concurrent requests at max_model_len 8192"
    ) in out
    assert "KV float32" in out


@pytest.mark.slow  # a CLI subprocess: torch import + model load
def test_serve_prints_loading_progress_and_the_plan_summary() -> None:
    """On stderr before "listening on": the loading line and `pagedkv plan`'s summary for the
    same settings."""
    plan = subprocess.run(
        [*CMD, "plan", "--memory", "64MiB", "--context", "256", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    summary = json.loads(plan.stdout)["summary"]
    proc = subprocess.Popen(
        [*CMD, "serve", "--port", "0", "--kv-cache-memory", "64MiB", "--max-model-len", "256"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if "listening on" in line:
                break
    finally:
        proc.terminate()
        proc.wait(60)
    assert any(
        line.startswith("pagedkv serve: loading model ") and " ... done in " in line
        for line in lines
    ), lines
    assert f"pagedkv serve: {summary}" in lines


def test_a_bad_kv_cache_layout_is_one_line() -> None:
    res = pagedkv("generate", "hi", "--kv-cache-layout", "LBNCH")
    assert_one_line_error(res, "kv_cache_layout='LBNCH'", "C last")
