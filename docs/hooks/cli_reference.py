"""The CLI reference: every ``pagedkv`` subcommand, walked recursively from
``pagedkv.entrypoints.cli.build_parser()``, as its usage, description, option tables and examples.

Defaults that come from a ``PAGEDKV_*`` environment variable are shown as ``$NAME``, never as the
build machine's value.
"""

from __future__ import annotations

import argparse
import html
import os

from md import cell, code, slug, table


def _options_table(parser: argparse.ArgumentParser) -> str:
    fmt = parser._get_formatter()
    env_values = {v: k for k, v in os.environ.items() if k.startswith("PAGEDKV_") and v}
    out = []
    for group in parser._action_groups:
        rows = []
        for action in group._group_actions:
            if action.help == argparse.SUPPRESS or isinstance(
                action, (argparse._HelpAction, argparse._SubParsersAction)
            ):
                continue
            names = ", ".join(action.option_strings) or action.dest
            if action.option_strings and action.nargs != 0:
                # A metavar, not "{a,b,c}": the choices go in the help column, the name stays short.
                metavar = action.metavar or action.dest.upper()
                plain = argparse.Action([], action.dest, nargs=action.nargs, metavar=metavar)
                names += f" {fmt._format_args(plain, metavar)}"
            default = action.default
            shown = "" if default in (None, argparse.SUPPRESS) or action.nargs == 0 else default
            # A default read from the environment (e.g. --api-key from PAGEDKV_API_KEY) is named,
            # never printed: the build machine's secrets must not reach the site.
            if isinstance(shown, str) and shown in env_values:
                shown = "$" + env_values[shown]
            help_text = fmt._expand_help(action) if action.help else ""
            if action.choices and not isinstance(action.choices, dict):
                help_text += f" (choices: {', '.join(map(str, action.choices))})"
            rows.append([code(names), code(shown) if shown != "" else "", cell(help_text)])
        if rows:
            title = group.title or "options"
            out.append(f"**{cell(title)}**\n\n" + table(["option", "default", "help"], rows))
    return "\n".join(out)


def _walk(parser: argparse.ArgumentParser, path: list[str], depth: int) -> list[str]:
    parts = []
    if path:
        name = " ".join(path)
        parts.append(f"{'#' * min(depth + 1, 4)} pagedkv {name}\n")
        desc = (parser.description or "").strip()
        if desc:  # paragraphs kept; Markdown joins the lines of each
            parts.append(html.escape(desc, quote=False) + "\n")
        usage = parser.format_usage().strip()
        parts.append(f"```text\n{usage}\n```\n")
        opts = _options_table(parser)
        if opts:
            parts.append(opts)
        if parser.epilog and "\n" in parser.epilog.strip():  # examples, kept verbatim
            parts.append(f"```text\n{parser.epilog.strip()}\n```\n")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            seen: set[int] = set()
            for sub_name, sub in action.choices.items():
                if id(sub) in seen:  # an alias
                    continue
                seen.add(id(sub))
                if not sub.description and helps.get(sub_name):
                    sub.description = helps[sub_name]
                parts += _walk(sub, [*path, sub_name], depth + 1)
    return parts


def render_cli() -> str:
    from pagedkv.entrypoints.cli import build_parser

    parser = build_parser()
    top = parser.format_usage().strip()
    commands = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            commands = [
                [f"[`{n}`](#{slug('pagedkv ' + n)})", cell(helps.get(n, ""))]
                for n in action.choices
            ]
    head = f"```text\n{top}\n```\n\n" + table(["command", "what it does"], commands)
    return head + "\n" + "\n".join(_walk(parser, [], 1))
