"""The README's links into the docs, checked against the built site: mkdocs' own link validation
covers docs/ only, and the README is the front door."""

from __future__ import annotations

import re
from pathlib import Path

LINK = re.compile(r"\]\((docs/[^)#\s]+\.md)(#[^)\s]+)?\)")


def broken_links(readme: Path, site_dir: Path) -> list[str]:
    """Each ``[text](docs/PAGE.md#anchor)`` of ``readme`` whose page is missing from the built
    ``site_dir`` or whose anchor is not an ``id`` on that page."""
    bad = []
    for m in LINK.finditer(readme.read_text()):
        page, anchor = m[1].removeprefix("docs/").removesuffix(".md"), m[2]
        html = site_dir / ("index.html" if page == "index" else f"{page}/index.html")
        if not html.exists():
            bad.append(f"{m[1]}: no such page")
        elif anchor and f'id="{anchor[1:]}"' not in html.read_text():
            bad.append(f"{m[1]}{anchor}: no such anchor")
    return bad
