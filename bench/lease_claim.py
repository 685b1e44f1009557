"""Does the lease's claim stay indexed as the task table grows? The claim of ``--max-tasks`` tasks with few
and with many finished and waiting tasks of every priority, on MariaDB (issue 31 item 5).

    python -m bench.lease_claim [--finished 1000 1000000] [--waiting 1000 200000] [--max-tasks 10]
                                [--repeats 30] [--json-file PATH]

For each size (``--finished[i]``, ``--waiting[i]``), a fresh MariaDB database, migrated, with two queues:
``plain`` (no limits) and ``limited`` (``max_concurrency_per_key`` 1). Inserted set-based (MariaDB's
``seq`` engine, ids from ``UUID()``): ``--finished`` ``SUCCEEDED`` tasks in ``plain``, and ``--waiting``
``WAITING`` tasks in each queue, their priorities spread over -100..100, due over the last day, one in ten
due in an hour (the claim passes over those of a higher priority than the first due one), the limited
queue's spread over 1,000 ``concurrency_key`` values. Then the tables are analysed and, ``--repeats``
times per queue and size (the sizes alternating), :func:`orbit_server.tasks.leases.lease_tasks` grants
``--max-tasks`` tasks in a transaction that is rolled back (so every claim finds the same rows), in this
process (no HTTP). Prints the median and 90th percentile per claim, the ratio of the largest size to the
smallest (target: at most 1.5x), and for the largest size the claim ``SELECT``'s EXPLAIN and what it
read when run (``Handler_read_*``, ``Sort_rows``: 0 when the order comes from the index).

Seeding 1,000,000 finished and 2 x 200,000 waiting tasks takes a few minutes; a quick look:
``--finished 1000 50000 --waiting 1000 10000``. Writes its figures, with date, commit, command and load
averages, to ``bench/results/claim-<UTC time>-<commit>.json`` unless ``--json-file -``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench._support import MYSQL_SERVER
from orbit_server.db import migrate
from orbit_server.db.engine import create_engine
from orbit_server.tasks import leases as leasing
from orbit_server.tasks import store

RESULTS = Path(__file__).resolve().parent / "results"
QUEUES = ("plain", "limited")
_INSERT = (
    "INSERT INTO tasks (id, namespace_id, queue_id, handler, params, status, state_version, attempt_count, "
    "max_attempts, retry_safe, available_at, cancel_requested, result, created_at, updated_at, finished_at, "
    "holds_permit, priority, concurrency_key) "
    "SELECT UUID(), :ns, :queue, 'h', '{{}}', :status, :version, :attempts, 3, 0, {due}, 0, NULL, NOW(6), NOW(6), "
    "{finished}, 0, {priority}, {key} FROM seq_1_to_{count}"
)


def _seed(engine: sa.Engine, finished: int, waiting: int) -> dict[str, int]:
    """Create the namespace and queues and insert the tasks (module docstring); the queue ids."""
    with engine.begin() as conn:
        namespace_id = store.create_namespace(conn, "bench")
        store.create_queue(conn, "bench", "plain")
        store.create_queue(conn, "bench", "limited", max_concurrency_per_key=1)
        ids = {name: int(conn.execute(sa.text("SELECT id FROM queues WHERE name = :n"), {"n": name}).scalar_one())
               for name in QUEUES}  # fmt: skip
    with engine.connect() as conn:
        for done in range(0, finished, 100_000):  # in transactions of 100,000 rows
            conn.execute(
                sa.text(_INSERT.format(due="NOW(6)", finished="NOW(6)", priority="0", key="NULL",
                                       count=min(100_000, finished - done))),
                {"ns": namespace_id, "queue": ids["plain"], "status": "SUCCEEDED", "version": 4, "attempts": 1},
            )  # fmt: skip
            conn.commit()
        due = "IF(seq % 10 = 0, NOW(6) + INTERVAL 1 HOUR, NOW(6) - INTERVAL (seq * 7 % 86400) SECOND)"
        for name in QUEUES:
            for done in range(0, waiting, 100_000):
                count = min(100_000, waiting - done)
                key = "CONCAT('k', seq % 1000)" if name == "limited" else "NULL"
                conn.execute(
                    sa.text(_INSERT.format(due=due, finished="NULL", priority="CAST(seq * 7919 % 201 AS SIGNED) - 100", key=key,
                                           count=count)),
                    {"ns": namespace_id, "queue": ids[name], "status": "WAITING", "version": 1, "attempts": 0},
                )  # fmt: skip
                conn.commit()
        conn.execute(sa.text("ANALYZE TABLE tasks"))
    return {"namespace_id": namespace_id, **ids}


def _claim(engine: sa.Engine, namespace_id: int, queue: str, max_tasks: int) -> float:
    """Seconds of one lease of ``max_tasks`` (rolled back)."""
    with engine.connect() as conn:
        started = time.perf_counter()
        grants = leasing.lease_tasks(conn, namespace_id, queue, worker_id="bench", max_tasks=max_tasks,
                                     lease_seconds=30)  # fmt: skip
        spent = time.perf_counter() - started
        conn.rollback()
    if len(grants) != max_tasks:
        raise SystemExit(f"the lease of {queue} granted {len(grants)}, expected {max_tasks}")
    return spent


def _explain(engine: sa.Engine, namespace_id: int, queue: str, max_tasks: int) -> dict[str, Any]:
    """The claim ``SELECT`` of one lease, as the driver got it: its EXPLAIN and what it read when run."""
    captured: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if statement.lstrip().startswith("SELECT") and "ORDER BY tasks.priority DESC" in statement:
            captured.append((statement, parameters))

    sa.event.listen(engine, "before_cursor_execute", capture)
    try:
        _claim(engine, namespace_id, queue, max_tasks)
    finally:
        sa.event.remove(engine, "before_cursor_execute", capture)
    statement, parameters = captured[0]
    with engine.connect() as conn:
        plan = [dict(row) for row in conn.exec_driver_sql(f"EXPLAIN {statement}", parameters).mappings()]
        conn.exec_driver_sql("FLUSH STATUS")
        conn.exec_driver_sql(statement, parameters).all()
        status: dict[str, Any] = dict(conn.exec_driver_sql("SHOW SESSION STATUS").all())
        conn.rollback()
    read = {k: int(v) for k, v in status.items() if k.startswith("Handler_read") and v != "0"}
    return {"explain": plan, "handler_reads": read, "sort_rows": int(status["Sort_rows"])}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--finished", type=int, nargs="+", default=[1000, 1_000_000])
    parser.add_argument("--waiting", type=int, nargs="+", default=[1000, 200_000])
    parser.add_argument("--max-tasks", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json-file", help="default bench/results/claim-<UTC time>-<commit>.json; '-': none")
    args = parser.parse_args()
    if len(args.finished) != len(args.waiting):
        parser.error("--finished and --waiting take as many sizes each")
    commit = (
        subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        or "unknown"
    )
    started = datetime.now(UTC)
    meta: dict[str, Any] = {
        "date": started.strftime("%Y-%m-%dT%H:%M:%SZ"), "started_at": started.isoformat(timespec="seconds"),
        "commit": commit, "command": "python -m bench.lease_claim " + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cores": os.cpu_count()},
        "loadavg_at_start": os.getloadavg(), "max_tasks": args.max_tasks, "repeats": args.repeats,
        "settings": {"database": "MariaDB on this machine (its buffer pool as configured)"},
    }  # fmt: skip
    root = sa.create_engine(sa.make_url(MYSQL_SERVER).set(database=None), isolation_level="AUTOCOMMIT")
    made: list[tuple[str, sa.Engine, dict[str, int], float]] = []
    try:
        for finished, waiting in zip(args.finished, args.waiting, strict=True):
            name = f"orbit_claim_{uuid.uuid4().hex[:8]}"
            with root.connect() as conn:
                conn.exec_driver_sql(f"CREATE DATABASE {name}")
            engine = create_engine(
                sa.make_url(MYSQL_SERVER).set(database=name).render_as_string(False), pool_size=2
            )
            made.append((name, engine, {}, 0.0))
            seeding = time.perf_counter()
            migrate.upgrade(engine)
            ids = _seed(engine, finished, waiting)
            made[-1] = (name, engine, ids, time.perf_counter() - seeding)
            print(f"seeded {finished:,} finished, 2 x {waiting:,} waiting in {made[-1][3]:.0f} s", flush=True)
        samples: dict[tuple[int, str], list[float]] = {(i, q): [] for i in range(len(made)) for q in QUEUES}
        for _name, engine, ids, _ in made:  # warm up
            for queue in QUEUES:
                _claim(engine, ids["namespace_id"], queue, args.max_tasks)
        for repeat in range(args.repeats):  # the sizes alternate, so that they meet the same load
            order = range(len(made)) if repeat % 2 == 0 else reversed(range(len(made)))
            for index in order:
                _name, engine, ids, _ = made[index]
                for queue in QUEUES:
                    samples[index, queue].append(_claim(engine, ids["namespace_id"], queue, args.max_tasks))
        _name, engine, ids, _ = made[-1]
        plans = {queue: _explain(engine, ids["namespace_id"], queue, args.max_tasks) for queue in QUEUES}
    finally:
        with root.connect() as conn:
            for name, engine, *_ in made:
                engine.dispose()
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}")
        root.dispose()
    meta["loadavg_at_end"] = os.getloadavg()
    figures: list[dict[str, Any]] = []
    print(f"{'finished':>10} {'waiting':>9} {'queue':>8} {'median ms':>10} {'p90 ms':>8}")
    for index, (finished, waiting) in enumerate(zip(args.finished, args.waiting, strict=True)):
        for queue in QUEUES:
            values = sorted(samples[index, queue])
            median, p90 = statistics.median(values) * 1000, values[int(0.9 * (len(values) - 1))] * 1000
            print(f"{finished:>10,} {waiting:>9,} {queue:>8} {median:>10.2f} {p90:>8.2f}")
            figures.append({
                "section": "claim", "name": f"lease of {args.max_tasks} ({queue}), {finished:,} finished, "
                f"{waiting:,} waiting", "value": median, "unit": "ms", "note": f"median; p90 {p90:.2f} ms",
                "base": None, "ratio": None, "target": None, "passed": None,
            })  # fmt: skip
    for queue in QUEUES:
        ratio = statistics.median(samples[len(made) - 1, queue]) / statistics.median(samples[0, queue])
        print(f"{queue}: largest / smallest (medians) {ratio:.2f}x  (target <= 1.5x)")
        figures.append({
            "section": "claim", "name": f"lease of {args.max_tasks} ({queue}): largest / smallest table",
            "value": ratio, "unit": "×", "note": "medians", "base": None, "ratio": None, "target": "≤ 1.5×",
            "passed": ratio <= 1.5,
        })  # fmt: skip
    for queue, found in plans.items():
        [claim] = [row for row in found["explain"] if row["table"] == "tasks"]
        print(f"{queue} claim at the largest size: key={claim['key']} type={claim['type']} "
              f"Extra={claim['Extra']!r}; read {found['handler_reads']}, Sort_rows {found['sort_rows']}")  # fmt: skip
    document = {"figures": figures, "plans": plans, "meta": meta}
    json_file = args.json_file or str(
        RESULTS / f"claim-{meta['started_at'][:16].replace(':', '')}-{commit[:7]}.json"
    )
    if json_file != "-":
        Path(json_file).parent.mkdir(parents=True, exist_ok=True)
        Path(json_file).write_text(json.dumps(document, indent=2, default=str) + "\n")
        print(f"figures written to {json_file}")


if __name__ == "__main__":
    main()
