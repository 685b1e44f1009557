"""A lease call's server cost on PostgreSQL, two versions of the code paired in one run (issue 28).

    python -m bench.pg_lease --ab-pythonpath DIR [--calls 300] [--rounds 4] [--json-file PATH|-]

Two ``orbit-server serve`` processes, each on a fresh PostgreSQL database of its own (at
``ORBIT_TEST_POSTGRES_URL``, migrated; dropped at the end), with the background loops off: side A imports
the code in ``DIR`` first (``PYTHONPATH``, e.g. ``/work/main``: the base), side B this checkout. Beside
them the floor of ``bench.call_floor`` (:mod:`bench._floor_app`: a bare FastAPI route under the same
uvicorn updating a task and its attempt by key, inserting an event and committing) on side B's database.
Each round sends, one call after the other (concurrency 1, ``wait_seconds`` 0) to each side: ``--calls``
empty leases (``max_tasks`` 1, and 10), leases with one grant (``max_tasks`` 1 on a queue of due tasks)
and leases of 10 grants; and the floor's call, on tasks leased beforehand. The sides alternate (A first
in odd rounds, B first in even ones; the floor first in odd rounds, last in even ones), so both meet the
same load; each round's queues are filled first, then both databases are analysed. Per call: the server
process's CPU (``/proc``), the CPU of its database's PostgreSQL backends (their process titles name the
database), the wall time. Reported: the medians over rounds, each call's
ratio to the floor's CPU in the same round (issue 28: a lease with one grant ≤ 2×, an empty lease ≤ 1×)
and B / A (the median of the per-round ratios of B's server CPU to A's). Preparing tasks is not counted.

Writes its figures with date, commit, machine and load averages to ``bench/results/pg-lease-*.json``
unless ``--json-file -``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from bench._support import ProcessCpu, cli, cpu_seconds, orbit_server_processes, run_provenance, write_results
from bench.call_floor import NS, Orbit, _floor_process

POSTGRES_SERVER = os.environ.get(
    "ORBIT_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
HERE = str(Path(__file__).resolve().parent.parent)
#: The lease calls measured: (name, max_tasks, grants each call must get).
CALLS = [("empty lease", 1, 0), ("empty lease, max 10", 10, 0), ("lease, one grant", 1, 1), ("lease, 10 grants", 10, 10)]  # fmt: skip


@contextlib.contextmanager
def _databases(count: int) -> Iterator[list[str]]:
    """``count`` fresh PostgreSQL databases, migrated, each with the namespace :data:`NS`; dropped after."""
    admin = sa.create_engine(POSTGRES_SERVER, isolation_level="AUTOCOMMIT")
    names = [f"bench_pglease_{uuid.uuid4().hex[:8]}" for _ in range(count)]
    try:
        with admin.connect() as conn:
            for name in names:
                conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        urls = [
            sa.make_url(POSTGRES_SERVER).set(database=n).render_as_string(hide_password=False) for n in names
        ]
        for url in urls:
            cli("migrate", url=url)
            cli("namespace", "create", NS, url=url)
        yield urls
    finally:
        with admin.connect() as conn:
            for name in names:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def _measure(pid: int, database: str, calls: list[Callable[[], None]]) -> dict[str, float]:
    """Run ``calls`` one after the other: the server's CPU, its database backends' CPU and the wall time,
    each per call, in ms."""
    with ProcessCpu("postgres", titles=(database,)) as db_cpu:
        cpu, started = cpu_seconds(pid), time.perf_counter()
        for call in calls:
            call()
        wall, cpu = time.perf_counter() - started, cpu_seconds(pid) - cpu
    n = len(calls)
    return {
        "server_cpu_ms": cpu / n * 1000,
        "db_cpu_ms": db_cpu.seconds / n * 1000,
        "wall_ms": wall / n * 1000,
    }


def _queues(orbit: Orbit, n: int) -> dict[str, str]:
    """A new queue per call of :data:`CALLS`, with the due tasks its ``n`` calls grant."""
    return {name: orbit.submitted(n * granted) if granted else orbit.queue() for name, _, granted in CALLS}


def _analyze(url: str) -> None:
    """Statistics as a database in use has them (autovacuum would take them at a random moment)."""
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE")
    engine.dispose()


def _lease_round(
    orbit: Orbit, pid: int, database: str, n: int, queues: dict[str, str]
) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, max_tasks, granted in CALLS:
        queue = queues[name]

        def call(queue: str = queue, max_tasks: int = max_tasks, granted: int = granted) -> None:
            got = len(orbit.lease(queue, max_tasks))
            if got != granted:
                sys.exit(f"a lease of {max_tasks} granted {got}, not {granted}")

        out[name] = _measure(pid, database, [call] * n)
    return out


def _floor_round(
    floor: httpx.Client, grants: list[dict[str, Any]], pid: int, database: str
) -> dict[str, float]:
    def call(grant: dict[str, Any]) -> Callable[[], None]:
        path = f"/floor/{grant['task']['id']}/{grant['attempt']['id']}"

        def post() -> None:
            floor.post(path).raise_for_status()

        return post

    return _measure(pid, database, [call(g) for g in grants])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--ab-pythonpath", required=True, metavar="DIR", help="side A's code (B: this checkout)"
    )
    parser.add_argument("--calls", type=int, default=300, help="calls of each kind per round (default 300)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds (default 4)")
    parser.add_argument("--json-file", default=None, help="where to write the figures ('-': nowhere)")
    args = parser.parse_args()
    meta = run_provenance(
        "bench.pg_lease",
        {"calls": args.calls, "rounds": args.rounds, "side A": args.ab_pythonpath, "side B": HERE,
         "servers": "orbit-server serve defaults, background loops off, PostgreSQL on this machine, psycopg"},
    )  # fmt: skip
    quiet = {
        f"ORBIT_{loop}_INTERVAL_SECONDS": "0" for loop in ("SWEEP", "SCHEDULER", "FLOW", "METRICS_SAMPLE")
    }
    rounds: list[dict[str, dict[str, float]]] = []
    with _databases(2) as (url_a, url_b):
        keys = [
            {role: cli("api-key", "create", NS, "--role", role, url=url) for role in ("submit", "work")}
            for url in (url_a, url_b)
        ]
        with (
            # not from this directory: ``python -m`` would import this checkout's code before PYTHONPATH's
            tempfile.TemporaryDirectory() as elsewhere,
            orbit_server_processes(url_a, env={**quiet, "PYTHONPATH": args.ab_pythonpath}, cwd=elsewhere) as [
                server_a
            ],
            orbit_server_processes(url_b, env={**quiet, "PYTHONPATH": HERE}, cwd=elsewhere) as [server_b],
            _floor_process(url_b) as (floor_base, floor_proc),
            httpx.Client(base_url=floor_base, timeout=60) as floor,
        ):
            sides = [
                ("A", Orbit(server_a.base, keys[0], url_a), server_a.proc.pid, sa.make_url(url_a).database),
                ("B", Orbit(server_b.base, keys[1], url_b), server_b.proc.pid, sa.make_url(url_b).database),
            ]
            for _, orbit, _, _ in sides:
                orbit.leased(20)  # warm-up: the key cache, the first statements, the sightings
            for round_ in range(1, args.rounds + 1):
                floor_grants = sides[1][1].leased(args.calls)
                queues = {side: _queues(orbit, args.calls) for side, orbit, _, _ in sides}
                for url in (url_a, url_b):
                    _analyze(url)
                database_b = str(sides[1][3])
                figures: dict[str, dict[str, float]] = {}
                if round_ % 2:
                    figures["floor"] = _floor_round(floor, floor_grants, floor_proc.pid, database_b)
                for side, orbit, pid, database in sides if round_ % 2 else sides[::-1]:
                    measured = _lease_round(orbit, pid, str(database), args.calls, queues[side])
                    figures |= {f"{call} [{side}]": figure for call, figure in measured.items()}
                if not round_ % 2:
                    figures["floor"] = _floor_round(floor, floor_grants, floor_proc.pid, database_b)
                rounds.append(figures)
                print(f"round {round_}: " + ", ".join(f"{k} {v['server_cpu_ms']:.2f}" for k, v in figures.items()),
                      file=sys.stderr)  # fmt: skip
    report = _report(rounds)
    meta["loadavg_at_end"] = os.getloadavg()
    _print(report, meta)
    write_results("pg-lease", meta, report, args.json_file)


def _report(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """Medians over the rounds, each call's median ratio to the floor's server CPU in its round, and for
    side B its median ratio to side A's same call."""
    out: dict[str, dict[str, Any]] = {}
    for kind in rounds[0]:
        values = [r[kind] for r in rounds]
        figure: dict[str, Any] = {
            key: round(statistics.median(v[key] for v in values), 3) for key in values[0]
        }
        if kind != "floor":
            ratios = [r[kind]["server_cpu_ms"] / r["floor"]["server_cpu_ms"] for r in rounds]
            figure["cpu_ratio_to_floor"] = round(statistics.median(ratios), 2)
        if kind.endswith(" [B]"):
            a = kind.removesuffix(" [B]") + " [A]"
            for key in ("server_cpu_ms", "db_cpu_ms", "wall_ms"):
                paired = [r[kind][key] / r[a][key] for r in rounds if r[a][key] > 0]
                figure[f"{key}_b_over_a"] = round(statistics.median(paired), 2) if paired else None
        out[kind] = figure
    return out


def _print(report: dict[str, dict[str, Any]], meta: dict[str, Any]) -> None:
    load = f"load {meta['loadavg_at_start'][0]:.1f} at start, {meta['loadavg_at_end'][0]:.1f} at end"
    print(f"\nbench.pg_lease at {meta['commit'][:7]}, {meta['date']}, {load}")
    print(f"{'call':28} {'server CPU ms':>13} {'× floor':>8} {'DB CPU ms':>10} {'wall ms':>8} "
          f"{'B/A CPU':>8} {'B/A DB':>7} {'B/A wall':>8}")  # fmt: skip
    for kind, f in report.items():
        ratio = f.get("cpu_ratio_to_floor")
        cells = [f.get(f"{k}_b_over_a") for k in ("server_cpu_ms", "db_cpu_ms", "wall_ms")]
        print(
            f"{kind:28} {f['server_cpu_ms']:13.2f} {'' if ratio is None else f'{ratio:.2f}×':>8} "
            f"{f['db_cpu_ms']:10.2f} {f['wall_ms']:8.2f} "
            + " ".join(
                f"{'' if c is None else f'{c:.2f}×':>{w}}" for c, w in zip(cells, (8, 7, 8), strict=True)
            )
        )


if __name__ == "__main__":
    main()
