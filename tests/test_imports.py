"""The import graph of pagedkv: no circles, no upward imports, a torch-free core.

The graph is read from the source with `ast` (nothing is imported): one node per module, one
edge per ``import``/``from ... import`` of a pagedkv module *anywhere* in the file, function-level
imports included (a circle closed inside a function is still a circle: it only fails later,
at the first call). Imports under ``if TYPE_CHECKING:`` never run and are left out.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Layers, lowest first: a module may import its own layer and the ones below. A key is a package
# under pagedkv (``"engine"``) or a subpackage (``"entrypoints.cli"``); a module belongs to the
# longest key that prefixes it (`layer_of`). kv_transfer sits just above offload (the offloading
# connector builds the offload tiers); transfer (the NIXL/TCP data plane) below both, which use
# it; forwarding (the HTTP forwarding the PD proxy and the router share) below entrypoints; the
# router above entrypoints (it reads the server's protocol models), the fleet simulator above
# the router (it reuses its index and policies), and the CLI on top of everything. distributed
# (torch.distributed process groups) sits beside ops, whose DCP attention uses its collectives.
LAYERS = {
    "envs": 0,
    "core": 0,
    "ops": 1,
    "distributed": 1,
    "transfer": 1,
    "models": 2,
    "offload": 2,
    "kv_transfer": 3,
    "engine": 4,
    "bench": 5,
    "forwarding": 5,
    "entrypoints": 6,
    "router": 7,
    "sim": 8,
    "entrypoints.cli": 9,
}


def layer_of(module: str) -> int | None:
    """The layer of ``module`` (``pagedkv.x.y``): its longest `LAYERS` key, None if none."""
    rel = module.partition(".")[2]
    keys = [k for k in LAYERS if rel == k or rel.startswith(k + ".")]
    return LAYERS[max(keys, key=len)] if keys else None


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node`` (at any depth), except ``if TYPE_CHECKING:`` bodies."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child):
            for sub in child.orelse:
                yield from _import_nodes(ast.Module(body=[sub], type_ignores=[]))
        else:
            yield from _import_nodes(child)


def _resolve(name: str, modules: set[str]) -> str | None:
    """The module ``name`` denotes: itself, else its longest known prefix (``a.b.attr`` → ``a.b``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(path: Path, root: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports (see the module docstring)."""
    mod = module_name(path, root)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import sub`` imports the submodule when there is one.
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        out.update(t for t in (_resolve(t, modules) for t in targets) if t is not None)
    out.discard(mod)
    return out


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module → the package's modules it imports, for every module of ``root/package``."""
    files = sorted((root / package).rglob("*.py"))
    modules = {module_name(f, root) for f in files}
    return {module_name(f, root): imports_of(f, root, modules) for f in files}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _path_in(graph: dict[str, set[str]], component: list[str]) -> str:
    """One circle through ``component`` as ``a → b → a`` (for the failure message)."""
    members = set(component)
    start = component[0]
    path, seen = [start], {start}
    while True:
        nxt = sorted(w for w in graph[path[-1]] if w in members)
        back = [w for w in nxt if w in seen]
        if back:
            return " → ".join(path[path.index(back[0]) :] + [back[0]])
        path.append(nxt[0])
        seen.add(nxt[0])


def test_no_import_cycles_in_pagedkv() -> None:
    graph = import_graph(SRC, "pagedkv")
    assert "pagedkv.offload.tiering" in graph and graph["pagedkv.core.units"] == set()
    cycles = find_cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(_path_in(graph, c) for c in cycles)


@pytest.mark.slow
def test_offload_tiers_import_only_the_base() -> None:
    """The circle that was: fs_tier/redis_tier imported tiering, whose factory imported them."""
    graph = import_graph(SRC, "pagedkv")
    for tier in ("fs_tier", "redis_tier"):
        assert "pagedkv.offload.tiering" not in graph[f"pagedkv.offload.{tier}"]
        assert "pagedkv.offload.base" in graph[f"pagedkv.offload.{tier}"]
    assert "pagedkv.offload.factory" not in graph["pagedkv.offload.tiering"]


def test_layer_of_takes_the_longest_key() -> None:
    assert layer_of("pagedkv.entrypoints.cli.serve") == LAYERS["entrypoints.cli"]
    assert layer_of("pagedkv.entrypoints.cli") == LAYERS["entrypoints.cli"]
    assert layer_of("pagedkv.entrypoints.openai.protocol") == LAYERS["entrypoints"]
    # A key prefixes whole names, not text: entrypoints.clinic would not be the CLI.
    assert layer_of("pagedkv.entrypoints.clinic") == LAYERS["entrypoints"]
    assert layer_of("pagedkv.core.events") == 0 and layer_of("pagedkv") is None


def test_every_package_has_a_layer() -> None:
    """A new package must say where it sits (else the upward check would skip it silently)."""
    packages = {
        p.name
        for p in (SRC / "pagedkv").iterdir()
        if (p / "__init__.py").exists() or (p.suffix == ".py" and p.stem != "__init__")
    }
    missing = sorted(p for p in packages if layer_of(f"pagedkv.{p.removesuffix('.py')}") is None)
    assert not missing, f"packages without a layer in LAYERS: {missing}"


def test_no_upward_imports_and_a_torch_free_core() -> None:
    graph = import_graph(SRC, "pagedkv")
    upward = [
        f"{m} → {t}"
        for m, targets in graph.items()
        for t in targets
        if (lm := layer_of(m)) is not None and (lt := layer_of(t)) is not None and lt > lm
    ]
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))
    torch_in_core = [
        f.name
        for f in sorted((SRC / "pagedkv" / "core").rglob("*.py"))
        if "torch" in _top_level_names(f)
    ]
    assert not torch_in_core, f"core/ imports torch: {torch_in_core}"


