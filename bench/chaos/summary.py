"""What a chaos run found, for people and files: its table, a failed run's evidence, its results file.

:func:`bench.chaos.run.run` returns the run's summary (a dict); this module shows it (:func:`show`),
quotes what the logs say about a violation (:func:`evidence`) and writes it as a ``bench/results/`` file
(:func:`results_file`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["evidence", "results_file", "show"]


def evidence(root: Path, violations: list[str], *, per_id: int = 12) -> str:
    """What a failed run's logs say about its violations, for a test's failure message: the fault
    log, and the log lines that name each id (an order, a task, an event) a violation names, at most
    ``per_id`` lines per id. The run directory ``root`` may be gone with its temp folder by the time
    someone reads a CI log: this is what is left of it."""
    logs = root / "logs"
    parts = [f"run directory {root}"]
    faults = logs / "faults.log"
    if faults.is_file():
        parts.append("--- faults.log\n" + faults.read_text(errors="replace"))
    ids = dict.fromkeys(
        re.findall(
            r"\b(?:ord_[0-9a-f]{8,}|[0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12})", " ".join(violations)
        )
    )
    texts = {path.name: path.read_text(errors="replace").splitlines() for path in sorted(logs.glob("*.log"))}
    for found in list(ids)[:6]:
        lines = [f"{name}: {line}" for name, text in texts.items() for line in text if found in line]
        parts.append(f"--- {found}: {len(lines)} log lines\n" + "\n".join(lines[:per_id]))
    return "\n".join(parts)


def show(s: dict[str, Any]) -> None:
    out = Console()
    ok = not s["violations"]
    table = Table(
        "measure",
        "value",
        title=f"Chaos run (seed {s['seed']}{'' if s['skip_locked'] else ', no SKIP LOCKED'})",
    )
    table.add_row("orders (acknowledged)", f"{s['orders']} ({s['acknowledged_orders']})")
    table.add_row("order outcomes", ", ".join(f"{k} {v}" for k, v in sorted(s["order_statuses"].items())))
    table.add_row("faults injected", str(s["faults_total"]))
    for kind in s["faults"]:
        missed = s["faults_missed"].get(kind)
        table.add_row(
            f"  {kind}", f"{s['faults'][kind]}" + (f" (+{missed} armed, not reached)" if missed else "")
        )
    if s["cluster"]:
        table.add_row("node faults", str(s["node_faults"]))
        table.add_row(
            "paused nodes restarted (group communication closed)", str(s["nodes_restarted_after_pause"])
        )
        table.add_row("faults recovered by an operator's procedure", str(s["operator_recoveries"]))
        table.add_row("certification failures / brute-force aborts per 1,000 tasks",
                      f"{s['cert_failures_per_1000_tasks']} / {s['bf_aborts_per_1000_tasks']}")  # fmt: skip
    else:
        server = "postgres" if s.get("server_db") == "postgres" else "mariadbd"
        table.add_row(
            f"database crashes (SIGKILL mariadbd; Orbit's: {server})",
            ", ".join(f"{k} {v}" for k, v in s["db_crashes"].items()),
        )
    table.add_row("lost", str(s["lost"]))
    table.add_row("duplicated", str(s["duplicated"]))
    table.add_row("double-charged", str(s["double_charged"]))
    table.add_row("results applied twice", str(s["results_applied_twice"]))
    table.add_row("two live attempts at once", str(s["live_attempt_overlaps"]))
    table.add_row("invariant violations", str(len(s["violations"])))
    table.add_row(
        "tasks / attempts (expired) / events",
        f"{s['tasks']} / {s['attempts']} ({s['attempts_expired']}) / {s['task_events']}",
    )
    table.add_row("result events / follow-ups", f"{s['result_events']} / {s['follow_ups']}")
    table.add_row("outbox rows sent more than once", str(s["resent_rows"]))
    table.add_row("failed without a decline / charged but not completed",
                  f"{s['failed_not_declined']} / {s['charged_but_not_completed']}")  # fmt: skip
    table.add_row("processes that exited by themselves", str(s["self_exits"]))
    table.add_row(
        "faults phase / drain after the last fault", f"{s['faults_seconds']} s / {s['drain_seconds']} s"
    )
    table.add_row("total time", f"{s['total_seconds']} s")
    out.print(table)
    for line in s["violations"]:
        out.print(f"[red]violation[/red] {line}")
    for line in s["self_exit_details"]:
        out.print(f"[yellow]exited by itself[/yellow] {line[:600]}")
    out.print("[green]Every invariant held.[/green]" if ok else "[red]Invariants were violated.[/red]")


#: The figures of a results file (:func:`results_file`): (summary key, name, unit, target when one is set).
_FIGURES = (
    ("orders", "orders placed", "orders", None),
    ("acknowledged_orders", "orders acknowledged", "orders", None),
    ("faults_total", "faults injected", "faults", None),
    ("node_faults", "node faults (cluster)", "faults", None),
    ("lost", "lost", "orders", "0"),
    ("duplicated", "duplicated", "tasks", "0"),
    ("double_charged", "double-charged", "orders", "0"),
    ("results_applied_twice", "results applied twice", "results", "0"),
    ("live_attempt_overlaps", "two live attempts at once", "tasks", "0"),
    ("tasks", "tasks", "tasks", None),
    ("attempts", "attempts", "attempts", None),
    ("attempts_expired", "attempts expired", "attempts", None),
    ("resent_rows", "outbox rows sent more than once", "rows", None),
    ("cert_failures_per_1000_tasks", "certification failures per 1,000 tasks (cluster)", "", None),
    ("bf_aborts_per_1000_tasks", "brute-force aborts per 1,000 tasks (cluster)", "", None),
)


def _section(summary: dict[str, Any]) -> str:
    """A results file's section: ``chaos``, ``chaos (galera)`` or ``chaos (server on postgres)``."""
    if summary.get("cluster"):
        return f"chaos ({summary['cluster']})"
    if summary.get("server_db", "mariadb") != "mariadb":
        return f"chaos (server on {summary['server_db']})"
    return "chaos"


def results_file(
    path: Path, summary: dict[str, Any], started: float, load: list[float], argv: Sequence[str]
) -> None:
    """Write ``summary`` as a results file: ``figures`` (the invariants with their target of 0 and the
    run's size), ``summary`` as :func:`run` returned it, and ``meta`` (date, commit, command, machine, load
    averages), the shape ``bench/results/README.md`` describes."""
    import platform

    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    figures = [
        {"section": _section(summary), "name": name,
         "value": summary[key], "unit": unit, "note": "", "base": None, "ratio": None, "target": target,
         "passed": None if target is None else summary[key] == 0}
        for key, name, unit, target in _FIGURES
        if isinstance(summary.get(key), int | float)
    ]  # fmt: skip
    figures.append({"section": figures[0]["section"], "name": "invariant violations", "value": len(summary["violations"]),
                    "unit": "", "note": "", "base": None, "ratio": None, "target": "0",
                    "passed": not summary["violations"]})  # fmt: skip
    meta = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "commit": commit or None,
        "command": " ".join(["python -m bench.chaos", *argv]),
        "machine": {"platform": platform.platform(), "cores": os.cpu_count()},
        "loadavg_at_start": load,
        "loadavg_at_end": list(os.getloadavg()),
        "seconds": round(time.time() - started, 1),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"figures": figures, "summary": summary, "meta": meta}, indent=2, default=str) + "\n"
    )
