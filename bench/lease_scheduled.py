"""A lease's cost beside a queue's tasks scheduled for later: flat, or growing with them (issue 28).

    python -m bench.lease_scheduled [--database mariadb|sqlite|postgres] [--scheduled 50000] [--calls 50]
                                    [--json-file PATH|-]

On a fresh, migrated database (MariaDB at ``ORBIT_TEST_MYSQL_URL``, PostgreSQL at
``ORBIT_TEST_POSTGRES_URL``, dropped at the end; or SQLite in a temporary directory), four queues: ``few``
(10 waiting tasks due in an hour) and ``many`` (``--scheduled`` of them), each at the default priority (0)
and, as ``few-mixed`` / ``many-mixed``, spread over priorities 0-5. For each queue, in this process (no
HTTP): ``--calls`` empty leases (``leases.lease``, ``max_tasks`` 10, nothing due: an idle worker's lease),
then, with 3 tasks due, ``--calls`` leases of 10 in a transaction rolled back each time (fewer due than
asked for). Prints the milliseconds per lease (median of 5 batches of ``--calls`` / 5) and each ``many``
queue's ratio to its ``few`` queue: 1.0 is a lease that reads none of the tasks not yet due. Run it with
``PYTHONPATH`` at another checkout to measure that code. Writes ``bench/results/lease-scheduled-*.json``
(date, commit, load) unless ``--json-file -``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench._support import MYSQL_SERVER, cli, run_provenance
from orbit_server.db.engine import db_now
from orbit_server.db.schema import namespaces, queues, tasks
from orbit_server.tasks import leases, store

RESULTS = Path(__file__).resolve().parent / "results"
POSTGRES_SERVER = os.environ.get(
    "ORBIT_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


def _row(namespace_id: int, queue_id: int, at: Any, priority: int) -> dict[str, Any]:
    return {
        "id": str(uuid.uuid4()), "namespace_id": namespace_id, "queue_id": queue_id, "handler": "h",
        "params": {}, "status": "WAITING", "state_version": 1, "attempt_count": 0, "max_attempts": 3,
        "available_at": at, "created_at": at, "updated_at": at, "priority": priority,
    }  # fmt: skip


def _database(kind: str) -> tuple[str, sa.Engine | None, str]:
    """``(url, admin engine or None, name)`` of a new database."""
    name = f"orbit_lsched_{uuid.uuid4().hex[:8]}"
    if kind == "sqlite":
        return f"sqlite:///{Path(tempfile.mkdtemp(prefix='orbit-bench-')) / 'bench.db'}", None, name
    server = MYSQL_SERVER if kind == "mariadb" else POSTGRES_SERVER
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        suffix = " CHARACTER SET utf8mb4" if kind == "mariadb" else ""
        conn.execute(sa.text(f"CREATE DATABASE {name}{suffix}"))
    return sa.make_url(server).set(database=name).render_as_string(hide_password=False), admin, name


def _per_lease_ms(run: Any, calls: int) -> float:
    batch = max(1, calls // 5)
    times = []
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(batch):
            run()
        times.append((time.perf_counter() - began) / batch * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--database", choices=["mariadb", "sqlite", "postgres"], default="mariadb")
    parser.add_argument("--scheduled", type=int, default=50000, help="tasks due later in the 'many' queues")
    parser.add_argument("--calls", type=int, default=50, help="leases per figure (default 50)")
    parser.add_argument("--json-file", default=None, help="where to write the figures ('-': nowhere)")
    args = parser.parse_args()
    import orbit_server

    code = str(Path(orbit_server.__file__).resolve().parent.parent)
    settings = {"database": args.database, "scheduled": args.scheduled, "calls": args.calls}
    if code != str(Path(__file__).resolve().parent.parent):
        settings["orbit_server_from"] = code  # another checkout's server code (PYTHONPATH)
    meta = run_provenance("bench.lease_scheduled", settings)
    url, admin, name = _database(args.database)
    figures: dict[str, dict[str, float]] = {}
    try:
        cli("migrate", url=url)
        cli("namespace", "create", "bench", url=url)
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            namespace_id = conn.execute(
                sa.select(namespaces.c.id).where(namespaces.c.name == "bench")
            ).scalar_one()
            now = db_now(conn)
            ids: dict[str, int] = {}
            for queue, count, mixed in (
                ("few", 10, False), ("many", args.scheduled, False),
                ("few-mixed", 10, True), ("many-mixed", args.scheduled, True),
            ):  # fmt: skip
                store.create_queue(conn, "bench", queue)
                ids[queue] = conn.execute(sa.select(queues.c.id).where(queues.c.name == queue)).scalar_one()
                later = now + timedelta(hours=1)
                rows = [_row(namespace_id, ids[queue], later, n % 6 if mixed else 0) for n in range(count)]
                for start in range(0, len(rows), 5000):
                    conn.execute(tasks.insert(), rows[start : start + 5000])
        with engine.connect() as conn:
            conn.exec_driver_sql("ANALYZE TABLE tasks" if args.database == "mariadb" else "ANALYZE tasks")
            conn.commit()
        options: dict[str, Any] = {
            "worker_id": "bench",
            "max_tasks": 10,
            "lease_seconds": 30.0,
            "start": False,
        }

        def empty(queue: str) -> None:
            assert leases.lease(engine, namespace_id, queue, **options) == []

        def three_due(queue: str) -> None:
            with engine.connect() as conn, conn.begin() as transaction:
                grants = leases.lease_tasks(conn, namespace_id, queue, **options)
                assert len(grants) == 3, grants
                transaction.rollback()

        for queue in ids:
            figures[queue] = {"empty lease ms": _per_lease_ms(lambda q=queue: empty(q), args.calls)}
        with engine.begin() as conn:
            for queue_id in ids.values():
                conn.execute(
                    tasks.insert(),
                    [_row(namespace_id, queue_id, now - timedelta(minutes=3 - n), 0) for n in range(3)],
                )
        for queue in ids:
            figures[queue]["lease of 10, 3 due, ms"] = _per_lease_ms(lambda q=queue: three_due(q), args.calls)
        engine.dispose()
    finally:
        if admin is not None:
            with admin.connect() as conn:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}"))
            admin.dispose()
    meta["load_at_end"] = os.getloadavg()
    print(f"bench.lease_scheduled at {meta['commit'][:7]} (server code: {code}), {args.database}, "
          f"scheduled={args.scheduled}, load {meta['loadavg_at_start'][0]:.1f}")  # fmt: skip
    print(f"{'queue':<12} {'empty lease ms':>15} {'× few':>7} {'10 asked, 3 due ms':>19} {'× few':>7}")
    for queue, values in figures.items():
        base = figures[queue.replace("many", "few")]
        print(
            f"{queue:<12} {values['empty lease ms']:>15.2f} {values['empty lease ms'] / base['empty lease ms']:>6.2f}×"
            f" {values['lease of 10, 3 due, ms']:>19.2f}"
            f" {values['lease of 10, 3 due, ms'] / base['lease of 10, 3 due, ms']:>6.2f}×"
        )
    if args.json_file != "-":
        stamp = meta["date"][:16].replace(":", "")
        path = (
            Path(args.json_file)
            if args.json_file
            else RESULTS
            / (
                f"lease-scheduled-{args.database}-{stamp}-{meta['commit'][:7]}"
                f"{'-other-code' if 'orbit_server_from' in settings else ''}.json"
            )
        )
        path.write_text(json.dumps({"meta": meta, "figures": figures}, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