@pytest.mark.slow
def test_no_private_names_imported_across_packages() -> None:
    """A ``_name`` is its package's own business: another package that needs it gets a public
    name (the router once imported the proxy's ``_forward_headers`` and ``_unavailable``)."""
    crossing = []
    for f in sorted((SRC / "pagedkv").rglob("*.py")):
        package = module_name(f, SRC).split(".")[:2]
        for node in _import_nodes(ast.parse(f.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or node.level:
                continue
            target = (node.module or "").split(".")
            if target[:1] == ["pagedkv"] and target[:2] != package:
                crossing += [
                    f"{module_name(f, SRC)} ← {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert not crossing, "private names imported from another package:\n" + "\n".join(crossing)


def _top_level_names(path: Path) -> set[str]:
    """The top-level packages ``path`` imports (``torch`` for ``import torch.nn``)."""
    names: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("name", ["parse_size", "cdiv", "GiB", "MiB"])
@pytest.mark.slow
def test_one_definition_of_each_unit_helper(name: str) -> None:
    """``parse_size``, ``cdiv``, ``GiB``, ``MiB`` are defined once (core/units.py) and imported
    everywhere else, so that a size means the same bytes in every option."""
    where = []
    for f in sorted((SRC / "pagedkv").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            defined = (
                [node.name]
                if isinstance(node, ast.FunctionDef)
                else [t.id for t in node.targets if isinstance(t, ast.Name)]
                if isinstance(node, ast.Assign)
                else []
            )
            if name in defined:
                where.append(str(f.relative_to(SRC)))
    assert where == ["pagedkv/core/units.py"]


def test_the_one_parse_size_serves_every_option() -> None:
    from pagedkv.core.units import parse_size
    from pagedkv.entrypoints.cli import plan
    from pagedkv.offload import spec

    assert plan.parse_size is parse_size and spec.parse_size is parse_size
    assert parse_size(".5KiB") == 512 and parse_size(" 2 GB ") == 2 * 10**9
    with pytest.raises(ValueError, match="invalid size '4 parsecs'"):
        parse_size("4 parsecs")
    with pytest.raises(ValueError, match="invalid size '1e9'"):
        spec.parse_offload_spec("cpu:1e9")


# ---- the checker itself finds what it must -------------------------------------------------------


def _write_package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


@pytest.mark.parametrize(
    "b_source",
    [
        "from pkg.a import X\n",  # module level
        "def f():\n    from pkg import a\n    return a\n",  # inside a function
        "from . import a\n",  # relative
        "import pkg.a\n",  # plain import
    ],
)
def test_checker_finds_a_circle(tmp_path: Path, b_source: str) -> None:
    _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg import b\nX = 1\n",
            "pkg/b.py": b_source,
            "pkg/c.py": "import pkg.a\n",
        },
    )
    graph = import_graph(tmp_path, "pkg")
    assert find_cycles(graph) == [["pkg.a", "pkg.b"]]
    assert _path_in(graph, ["pkg.a", "pkg.b"]) == "pkg.a → pkg.b → pkg.a"


def test_checker_ignores_type_checking_imports(tmp_path: Path) -> None:
    _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import Y\nX = 1\n",
            "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import X\n"
            "else:\n    import pkg.c\nY = 2\n",
            "pkg/c.py": "",
        },
    )
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.b"] == {"pkg.c"} and find_cycles(graph) == []


def test_the_scheduler_knows_only_core_its_types_and_the_connector_seam() -> None:
    """The scheduler reaches the connector through `KVConnectorBase` only, never a concrete
    connector, tier code or torch (module-level and function-level imports alike)."""
    src = Path(__file__).resolve().parents[1] / "src" / "pagedkv" / "engine" / "scheduler.py"
    allowed = (
        "pagedkv.core.",
        "pagedkv.engine.request",
        "pagedkv.engine.scheduler_output",
        "pagedkv.kv_transfer.base",
    )
    for node in ast.walk(ast.parse(src.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pagedkv"):
            assert node.module.startswith(allowed), node.module
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + (
                [node.module] if isinstance(node, ast.ImportFrom) else []
            )
            assert not any(n and n.split(".")[0] == "torch" for n in names)
