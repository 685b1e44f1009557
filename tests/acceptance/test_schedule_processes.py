"""Two ``orbit-server serve`` processes on one MariaDB or PostgreSQL database, both running the scheduler:
exactly one occurrence and one task per fire time, and no error from the race."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import timedelta

import httpx
import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from orbit_server.cli import main
from orbit_server.db.engine import create_engine
from orbit_server.db.schema import schedule_occurrences, schedules, submission_keys, tasks
from tests.conftest import DatabaseFactory
from tests.server_processes import await_ready, free_port


def _run(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("mariadb", marks=pytest.mark.mariadb),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
def test_two_server_processes_give_one_task_per_fire_time(make_database: DatabaseFactory, kind: str) -> None:
    url = make_database(kind).render_as_string(hide_password=False)
    _run("migrate", "--database-url", url)
    _run("namespace", "create", "shop", "--database-url", url)
    _run("queue", "create", "shop", "q", "--database-url", url)
    key = _run("api-key", "create", "shop", "--role", "admin", "--database-url", url).strip().splitlines()[-1]
    # Scheduler passes every 20 ms in each process: they meet on the same due schedules all the time.
    env = os.environ | {"ORBIT_SCHEDULER_INTERVAL_SECONDS": "0.02"}
    ports = [free_port(), free_port()]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "orbit_server", "serve", "--database-url", url, "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for port in ports
    ]
    outputs: list[str] = []
    engine = create_engine(url, pool_size=2)
    try:
        for port, proc in zip(ports, procs, strict=True):
            await_ready(f"http://127.0.0.1:{port}", proc)
        headers = {"Authorization": f"Bearer {key}"}
        names = [f"every-second-{n}" for n in range(4)]
        for n, name in enumerate(names):  # created through either process
            response = httpx.post(
                f"http://127.0.0.1:{ports[n % 2]}/v1/namespaces/shop/schedules",
                json={"name": name, "queue": "q", "handler": "tick", "interval_seconds": 1},
                headers=headers,
            )
            assert response.status_code == 201, response.text
        # And one with a backlog to catch up, which both processes find due at once.
        response = httpx.post(
            f"http://127.0.0.1:{ports[0]}/v1/namespaces/shop/schedules",
            json={"name": "backlog", "queue": "q", "handler": "tick", "interval_seconds": 1, "paused": True,
                  "misfire_policy": "catch_up", "catch_up_max": 20, "misfire_grace_seconds": 0},
            headers=headers,
        )  # fmt: skip
        assert response.status_code == 201, response.text
        with engine.begin() as conn:
            start = conn.execute(
                sa.select(schedules.c.start_at).where(schedules.c.name == "backlog")
            ).scalar_one()
            conn.execute(
                schedules.update()
                .where(schedules.c.name == "backlog")
                .values(start_at=start - timedelta(seconds=30), next_fire_at=start - timedelta(seconds=30))
            )
        assert httpx.post(f"http://127.0.0.1:{ports[1]}/v1/namespaces/shop/schedules/backlog/resume",
                          headers=headers).status_code == 200  # fmt: skip

        def fired() -> Counter[str]:
            with engine.begin() as conn:
                rows = conn.execute(
                    sa.select(schedules.c.name).join(
                        schedule_occurrences, schedule_occurrences.c.schedule_id == schedules.c.id
                    )
                ).scalars()
                return Counter(rows)

        deadline = time.monotonic() + 20
        while min(fired()[name] for name in names) < 4:  # four fire times each (about 4 s)
            assert time.monotonic() < deadline, fired()
            time.sleep(0.1)
        for name in [*names, "backlog"]:
            assert httpx.post(f"http://127.0.0.1:{ports[0]}/v1/namespaces/shop/schedules/{name}/pause",
                              headers=headers).status_code == 200  # fmt: skip
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            output, _ = proc.communicate(timeout=60)
            outputs.append(output)

    with engine.begin() as conn:
        occurrences = conn.execute(
            sa.select(schedules.c.name, schedule_occurrences.c.scheduled_at, schedule_occurrences.c.task_id,
                      schedule_occurrences.c.status)
            .join(schedules, schedules.c.id == schedule_occurrences.c.schedule_id)
        ).all()  # fmt: skip
        task_count = conn.execute(sa.select(sa.func.count()).select_from(tasks)).scalar_one()
        key_count = conn.execute(sa.select(sa.func.count()).select_from(submission_keys)).scalar_one()
    engine.dispose()
    by_schedule: dict[str, list[object]] = {}
    for row in occurrences:
        by_schedule.setdefault(row.name, []).append(row.scheduled_at)
        assert row.status == "created" and row.task_id
    for name, times in by_schedule.items():
        ordered = sorted(times)  # type: ignore[type-var]
        assert len(set(ordered)) == len(ordered), name  # one occurrence per fire time
        assert all(b - a == timedelta(seconds=1) for a, b in itertools.pairwise(ordered)), name  # type: ignore[operator]
    assert len(by_schedule["backlog"]) >= 20
    assert task_count == key_count == len(occurrences) == len({row.task_id for row in occurrences})
    for output in outputs:
        assert "Traceback" not in output and " ERROR " not in output and '" 500' not in output, output
    assert sum(output.count("schedule fired") for output in outputs) == len(occurrences)
