"""The price of ``enqueue`` in a business transaction, alone: ``bench.compare``'s measurement, nothing else.

    python -m bench.enqueue_cost [--n 1000] [--rounds 3] [--db {mariadb,postgres}] [--ab-pythonpath DIR] [--json]

Each round is :func:`bench.compare.business_transactions` on a new business database (MariaDB at
``ORBIT_TEST_MYSQL_URL`` by default, or PostgreSQL at ``ORBIT_TEST_POSTGRES_URL``, default
``postgresql+psycopg://postgres@127.0.0.1:5432/postgres``; dropped at the end): ``--n`` order
transactions ("INSERT order, COMMIT") alternated in chunks of 50 with the same transaction plus
``enqueue``, and plus ``enqueue`` with an ordering key. It prints ``bench.compare``'s figures under their
names ("enqueue cost (time with / without)", "enqueue cost with ordering key (time / without)"), per round
and their median, with the load average. No results file: ``bench.compare`` writes the ones the docs quote.

``--ab-pythonpath DIR`` compares two versions of the code in one run (a paired measurement on a noisy
machine): side A imports the packages in ``DIR`` first (e.g. the base commit's
``git archive BASE outbox_adapter orbit_client migrations/outbox | tar -x -C DIR``; the benchmark itself
comes from this checkout), side B this checkout alone. Each side is a process of its own with a business
database of its own, and the two run the same chunks in lockstep (A's chunk 1, B's chunk 1, B's chunk 2,
A's chunk 2, ...), so both meet the same load; each side's figures are computed as ``bench.compare``'s,
and B / A is the median over rounds of the ratio of B's figure to A's. Paired runs also report each
side's client CPU per ``enqueue`` (its process's CPU in transactions with ``enqueue`` minus without,
per transaction, µs): the part of the price that is Python, without the commit's fsync noise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench._compare import Report
from bench._support import MYSQL_SERVER

#: The figures of :func:`bench.compare.business_transactions` this module reports, under those names.
COST = "enqueue cost (time with / without)"
KEYED_COST = "enqueue cost with ordering key (time / without)"
BASE = "business txn without enqueue (base)"
#: Paired runs only: the client process's CPU per transaction, with minus without ``enqueue``.
CPU = "client CPU per enqueue (µs)"
KEYED_CPU = "client CPU per enqueue with ordering key (µs)"
POSTGRES_SERVER = os.environ.get(
    "ORBIT_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


@contextlib.contextmanager
def _business_database(db: str) -> Iterator[sa.Engine]:
    """A new, empty business database on ``db`` (``mariadb`` or ``postgres``); dropped on exit."""
    server = MYSQL_SERVER if db == "mariadb" else POSTGRES_SERVER
    name = f"orbit_enq_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    quote = "`" if db == "mariadb" else '"'
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE {quote}{name}{quote}")
    engine = sa.create_engine(sa.make_url(server).set(database=name))
    try:
        yield engine
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {quote}{name}{quote}")
        admin.dispose()


def _figures(n: int, seconds: list[float]) -> dict[str, float]:
    from bench.compare import add_business_figures

    report = Report()
    add_business_figures(report, n, *seconds)
    return {f.name: f.value for f in report.figures if f.value is not None}


def one_round(n: int, db: str) -> dict[str, float]:
    """One :func:`bench.compare.business_transactions` on a new database: its figures by name."""
    from bench.compare import business_transactions

    report = Report()
    with _business_database(db) as engine:
        business_transactions(report, engine, n)
    return {f.name: f.value for f in report.figures if f.value is not None}


def _serve(db: str) -> None:
    """Side process: run the chunk ``start count`` read from each stdin line; answer its seconds."""
    from bench.compare import Business

    with _business_database(db) as engine:
        business = Business.create(engine)
        print("ready", flush=True)
        for line in sys.stdin:
            start, count = map(int, line.split())
            print(json.dumps([*business.chunk(start, count), *business.cpu]), flush=True)


class _Side:
    def __init__(self, first: str, here: str, db: str) -> None:
        pythonpath = here if first == here else f"{first}{os.pathsep}{here}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.enqueue_cost", "--db", db, "--serve"],
            env={**os.environ, "PYTHONPATH": pythonpath},
            cwd=first,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._read()
        self.seconds = [0.0, 0.0, 0.0]
        self.cpu = [0.0, 0.0, 0.0]

    def _read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"a side process ended early (exit code {self.proc.wait()})")
        return line

    def chunk(self, start: int, count: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{start} {count}\n")
        self.proc.stdin.flush()
        answer = json.loads(self._read())
        for i, value in enumerate(answer[:3]):
            self.seconds[i] += value
        self.cpu = answer[3:]  # the process's totals so far

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def paired_round(n: int, db: str, a_dir: str, here: str) -> dict[str, dict[str, float]]:
    """Sides A (``a_dir`` first on the path) and B (this checkout) in lockstep chunks: their figures."""
    from bench.compare import BUSINESS_CHUNK

    sides = {"A": _Side(a_dir, here, db), "B": _Side(here, here, db)}
    try:
        for index, start in enumerate(range(0, n, BUSINESS_CHUNK)):
            for name in ("A", "B") if index % 2 == 0 else ("B", "A"):
                sides[name].chunk(start, min(BUSINESS_CHUNK, n - start))
    finally:
        for side in sides.values():
            side.close()
    return {name: {**_figures(n, side.seconds), **_cpu_figures(n, side.cpu)} for name, side in sides.items()}


def _cpu_figures(n: int, cpu: list[float]) -> dict[str, float]:
    """This side's own CPU (the client's: the database's is not in it) per ``enqueue``, in µs: far less
    noisy than the wall-clock figures, which the commit's fsync dominates."""
    return {CPU: (cpu[1] - cpu[0]) / n * 1e6, KEYED_CPU: (cpu[2] - cpu[0]) / n * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--n", type=int, default=1000, help="transactions of each kind per round (default 1000)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--db", choices=["mariadb", "postgres"], default="mariadb", help="business database")
    parser.add_argument(
        "--ab-pythonpath", metavar="DIR", help="side A's code (B: this checkout), paired rounds"
    )
    parser.add_argument("--json", action="store_true", help="print the rounds as JSON")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _serve(args.db)
        return
    here = str(Path(__file__).resolve().parent.parent)
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        entry: dict[str, Any] = {"loadavg": os.getloadavg()}
        if args.ab_pythonpath:
            entry.update(paired_round(args.n, args.db, str(Path(args.ab_pythonpath).resolve()), here))
        else:
            entry["B"] = one_round(args.n, args.db)
        rounds.append(entry)
        print(_line(r, entry), file=sys.stderr)
    sides = ("A", "B") if args.ab_pythonpath else ("B",)
    summary: dict[str, dict[str, float]] = {
        name: {side: statistics.median(e[side][name] for e in rounds) for side in sides}
        for name in (BASE, COST, KEYED_COST, *((CPU, KEYED_CPU) if args.ab_pythonpath else ()))
    }
    if args.ab_pythonpath:
        for name in (COST, KEYED_COST, CPU, KEYED_CPU):
            summary[name]["B/A"] = statistics.median(e["B"][name] / e["A"][name] for e in rounds)
    result = {
        "n": args.n,
        "db": args.db,
        "rounds": rounds,
        "median": summary,
        "loadavg_at_end": os.getloadavg(),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name, values in summary.items():
            print(
                f"{name}: "
                + ", ".join(f"{k} {v:.3f}" if v < 100 else f"{k} {v:.0f}" for k, v in values.items())
            )
        print(f"load average at end: {' '.join(f'{x:.2f}' for x in result['loadavg_at_end'])}")


def _line(r: int, entry: dict[str, Any]) -> str:
    parts = [f"round {r + 1} (load {entry['loadavg'][0]:.2f})"]
    for side in ("A", "B"):
        if side in entry:
            f = entry[side]
            cpu = f" (client CPU {f[CPU]:.0f} / {f[KEYED_CPU]:.0f} µs)" if CPU in f else ""
            parts.append(
                f"{side}: base {f[BASE]:.0f} txn/s, cost {f[COST]:.2f}x, keyed {f[KEYED_COST]:.2f}x{cpu}"
            )
    return "; ".join(parts)


if __name__ == "__main__":
    main()
