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


def pagedkv(*argv: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CMD, *argv], input=stdin, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "2"], "top_p"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--n", "0"], "n="),
    (["--block-size", "0"], "block_size"),
    (["--model", "/no/such/model.gguf"], "/no/such/model.gguf"),
    (["--system", "be brief"], "--system needs --chat"),
])
def test_bad_options_exit_2_with_one_line(capsys, argv: list[str], message: str) -> None:
    assert main(["generate", "hello", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_unparseable_option_is_an_argparse_error(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", "hello", "--max-tokens", "many"])
    assert e.value.code == 2 and "--max-tokens" in capsys.readouterr().err


def test_generate_text_and_json() -> None:
    res = pagedkv("generate", "The capital of France is", "--temperature", "0", "--max-tokens", "6", *SMALL)
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout

    res = pagedkv("generate", "What is the capital of France?", "--chat", "--json", "--temperature", "0",
                  "--max-tokens", "24", *SMALL)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert {"text", "token_ids", "finish_reason", "num_cached_tokens", "ttft", "outputs"} <= set(out)
    assert "Paris" in out["text"] and out["finish_reason"] == "stop"
    assert 0 < len(out["token_ids"]) <= 24 and out["num_cached_tokens"] == 0
    assert 0 < out["ttft"] <= out["e2e_latency"]
    assert "<|im_start|>user" in out["prompt"]  # the chat template was applied


def test_generate_n_stop_and_too_long_prompt() -> None:
    res = pagedkv("generate", "One, two, three,", "--n", "2", "--seed", "3", "--max-tokens", "8", "--json",
                  "--stop", "\n", *SMALL)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert [c["index"] for c in out["outputs"]] == [0, 1]
    assert all("\n" not in c["text"] for c in out["outputs"])

    res = pagedkv("generate", "word " * 400, "--max-model-len", "128", "--num-kv-blocks", "64")
    assert res.returncode == 2 and "longer than the maximum model length" in res.stderr
    assert "Traceback" not in res.stderr


def test_chat_two_turns_reset_and_exit() -> None:
    """Two turns through piped stdin: both answered, the second using the first as context;
    /reset clears the history; /exit ends the session with code 0 (the last line never runs)."""
    stdin = ("What is the capital of France?\n"
             "What did I just ask you about? Answer in one word.\n"
             "/reset\n"
             "/exit\n"
             "This line is never read\n")
    res = pagedkv("chat", "--temperature", "0", "--max-tokens", "24", "--stats", *SMALL, stdin=stdin)
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


def test_chat_ends_at_eof() -> None:
    res = pagedkv("chat", "--temperature", "0", "--max-tokens", "8", *SMALL, stdin="Hello!\n")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()
