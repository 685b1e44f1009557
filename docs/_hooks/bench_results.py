"""mkdocs hook: the Performance page's table, rendered at build time from a committed results file.

A page that holds the line ``<!-- bench-results: compare -->`` gets, in its place, the newest
``bench/results/compare-*.json`` (``python -m bench.compare --json-file``; files are named by the run's
UTC date, so the newest sorts last) as a provenance list and one table: every figure of the file with
its unit, the figure it is compared with and that one's value, the ratio, the target and whether it was
met. Nothing is typed by hand, so every number on the page is in the file it names. Without a file the
place says so (an admonition), and the build still passes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

MARKER = re.compile(r"^<!-- bench-results: (?P<kind>[a-z]+) -->$", re.M)
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def newest(kind: str, results: Path = RESULTS) -> Path | None:
    files = sorted(results.glob(f"{kind}-*.json"))
    return files[-1] if files else None


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
        *([f"- **Orbit's database**: MariaDB `{json.dumps(meta['mariadb'])}`"] if "mariadb" in meta else []),
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
        path = newest(match["kind"])
        return render(path, repo) if path else missing(match["kind"])

    return MARKER.sub(table, markdown)
