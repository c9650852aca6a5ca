"""No import cycle of any length among the files of ``kvrouter/``, ``tui/`` and ``tools/``.

Every ``import`` and ``from ... import`` statement counts, wherever it stands: at the top, under
``if TYPE_CHECKING:``, inside a function. A cycle hidden in either of the last two is still a design
decision nobody made (``STYLE.md``, "Import circles"), and the layers of the service (core, edges, process)
must point one way. An edge goes from a module to the module it names (``from . import x`` names the
module ``x``; ``from .a import b`` names ``a``, or ``a.b`` when that is a module); a package's implicit
import of its ``__init__`` is not an edge, since every module would otherwise be in a cycle with its
package's re-exports. The walk reads the files' text (``ast``), so it runs nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGES = ("kvrouter", "tui", "tools")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _named(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: dict[str, Path]) -> list[str]:
    """The modules of ``known`` an import statement of ``module`` names."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".")
            if not is_package:
                base.pop()
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join([*base, *([node.module] if node.module else [])])
        else:
            prefix = node.module or ""
        for alias in node.names:
            names.append(f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in known else prefix)
    resolved = []
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            resolved.append(name)
    return resolved


def _graph() -> dict[str, set[str]]:
    known = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        graph[module] = {
            named
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for named in _named(node, module, is_package, known)
        }
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
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


def test_no_module_imports_itself_back_through_any_path():
    graph = _graph()
    assert len(graph) > 150  # the walk found the tree
    assert _cycles(graph) == []


def test_the_walk_sees_imports_under_type_checking_and_inside_functions():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import x\ndef f():\n    from . import c\n"
    )
    tree = ast.parse(source)
    known = {"p.a": ROOT, "p.b": ROOT, "p.c": ROOT}
    named = {
        n for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for n in _named(node, "p.a", False, known)
    }
    assert named == {"p.b", "p.c"}


TRANSPORTS = ("aiohttp", "zmq", "socket", "nats", "http")
"""What the service's core never imports itself: it knows no socket and no HTTP."""


def test_the_service_layers_point_one_way():
    """The core imports neither edges nor process, nor any transport; the edges never import the process layer."""
    for path in (ROOT / "kvrouter" / "service" / "core").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                tops = {alias.name.partition(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                tops = {node.module.partition(".")[0]}
            else:
                continue
            assert not tops & set(TRANSPORTS), (path.name, tops)
    graph = _graph()
    for module, names in graph.items():
        if module.startswith("kvrouter.service.core"):
            assert not {n for n in names if n.startswith(("kvrouter.service.edges", "kvrouter.service.process"))}, (
                module
            )
        if module.startswith("kvrouter.service.edges"):
            assert not {n for n in names if n.startswith("kvrouter.service.process")}, module
