"""``pagedkv generate`` and ``pagedkv chat`` on the real default model.

Option errors are checked in-process (they fail before the model loads); completions and the
interactive chat run as real subprocesses, the chat driven through piped stdin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedkv.entrypoints.cli import main

SCRIPT = os.path.join(os.path.dirname(sys.executable), "pagedkv")
CMD = [SCRIPT] if os.path.exists(SCRIPT) else [sys.executable, "-m", "pagedkv.entrypoints.cli"]
SMALL = ["--max-model-len", "256", "--num-kv-blocks", "64"]  # small KV pool: quick to allocate


def pagedkv(
    *argv: str, stdin: str | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CMD, *argv], input=stdin, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "2"], "top_p"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--n", "0"], "n="),
        (["--block-size", "0"], "block_size"),
        (["--model", "/no/such/model.gguf"], "/no/such/model.gguf"),
        (["--system", "be brief"], "--system needs --chat"),
    ],
)
def test_bad_options_exit_2_with_one_line(capsys, argv: list[str], message: str) -> None:
    assert main(["generate", "hello", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_unparseable_option_is_an_argparse_error(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", "hello", "--max-tokens", "many"])
    assert e.value.code == 2 and "--max-tokens" in capsys.readouterr().err


@pytest.mark.slow  # a CLI subprocess: torch import + model load
def test_generate_text_and_json() -> None:
    res = pagedkv(
        "generate", "The capital of France is", "--temperature", "0", "--max-tokens", "6", *SMALL
    )
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout

    res = pagedkv(
        "generate",
        "What is the capital of France?",
        "--chat",
        "--json",
        "--temperature",
        "0",
        "--max-tokens",
        "24",
        *SMALL,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert {"text", "token_ids", "finish_reason", "num_cached_tokens", "ttft", "outputs"} <= set(
        out
    )
    assert "Paris" in out["text"] and out["finish_reason"] == "stop"
    assert 0 < len(out["token_ids"]) <= 24 and out["num_cached_tokens"] == 0
    assert 0 < out["ttft"] <= out["e2e_latency"]
    assert "<|im_start|>user" in out["prompt"]  # the chat template was applied


@pytest.mark.slow  # a CLI subprocess: torch import + model load
def test_generate_n_stop_and_too_long_prompt() -> None:
    res = pagedkv(
        "generate",
        "One, two, three,",
        "--n",
        "2",
        "--seed",
        "3",
        "--max-tokens",
        "8",
        "--json",
        "--stop",
        "\n",
        *SMALL,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert [c["index"] for c in out["outputs"]] == [0, 1]
    assert all("\n" not in c["text"] for c in out["outputs"])

    res = pagedkv("generate", "word " * 400, "--max-model-len", "128", "--num-kv-blocks", "64")
    assert res.returncode == 2 and "longer than the maximum model length" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow  # a CLI subprocess: torch import + model load
def test_chat_two_turns_reset_and_exit() -> None:
    """Two turns through piped stdin: both answered, the second using the first as context;
    /reset clears the history; /exit ends the session with code 0 (the last line never runs)."""
    stdin = (
        "What is the capital of France?\n"
        "What did I just ask you about? Answer in one word.\n"
        "/reset\n"
        "/exit\n"
        "This line is never read\n"
    )
    res = pagedkv(
        "chat", "--temperature", "0", "--max-tokens", "24", "--stats", *SMALL, stdin=stdin
    )
    assert res.returncode == 0, res.stderr
    replies = [line for line in res.stdout.splitlines() if line.strip()]
    assert len(replies) == 2, res.stdout
    assert "Paris" in replies[0]
    assert "[conversation cleared]" in res.stderr
    # The second turn re-sends the first exchange: its prompt hits the prefix cache.
    stats = [line for line in res.stderr.splitlines() if "prompt tokens cached" in line]
    assert len(stats) == 2
    cached = int(stats[1].split(", ")[-1].split("/")[0])
    assert cached >= 16


@pytest.mark.slow
def test_chat_ends_at_eof() -> None:
    res = pagedkv("chat", "--temperature", "0", "--max-tokens", "8", *SMALL, stdin="Hello!\n")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()


@pytest.mark.slow  # a CLI subprocess: torch import + model load
def test_generate_shows_loading_progress_and_the_plan_summary() -> None:
    """stderr: "loading model ... done in X s", then the same one-line KV summary `pagedkv plan`
    prints for the same settings; stdout holds only the completion."""
    flags = ["--max-model-len", "256", "--kv-cache-memory", "64MiB"]
    res = pagedkv(
        "generate", "The capital of France is", "--temperature", "0", "--max-tokens", "4", *flags
    )
    assert res.returncode == 0, res.stderr
    plan = pagedkv("plan", "--memory", "64MiB", "--context", "256", "--json")
    summary = json.loads(plan.stdout)["summary"]
    lines = res.stderr.strip().splitlines()
    assert lines[0].startswith("pagedkv generate: loading model ") and " ... done in " in lines[0]
    assert lines[0].endswith(" s")
    assert lines[1] == f"pagedkv generate: {summary}"
    assert summary.startswith("KV cache: 91 blocks of 16 tokens")  # 64 MiB / 720 KiB per fp32 block
    assert "Paris" in res.stdout and "KV cache" not in res.stdout


@pytest.mark.slow  # a CLI subprocess: torch import + model load
def test_chat_help_unknown_commands_and_cut_replies() -> None:
    """The banner comes before the model loads; /help lists the commands; an unknown /command
    is refused and never sent to the model (one request in all); a reply that hits
    --max-tokens says so; "//" sends a message starting with "/"."""
    stdin = (
        "/help\n/frobnicate the model\nWhat is the capital of France?\n//etc is a folder\n/exit\n"
    )
    res = pagedkv("chat", "--temperature", "0", "--max-tokens", "3", "--stats", *SMALL, stdin=stdin)
    assert res.returncode == 0, res.stderr
    err = res.stderr.splitlines()
    banner = err.index("pagedkv chat: type a message; /help lists commands, /exit quits.")
    loading = next(i for i, line in enumerate(err) if "loading model" in line)
    assert banner < loading
    assert "  /reset   clear the conversation (keeps --system)" in err
    assert any(line.startswith("unknown command /frobnicate: type /help") for line in err)
    assert err.count("[reply cut at --max-tokens 3]") == 2
    assert (
        len([line for line in err if "prompt tokens cached" in line]) == 2
    )  # two requests, not three
    assert len([line for line in res.stdout.splitlines() if line.strip()]) == 2


def test_llm_generate_progress_bar_shows_token_speeds(capsys) -> None:
    """vLLM's bar postfix: "est. speed input: X toks/s, output: Y toks/s"."""
    import re

    from pagedkv import LLM, SamplingParams

    llm = LLM(max_model_len=128, num_kv_blocks=32)
    llm.generate(["Hello", "The capital of France is"], SamplingParams(temperature=0, max_tokens=3))
    err = capsys.readouterr().err
    m = re.findall(r"est\. speed input: ([0-9.]+) toks/s, output: ([0-9.]+) toks/s", err)
    assert m, err[-500:]
    assert float(m[-1][0]) > 0 and float(m[-1][1]) > 0


