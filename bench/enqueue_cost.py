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
machine): each round runs once with the packages in ``DIR`` first on the path (A, e.g. the base commit's
``git archive BASE outbox_adapter orbit_client migrations/outbox | tar -x -C DIR``; the benchmark itself comes from this
checkout) and once with this checkout alone (B), in alternating order, each in a process of its own;
the report gives both sides' figures per round and the median of B / A.
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


def one_round(n: int, db: str) -> dict[str, float]:
    """One :func:`bench.compare.business_transactions` on a new database: its figures by name."""
    from bench.compare import business_transactions

    report = Report()
    with _business_database(db) as engine:
        business_transactions(report, engine, n)
    return {f.name: f.value for f in report.figures if f.value is not None}


def _child(n: int, db: str, first: str, here: str) -> dict[str, float]:
    """One round in a process of its own, importing packages from ``first`` before this checkout."""
    pythonpath = here if first == here else f"{first}{os.pathsep}{here}"
    done = subprocess.run(
        [sys.executable, "-m", "bench.enqueue_cost", "--n", str(n), "--db", db, "--child"],
        env={**os.environ, "PYTHONPATH": pythonpath},
        cwd=first,
        check=True,
        capture_output=True,
        text=True,
    )
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


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
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_round(args.n, args.db)))
        return
    here = str(Path(__file__).resolve().parent.parent)
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        entry: dict[str, Any] = {"loadavg": os.getloadavg()}
        if args.ab_pythonpath:
            order = ("A", "B") if r % 2 == 0 else ("B", "A")
            for side in order:
                entry[side] = _child(args.n, args.db, args.ab_pythonpath if side == "A" else here, here)
            entry["order"] = "".join(order)
        else:
            entry["B"] = one_round(args.n, args.db)
        rounds.append(entry)
        print(_line(r, entry), file=sys.stderr)
    summary = {
        name: {
            side: statistics.median(e[side][name] for e in rounds)
            for side in ("A", "B")
            if all(side in e for e in rounds)
        }
        for name in (BASE, COST, KEYED_COST)
    }
    if args.ab_pythonpath:
        for name in (COST, KEYED_COST):
            summary[name]["B/A"] = statistics.median(e["B"][name] / e["A"][name] for e in rounds)
    result = {"n": args.n, "db": args.db, "rounds": rounds, "median": summary,
              "loadavg_at_end": os.getloadavg()}  # fmt: skip
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
            parts.append(f"{side}: base {f[BASE]:.0f} txn/s, cost {f[COST]:.2f}x, keyed {f[KEYED_COST]:.2f}x")
    return "; ".join(parts)


if __name__ == "__main__":
    main()
