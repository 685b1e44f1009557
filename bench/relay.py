"""Rows per second delivered by the outbox relay, business database on MariaDB, against a real
``orbit-server`` process (its own MariaDB database).

    python -m bench.relay [--rows 600] [--concurrency 8] [--batch-sizes 1,10,50,200]

Baseline: the same number of submissions sent straight to the server with ``OrbitClient``
from ``--concurrency`` threads (what the server accepts when fed directly). Then, for each
batch size, ``--rows`` outbox rows are enqueued (not timed) and one in-process ``Relay``
with ``--concurrency`` sends drains them (``run_once``): claim transactions, queue checks
(cached), sends and conditional-update records. It prints rows/s and the ratio to the
baseline measured in the same run; these machines are noisy, so compare ratios.
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid

import sqlalchemy as sa

from bench._support import MYSQL_SERVER, cli, orbit_servers
from orbit_client import OrbitClient, RetryPolicy
from outbox_adapter import Backoff, Outbox, OutboxTables, Relay, enqueue


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


def relay_round(
    engine: sa.Engine, base: str, key: str, rows: int, concurrency: int, batch_size: int
) -> float:
    """Enqueue ``rows`` rows in fresh tables (untimed), then time one relay draining them."""
    tables = OutboxTables(name=f"bench_{uuid.uuid4().hex[:8]}")
    Outbox(engine, tables=tables).migrate()
    with engine.begin() as conn:
        for n in range(rows):
            enqueue(conn, namespace="bench", queue="q", handler="bench.noop", params={"n": n}, tables=tables)
    with OrbitClient(base, api_key=key, retry=RetryPolicy(max_attempts=1)) as client:
        relay = Relay(client=client, engine=engine, tables=tables, batch_size=batch_size, concurrency=concurrency,
                      backoff=Backoff.no_wait())  # fmt: skip
        started = time.perf_counter()
        stats = relay.run_once()
        elapsed = time.perf_counter() - started
    if stats.delivered != rows:
        raise SystemExit(f"batch size {batch_size}: delivered {stats.delivered} of {rows}: {stats}")
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP TABLE {tables.events_name}, {tables.name}, {tables.name}_alembic_version")
    return rows / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--batch-sizes", default="1,10,50,200")
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
    engine = sa.create_engine(urls["business"])
    results: list[tuple[str, float]] = []
    try:
        with orbit_servers(server_url) as (base,):
            direct = baseline(base, key, args.rows, args.concurrency)
            results.append(("direct submits (base)", direct))
            for batch_size in batch_sizes:
                rate = relay_round(engine, base, key, args.rows, args.concurrency, batch_size)
                results.append((f"relay, batch size {batch_size}", rate))
    finally:
        engine.dispose()
        with admin.connect() as conn:
            for name in names.values():
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
        admin.dispose()
    print(f"business db=mariadb server db=mariadb rows/round={args.rows} concurrency={args.concurrency}")
    print(f"{'round':<26}{'rows/s':>10}{'ratio to baseline':>20}")
    for label, rate in results:
        print(f"{label:<26}{rate:>10.0f}{rate / direct:>20.2f}")


if __name__ == "__main__":
    main()
