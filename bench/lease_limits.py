"""What a lease transaction costs with and without concurrency limits: statements and time per call.

    python -m bench.lease_limits [--database sqlite|mariadb] [--leases 300] [--max-tasks 4]

Calls :func:`orbit_server.tasks.leases.lease_tasks` in this process (no HTTP), ``--leases`` times per
kind of queue, on a fresh database with enough ``WAITING`` tasks:

- ``plain``: a queue without limits (the path every queue took before limits existed);
- ``per-key``: ``max_concurrency_per_key`` 1, every task with its own ``concurrency_key``;
- ``in-queue``: ``max_concurrency`` large enough never to bind, tasks without a key.

Prints statements per lease (counted by a ``before_cursor_execute`` listener: they do not depend
on the machine's load) and the median wall and mean process CPU time per lease, in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event

from bench._support import MYSQL_SERVER
from orbit_server.db import migrate
from orbit_server.db.engine import create_engine, db_now
from orbit_server.db.schema import tasks
from orbit_server.db.transact import transact
from orbit_server.tasks import leases as leasing
from orbit_server.tasks import store


def _database(kind: str) -> tuple[str, Any]:
    if kind == "sqlite":
        return f"sqlite:////tmp/orbit-bench-{uuid.uuid4().hex}.db", None
    name = f"orbit_bench_{uuid.uuid4().hex[:8]}"
    root = sa.create_engine(sa.make_url(MYSQL_SERVER).set(database=None))
    with root.begin() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE {name}")
    return sa.make_url(MYSQL_SERVER).set(database=name).render_as_string(False), (root, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database", choices=["sqlite", "mariadb"], default="sqlite")
    parser.add_argument("--leases", type=int, default=300)
    parser.add_argument("--max-tasks", type=int, default=4)
    args = parser.parse_args()
    url, cleanup = _database(args.database)
    engine = create_engine(url, pool_size=4)
    try:
        migrate.upgrade(engine)
        kinds: dict[str, dict[str, Any]] = {
            "plain": {},
            "per-key": {"max_concurrency_per_key": 1},
            "in-queue": {"max_concurrency": 10**6},
        }
        with engine.begin() as conn:
            store.create_namespace(conn, "bench")
            namespace_id = store.get_namespace_id(conn, "bench")
            now = db_now(conn)
            for name, limits in kinds.items():
                store.create_queue(conn, "bench", name, **limits)
                queue_id = conn.execute(
                    sa.text("SELECT id FROM queues WHERE name = :n"), {"n": name}
                ).scalar()
                conn.execute(
                    tasks.insert(),
                    [
                        {"id": str(uuid.uuid4()), "namespace_id": namespace_id, "queue_id": queue_id, "handler": "h",
                         "params": {}, "status": "WAITING", "state_version": 1, "attempt_count": 0,
                         "max_attempts": 3, "available_at": now, "created_at": now, "updated_at": now,
                         "concurrency_key": str(uuid.uuid4()) if name == "per-key" else None}
                        for _ in range(args.leases * args.max_tasks)
                    ],
                )  # fmt: skip
        statements = [0]
        event.listen(engine, "before_cursor_execute", lambda *_: statements.__setitem__(0, statements[0] + 1))
        print(f"database={args.database} leases={args.leases} max_tasks={args.max_tasks}")
        print(f"{'queue':>10}{'stmts/lease':>13}{'median ms':>11}{'cpu ms':>9}")
        for name in kinds:
            statements[0] = 0
            wall: list[float] = []
            cpu: list[float] = []
            for _ in range(args.leases):
                started, cpu_started = time.perf_counter(), time.process_time()
                granted = transact(
                    engine, leasing.lease_tasks, namespace_id, name, worker_id="bench",
                    max_tasks=args.max_tasks, lease_seconds=300,
                )  # fmt: skip
                wall.append(time.perf_counter() - started)
                cpu.append(time.process_time() - cpu_started)
                assert len(granted) == args.max_tasks
            print(
                f"{name:>10}{statements[0] / args.leases:>13.1f}{statistics.median(wall) * 1000:>11.2f}"
                f"{statistics.mean(cpu) * 1000:>9.2f}"
            )
    finally:
        engine.dispose()
        if cleanup is not None:
            root, name = cleanup
            with root.begin() as conn:
                conn.exec_driver_sql(f"DROP DATABASE {name}")


if __name__ == "__main__":
    main()
