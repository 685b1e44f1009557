"""mkdocs hook: the command-line reference, generated from the click commands at build time.

Each ``::: mkdocs-click`` block (``:module:``, ``:command:``, ``:prog_name:``, ``:depth:``, ``:style:``,
``:list_subcommands:``) becomes mkdocs-click's Markdown for that command and all its subcommands, with
``<`` and ``>`` outside code blocks escaped: help texts such as ``<table>_events`` would otherwise be
read as HTML tags (an open ``<table>`` broke the page's structure).
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from mkdocs_click._docs import make_command_docs

BLOCK = re.compile(r"^::: mkdocs-click\n((?:    :\w+: .*\n)+)", re.M)


def _escaped(lines: list[str]) -> str:
    out, fenced = [], False
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            line = line.replace("<", "&lt;").replace(">", "&gt;")
        out.append(line)
    return "\n".join(out) + "\n"


def render(options: dict[str, str]) -> str:
    command = getattr(importlib.import_module(options["module"]), options["command"])
    lines = make_command_docs(
        prog_name=options.get("prog_name", options["command"]),
        command=command,
        depth=int(options.get("depth", "0")),
        style=options.get("style", "plain"),
        list_subcommands=options.get("list_subcommands", "false") == "true",
        has_attr_list=True,
    )
    return _escaped(list(lines))


def on_page_markdown(markdown: str, **_: Any) -> str:
    return BLOCK.sub(lambda m: render(dict(re.findall(r":(\w+): (.*)", m[1]))), markdown)
