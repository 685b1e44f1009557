"""Submissions per second against a real ``orbit-server`` process.

    python -m bench.submit [--database mariadb|sqlite] [--clients 16] [--requests 2000]
                           [--driver pymysql|mysqldb] [--serve-args '--workers 2']

Three phases against one server process, each with ``--clients`` threads:

1. baseline: ``GET /healthz`` (the HTTP stack alone, no database);
2. first submissions, each with a new idempotency key (three inserts in one transaction);
3. replays: the same submissions again (a lookup, no insert).

It prints requests/s for each and the ratio to the baseline: these machines are
noisy, so compare ratios between runs, not absolute figures. On MariaDB it also prints the
statements, pings and rollbacks per first submission (MariaDB's global counters: other clients
of the same server count too). ``--driver mysqldb`` runs the server on mysqlclient (the
``mysqlclient`` extra); ``--serve-args`` are added to ``orbit-server serve``.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import sqlalchemy as sa

from bench._support import MYSQL_SERVER, cli, cpu_seconds, orbit_server_processes


def run_phase(clients: int, total: int, make_call: Callable[[httpx.Client, int], httpx.Response]) -> float:
    """Run ``total`` calls spread over ``clients`` threads; return calls per second."""
    per_client = total // clients
    failures: list[str] = []
    barrier = threading.Barrier(clients + 1)

    def worker(index: int) -> None:
        with httpx.Client(timeout=60) as http:
            barrier.wait()
            for i in range(per_client):
                response = make_call(http, index * per_client + i)
                if response.status_code >= 300 and response.status_code != 200:
                    failures.append(f"{response.status_code} {response.text[:200]}")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if failures:
        raise SystemExit(f"{len(failures)} calls failed, e.g. {failures[0]}")
    return per_client * clients / elapsed


def _counters(admin: sa.Engine | None) -> dict[str, int]:
    if admin is None:
        return {}
    names = ("Questions", "Com_admin_commands", "Com_rollback", "Com_commit", "Com_select")
    with admin.connect() as conn:
        rows = conn.exec_driver_sql("SHOW GLOBAL STATUS WHERE Variable_name IN ('" + "','".join(names) + "')")
        return {name: int(value) for name, value in rows}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--database", choices=["mariadb", "sqlite"], default="mariadb")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--driver", choices=["pymysql", "mysqldb"], default="pymysql")
    parser.add_argument("--serve-args", default="", help="extra `orbit-server serve` arguments")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="orbit-bench-"))
    admin = None
    if args.database == "mariadb":
        name = f"orbit_bench_{uuid.uuid4().hex[:8]}"
        admin = sa.create_engine(MYSQL_SERVER, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
        url = sa.make_url(MYSQL_SERVER).set(database=name).render_as_string(hide_password=False)
        cli("migrate", url=url)
        serve_url = (
            sa.make_url(url).set(drivername=f"mysql+{args.driver}").render_as_string(hide_password=False)
        )
    else:
        url = serve_url = f"sqlite:///{tmp / 'bench.db'}"
    cli("namespace", "create", "bench", url=url)
    cli("queue", "create", "bench", "q", url=url)
    key = cli("api-key", "create", "bench", "--role", "submit", url=url)
    try:
        with orbit_server_processes(serve_url, serve_args=args.serve_args.split()) as (server,):
            base = server.base
            run_id = uuid.uuid4().hex[:8]
            headers = {"Authorization": f"Bearer {key}"}

            def submit(http: httpx.Client, n: int) -> httpx.Response:
                return http.post(
                    f"{base}/v1/namespaces/bench/tasks",
                    json={"queue": "q", "handler": "bench.noop", "params": {"n": n, "sku": "BENCH-Ü-1"}},
                    headers={**headers, "Idempotency-Key": f"bench-{run_id}-{n}"},
                )

            cpu = [cpu_seconds(server.proc.pid)]
            healthz = run_phase(args.clients, args.requests, lambda http, _n: http.get(f"{base}/healthz"))
            cpu.append(cpu_seconds(server.proc.pid))
            before = _counters(admin)
            first = run_phase(args.clients, args.requests, submit)
            after = _counters(admin)
            cpu.append(cpu_seconds(server.proc.pid))
            replay = run_phase(args.clients, args.requests, submit)
            cpu.append(cpu_seconds(server.proc.pid))
    finally:
        if admin is not None:
            with admin.connect() as conn:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
            admin.dispose()
    print(f"database={args.database} driver={args.driver} clients={args.clients} requests/phase={args.requests}"
          f" serve-args={args.serve_args!r}")  # fmt: skip
    if before:
        per = {k: (after[k] - before[k]) / (args.requests // args.clients * args.clients) for k in before}
        print("per first submission: " + ", ".join(f"{k} {v:.2f}" for k, v in per.items()))
    done = args.requests // args.clients * args.clients
    print(f"{'phase':<22}{'req/s':>10}{'ratio to baseline':>20}{'server CPU ms/req':>20}")
    phases = (("GET /healthz (base)", healthz), ("first submissions", first), ("replays", replay))
    for i, (label, rate) in enumerate(phases):
        print(f"{label:<22}{rate:>10.0f}{rate / healthz:>20.2f}{(cpu[i + 1] - cpu[i]) * 1000 / done:>20.2f}")


if __name__ == "__main__":
    main()
