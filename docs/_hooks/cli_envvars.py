"""mkdocs hook: the environment variables of a command line, read from its click options at build time.

A page that holds ``<!-- cli-envvars: orbit-outbox -->`` (or ``orbit-server``) gets, in its place, one row
per environment variable: the options that read it (with their commands), the default and the help text.
"""

from __future__ import annotations

import re
from typing import Any

import click

MARKER = re.compile(r"^<!-- cli-envvars: (?P<prog>orbit-outbox|orbit-server) -->$", re.M)


def envvars(group: click.Group) -> dict[str, list[tuple[str, click.Parameter]]]:
    """Every environment variable of ``group``'s options: ``{VAR: [(command path, option), ...]}``."""
    found: dict[str, list[tuple[str, click.Parameter]]] = {}

    def walk(command: click.Command, path: str) -> None:
        for param in command.params:
            names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or [])
            for name in names:
                found.setdefault(name, []).append((path, param))
        if isinstance(command, click.Group):
            context = click.Context(command)
            for name in command.list_commands(context):
                sub = command.get_command(context, name)
                if sub is not None:
                    walk(sub, f"{path} {name}")

    walk(group, group.name or "")
    return found


def _group(prog: str) -> click.Group:
    if prog == "orbit-outbox":
        from outbox_adapter.cli import main as outbox_main

        return outbox_main  # type: ignore[return-value]
    from orbit_server.cli import main as server_main

    return server_main  # type: ignore[return-value]


def table(prog: str) -> str:
    lines = ["| variable | read by | default | meaning |", "| --- | --- | --- | --- |"]
    for name, uses in sorted(envvars(_group(prog)).items()):

        def command(path: str) -> str:
            return " ".join([prog, *path.split(" ")[1:]])

        readers = sorted({f"`{command(path)} {p.opts[0]}`" for path, p in uses})
        first = uses[0][1]
        default = None if callable(first.default) else first.default
        shown = "" if default in (None, ()) or first.required else f"`{default}`"
        helps: dict[str, list[str]] = {}
        for path, p in uses:
            helps.setdefault(" ".join((getattr(p, "help", None) or "").split()), []).append(command(path))
        if len(helps) == 1:
            meaning = next(iter(helps))
        else:
            meaning = "; ".join(f"{', '.join(f'`{c}`' for c in cs)}: {h}" for h, cs in helps.items())
        lines.append(f"| `{name}` | {', '.join(readers)} | {shown} | {meaning.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown: str, **_: Any) -> str:
    return MARKER.sub(lambda m: table(m["prog"]), markdown)
