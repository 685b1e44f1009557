"""The documentation's pages, for the tests that keep them true (issue 29): the site under ``docs/`` in the
order of its navigation (``mkdocs.yml``), the README, and their sections by heading."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def page(path: str) -> str:
    """The Markdown of ``docs/<path>``."""
    return (DOCS / path).read_text(encoding="utf-8")


def nav_pages() -> list[str]:
    """Every page of the site's navigation, in the order a reader meets them (``docs/``-relative paths)."""
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    found: list[str] = []

    def walk(items: Any) -> None:
        for item in items:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            if isinstance(value, list):
                walk(value)
            else:
                found.append(value)

    walk(nav)
    return found


def section(text: str, heading: str) -> str:
    """The text under ``heading`` (a whole heading line, e.g. ``"## Flows"``) up to the next heading of its
    level or higher."""
    level = heading.split(" ", 1)[0]
    after = text.split(f"\n{heading}\n", 1)[1]
    ends = [after.find(f"\n{'#' * n} ") for n in range(1, len(level) + 1)]
    ends = [e for e in ends if e >= 0]
    return after[: min(ends)] if ends else after
