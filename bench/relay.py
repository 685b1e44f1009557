"""Rows per second delivered by the outbox relay, business database on MariaDB, against a real
``orbit-server`` process (its own MariaDB database).

    python -m bench.relay [--rows 2000] [--concurrency 4] [--batch-sizes 1,100] [--engine app|own] [--metrics]

Baseline: the same number of submissions sent straight to the server with ``OrbitClient``
from ``--concurrency`` threads (what the server accepts when fed directly). Then, for each
batch size, ``--rows`` outbox rows are enqueued (not timed) and one in-process ``Relay``
with ``--concurrency`` requests in flight drains them (``run_once``): claim transactions,
sends and conditional-update records. It prints rows/s and the ratio to the baseline
measured in the same run (these machines are noisy, so compare ratios), and, per relayed
row, the SQL statements the relay ran on the business database (a ``before_cursor_execute``
listener) and its round trips to it (every command PyMySQL sends: statements, ``SET``,
``COMMIT``/``ROLLBACK`` including the pool's reset, ``PING``).

``--engine app`` hands the relay an engine built as an application builds one
(``sa.create_engine(url)``); ``--engine own`` lets the relay build its own from the URL.
``--metrics`` runs each batch size twice more, alternating, without and with ``RelayMetrics``
(the counters and the backlog sampler of ``--metrics-port``), to show what counting costs.
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pymysql.connections
import sqlalchemy as sa
from sqlalchemy import event

from bench._support import MYSQL_SERVER, cli, orbit_servers
from orbit_client import OrbitClient, RetryPolicy
from outbox_adapter import Backoff, Outbox, OutboxTables, Relay, enqueue
from outbox_adapter._metrics import RelayMetrics


def baseline(base: str, key: str, rows: int, concurrency: int) -> float:
    """Direct submissions per second from ``concurrency`` threads."""
    run_id = uuid.uuid4().hex[:8]
    per_thread = rows // concurrency
    barrier = threading.Barrier(concurrency + 1)

    def worker(index: int) -> None:
        with OrbitClient(base, api_key=key, retry=RetryPolicy(max_attempts=1)) as client:
            barrier.wait()
            for i in range(per_thread):
                client.submit_task(
                    "bench", "q", "bench.noop", {"n": i}, idempotency_key=f"direct-{run_id}-{index}-{i}"
                )

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(concurrency)]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    return per_thread * concurrency / (time.perf_counter() - started)


class Counts:
    """Statements (SQLAlchemy ``before_cursor_execute``) and round trips (PyMySQL commands)."""

    def __init__(self) -> None:
        self.statements = 0
        self.round_trips = 0


@contextmanager
def counting(engine: sa.Engine) -> Iterator[Counts]:
    """Count the statements run on ``engine`` and every command PyMySQL sends (this process talks
    to no other MySQL database meanwhile: the server is another process)."""
    counts = Counts()
    original = pymysql.connections.Connection._execute_command

    def command(self: Any, command: int, sql: Any) -> Any:
        counts.round_trips += 1
        return original(self, command, sql)

    def statement(*_args: Any) -> None:
        counts.statements += 1

    pymysql.connections.Connection._execute_command = command  # type: ignore[method-assign]
    event.listen(engine, "before_cursor_execute", statement)
    try:
        yield counts
    finally:
        event.remove(engine, "before_cursor_execute", statement)
        pymysql.connections.Connection._execute_command = original  # type: ignore[method-assign]


def relay_round(
    engine: sa.Engine,
    url: str,
    base: str,
    key: str,
    rows: int,
    concurrency: int,
    batch_size: int,
    own: bool,
    metrics: bool = False,
) -> tuple[float, float, float]:
    """Enqueue ``rows`` rows in fresh tables (untimed), then time one relay draining them.
    Returns rows/s, statements per row and round trips per row."""
    tables = OutboxTables(name=f"bench_{uuid.uuid4().hex[:8]}")
    Outbox(engine, tables=tables).migrate()
    with engine.begin() as conn:
        for n in range(rows):
            enqueue(conn, namespace="bench", queue="q", handler="bench.noop", params={"n": n}, tables=tables)
    with OrbitClient(base, api_key=key, retry=RetryPolicy(max_attempts=1)) as client:
        where: dict[str, Any] = {"database_url": url} if own else {"engine": engine}
        if metrics:
            where["metrics"] = RelayMetrics()
        relay = Relay(client=client, tables=tables, batch_size=batch_size, concurrency=concurrency,
                      backoff=Backoff.no_wait(), **where)  # fmt: skip
        with counting(relay.outbox.engine) as counts:
            started = time.perf_counter()
            stats = relay.run_once()
            elapsed = time.perf_counter() - started
        relay.close()
    if stats.delivered != rows:
        raise SystemExit(f"batch size {batch_size}: delivered {stats.delivered} of {rows}: {stats}")
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP TABLE {tables.events_name}, {tables.name}, {tables.name}_alembic_version")
    return rows / elapsed, counts.statements / rows, counts.round_trips / rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--batch-sizes", default="1,100")
    parser.add_argument("--engine", choices=("app", "own"), default="app")
    parser.add_argument(
        "--metrics", action="store_true", help="also time each batch size without/with metrics"
    )
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    names = {role: f"orbit_bench_{role}_{uuid.uuid4().hex[:8]}" for role in ("server", "business")}
    admin = sa.create_engine(MYSQL_SERVER, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        for name in names.values():
            conn.execute(sa.text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
    urls = {role: sa.make_url(MYSQL_SERVER).set(database=name) for role, name in names.items()}
    server_url = urls["server"].render_as_string(hide_password=False)
    cli("migrate", url=server_url)
    cli("namespace", "create", "bench", url=server_url)
    cli("queue", "create", "bench", "q", url=server_url)
    key = cli("api-key", "create", "bench", "--role", "submit", url=server_url)
    business_url = urls["business"].render_as_string(hide_password=False)
    engine = sa.create_engine(urls["business"])
    results: list[tuple[str, float, str, str]] = []
    try:
        with orbit_servers(server_url) as (base,):
            direct = baseline(base, key, min(args.rows, 1000), args.concurrency)
            results.append(("direct submits (base)", direct, "", ""))
            for batch_size in batch_sizes:
                rate, statements, trips = relay_round(engine, business_url, base, key, args.rows, args.concurrency,
                                                      batch_size, args.engine == "own")  # fmt: skip
                results.append((f"relay, batch size {batch_size}", rate, f"{statements:.2f}", f"{trips:.2f}"))
                for label, on in (("no metrics", False), ("metrics", True)) * (2 if args.metrics else 0):
                    rate, statements, trips = relay_round(engine, business_url, base, key, args.rows,
                                                          args.concurrency, batch_size, args.engine == "own",
                                                          metrics=on)  # fmt: skip
                    results.append(
                        (f"  batch {batch_size}, {label}", rate, f"{statements:.2f}", f"{trips:.2f}")
                    )
    finally:
        engine.dispose()
        with admin.connect() as conn:
            for name in names.values():
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
        admin.dispose()
    print(
        f"business db=mariadb server db=mariadb rows/round={args.rows} concurrency={args.concurrency} "
        f"engine={args.engine}"
    )
    print(
        f"{'round':<26}{'rows/s':>10}{'ratio to baseline':>20}{'statements/row':>16}{'round trips/row':>17}"
    )
    for label, rate, statements, trips in results:
        print(f"{label:<26}{rate:>10.0f}{rate / direct:>20.2f}{statements:>16}{trips:>17}")


if __name__ == "__main__":
    main()
