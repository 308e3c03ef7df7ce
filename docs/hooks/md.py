"""Markdown building blocks shared by the docs generators (tables, cells, inline code)."""

from __future__ import annotations

import html
import re
from collections.abc import Iterable
from typing import Any


def cell(value: Any) -> str:
    """One Markdown table cell: pipes escaped, HTML escaped, newlines folded."""
    text = "" if value is None else str(value)
    text = html.escape(" ".join(text.split()), quote=False)
    return text.replace("|", "\\|")


def code(value: Any) -> str:
    """Inline code; a pipe inside backticks does not split a table cell, so none is escaped."""
    text = str(value)
    return f"`{text}`" if text else ""


def table(header: list[str], rows: Iterable[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
