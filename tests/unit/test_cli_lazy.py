"""The lazy click groups (``orbit_server/cli/lazy.py``, ``outbox_adapter/cli/_lazy.py``) list their commands
without importing them, from a summary declared next to the module: each summary must be the command's own,
or ``--help`` would list a stale line that no help snapshot catches."""

from __future__ import annotations

import click
import pytest


def _groups() -> list[tuple[str, click.Group]]:
    from orbit_server.cli import main as server_main
    from outbox_adapter.cli import main as outbox_main

    assert isinstance(server_main, click.Group) and isinstance(outbox_main, click.Group)
    return [("orbit-server", server_main), ("orbit-outbox", outbox_main)]


@pytest.mark.parametrize("prog", ["orbit-server", "orbit-outbox"])
def test_each_lazy_summary_is_the_commands_own(prog: str) -> None:
    group = dict(_groups())[prog]
    lazy: dict[str, tuple[str, str, str]] = group.lazy  # type: ignore[attr-defined]
    assert lazy, f"{prog}'s group is not lazy"
    ctx = click.Context(group)
    for name, (_module, _attribute, summary) in sorted(lazy.items()):
        command = group.get_command(ctx, name)
        assert command is not None, name
        for limit in (45, 80, 1000):  # click cuts the summary to the width left in the listing
            declared = click.Command(None, help=summary).get_short_help_str(limit)
            assert declared == command.get_short_help_str(limit), (prog, name, limit)
