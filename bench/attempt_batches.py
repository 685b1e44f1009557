"""What a batched ``start`` and ``complete`` call costs, by its number of items, paired between two servers.

    python -m bench.attempt_batches --ab-env PYTHONPATH=DIR [--sizes 2 3 4 8 16] [--calls 100]
                                    [--rounds 3] [--json-file PATH|-]

Two ``orbit-server serve`` processes on one fresh MariaDB database (as in :mod:`bench.call_floor`:
background loops off, each server as its own MariaDB user, so that MariaDB's per-user statistics
count each side's commands and CPU): the first runs this checkout, the second the environment
``--ab-env`` gives it (``PYTHONPATH=DIR`` with another version's ``orbit_server``, ``orbit_client``
and ``migrations``, e.g. ``git archive BASE orbit_server orbit_client migrations | tar -x -C DIR``;
run from outside the checkout, so that ``python -m`` does not import the checkout first). For each
size, ``--calls`` batches of that many tasks leased beforehand are started, then completed, one
call after the other; per call: the server process's CPU (``/proc``), MariaDB's CPU and its
commands. Each round measures both servers, in alternating order; the medians over rounds, and
the median of the per-round ratios second / first (server CPU, and server + MariaDB CPU).

This is how the size from which a batch is written set-based
(``orbit_server.api.attempt_batches._SET_BASED_FROM``) was chosen: a second server whose copy sets
it to a size nobody sends runs every batch item by item. Writes its figures with date, commit and
load to ``bench/results/attempt-batches-*.json`` unless ``--json-file -``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import sqlalchemy as sa

from bench._support import (
    MYSQL_SERVER,
    cli,
    cpu_seconds,
    orbit_server_processes,
    run_provenance,
    write_results,
)
from bench.call_floor import NS, Counters, Orbit, _attempt, _database

ACTIONS = ("start", "complete")
#: The servers' background loops, off: they are not part of any call.
QUIET = {f"ORBIT_{loop}_INTERVAL_SECONDS": "0" for loop in ("SWEEP", "SCHEDULER", "FLOW", "METRICS_SAMPLE")}


def _measure(orbit: Orbit, pid: int, counters: Counters, user: str, size: int, calls: int) -> dict[str, Any]:
    """Start, then complete, ``calls`` batches of ``size`` fresh tasks; figures per call, by action."""
    grants = orbit.leased(size * calls)
    batches = [grants[i : i + size] for i in range(0, len(grants), size)]
    out: dict[str, Any] = {}
    for action in ACTIONS:
        body = {"result": {"ok": True}} if action == "complete" else {}
        commands, db_cpu = counters.read(user)
        cpu = cpu_seconds(pid)
        for batch in batches:
            orbit.post(f"/attempts/{action}", {"items": [_attempt(grant, orbit, **body) for grant in batch]})
        cpu = cpu_seconds(pid) - cpu
        commands_after, db_cpu_after = counters.read(user)
        out[action] = {
            "server_cpu_ms": cpu / calls * 1000,
            "db_cpu_ms": (db_cpu_after - db_cpu) / calls * 1000,
            "commands": (commands_after - commands) / calls,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ab-env", action="append", required=True, metavar="NAME=VALUE",
                        help="the second server's environment (repeatable), e.g. PYTHONPATH=DIR")  # fmt: skip
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 3, 4, 8, 16])
    parser.add_argument("--calls", type=int, default=100, help="batches of each size and action per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json-file", default=None, help="where to write the figures ('-': nowhere)")
    args = parser.parse_args()
    ab_env = dict(item.split("=", 1) for item in args.ab_env)
    meta = run_provenance(
        "bench.attempt_batches",
        {"sizes": args.sizes, "calls": args.calls, "rounds": args.rounds, "second server's environment": args.ab_env,
         "servers": "orbit-server serve defaults, background loops off, MariaDB on this machine, PyMySQL"},
    )  # fmt: skip
    admin = sa.create_engine(MYSQL_SERVER)
    with admin.connect() as conn:
        userstat_was = conn.exec_driver_sql("SELECT @@GLOBAL.userstat").scalar_one()
        conn.exec_driver_sql("SET GLOBAL userstat = 1")
    counters = Counters(admin)
    rounds: list[dict[str, Any]] = []
    try:
        with _database(admin) as (name, users):
            url = sa.make_url(MYSQL_SERVER).set(username=users["orbit"], password=None, database=name)
            url_text = url.render_as_string(False)
            cli("migrate", url=url_text)
            cli("namespace", "create", NS, url=url_text)
            keys = {
                role: cli("api-key", "create", NS, "--role", role, url=url_text)
                for role in ("submit", "work")
            }
            with (
                orbit_server_processes(url_text, env=QUIET) as [first],
                orbit_server_processes(url_text, env={**QUIET, **ab_env}) as [second],
            ):
                sides = {
                    "first": (Orbit(first.base, keys, url_text), first.proc.pid),
                    "second": (Orbit(second.base, keys, url_text, prefix="b"), second.proc.pid),
                }
                for orbit, _ in sides.values():
                    orbit.leased(20)  # warm-up: the key cache, the first statements
                for round_ in range(args.rounds):
                    figures: dict[str, Any] = {}
                    for size in args.sizes:
                        order = ("first", "second") if round_ % 2 == 0 else ("second", "first")
                        for side in order:
                            orbit, pid = sides[side]
                            figures[f"{side} {size}"] = _measure(
                                orbit, pid, counters, users["orbit"], size, args.calls
                            )
                    rounds.append(figures)
                    print(f"round {round_ + 1} of {args.rounds} done", file=sys.stderr)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"SET GLOBAL userstat = {int(userstat_was)}")
    report = _report(rounds, args.sizes)
    _print(report, meta)
    write_results("attempt-batches", meta, report, args.json_file)


def _report(rounds: list[dict[str, Any]], sizes: list[int]) -> dict[str, Any]:
    """Per action and size: each server's medians, and the medians of the per-round ratios second / first."""
    out: dict[str, Any] = {}
    for action in ACTIONS:
        for size in sizes:
            first = [r[f"first {size}"][action] for r in rounds]
            second = [r[f"second {size}"][action] for r in rounds]
            figure: dict[str, Any] = {
                side: {key: round(statistics.median(v[key] for v in values), 3) for key in values[0]}
                for side, values in (("first", first), ("second", second))
            }
            figure["second_over_first_server_cpu"] = round(
                statistics.median(
                    b["server_cpu_ms"] / a["server_cpu_ms"] for a, b in zip(first, second, strict=True)
                ),
                2,
            )
            figure["second_over_first_with_db_cpu"] = round(
                statistics.median(
                    (b["server_cpu_ms"] + b["db_cpu_ms"]) / (a["server_cpu_ms"] + a["db_cpu_ms"])
                    for a, b in zip(first, second, strict=True)
                ),
                2,
            )
            out[f"{action}, {size} items"] = figure
    return out


def _print(report: dict[str, Any], meta: dict[str, Any]) -> None:
    print(
        f"\nbench.attempt_batches at {meta['commit'][:7]}, {meta['date']}, load {meta['loadavg_at_start'][0]:.1f}"
    )
    print(
        f"{'call':22} {'server CPU ms':>21} {'MariaDB CPU ms':>21} {'commands':>15} {'2nd/1st':>8} {'with DB':>8}"
    )
    for call, f in report.items():
        a, b = f["first"], f["second"]
        print(
            f"{call:22} {a['server_cpu_ms']:10.2f}{b['server_cpu_ms']:11.2f} {a['db_cpu_ms']:10.2f}{b['db_cpu_ms']:11.2f} "
            f"{a['commands']:7.1f}{b['commands']:8.1f} {f['second_over_first_server_cpu']:7.2f}× "
            f"{f['second_over_first_with_db_cpu']:7.2f}×"
        )


if __name__ == "__main__":
    main()
