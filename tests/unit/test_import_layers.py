"""The import graph of the three packages: no circles, and inside ``orbit_server`` only the arrows of
DESIGN §1 (README "Development": api/cli/console → areas → db).

Read with :mod:`ast`, nothing imported: every ``import`` and ``from ... import`` of a module counts, at
module level or inside a function (a function-level import is a circle that waits for its first
call). Imports under ``if TYPE_CHECKING:`` count too: they do not run, but a module that names
another's type depends on it as much as one that calls it, and issue 18 counted such pairs as circles
(``orbit_client._exceptions`` ↔ ``_models``); a type a lower layer needs belongs in that layer.
``from . import x`` in a package's ``__init__`` counts like any other import; the implicit import of
a package's ``__init__`` when one of its modules is imported is not an arrow.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("orbit_client", "orbit_server", "outbox_adapter")

#: Which other packages each package may import (DESIGN §1, the package table).
PACKAGE_ARROWS = {
    "orbit_client": set(),
    "outbox_adapter": {"orbit_client"},
    "orbit_server": {"orbit_client"},
}

#: ``orbit_server``'s layers: top-level name (folder or root module) → layer.
SERVER_LAYERS = {
    # Entry points: the package's lazy names, ``python -m orbit_server`` and the console script.
    "__init__": "entry",
    "__main__": "entry",
    "_entry": "entry",
    # Leaf modules: they import nothing of the server, so every layer may import them.
    "settings": "leaf",
    "errors": "leaf",
    "_ids": "leaf",
    "api": "api",
    "cli": "cli",
    "console": "console",
    "tasks": "tasks",
    "results": "area",
    "schedules": "area",
    "retention": "area",
    "flows": "area",
    "db": "db",
}
#: Which layers a layer may import, besides its own folder (DESIGN §1, the ``orbit_server`` table).
LAYER_ARROWS = {
    "entry": {"api", "cli", "leaf"},
    "api": {"tasks", "area", "db", "leaf"},
    "cli": {"tasks", "area", "db", "leaf"},
    "console": {"tasks", "area", "db", "leaf"},
    "area": {"tasks", "db", "leaf"},
    "tasks": {"db", "leaf"},
    "db": {"leaf"},
    "leaf": set(),
}
#: Arrows DESIGN §1 does not draw, allowed one by one with the reason.
SERVER_EXCEPTIONS = {
    # The app factory mounts the web console's router under /ui: the one place api and console meet.
    ("orbit_server.api.app", "orbit_server.console"),
    # ``orbit-server serve`` runs the app: the command builds it (both imports are inside ``serve``).
    ("orbit_server.cli.main", "orbit_server.api.app"),
    ("orbit_server.cli.main", "orbit_server.api._http"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(package: str) -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, at any depth, ``if TYPE_CHECKING:`` included."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def _edges(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` (file ``path``) imports."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in _imports(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                # ``import a.b.c`` imports a, a.b and a.b.c; the deepest known one is the arrow.
                for i in range(len(parts), 0, -1):
                    if ".".join(parts[:i]) in known:
                        found.add(".".join(parts[:i]))
                        break
            continue
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            if sub in known:
                found.add(sub)
            elif target in known:
                found.add(target)
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        modules.update(_modules(package))
    known = set(modules)
    return {name: _edges(name, path, known) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path_in(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One circle through the component's first module, for the message: a → b → ... → a."""
    members = set(component)
    start = component[0]
    seen = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return [*seen[v], start]
                if w not in seen:
                    seen[w] = [*seen[v], w]
                    nxt.append(w)
        frontier = nxt
    return component


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circles(package: str) -> None:
    graph = {k: v for k, v in _graph().items() if k.split(".")[0] == package}
    circles = [" → ".join(_path_in(graph, c)) for c in _cycles(graph)]
    assert not circles, f"import circles in {package}:\n" + "\n".join(circles)


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_import_only_what_design_allows(package: str) -> None:
    allowed = PACKAGE_ARROWS[package] | {package}
    bad = sorted(
        f"{module} imports {target}"
        for module, targets in _graph().items()
        if module.split(".")[0] == package
        for target in targets
        if target.split(".")[0] not in allowed
    )
    assert not bad, f"{package} may import only {sorted(allowed)}:\n" + "\n".join(bad)


def _layer(module: str) -> tuple[str, str]:
    """(top-level name, layer) of an ``orbit_server`` module."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    if top not in SERVER_LAYERS:
        raise AssertionError(f"{module}: not in a layer of DESIGN §1; add its folder to SERVER_LAYERS")
    return top, SERVER_LAYERS[top]


def test_server_arrows_point_down() -> None:
    bad = []
    for module, targets in sorted(_graph().items()):
        if not module.startswith("orbit_server"):
            continue
        top, layer = _layer(module)
        for target in sorted(targets):
            if not target.startswith("orbit_server") or (module, target) in SERVER_EXCEPTIONS:
                continue
            target_top, target_layer = _layer(target)
            if target_top == top and layer != "leaf":
                continue  # inside one folder
            if target_layer not in LAYER_ARROWS[layer]:
                bad.append(f"{module} ({layer}) imports {target} ({target_layer})")
    assert not bad, "arrows DESIGN §1 does not draw:\n" + "\n".join(bad)


#: The one place Django may be imported (DESIGN §1: the Django integration; "django from anywhere else" never).
DJANGO_HOME = "outbox_adapter.django"


def test_django_is_imported_only_by_the_django_integration() -> None:
    """``django`` (and the ``django_tasks`` backport) only under ``outbox_adapter.django``: a user without
    the ``django`` extra never needs it, and the core outbox never depends on it."""
    bad = []
    for package in PACKAGES:
        for name, path in _modules(package).items():
            if name == DJANGO_HOME or name.startswith(f"{DJANGO_HOME}."):
                continue
            for node in _imports(ast.parse(path.read_text(encoding="utf-8"))):
                targets = (
                    [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                )
                if getattr(node, "level", 0) == 0 and any(
                    t.split(".")[0] in ("django", "django_tasks") for t in targets
                ):
                    bad.append(f"{name} imports {', '.join(targets)}")
    assert not bad, f"only {DJANGO_HOME} may import Django:\n" + "\n".join(bad)
