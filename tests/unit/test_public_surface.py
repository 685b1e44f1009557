"""The public surface stays as it is across refactors: the OpenAPI document (byte for byte), every
command's ``--help``, and the ``__all__`` of the three packages, compared with snapshots in
``tests/unit/surface/``.

A deliberate change of the surface regenerates the snapshots (``ORBIT_UPDATE_SURFACE=1 pytest
tests/unit/test_public_surface.py``) and says so in its commit; a refactor never does.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

SURFACE = Path(__file__).parent / "surface"
UPDATE = os.environ.get("ORBIT_UPDATE_SURFACE") == "1"


def _check(name: str, text: str) -> None:
    path = SURFACE / name
    if UPDATE:
        path.write_text(text, encoding="utf-8")
        return
    assert path.exists(), f"no snapshot {path}; run with ORBIT_UPDATE_SURFACE=1 once"
    assert text == path.read_text(encoding="utf-8"), f"{name} changed"


def _commands(group: click.Command, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    yield path, group
    if isinstance(group, click.Group):  # through click's API: a lazy group imports its commands on request
        ctx = click.Context(group)
        for name in sorted(group.list_commands(ctx)):
            command = group.get_command(ctx, name)
            assert command is not None, name
            yield from _commands(command, (*path, name))


def _help_of(prog: str, root: click.Command) -> str:
    runner = CliRunner()
    out: list[str] = []
    for path, _command in _commands(root, ()):
        result = runner.invoke(root, [*path, "--help"], prog_name=prog, terminal_width=100)
        assert result.exit_code == 0, (path, result.output)
        out.append(f"$ {prog} {' '.join(path)} --help\n{result.output}")
    return "\n".join(out)


def test_openapi_document_is_unchanged(tmp_path: Path) -> None:
    from orbit_server import ServerSettings, create_app

    app = create_app(ServerSettings(database_url=f"sqlite:///{tmp_path}/orbit.db"))
    _check("openapi.json", json.dumps(app.openapi(), indent=1, sort_keys=True) + "\n")


def test_server_commands_and_options_are_unchanged() -> None:
    from orbit_server.cli import main

    _check("orbit-server-help.txt", _help_of("orbit-server", main))


def test_outbox_commands_and_options_are_unchanged() -> None:
    from outbox_adapter.cli import main

    _check("orbit-outbox-help.txt", _help_of("orbit-outbox", main))


@pytest.mark.parametrize(
    "package",
    [
        "orbit_client",
        "outbox_adapter",
        "orbit_server",
        # The Django integration (``[django]`` extra): what a Django project imports from it.
        "outbox_adapter.django",
        "outbox_adapter.django.backend",
        "outbox_adapter.django.consumer",
    ],
)
def test_exported_names_are_unchanged(package: str) -> None:
    module = importlib.import_module(package)
    names = sorted(getattr(module, "__all__", []))
    _check(f"{package}-all.txt", "\n".join(names) + "\n")
