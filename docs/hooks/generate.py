"""MkDocs hook: the pages generated from the code and the results, at build time.

A page opts in with a marker line in its Markdown, which the hook replaces:

- ``<!-- generate:cli -->``: the CLI reference (``cli_reference.py``, from the argparse parsers);
- ``<!-- generate:env -->``: the ``PAGEDKV_*`` variables (``env_reference.py``, from
  ``pagedkv.envs``);
- ``<!-- generate:benchmarks -->``: the benchmark tables (``benchmark_tables.py``, from
  ``benchmarks/results/``), whose plots are published under ``benchmarks/``.

After the build, the README's links into ``docs/`` are checked against the site
(``readme_links.py``): a broken one fails the build like a broken link inside the docs.

The repository's ``src/`` goes first on ``sys.path`` so the docs describe this checkout's code,
installed or not. Nothing here is imported by pagedkv itself.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# MkDocs puts this folder on sys.path only while it loads the hook, so the siblings are imported
# now, at load time.
from benchmark_tables import RESULTS, render_benchmarks
from cli_reference import render_cli
from env_reference import render_env
from readme_links import broken_links

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
GENERATORS = {"cli": render_cli, "env": render_env, "benchmarks": render_benchmarks}


@contextlib.contextmanager
def this_checkout() -> Iterator[None]:
    """``import pagedkv`` finds this checkout's ``src/`` (not another installed copy) while a
    page is generated; refuses to describe a pagedkv already imported from elsewhere."""
    sys.path.insert(0, str(SRC))
    try:
        mod = sys.modules.get("pagedkv")
        if mod is not None and not str(getattr(mod, "__file__", "")).startswith(str(SRC)):
            raise RuntimeError(f"pagedkv was imported from {mod.__file__}, not {SRC}")
        yield
    finally:
        sys.path.remove(str(SRC))


def on_files(files: Any, config: Any) -> Any:
    """Publish the result plots (``benchmarks/results/*.png``) under ``benchmarks/``."""
    from mkdocs.structure.files import File

    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"benchmarks/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    for name, render in GENERATORS.items():
        marker = f"<!-- generate:{name} -->"
        if marker in markdown:
            with this_checkout():
                markdown = markdown.replace(marker, render())
    return markdown


def on_post_build(config: Any) -> None:
    """Fail the build when a README link into docs/ points at no page or anchor."""
    from mkdocs.exceptions import PluginError

    bad = broken_links(ROOT / "README.md", Path(config["site_dir"]))
    if bad:
        raise PluginError("README.md links to missing docs: " + "; ".join(bad))
