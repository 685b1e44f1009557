"""Concurrency limit 1 per key with two ``orbit-server serve`` processes and four worker processes
racing on one database (SQLite file, MariaDB, PostgreSQL): no two attempts of one ``concurrency_key`` were
ever live at the same instant, checked from the attempts' lease intervals in the database
(``[leased_at, finished_at]``, database clock), while different keys did run side by side.
Then a pause in the middle of the run: no grant is made while the queue is paused, and the
attempts in flight finish (DESIGN §9; seed 001 §3, §5, invariant 12).
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from orbit_server.cli import main
from orbit_server.db.engine import create_engine
from orbit_server.db.schema import queue_events, task_attempts, tasks
from tests.conftest import DatabaseFactory
from tests.server_processes import await_ready, free_port

REPO = Path(__file__).resolve().parents[2]
KEYS = [f"customer-{n}" for n in range(4)]
PER_KEY = 5


def _run(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def _serve(url: str, port: int, log: Path) -> subprocess.Popen[str]:
    # Lease long-polls look again every 50 ms: the two processes' grants meet all the time.
    env = os.environ | {"ORBIT_LEASE_POLL_INTERVAL_SECONDS": "0.05", "ORBIT_SWEEP_INTERVAL_SECONDS": "0.2"}
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "orbit_server", "serve", "--database-url", url, "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip


def _await_ready(port: int, proc: subprocess.Popen[str], log: Path) -> None:
    await_ready(f"http://127.0.0.1:{port}", proc, output=lambda: log.read_text()[-3000:])


@pytest.mark.parametrize(
    "kind",
    [
        "sqlite",
        pytest.param("mariadb", marks=pytest.mark.mariadb),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
def test_limit_one_per_key_is_never_exceeded_by_racing_servers_and_workers(
    kind: str, make_database: DatabaseFactory, tmp_path: Path
) -> None:
    url = make_database(kind).render_as_string(hide_password=False)
    _run("migrate", "--database-url", url)
    _run("namespace", "create", "shop", "--database-url", url)
    _run("queue", "create", "shop", "fulfil", "--max-concurrency-per-key", "1", "--database-url", url)
    key = _run("api-key", "create", "shop", "--role", "admin", "--database-url", url).strip().splitlines()[-1]
    ports = [free_port(), free_port()]
    servers = [_serve(url, port, tmp_path / f"server-{port}.log") for port in ports]
    workers: list[subprocess.Popen[str]] = []
    engine = create_engine(url, pool_size=2)
    try:
        for port, proc in zip(ports, servers, strict=True):
            _await_ready(port, proc, tmp_path / f"server-{port}.log")
        headers = {"Authorization": f"Bearer {key}"}
        items = [
            {"idempotency_key": str(uuid.uuid4()), "queue": "fulfil", "handler": "slow",
             "params": {"seconds": 0.03}, "options": {"concurrency_key": customer}}
            for _ in range(PER_KEY) for customer in KEYS
        ]  # fmt: skip
        response = httpx.post(
            f"http://127.0.0.1:{ports[0]}/v1/namespaces/shop/tasks/batch",
            json={"items": items},
            headers=headers,
        )
        assert response.status_code == 200, response.text
        for n in range(4):  # two workers per server process, four handler slots each
            argv = [sys.executable, "-m", "tests.acceptance.worker_process", f"http://127.0.0.1:{ports[n % 2]}",
                    key, "shop", "fulfil", "--concurrency", "4"]  # fmt: skip
            with (tmp_path / f"worker-{n}.log").open("w") as log:
                workers.append(
                    subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log, text=True)
                )

        def succeeded() -> int:
            with engine.begin() as conn:
                return int(
                    conn.execute(sa.select(sa.func.count()).where(tasks.c.status == "SUCCEEDED")).scalar_one()
                )

        deadline = time.monotonic() + 60
        while succeeded() < len(items) // 2:  # the database is the only witness: poll it
            assert time.monotonic() < deadline, succeeded()
            time.sleep(0.05)
        # Pause in the middle of the run, hold it a while, resume.
        paused = httpx.post(
            f"http://127.0.0.1:{ports[1]}/v1/namespaces/shop/queues/fulfil/pause", headers=headers
        )
        assert paused.status_code == 200 and paused.json()["paused"] is True
        time.sleep(0.5)  # long enough for many lease polls from both servers to meet the closed gate
        resumed = httpx.post(
            f"http://127.0.0.1:{ports[0]}/v1/namespaces/shop/queues/fulfil/resume", headers=headers
        )
        assert resumed.status_code == 200
        while succeeded() < len(items):
            assert time.monotonic() < deadline, succeeded()
            time.sleep(0.05)

        with engine.begin() as conn:
            rows = conn.execute(
                sa.select(tasks.c.concurrency_key, task_attempts.c.leased_at, task_attempts.c.finished_at,
                          task_attempts.c.status)
                .join(tasks, tasks.c.id == task_attempts.c.task_id)
            ).all()  # fmt: skip
            pause_at, resume_at = conn.execute(
                sa.select(queue_events.c.created_at)
                .order_by(queue_events.c.id)
                .where(queue_events.c.event.in_(["paused", "resumed"]))
            ).scalars()
            holders = conn.execute(sa.text("SELECT COUNT(*) FROM concurrency_permits")).scalar_one()
    finally:
        for proc in [*workers, *servers]:
            proc.send_signal(signal.SIGTERM)
        for proc in [*workers, *servers]:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        engine.dispose()

    assert holders == 0  # every permit came back with its attempt's end
    intervals: dict[str, list[tuple[object, object]]] = defaultdict(list)
    for row in rows:
        assert row.finished_at is not None, row
        intervals[row.concurrency_key].append((row.leased_at, row.finished_at))
    assert sorted(intervals) == KEYS
    for customer, spans in intervals.items():
        spans.sort()
        for (_, earlier_end), (later_start, _) in itertools.pairwise(spans):
            assert later_start >= earlier_end, f"two live attempts of {customer}: {spans}"
    # The limit is per key, not per queue: attempts of different keys did overlap.
    every = sorted((start, end) for spans in intervals.values() for start, end in spans)
    assert any(later[0] < earlier[1] for earlier, later in itertools.pairwise(every))
    # Nothing was granted while the queue was paused.
    assert not [start for start, _ in every if pause_at < start < resume_at]
