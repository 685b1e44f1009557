"""``orbit-outbox consume`` as a real process, killed for real between commit and ack, and stopped by
SIGTERM, on SQLite, MariaDB and PostgreSQL, against a real Orbit server (DESIGN §5 "Inbox").

The kill uses the test-only fault hook ``ORBIT_OUTBOX_FAULT=pause-after-commit`` (see
``outbox_adapter._faults``): the consumer announces on stderr that the event's transaction
committed and blocks before acking; the test waits for that line, then sends SIGKILL.
"""

from __future__ import annotations

import signal
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine

from orbit_client import OrbitClient
from outbox_adapter import Outbox, OutboxTables
from tests.acceptance.test_outbox_processes import Process
from tests.conftest import DatabaseFactory
from tests.servers import RunningServer, run_server

KINDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("mariadb", id="mariadb", marks=pytest.mark.mariadb),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]
HANDLER = "tests.integration.outbox.inbox_handlers:record"


@dataclass
class Setup:
    url: URL
    engine: Engine
    tables: OutboxTables
    orders: sa.Table
    namespace: str
    keys: dict[str, str]
    orbit: RunningServer

    def consume(self, *extra: str, lease_seconds: float = 1.0, **env: str) -> Process:
        args = [
            sys.executable, "-m", "outbox_adapter.cli", "--log-format", "json", "consume",
            "--database-url", self.url.render_as_string(hide_password=False), "--table", self.tables.name,
            "--subscription", "results", "--handler", HANDLER, "--lease-seconds", str(lease_seconds), "--poll-interval", "0.1",
            *extra,
        ]  # fmt: skip
        return Process(
            args,
            ORBIT_URL=self.orbit.base_url,
            ORBIT_API_KEY=self.keys["work"],
            ORBIT_NAMESPACE=self.namespace,
            INBOX_TEST_ORDERS=self.orders.name,
            **env,
        )

    def applied(self) -> list[tuple[str, int]]:
        with self.engine.connect() as conn:
            return sorted(
                (s, n) for s, n in conn.execute(sa.select(self.orders.c.status, self.orders.c.applied))
            )


@pytest.fixture(scope="module")
def orbit(make_database: DatabaseFactory) -> Iterator[RunningServer]:
    with run_server(make_database("sqlite")) as running:
        yield running


@pytest.fixture(scope="module", params=KINDS)
def setup(
    request: pytest.FixtureRequest, make_database: DatabaseFactory, orbit: RunningServer
) -> Iterator[Setup]:
    url = make_database(request.param)
    engine = sa.create_engine(url)
    tables = OutboxTables(name=f"ob_{uuid.uuid4().hex[:10]}")
    Outbox(engine, tables=tables).migrate()
    orders = sa.Table(
        f"orders_{uuid.uuid4().hex[:8]}",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("task_id", sa.String(64), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("applied", sa.Integer, nullable=False),
    )
    orders.create(engine)
    namespace = f"ns-{uuid.uuid4().hex[:8]}"
    keys = orbit.add_namespace(namespace, ("default",))
    with OrbitClient(orbit.base_url, api_key=keys["admin"]) as admin:
        admin.create_subscription(namespace, "results")
        task_ids = []
        for _ in range(3):  # three CANCELLED result events
            task = admin.submit_task(
                namespace, "default", "orders.fulfil", {}, idempotency_key=str(uuid.uuid4())
            )
            admin.cancel_task(namespace, task.task.id, reason="test")
            task_ids.append(task.task.id)
    with engine.begin() as conn:
        conn.execute(
            orders.insert(),
            [{"id": i, "task_id": t, "status": "PENDING", "applied": 0} for i, t in enumerate(task_ids)],
        )
    yield Setup(url, engine, tables, orders, namespace, keys, orbit)
    engine.dispose()


def test_a_consumer_killed_between_commit_and_ack_applies_the_event_once(setup: Setup) -> None:
    crashing = setup.consume(ORBIT_OUTBOX_FAULT="pause-after-commit")
    crashing.wait_for_line("paused-after-commit")
    crashing.popen.send_signal(signal.SIGKILL)
    assert crashing.finish()[0] == -signal.SIGKILL
    assert setup.applied() == [("CANCELLED", 1), ("PENDING", 0), ("PENDING", 0)]  # committed, never acked

    time.sleep(1.2)  # the killed consumer's 1 s lease lapses: the server delivers that event again
    # A lease long enough for all three on a loaded machine (with 1 s, a slow first apply leaves the
    # other two to their lease, and a --once run then ends on the empty lease that follows).
    code, stats = setup.consume("--once", "--json", lease_seconds=30).finish()
    assert code == 0
    assert {k: stats[k] for k in ("applied", "duplicates", "acked", "failed")} == {
        "applied": 2,
        "duplicates": 1,
        "acked": 3,
        "failed": 0,
    }
    assert setup.applied() == [("CANCELLED", 1)] * 3
    inbox = Outbox(setup.engine, tables=setup.tables).inbox_rows()
    assert len(inbox) == 3 and len({r.event_id for r in inbox}) == 3


def test_sigterm_stops_the_consumer_cleanly(setup: Setup) -> None:
    running = setup.consume()
    running.wait_for_line('"consumer_started"')
    running.popen.send_signal(signal.SIGTERM)
    code, _ = running.finish(timeout=20)
    assert code == 0
    assert any('"consumer_stopped"' in line for line in running.stderr)
