"""From a submission on one server process to the grant on another, on PostgreSQL, with and without NOTIFY.

    python -m bench.notify_latency [--rounds 20] [--poll-interval 0.5] [--postgres-url URL] [--json-file PATH]

Makes a scratch database on ``--postgres-url``'s server (dropped at the end), then, once with
``ORBIT_NOTIFY=true`` and once with ``ORBIT_NOTIFY=false``, starts two ``orbit-server serve`` processes A and
B on it (``ORBIT_LEASE_POLL_INTERVAL_SECONDS=--poll-interval`` on both, the default 0.5 s). Each round a
worker long-polls A (``wait_seconds`` 10, a new worker id), the bench waits until A has looked for tasks and
found none (the worker's sighting row is written), waits a random part of the poll interval (the same
sequence in both modes: where in A's poll the submission lands), then submits one task through B and times
from just before the submission to the grant's answer. Prints the median, 90th percentile and largest latency
of both modes in milliseconds (the submission's own round trip included), and the median from B's answer to
the grant. Without NOTIFY the grant waits for A's next poll: about half the poll interval on average.

``--json-file PATH`` also writes the figures with the date, commit, command and load averages (the docs quote
figures only from committed files in ``bench/results/``: write one only from a quiet machine).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import httpx
import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine, make_url

from bench._support import orbit_server_processes
from orbit_server.db import migrate
from orbit_server.db.engine import create_engine
from orbit_server.db.schema import worker_sightings
from orbit_server.tasks import store

NS, QUEUE = "bench", "jobs"
POSTGRES_SERVER = os.environ.get(
    "ORBIT_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


@contextmanager
def scratch_database(server: str) -> Iterator[URL]:
    """A new empty database on ``server``'s PostgreSQL, dropped on exit."""
    admin = sa.create_engine(make_url(server), isolation_level="AUTOCOMMIT")
    name = f"orbit_bench_notify_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(server).set(database=name)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def prepare(engine: Engine) -> dict[str, str]:
    migrate.upgrade(engine)
    with engine.begin() as conn:
        store.create_namespace(conn, NS)
        store.create_queue(conn, NS, QUEUE)
        return {role: store.create_api_key(conn, NS, role) for role in ("submit", "work")}


def one_round(engine: Engine, keys: dict[str, str], a: str, b: str, phase: float) -> tuple[float, float]:
    """Seconds from just before a submission on ``b`` to the grant of a long-poll waiting on ``a``, and from
    the submission's answer to the grant; the submission leaves ``phase`` seconds after ``a`` looked."""
    worker = f"bench-{uuid.uuid4().hex[:8]}"
    answered: list[float] = []

    def lease() -> None:
        answer = httpx.post(
            f"{a}/v1/namespaces/{NS}/queues/{QUEUE}/leases",
            json={"worker_id": worker, "wait_seconds": 10, "lease_seconds": 60},
            headers={"Authorization": f"Bearer {keys['work']}"},
            timeout=40,
        )
        answer.raise_for_status()
        if answer.json():
            answered.append(time.perf_counter())

    thread = threading.Thread(target=lease)
    thread.start()
    seen = sa.select(sa.func.count()).where(worker_sightings.c.worker_id == worker)
    deadline = time.monotonic() + 30
    while True:  # the long-poll has looked once and found nothing: it is waiting now
        with engine.connect() as conn:
            if conn.execute(seen).scalar_one():
                break
        if time.monotonic() > deadline:
            raise SystemExit("the lease call never looked for tasks")
        time.sleep(0.01)
    time.sleep(phase)  # where in A's poll interval the submission lands
    started = time.perf_counter()
    httpx.post(
        f"{b}/v1/namespaces/{NS}/tasks",
        json={"queue": QUEUE, "handler": "noop"},
        headers={"Authorization": f"Bearer {keys['submit']}", "Idempotency-Key": uuid.uuid4().hex},
        timeout=30,
    ).raise_for_status()
    submitted = time.perf_counter()
    thread.join()
    if not answered:
        raise SystemExit("the long-poll ended without the task")
    return answered[0] - started, answered[0] - submitted


def summary(rounds: list[tuple[float, float]]) -> dict[str, float]:
    ms = sorted(total * 1000 for total, _ in rounds)
    after = sorted(rest * 1000 for _, rest in rounds)
    return {
        "median_ms": round(statistics.median(ms), 1),
        "p90_ms": round(ms[max(0, int(len(ms) * 0.9) - 1)], 1),
        "max_ms": round(ms[-1], 1),
        "after_answer_median_ms": round(statistics.median(after), 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=20, help="submissions timed per mode (default 20)")
    parser.add_argument("--poll-interval", type=float, default=0.5, help="ORBIT_LEASE_POLL_INTERVAL_SECONDS")
    parser.add_argument(
        "--postgres-url", default=POSTGRES_SERVER, help="a PostgreSQL server to make a database on"
    )
    parser.add_argument("--json-file", default=None, help="also write the figures and their context here")
    args = parser.parse_args(argv)
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    load_at_start = os.getloadavg()
    figures: dict[str, dict[str, float]] = {}
    with scratch_database(args.postgres_url) as url:
        engine = create_engine(url, pool_size=2)
        try:
            keys = prepare(engine)
            for mode in ("true", "false"):
                env = {"ORBIT_NOTIFY": mode, "ORBIT_LEASE_POLL_INTERVAL_SECONDS": str(args.poll_interval)}
                with orbit_server_processes(url.render_as_string(False), 2, env=env) as (a, b):
                    one_round(engine, keys, a.base, b.base, 0.0)  # warm-up: connections, first requests
                    phases = random.Random(7)  # the same landing points in both modes
                    rounds = [
                        one_round(engine, keys, a.base, b.base, phases.uniform(0, args.poll_interval))
                        for _ in range(args.rounds)
                    ]
                figures[f"notify_{mode}"] = summary(rounds)
        finally:
            engine.dispose()
    for mode, label in (("notify_true", "with NOTIFY   "), ("notify_false", "without NOTIFY")):
        f = figures[mode]
        print(f"{label}: submit on B -> grant on A  median {f['median_ms']:7.1f} ms  "
              f"p90 {f['p90_ms']:7.1f} ms  max {f['max_ms']:7.1f} ms; from B's answer: median "
              f"{f['after_answer_median_ms']:7.1f} ms  ({args.rounds} rounds)")  # fmt: skip
    print(
        f"poll interval {args.poll_interval} s; load averages at start {load_at_start}, at end {os.getloadavg()}"
    )
    if args.json_file:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        document = {
            "meta": {
                "benchmark": "notify_latency", "started_at": started_at, "commit": commit or "unknown",
                "command": " ".join([Path(sys.executable).name, "-m", "bench.notify_latency", *(argv or sys.argv[1:])]),
                "rounds": args.rounds, "poll_interval_seconds": args.poll_interval,
                "loadavg_at_start": load_at_start, "loadavg_at_end": os.getloadavg(),
            },
            "figures": figures,
        }  # fmt: skip
        Path(args.json_file).write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
