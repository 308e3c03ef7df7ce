"""``pagedkv.envs``: the one reader of ``PAGEDKV_*`` variables, read at access time."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pagedkv import envs

SRC = Path(__file__).resolve().parents[1] / "src" / "pagedkv"


def test_values_are_read_when_accessed(monkeypatch) -> None:
    monkeypatch.delenv("PAGEDKV_NATIVE_STEP", raising=False)
    assert envs.PAGEDKV_NATIVE_STEP is True
    for off in ("0", "OFF", "false", "no"):
        monkeypatch.setenv("PAGEDKV_NATIVE_STEP", off)
        assert envs.PAGEDKV_NATIVE_STEP is False
    monkeypatch.setenv("PAGEDKV_NATIVE_STEP", "1")
    assert envs.PAGEDKV_NATIVE_STEP is True


def test_parsers_keep_each_variables_meaning(monkeypatch) -> None:
    """The meanings the variables had when each module read its own (unset, "0", other)."""
    cases = {
        "PAGEDKV_NATIVE": [
            (None, "auto"),
            ("0", "off"),
            ("No", "off"),
            ("1", "on"),
            ("YES", "on"),
            ("auto", "auto"),
            ("bogus", "auto"),
        ],
        "PAGEDKV_NATIVE_ISA": [(None, ""), ("AVX2", "avx2")],
        "PAGEDKV_DENSE_LINEAR": [
            (None, "auto"),
            ("oneDNN", "onednn"),
            ("MKL_Packed", "mkl_packed"),
        ],
        "PAGEDKV_TRITON": [(None, True), ("0", False), ("off", True)],
        "PAGEDKV_THP": [(None, True), ("0", False), ("1", True)],
        "PAGEDKV_KV_EVENTS_USE_INT_BLOCK_HASHES": [
            (None, False),
            ("", False),
            ("1", True),
            ("0", True),
        ],
        "PAGEDKV_API_KEY": [(None, None), ("", None), ("k", "k")],
        "PAGEDKV_BENCH_DIR": [(None, None), ("/scratch", "/scratch")],
    }
    for name, pairs in cases.items():
        for raw, want in pairs:
            if raw is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, raw)
            assert getattr(envs, name) == want, (name, raw)
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", "/tmp/x")
    assert envs.PAGEDKV_CACHE_DIR == Path("/tmp/x")
    monkeypatch.delenv("PAGEDKV_CACHE_DIR")
    assert envs.PAGEDKV_CACHE_DIR == Path.home() / ".cache" / "pagedkv"


def test_unknown_names_fail_loudly() -> None:
    with pytest.raises(AttributeError):
        envs.PAGEDKV_NO_SUCH_VARIABLE  # noqa: B018
    with pytest.raises(KeyError):
        envs.get("PAGEDKV_NO_SUCH_VARIABLE")


def test_describe_lists_every_variable_with_a_default_and_a_doc() -> None:
    rows = envs.describe()
    assert [r["name"] for r in rows] == list(envs.ENV_VARS)
    assert all(r["name"].startswith("PAGEDKV_") and r["doc"] for r in rows)
    assert set(envs.__dir__()) >= set(envs.ENV_VARS)


def test_envs_is_the_only_reader_and_imports_nothing_of_pagedkv() -> None:
    """No other module reads a PAGEDKV_* variable from os.environ / os.getenv, and envs.py
    stays layer 0: no torch, no pagedkv import."""
    readers = []
    pattern = re.compile(r"(environ(\.get)?\s*[\[(]|getenv\s*\()\s*[\"']PAGEDKV_")
    for f in sorted(SRC.rglob("*.py")):
        if f.name != "envs.py" and pattern.search(f.read_text(encoding="utf-8")):
            readers.append(str(f.relative_to(SRC)))
    assert not readers, f"read PAGEDKV_* directly: {readers}"
    tree = ast.parse((SRC / "envs.py").read_text(encoding="utf-8"))
    imported = {
        a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    imported |= {
        n.module.split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module and not n.level
    }
    assert not imported & {"pagedkv", "torch"}, imported


def test_every_variable_named_in_the_source_is_in_the_table() -> None:
    """A PAGEDKV_* name mentioned in src/ (docstrings, messages) is one envs.py documents."""
    names = set()
    for f in SRC.rglob("*.py"):
        names |= set(re.findall(r"\bPAGEDKV_[A-Z0-9_]+\b", f.read_text(encoding="utf-8")))
    assert names <= set(envs.ENV_VARS), sorted(names - set(envs.ENV_VARS))