# ---------------------------------------------------------------- --kv-transfer-config

OFFLOAD_JSON = json.dumps(
    {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kv_offload": "cpu:64MiB"},
    }
)


@pytest.mark.parametrize("command", [["generate", "hello"], ["serve", "--port", "0"]])
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kv-transfer-config", "{not json"], "--kv-transfer-config is not valid JSON"),
        (["--kv-transfer-config", '{"kv_conector": "OffloadingConnector"}'], "'kv_conector'"),
        (
            ["--kv-transfer-config", '{"kv_connector": "Nope", "kv_role": "kv_both"}'],
            "unknown kv_connector 'Nope'",
        ),
        (
            ["--kv-transfer-config", '{"kv_connector": "OffloadingConnector", "kv_role": "both"}'],
            "kv_role='both'",
        ),
        (
            ["--kv-transfer-config", OFFLOAD_JSON, "--kv-offload", "cpu:64MiB"],
            "either --kv-offload or --kv-transfer-config",
        ),
    ],
)
def test_bad_kv_transfer_config_exits_2_with_one_line(
    capsys, command: list[str], argv: list[str], message: str
) -> None:
    """generate and serve refuse a bad --kv-transfer-config before the model loads: one line
    naming the flag (and the bad field), exit code 2."""
    assert main([*command, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1
    assert "--kv-transfer-config" in err and "loading model" not in err


def test_kv_transfer_config_flag_reaches_the_engine(capsys) -> None:
    """The flag's JSON becomes the engine's typed `KVTransferConfig` (generate's and serve's
    wiring alike) and the engine builds the connector it names."""
    from pagedkv.entrypoints.cli import build_parser
    from pagedkv.entrypoints.cli.generate import engine_kwargs, make_llm
    from pagedkv.entrypoints.cli.serve import engine_config
    from pagedkv.kv_transfer.config import KVTransferConfig
    from pagedkv.offload.spec import OffloadConfig

    parser = build_parser()
    serve_config = engine_config(parser.parse_args(["serve", "--kv-transfer-config", OFFLOAD_JSON]))
    assert serve_config.kv_transfer_config.kv_connector == "OffloadingConnector"
    assert serve_config.kv_offload is None  # the short form was not used

    args = parser.parse_args(
        [
            "generate",
            "The capital of France is",
            "--temperature",
            "0",
            "--max-tokens",
            "4",
            "--kv-transfer-config",
            OFFLOAD_JSON,
            *SMALL,
        ]
    )
    kvt = engine_kwargs(args)["kv_transfer_config"]
    assert isinstance(kvt, KVTransferConfig) and kvt.kv_role == "kv_both"
    assert (
        "offload_config" not in kvt.kv_connector_extra_config
    )  # the engine config works on a copy
    llm = make_llm(args)
    try:
        assert type(llm.llm_engine.connector).__name__ == "OffloadingConnector"
        extra = llm.llm_engine.config.kv_transfer_config.kv_connector_extra_config
        assert extra["kv_offload"] == "cpu:64MiB"
        assert isinstance(
            extra["offload_config"], OffloadConfig
        )  # parsed once, into the typed config
        assert llm.llm_engine.connector.offload_config is extra["offload_config"]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow  # a CLI subprocess: torch import + model load
def test_generate_with_kv_transfer_config() -> None:
    """The documented OffloadingConnector config runs a completion end to end."""
    res = pagedkv(
        "generate",
        "The capital of France is",
        "--temperature",
        "0",
        "--max-tokens",
        "4",
        "--json",
        "--kv-transfer-config",
        OFFLOAD_JSON,
        *SMALL,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert "Paris" in out["text"] and 0 < len(out["token_ids"]) <= 4
