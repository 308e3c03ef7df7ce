"""The ``pagedkv`` command: one subcommand per small module in ``pagedkv.entrypoints``.

Convention for subcommand modules: ``add_parser(subparsers)`` registers the arguments and
``set_defaults(func=run)``; ``run(args) -> int`` returns the exit code. Keep heavy imports
(torch, the engine) inside ``run`` so ``pagedkv plan`` and ``--help`` start instantly.
To add a subcommand, write its module and append one small ``_add_<name>`` function to
``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any


def _add_plan(subparsers: Any) -> None:
    from pagedkv.entrypoints import plan

    plan.add_parser(subparsers)


def _add_generate(subparsers: Any) -> None:
    from pagedkv.entrypoints import generate

    generate.add_parser(subparsers)


def _add_chat(subparsers: Any) -> None:
    from pagedkv.entrypoints import chat

    chat.add_parser(subparsers)


def _add_bench(subparsers: Any) -> None:
    from pagedkv.entrypoints import bench

    bench.add_parser(subparsers)


def _add_serve(subparsers: Any) -> None:
    from pagedkv.entrypoints import serve

    serve.add_parser(subparsers)


def _add_events(subparsers: Any) -> None:
    from pagedkv.entrypoints import events_cli

    events_cli.add_parser(subparsers)


# Registration order = order in ``pagedkv --help``.
SUBCOMMANDS: list[Callable[[Any], None]] = [_add_plan, _add_generate, _add_chat, _add_bench]
SUBCOMMANDS += [_add_serve, _add_events]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedkv", description="A paged KV-cache memory system for LLM inference.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (console script ``pagedkv``); returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
