"""User-facing text cites the README, never DESIGN, a document users do not have (issue 10, first hour):
messages and log lines (every string that is not a docstring), public docstrings, the OpenAPI document
and the commands' ``--help``."""

from __future__ import annotations

import ast
import inspect
import json
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import orbit_client
import outbox_adapter

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted(
    p
    for root in ("orbit_client", "orbit_server", "outbox_adapter", "examples")
    for p in (REPO / root).rglob("*.py")
)


def _strings_that_are_not_docstrings(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_no_message_or_log_line_cites_design() -> None:
    cited = [
        f"{path.relative_to(REPO)}:{line}: {text[:80]!r}"
        for path in SOURCES
        for line, text in _strings_that_are_not_docstrings(path)
        if "DESIGN" in text
    ]
    assert cited == []


@pytest.mark.parametrize("package", [orbit_client, outbox_adapter], ids=lambda p: p.__name__)
def test_public_docstrings_cite_the_readme_not_design(package: object) -> None:
    cited = []
    for name in ["", *package.__all__]:  # type: ignore[attr-defined]
        obj = getattr(package, name) if name else package
        members = (
            [obj, *(m for n, m in vars(obj).items() if not n.startswith("_"))]
            if inspect.isclass(obj)
            else [obj]
        )
        cited += [
            f"{name}: {inspect.getdoc(m)!s:.60}" for m in members if "DESIGN" in (inspect.getdoc(m) or "")
        ]
    assert cited == []


def test_the_openapi_document_and_the_help_cite_no_design(tmp_path: Path) -> None:
    from orbit_server import ServerSettings, create_app
    from orbit_server.cli import main as server_main
    from outbox_adapter.cli import main as outbox_main

    document = json.dumps(create_app(ServerSettings(database_url=f"sqlite:///{tmp_path}/orbit.db")).openapi())
    assert "DESIGN" not in document
    for main in (server_main, outbox_main):
        names = main.list_commands(click.Context(main))  # type: ignore[attr-defined]
        for command in [None, *names]:
            shown = CliRunner().invoke(main, [command, "--help"] if command else ["--help"])
            assert shown.exit_code == 0 and "DESIGN" not in shown.output, (command, shown.output)


# The distribution is `orbit-tasks` (`orbit` on PyPI is someone else's 2014 package, issue 23): no install hint
# anywhere (messages, docstrings, the README, the packaging metadata) may name the old distribution.
_OLD_DISTRIBUTION = re.compile(r"(?<![\w.-])orbit\[|pip install [-\w ]*?(?<![\w.-])orbit(?![\w.\[-])")


def test_no_install_hint_names_the_old_distribution() -> None:
    texts = [*SOURCES, REPO / "README.md", REPO / "pyproject.toml", REPO / "Makefile"]
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()[:100]}"
        for path in texts
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _OLD_DISTRIBUTION.search(line)
    ]
    assert found == []


def test_the_distribution_name_is_the_one_the_hints_name() -> None:
    from importlib.metadata import distribution

    assert distribution("orbit-tasks").metadata["Name"] == "orbit-tasks"
    assert "pip install 'orbit-tasks[server]'" in (REPO / "orbit_server" / "_entry.py").read_text("utf-8")
    assert "pip install 'orbit-tasks[outbox]'" in (REPO / "outbox_adapter" / "_entry.py").read_text("utf-8")
