"""Tasks completed per second by worker processes against real ``orbit-server`` processes.

    python -m bench.workers [--database mariadb|sqlite] [--tasks 500] [--processes 4] [--concurrency 4]
                            [--servers 2] [--linger none 0.003 [--base-only]]

Each round submits ``--tasks`` tasks (not timed), then starts worker processes (each with
``--concurrency`` handler threads running a trivial handler) and times how long it takes until
every task is ``SUCCEEDED``, read from the database. Rounds:

1. 1 worker process on 1 server process (the baseline);
2. ``--processes`` worker processes on 1 server;
3. the same workers spread over ``--servers`` server processes sharing the database (leases are
   coordinated by the database alone, so servers can be added).

With ``--linger`` the baseline round runs once per value of the workers' ``report_linger``
(seconds, or ``none`` for a single call per report, as before batched attempt calls), one after
the other in the same run, and ratios are to the first; ``--base-only`` skips rounds 2 and 3.

A task costs a share of a lease call plus a start and a complete call (each shared with the
other tasks of a batch when reports are coalesced). It prints tasks/s per round and the ratio to the baseline; these machines are
noisy and every process shares their CPUs, so compare ratios, not absolute figures.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import sqlalchemy as sa

from bench._support import MYSQL_SERVER, cli, orbit_servers

_DONE = sa.text(
    "SELECT COUNT(*) FROM tasks t JOIN queues q ON q.id = t.queue_id WHERE q.name = :q AND t.status = 'SUCCEEDED'"
)


def submit_tasks(base: str, key: str, queue: str, tasks: int) -> None:
    run_id = uuid.uuid4().hex[:8]
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:

        def submit(n: int) -> None:
            response = http.post(
                "/v1/namespaces/bench/tasks",
                json={"queue": queue, "handler": "bench.echo", "params": {"n": n}},
                headers={"Idempotency-Key": f"{run_id}-{n}"},
            )
            response.raise_for_status()

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(submit, range(tasks)))


def run_round(
    bases: list[str], url: str, keys: dict[str, str], queue: str, tasks: int, processes: int, concurrency: int,
    linger: str | None = None,
) -> float:  # fmt: skip
    """Submit ``tasks`` tasks, run ``processes`` workers spread over the servers ``bases``; return tasks/s."""
    submit_tasks(bases[0], keys["submit"], queue, tasks)
    engine = sa.create_engine(url)
    started = time.perf_counter()
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.worker_process",
                bases[i % len(bases)],
                keys["work"],
                "bench",
                queue,
                str(concurrency),
                *([linger] if linger is not None else []),
            ],
            stdout=subprocess.DEVNULL,
        )
        for i in range(processes)
    ]
    try:
        deadline = time.monotonic() + 600
        while True:
            with engine.connect() as conn:
                done = conn.execute(_DONE, {"q": queue}).scalar_one()
            if done >= tasks:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"only {done} of {tasks} tasks succeeded in 10 minutes")
            time.sleep(0.05)
        elapsed = time.perf_counter() - started
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        for worker in workers:
            worker.wait(timeout=60)
        engine.dispose()
    return tasks / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--database", choices=["mariadb", "sqlite"], default="mariadb")
    parser.add_argument("--tasks", type=int, default=500)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--linger", nargs="*", default=None, help="report_linger values (seconds, or none)")
    parser.add_argument("--base-only", action="store_true", help="only the 1 worker, 1 server round(s)")
    args = parser.parse_args()
    lingers: list[str | None] = list(args.linger) if args.linger else [None]

    tmp = Path(tempfile.mkdtemp(prefix="orbit-bench-"))
    admin = None
    if args.database == "mariadb":
        name = f"orbit_bench_{uuid.uuid4().hex[:8]}"
        admin = sa.create_engine(MYSQL_SERVER, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
        url = sa.make_url(MYSQL_SERVER).set(database=name).render_as_string(hide_password=False)
        cli("migrate", url=url)
    else:
        url = f"sqlite:///{tmp / 'bench.db'}"
    cli("namespace", "create", "bench", url=url)
    for queue in (*(f"baseline-{n}" for n in range(len(lingers))), "scaled", "scaled-out"):
        cli("queue", "create", "bench", queue, url=url)
    keys = {role: cli("api-key", "create", "bench", "--role", role, url=url) for role in ("submit", "work")}
    try:
        with orbit_servers(url, max(1, args.servers)) as bases:
            rounds = [
                (
                    "1 worker, 1 server" + (f", linger {linger}" if linger is not None else " (base)"),
                    run_round(bases[:1], url, keys, f"baseline-{n}", args.tasks, 1, args.concurrency, linger),
                )
                for n, linger in enumerate(lingers)
            ]
            if not args.base_only:
                rounds.append(
                    (
                        f"{args.processes} workers, 1 server",
                        run_round(
                            bases[:1], url, keys, "scaled", args.tasks, args.processes, args.concurrency
                        ),
                    )
                )
            if len(bases) > 1 and not args.base_only:
                rounds.append(
                    (
                        f"{args.processes} workers, {len(bases)} servers",
                        run_round(
                            bases, url, keys, "scaled-out", args.tasks, args.processes, args.concurrency
                        ),
                    )
                )
    finally:
        if admin is not None:
            with admin.connect() as conn:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
            admin.dispose()
    print(f"database={args.database} tasks/round={args.tasks} concurrency/process={args.concurrency}")
    print(f"cpus={os.cpu_count()} (workers, servers and the database all share them)")
    baseline = rounds[0][1]
    print(f"{'round':<36}{'tasks/s':>10}{'ratio to baseline':>20}")
    for label, rate in rounds:
        print(f"{label:<36}{rate:>10.1f}{rate / baseline:>20.2f}")


if __name__ == "__main__":
    main()
