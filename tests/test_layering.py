"""epdserve's imports form no cycle and go only down the layers of ``epdserve/common/layers.py``.

Read from the source with ``ast`` (nothing is imported): every ``import`` of an epdserve module,
at module level or inside a function, relative ones resolved; those under ``if TYPE_CHECKING:``
are left out, since they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from epdserve.common.layers import LAYERS

PACKAGE = Path(__file__).resolve().parents[1] / "epdserve"

Graph = dict[str, dict[str, int]]  # module -> {imported module: line of the first such import}


def modules(package: Path) -> dict[str, Path]:
    """Dotted name -> file of every module under ``package`` (a package is named by its ``__init__``)."""
    out: dict[str, Path] = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run: all of them but the bodies of ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _type_checking(child.test):
            for stmt in child.orelse:
                if isinstance(stmt, ast.Import | ast.ImportFrom):
                    found.append(stmt)
                found.extend(_imports(stmt))
            continue
        if isinstance(child, ast.Import | ast.ImportFrom):
            found.append(child)
        found.extend(_imports(child))
    return found


def import_graph(package: Path) -> Graph:
    """Which module imports which, inside ``package`` only."""
    files = modules(package)
    top = package.name
    graph: Graph = {}
    for name, path in files.items():
        own_package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: dict[str, int] = {}
        for stmt in _imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(stmt, ast.Import):
                found = [alias.name for alias in stmt.names]
            else:
                if stmt.level:
                    base = own_package.split(".")[: len(own_package.split(".")) - (stmt.level - 1)]
                    source = ".".join(base + ([stmt.module] if stmt.module else []))
                else:
                    source = stmt.module or ""
                # ``from pkg import sub`` imports the submodule; ``from mod import name``, the module
                found = [f"{source}.{a.name}" if f"{source}.{a.name}" in files else source for a in stmt.names]
            for target in found:
                if target.split(".")[0] == top and target in files and target != name:
                    targets.setdefault(target, stmt.lineno)
        graph[name] = targets
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def describe(component: list[str], graph: Graph) -> str:
    members = set(component)
    edges = [f"  {a}:{graph[a][b]} -> {b}" for a in component for b in sorted(graph[a]) if b in members]
    return "import cycle among " + ", ".join(component) + ":\n" + "\n".join(edges)


def unit(module: str) -> str:
    """The layer table's name for a module: its subpackage or top-level module under epdserve."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(graph: Graph, layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """Imports of a unit of the same or a higher layer (other than one's own), and unplaced units."""
    layer = {name: i for i, names in enumerate(layers) for name in names}
    problems = sorted({f"{unit(m)} is in no layer of epdserve/common/layers.py" for m in graph if unit(m) not in layer})
    for a, targets in sorted(graph.items()):
        for b, line in targets.items():
            ua, ub = unit(a), unit(b)
            if ua != ub and ua in layer and ub in layer and layer[ub] >= layer[ua]:
                where = "the same layer as" if layer[ub] == layer[ua] else "a layer above"
                problems.append(f"{a}:{line} imports {b}: {ub} is in {where} {ua}")
    return problems


def test_the_graph_sees_lazy_relative_and_type_checking_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "epdserve"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from epdserve.low import b\n"
        "else:\n    import json\n"
        "def f():\n    from . import c\n"
    )
    (pkg / "low" / "b.py").write_text("from .a import f\n")
    (pkg / "low" / "c.py").write_text("import epdserve.low.b\n")
    graph = import_graph(pkg)
    assert graph["epdserve.low.a"] == {"epdserve.low.c": 7}
    assert graph["epdserve.low.b"] == {"epdserve.low.a": 1}
    assert cycles(graph) == [["epdserve.low.a", "epdserve.low.b", "epdserve.low.c"]]
    assert upward_imports(graph, (("__init__",), ("low",))) == []
    assert upward_imports(graph, (("low",),)) == ["__init__ is in no layer of epdserve/common/layers.py"]


def test_an_upward_or_sideways_import_is_named() -> None:
    graph = {"epdserve.engine.core": {"epdserve.api.logs": 3}, "epdserve.api.logs": {}, "epdserve.pd.x": {}}
    layers = (("engine",), ("api", "pd"))
    assert upward_imports(graph, layers) == [
        "epdserve.engine.core:3 imports epdserve.api.logs: api is in a layer above engine"
    ]
    graph = {"epdserve.pd.x": {"epdserve.api.logs": 9}, "epdserve.api.logs": {}}
    assert upward_imports(graph, layers) == [
        "epdserve.pd.x:9 imports epdserve.api.logs: api is in the same layer as pd"
    ]


@pytest.fixture(scope="module")
def graph() -> Graph:
    return import_graph(PACKAGE)


def test_epdserve_has_no_import_cycle(graph: Graph) -> None:
    assert len(graph) > 100  # the whole package was read
    found = cycles(graph)
    assert not found, "\n".join(describe(c, graph) for c in found)


def test_epdserve_imports_only_down_its_layers(graph: Graph) -> None:
    named = [name for names in LAYERS for name in names]
    assert len(named) == len(set(named)), "a unit is in two layers"
    problems = upward_imports(graph, LAYERS)
    assert not problems, "\n".join(problems)
