"""``EngineArgs`` (engine/arg_utils.py): each engine option declared once, and every
subcommand's engine flags built from it with the engine's own defaults and accepted values."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

import pytest

from pagedkv.core.specs import KV_CACHE_DTYPES
from pagedkv.engine.arg_utils import CACHE_ARGS, KV_EVENTS_ARGS, SCHEDULER_ARGS, EngineArgs
from pagedkv.engine.config import DTYPES, KV_OFFLOAD_CACHE_POLICIES, PREEMPTION_MODES, EngineConfig
from pagedkv.entrypoints.cli import build_parser

SRC = Path(__file__).resolve().parents[1] / "src" / "pagedkv"
CONFIG_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}


def _parser(include=CACHE_ARGS + SCHEDULER_ARGS + KV_EVENTS_ARGS) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p, include=include)
    return p


def _subparser(*path: str) -> argparse.ArgumentParser:
    p = build_parser()
    for name in path:
        action = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        p = action.choices[name]
    return p


def _defaults(p: argparse.ArgumentParser) -> dict[str, object]:
    return {a.dest: a.default for a in p._actions}


def test_fields_are_engine_config_fields_with_its_defaults_and_a_help() -> None:
    for f in dataclasses.fields(EngineArgs):
        assert f.metadata.get("help"), f"{f.name} has no help"
        if f.name == "kv_side_channel_port":  # CLI-only: folded into kv_transfer_config
            continue
        assert f.name in CONFIG_FIELDS, f.name
        assert f.default == CONFIG_FIELDS[f.name].default, f.name
    assert set(CONFIG_FIELDS) <= {f.name for f in dataclasses.fields(EngineArgs)}


def test_default_flags_give_the_default_engine_config() -> None:
    args = _parser().parse_args([])
    assert EngineArgs.from_cli_args(args).create_engine_config() == EngineConfig()
    assert EngineArgs().create_engine_config() == EngineConfig()


def test_from_cli_args_maps_flags_to_fields() -> None:
    args = _parser().parse_args(
        [
            "--block-size",
            "32",
            "--no-prefix-caching",
            "--kv-cache-memory",
            "64MiB",
            "--max-num-seqs",
            "7",
            "--enable-kv-cache-events",
            "--dtype",
            "bfloat16",
        ]
    )
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert (config.block_size, config.enable_prefix_caching, config.kv_cache_memory) == (
        32,
        False,
        64 << 20,
    )
    assert (config.max_num_seqs, config.enable_kv_cache_events, config.dtype) == (
        7,
        True,
        "bfloat16",
    )
    # generate's sampling --seed is None when unset: the engine seed keeps its default.
    assert EngineArgs.from_cli_args(argparse.Namespace(seed=None)).seed == 0
    assert EngineArgs.from_cli_args(argparse.Namespace(seed=5, temperature=0.0)).seed == 5


def test_kv_transfer_json_and_side_channel_port_are_folded_in() -> None:
    text = json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"kv_offload": "cpu:64MiB"},
        }
    )
    args = _parser().parse_args(["--kv-transfer-config", text, "--kv-side-channel-port", "5600"])
    kw = EngineArgs.from_cli_args(args).config_kwargs()
    assert "kv_side_channel_port" not in kw
    assert kw["kv_transfer_config"].kv_connector_extra_config["side_channel_port"] == 5600
    with pytest.raises(ValueError, match="--kv-side-channel-port needs --kv-transfer-config"):
        EngineArgs(kv_side_channel_port=1).config_kwargs()


def test_choices_are_what_engine_config_accepts() -> None:
    """One list per option: every choice the CLI offers passes EngineConfig's check, and
    a value outside it fails both."""
    actions = {a.dest: a for a in _parser()._actions}
    assert tuple(actions["dtype"].choices) == DTYPES
    assert tuple(actions["preemption_mode"].choices) == PREEMPTION_MODES
    for dtype in DTYPES:
        EngineConfig(dtype=dtype)
    for mode in KV_CACHE_DTYPES:
        EngineConfig(kv_cache_dtype=mode)
    for policy in KV_OFFLOAD_CACHE_POLICIES:
        EngineConfig(kv_offload_cache_policy=policy)
    for rotation in actions["kv_rotation"].choices:
        EngineConfig(kv_rotation=rotation)
    with pytest.raises(ValueError, match="choose " + ", ".join(KV_CACHE_DTYPES[:-1])):
        EngineConfig(kv_cache_dtype="int5")
    with pytest.raises(SystemExit):
        _parser().parse_args(["--dtype", "int3"])


def test_kv_cache_dtype_help_names_every_accepted_value() -> None:
    for path in (("generate",), ("chat",), ("serve",), ("plan",)):
        action = next(a for a in _subparser(*path)._actions if a.dest == "kv_cache_dtype")
        assert all(re.search(rf"\b{v}\b", action.help) for v in KV_CACHE_DTYPES), path


def test_subcommands_share_the_engine_defaults() -> None:
    """The 16 / 128 / 2048 defaults are EngineConfig's in every subcommand that has the flag
    (the simulator's and benchmarks' own context lengths and pool sizes aside)."""
    d = EngineConfig()
    own = {("bench", "memory"): {"max_num_batched_tokens"}}  # its hybrid row's prefill chunk
    checked = 0
    for path in (
        ("plan",),
        ("generate",),
        ("chat",),
        ("serve",),
        ("simulate", "run"),
        ("simulate", "sweep"),
        ("bench", "prefix-cache"),
        ("bench", "serve"),
        ("bench", "memory"),
    ):
        defaults = _defaults(_subparser(*path))
        for name in {"block_size", "max_num_seqs", "max_num_batched_tokens", "dtype"} - own.get(
            path, set()
        ):
            if name in defaults:
                assert defaults[name] == getattr(d, name), (path, name)
                checked += 1
    assert checked >= 20


def test_help_and_defaults_of_the_subset_flags() -> None:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(
        p, include=("max_num_seqs",), overrides=dict(max_num_seqs=dict(default=3))
    )
    assert p.parse_args([]).max_num_seqs == 3
    assert "(default 3)" in p.format_help()
    with pytest.raises(KeyError):
        EngineArgs.add_cli_args(argparse.ArgumentParser(), include=("no_such_option",))


def test_subcommands_declare_no_engine_flag_by_hand() -> None:
    """The engine flags of the subcommands come from EngineArgs: no ``add_argument`` of them in
    entrypoints/ or sim/ (a hand-typed copy would drift from the engine's default)."""
    flags = (
        "--block-size",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--kv-cache-dtype",
        "--dtype",
        "--num-kv-blocks",
        "--preemption-mode",
        "--kv-offload",
    )
    call = re.compile(r"add_argument\(\s*(\"[^\"]+\"(?:\s*,\s*\"[^\"]+\")*)")
    found = []
    for folder in ("entrypoints", "sim"):
        for f in sorted((SRC / folder).rglob("*.py")):
            for m in call.finditer(f.read_text(encoding="utf-8")):
                names = re.findall(r"\"([^\"]+)\"", m.group(1))
                found += [f"{f.relative_to(SRC)}: {n}" for n in names if n in flags]
    assert not found, found


def test_describe_lists_every_option_for_the_docs() -> None:
    rows = {r["name"]: r for r in EngineArgs.describe()}
    assert set(rows) == {f.name for f in dataclasses.fields(EngineArgs)}
    assert rows["block_size"]["help"] == "tokens per KV block (default 16)"
    assert (
        rows["enable_prefix_caching"]["flag"] == "--no-prefix-caching, --no-enable-prefix-caching"
    )
    assert rows["dtype"]["choices"] == ", ".join(DTYPES)
