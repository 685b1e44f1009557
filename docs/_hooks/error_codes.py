"""mkdocs hook: the error codes the server's domain errors answer with, read from the code at build time.

A page that holds the line ``<!-- error-codes -->`` gets, in its place, one row per subclass of
``orbit_server.errors.OrbitServerError`` (every module of the app is imported first, so the areas' own
errors are found too): HTTP status, ``code``, title and the class's docstring. A new error is on the page
the next time the site is built.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any

MARKER = "<!-- error-codes -->"


def _subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found.append(sub)
        found.extend(_subclasses(sub))
    return found


def table() -> str:
    import orbit_server
    from orbit_server.errors import OrbitServerError

    for module in pkgutil.walk_packages(orbit_server.__path__, "orbit_server."):
        if not module.name.endswith(("__main__", "_entry")) and "_migrations" not in module.name:
            importlib.import_module(module.name)
    rows = {}
    for cls in [OrbitServerError, *_subclasses(OrbitServerError)]:
        own = cls.__dict__.get("__doc__") or ""
        doc = (
            " ".join(inspect.cleandoc(own).split("\n\n", 1)[0].split()) if cls is not OrbitServerError else ""
        )
        rows.setdefault(cls.code, (cls.status, cls.code, cls.title, doc))
    lines = ["| status | `code` | title | notes |", "| --- | --- | --- | --- |"]
    for status, code, title, doc in sorted(rows.values()):
        notes = doc.replace("|", "\\|")
        lines.append(f"| {status} | `{code}` | {title} | {notes} |")
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown: str, **_: Any) -> str:
    return markdown.replace(MARKER, table()) if MARKER in markdown else markdown
