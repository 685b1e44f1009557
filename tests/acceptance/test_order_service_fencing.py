"""A stopped worker of the reference service cannot act after a newer attempt (issue 20 #3), with real
processes: worker A SIGSTOPs itself right after its reserve call (the ``stop-after-reserve`` hook), its
lease lapses, worker B gets generation 2, reserves and stops the same way; then A is resumed (SIGCONT).
Before the fix A went on and charged with generation 1 (the providers fenced per provider only); now the
providers refuse it (newest generation seen for the order and task is 2), so nothing is charged by A."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest
import sqlalchemy as sa

from examples.order_service.db import create_business_tables, provider_calls
from orbit_client import OrbitClient
from tests.conftest import DatabaseFactory
from tests.flow_support import until
from tests.servers import RunningServer, run_server

REPO = Path(__file__).resolve().parents[2]


def _stopped(proc: subprocess.Popen[bytes]) -> bool:
    """Whether ``proc`` is stopped (state ``T`` in /proc)."""
    stat = Path(f"/proc/{proc.pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


@pytest.fixture
def orbit(make_database: DatabaseFactory) -> Iterator[tuple[RunningServer, dict[str, str]]]:
    with run_server(make_database("sqlite"), sweep_interval_seconds=0.2) as running:
        yield running, running.add_namespace("shop", ("fulfilment",))


@pytest.mark.mariadb
def test_a_worker_stopped_past_its_lease_does_not_charge_after_the_newer_attempt(
    orbit: tuple[RunningServer, dict[str, str]], tmp_path: Path, make_database: DatabaseFactory
) -> None:
    server, keys = orbit
    # The business database on MariaDB: a SQLite file's one write lock can be held by a stopped process.
    shop_url = make_database("mariadb").render_as_string(hide_password=False)
    shop = sa.create_engine(shop_url)
    create_business_tables(shop)
    env = {**os.environ, "PYTHONPATH": str(REPO), "ORDER_SERVICE_FAULT": "stop-after-reserve"}
    logs: list[BinaryIO] = []

    def worker(name: str) -> subprocess.Popen[bytes]:
        args = [sys.executable, "-m", "examples.order_service.worker", "--database-url", shop_url,
                "--orbit-url", server.base_url, "--api-key", keys["work"], "--concurrency", "1",
                "--lease-seconds", "2"]  # fmt: skip
        logs.append((tmp_path / f"{name}.log").open("wb"))
        return subprocess.Popen(args, cwd=REPO, env=env, stderr=logs[-1])

    def wait_stopped(name: str, proc: subprocess.Popen[bytes]) -> None:
        """Until ``proc`` has stopped itself after its reserve; a failure shows both workers' logs
        and the task's attempts (the process may have exited, or never got the task)."""

        try:
            until(lambda: proc.poll() is not None or _stopped(proc), timeout=120, interval=0.05,
                  what=f"worker {name} to stop after its reserve")  # fmt: skip
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{diagnosis()}") from None
        assert proc.returncode is None, f"worker {name} exited ({proc.returncode})\n{diagnosis()}"

    def diagnosis() -> str:
        for log in logs:
            log.flush()
        parts = [
            f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}"
            for path in sorted(tmp_path.glob("*.log"))
        ]
        with OrbitClient(server.base_url, api_key=keys["admin"]) as admin:
            parts.append(f"--- task\n{admin.get_task('shop', task.id)!r}")
            parts += [f"--- attempt {a!r}" for a in admin.list_attempts("shop", task.id)]
        return "\n".join(parts)

    order_id = f"ord_{uuid.uuid4().hex[:10]}"
    with OrbitClient(server.base_url, api_key=keys["submit"]) as client:
        task = client.submit_task("shop", "fulfilment", "orders.fulfil",
                                  {"order_id": order_id, "sku": "SKU-1", "quantity": 1, "amount": "10.00"},
                                  idempotency_key=f"{order_id}:fulfil",
                                  options={"retry_safe": True, "max_attempts": 5}).task  # fmt: skip
    a = worker("a")
    b: subprocess.Popen[bytes] | None = None
    try:
        wait_stopped("A", a)
        b = worker("b")  # A's lease lapses while it is stopped; B gets generation 2
        wait_stopped("B (generation 2)", b)
        a.send_signal(signal.SIGCONT)  # A resumes with generation 1, its lease long gone

        def a_refused() -> list[tuple[str, int, str]]:
            with shop.connect() as conn:
                rows = conn.execute(
                    sa.select(
                        provider_calls.c.provider, provider_calls.c.generation, provider_calls.c.outcome
                    ).where(provider_calls.c.order_id == order_id, provider_calls.c.generation == 1)
                ).all()
            return [tuple(r) for r in rows if r[0] != "reserve"]  # type: ignore[misc]

        after = until(a_refused, timeout=60, what="worker A's next provider call")
        assert after == [("charge", 1, "stale")]  # refused: never performed by the older attempt
    finally:
        for proc in (a, b):
            if proc is not None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
        shop.dispose()
    assert task.id
