"""The ``pagedkv`` command: one subcommand per small module in ``pagedkv.entrypoints.cli``.

Convention for subcommand modules: ``add_parser(subparsers)`` registers the arguments and
``set_defaults(func=run)``; ``run(args) -> int`` returns the exit code. Keep heavy imports
(torch, the engine) inside ``run`` so ``pagedkv plan`` and ``--help`` start instantly.
To add a subcommand, write its module and append one small ``_add_<name>`` function to
``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from pagedkv.entrypoints.cli.common import CLIError, read_model_config

__all__ = ["CLIError", "build_parser", "main", "read_model_config"]


def _add_plan(subparsers: Any) -> None:
    from pagedkv.entrypoints.cli import plan

    plan.add_parser(subparsers)


def _add_generate(subparsers: Any) -> None:
    from pagedkv.entrypoints.cli import generate

    generate.add_parser(subparsers)


def _add_chat(subparsers: Any) -> None:
    from pagedkv.entrypoints.cli import chat

    chat.add_parser(subparsers)


def _add_bench(subparsers: Any) -> None:
    from pagedkv.entrypoints.cli import bench

    bench.add_parser(subparsers)


def _add_serve(subparsers: Any) -> None:
    from pagedkv.entrypoints.cli import serve

    serve.add_parser(subparsers)


def _add_events(subparsers: Any) -> None:
    from pagedkv.entrypoints.cli import events as events_cli

    events_cli.add_parser(subparsers)


def _add_proxy(subparsers: Any) -> None:
    from pagedkv.entrypoints.cli import proxy

    proxy.add_parser(subparsers)


def _add_router(subparsers: Any) -> None:
    from pagedkv.entrypoints.cli import router

    router.add_parser(subparsers)


def _add_simulate(subparsers: Any) -> None:
    from pagedkv.sim import cli as sim_cli

    sim_cli.add_parser(subparsers)


# Registration order = order in ``pagedkv --help``.
SUBCOMMANDS: list[Callable[[Any], None]] = [_add_plan, _add_generate, _add_chat, _add_bench]
SUBCOMMANDS += [_add_serve, _add_proxy, _add_router, _add_events, _add_simulate]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pagedkv")
    except PackageNotFoundError:
        from pagedkv import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedkv",
        description="A paged KV-cache memory system for LLM inference.",
        epilog="Run 'pagedkv COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"pagedkv {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def _stdout_closed() -> int:
    """The reader of our stdout went away (``pagedkv plan --json | head``): stop quietly, as
    ``cat`` would. Pointing stdout at /dev/null stops Python's exit-time flush from failing again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141  # 128 + SIGPIPE: what a shell reports for a writer killed by a closed pipe


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (console script ``pagedkv``); returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except CLIError as e:
        print(f"pagedkv {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt:
        return 130
