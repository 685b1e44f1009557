"""A click group whose subcommands are imported when one runs or shows its own help, not to list them:
``orbit-outbox --help`` imports neither SQLAlchemy, Alembic, rich's tables nor the client.

The same class as ``orbit_server/cli/lazy.py`` (the two packages may not import each other, and the client
has no click): each lazy subcommand is declared with the module and attribute that define it and the first
paragraph of its help, which the listing shortens exactly as click would; ``tests/unit/test_cli_lazy.py``
checks that each summary is the command's own, for both groups.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

__all__ = ["LazyGroup"]


def _short_help(text: str, limit: int) -> str:
    """``text`` shortened to ``limit`` exactly as click shortens a command's help in a listing."""
    return click.Command(None, help=text).get_short_help_str(limit)


class LazyGroup(click.Group):
    """``lazy``: subcommand name → ``(module, attribute, summary)``."""

    def __init__(self, *args: Any, lazy: dict[str, tuple[str, str, str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy and cmd_name not in self.commands:
            module, attribute, _summary = self.lazy[cmd_name]
            command = getattr(importlib.import_module(module), attribute)
            assert isinstance(command, click.Command)
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """As click lists them, with the lazy ones' summaries: nothing is imported to list them."""
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = []
        for name in names:
            if name in self.lazy and name not in self.commands:
                rows.append((name, _short_help(self.lazy[name][2], limit)))
            else:
                command = self.commands[name]
                if command.hidden:
                    continue
                rows.append((name, command.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)
