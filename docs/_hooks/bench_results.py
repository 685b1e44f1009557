"""mkdocs hook: the Performance page's table, rendered at build time from a committed results file.

A page that holds the line ``<!-- bench-results: compare -->`` gets, in its place, the newest
``bench/results/compare-<date>*.json`` (``python -m bench.compare --json-file``; files are named by the
run's UTC date, so the newest sorts last) as a provenance list and one table: every figure of the file with
its unit, the figure it is compared with and that one's value, the ratio, the target and whether it was
met. For ``compare`` that is the newest file per Orbit server database (``server_db`` in the file's
settings, ``mariadb`` when a file predates the setting), MariaDB first, each under a line naming it.
A kind may name a variant: ``chaos-galera`` is the newest ``chaos-galera-<date>*.json``, while ``chaos``
is the newest ``chaos-<date>*.json`` only (a file of a variant is not one of the plain kind's).
Nothing is typed by hand, so every number on the page is in the file it names. Without a file the
place says so (an admonition), and the build still passes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

MARKER = re.compile(r"^<!-- bench-results: (?P<kind>[a-z]+(?:-[a-z]+)*) -->$", re.M)
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
#: How a results file's ``server_db`` setting is named on the page.
SERVER_DBS = {"mariadb": "MariaDB", "postgres": "PostgreSQL"}


def newest(kind: str, results: Path = RESULTS) -> Path | None:
    """The newest ``<kind>-<date>*.json`` (a date follows the kind: a variant's files are not the kind's)."""
    files = sorted(results.glob(f"{kind}-[0-9]*.json"))
    return files[-1] if files else None


def server_db(path: Path) -> str:
    """The Orbit server database a results file was measured on (``mariadb`` when it does not say)."""
    meta = json.loads(path.read_text(encoding="utf-8")).get("meta", {})
    return str(meta.get("server_db") or (meta.get("settings") or {}).get("server_db") or "mariadb")


def newest_per_server_db(kind: str, results: Path = RESULTS) -> list[tuple[str, Path]]:
    """The newest ``<kind>-<date>*.json`` of each Orbit server database, MariaDB first."""
    found: dict[str, Path] = {}
    for path in sorted(results.glob(f"{kind}-[0-9]*.json")):
        found[server_db(path)] = path  # sorted by date: the last one of a database wins
    order = list(SERVER_DBS)
    return sorted(found.items(), key=lambda item: order.index(item[0]) if item[0] in order else len(order))


def _number(value: float | None) -> str:
    if value is None:
        return "n/a"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def render(path: Path, repo: Path | None = None) -> str:
    """Markdown for one results file: its provenance, then one row per figure."""
    document: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    meta = document.get("meta", {})
    figures = document.get("figures", [])
    by_name = {f["name"]: f for f in figures}
    shown = path.relative_to(repo).as_posix() if repo else path.name
    machine = meta.get("machine") or {}
    lines = [
        f"From `{shown}`:",
        "",
        f"- **Date** (UTC): {meta.get('date', 'not recorded')}; **commit**: `{meta.get('commit') or 'not recorded'}`",
        f"- **Command**: `{meta.get('command', 'not recorded')}`",
        f"- **Machine**: {machine.get('cpu', 'not recorded')}, {machine.get('cores', meta.get('cpus', '?'))} cores, "
        f"{machine.get('platform', '')}; Python {meta.get('python', '?')}",
        "- **Load average at the start** (1, 5, 15 min): "
        + (
            ", ".join(f"{x:.2f}" for x in meta["loadavg_at_start"])
            if "loadavg_at_start" in meta
            else "not recorded"
        ),
        *(
            [
                f"- **Orbit's databases**: PostgreSQL, the peer's instance (databases of their own beside the "
                f"peer's){'; the claim section on MariaDB' if 'mariadb' in meta else ''}"
            ]
            if meta.get("server_db") == "postgres"
            else [f"- **Orbit's database**: MariaDB `{json.dumps(meta['mariadb'])}`"]
            if "mariadb" in meta
            else []
        ),
        *(
            [f"- **The peer's database**: PostgreSQL `{json.dumps(meta['postgres'])}`"]
            if "postgres" in meta
            else []
        ),
        *(
            [
                f"- **Run settings**: `n={meta.get('n')}`, `concurrency={meta.get('concurrency')}`, "
                f"sections `{','.join(meta.get('sections', []))}`"
            ]
            if "n" in meta
            else []
        ),
        *(
            [
                f"- **Settings that differ from a default**, both sides: {'; '.join(f'{k}: {v}' for k, v in settings.items())}"
            ]
            if (settings := meta.get("settings"))
            else []
        ),
        "",
        "| section | figure | value | compared with | its value | ratio | target | met |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for f in figures:
        base = by_name.get(f.get("base") or "")
        cells = [
            f.get("section", ""),
            f["name"] + (f" ({f['note']})" if f.get("note") else ""),
            f"{_number(f.get('value'))} {f.get('unit', '')}".strip(),
            f.get("base") or "",
            f"{_number(base.get('value'))} {base.get('unit', '')}".strip() if base else "",
            f"{f['ratio']:.2f}×" if f.get("ratio") is not None else "",
            f.get("target") or "",
            {True: "yes", False: "**no**"}.get(f.get("passed"), ""),  # type: ignore[arg-type]
        ]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def missing(kind: str) -> str:
    return (
        f'!!! warning "No {kind} results file is committed yet"\n'
        f"    This place shows the newest `bench/results/{kind}-*.json` once one is committed "
        f"(`python -m bench.compare --json-file bench/results/{kind}-YYYY-MM-DD.json`). Until then the site "
        "quotes no figure of this kind.\n"
    )


def on_page_markdown(markdown: str, **_: Any) -> str:
    repo = RESULTS.parents[1]

    def table(match: re.Match[str]) -> str:
        if match["kind"] == "compare":
            runs = newest_per_server_db("compare")
            return (
                "\n".join(
                    f"**Orbit's server on {SERVER_DBS.get(db, db)}**\n\n{render(path, repo)}"
                    for db, path in runs
                )
                if runs
                else missing("compare")
            )
        path = newest(match["kind"])
        return render(path, repo) if path else missing(match["kind"])

    return MARKER.sub(table, markdown)
