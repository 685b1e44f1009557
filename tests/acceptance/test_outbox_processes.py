"""The relay as real processes (``python -m outbox_adapter.cli relay``), killed for real, on SQLite,
MariaDB and PostgreSQL, against a real Orbit server on a free port (DESIGN §5).

The kill "between send and record" uses the test-only fault hook ``ORBIT_OUTBOX_FAULT``
(see ``outbox_adapter._faults``): the relay announces on stderr that it has sent and
blocks before recording; the test waits for that line, then sends SIGKILL.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine

from outbox_adapter import Outbox, OutboxTables, enqueue
from outbox_adapter._db import db_now
from tests.conftest import DatabaseFactory
from tests.outbox_support import submission_count, task_count, wait_until
from tests.servers import RunningServer, run_server

KINDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("mariadb", id="mariadb", marks=pytest.mark.mariadb),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


@dataclass
class Setup:
    url: URL
    engine: Engine
    tables: OutboxTables
    namespace: str
    key: str
    orbit: RunningServer

    def relay_args(self, *extra: str) -> list[str]:
        return [
            sys.executable, "-m", "outbox_adapter.cli", "--log-format", "json", "relay",
            "--database-url", self.url.render_as_string(hide_password=False), "--table", self.tables.name,
            "--orbit-url", self.orbit.base_url, "--api-key", self.key, *extra,
        ]  # fmt: skip


@pytest.fixture(scope="module")
def orbit(make_database: DatabaseFactory) -> Iterator[RunningServer]:
    with run_server(make_database("sqlite")) as running:
        yield running


@pytest.fixture(scope="module", params=KINDS)
def biz(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[tuple[URL, Engine]]:
    url = make_database(request.param)
    engine = sa.create_engine(url)
    yield url, engine
    engine.dispose()


@pytest.fixture
def setup(biz: tuple[URL, Engine], orbit: RunningServer) -> Setup:
    url, engine = biz
    tables = OutboxTables(name=f"ob_{uuid.uuid4().hex[:10]}")
    Outbox(engine, tables=tables).migrate()
    namespace = f"ns-{uuid.uuid4().hex[:8]}"
    keys = orbit.add_namespace(namespace, ("default",))
    return Setup(url, engine, tables, namespace, keys["submit"], orbit)


class Process:
    """A child process whose stderr lines are read by a thread, so a test can wait for one."""

    def __init__(self, args: list[str], **env: str) -> None:
        self.popen = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env}
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            self.stderr.append(line)
            self.lines.put(line)

    def wait_for_line(self, needle: str, timeout: float = 30) -> str:
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no line with {needle!r}; stderr: {''.join(self.stderr)}") from None
            if needle in line:
                return line

    def finish(self, timeout: float = 60) -> tuple[int, Any]:
        """Wait for the exit; return the exit code and the JSON the process printed (or ``None``)."""
        assert self.popen.stdout is not None and self.popen.stderr is not None
        self.popen.wait(timeout)
        stdout = self.popen.stdout.read()
        self.popen.stdout.close()
        self._reader.join(10)
        self.popen.stderr.close()
        return self.popen.returncode, json.loads(stdout) if stdout.strip() else None


def _enqueue(s: Setup, n: int, **kwargs: Any) -> list[int]:
    with s.engine.begin() as conn:
        return [
            enqueue(conn, namespace=s.namespace, queue="default", handler="h", params={"n": i, "secret": "s3cr3t"},
                    tables=s.tables, **kwargs).id
            for i in range(n)
        ]  # fmt: skip


def test_sigkill_between_send_and_record_then_the_next_relay_resends_with_the_same_key(setup: Setup) -> None:
    [row_id] = _enqueue(setup, 1)
    outbox = Outbox(setup.engine, tables=setup.tables)
    key = outbox.get(row_id).idempotency_key

    first = Process(setup.relay_args("--once", "--lease-seconds", "1"), ORBIT_OUTBOX_FAULT="pause-after-send")
    first.wait_for_line(f"paused-after-send row_id={row_id}")
    assert submission_count(setup.orbit, key) == 1  # the server accepted the send...
    row = outbox.get(row_id)
    assert row.state == "PENDING" and row.lease_owner and row.orbit_task_id is None  # ...nothing recorded
    first.popen.send_signal(signal.SIGKILL)
    assert first.finish(10) == (-signal.SIGKILL, None)

    with setup.engine.connect() as conn:  # the dead relay's lease runs out (database clock)
        wait_until(lambda: db_now(conn) > row.lease_expires_at.replace(tzinfo=None))  # type: ignore[union-attr]
    code, stats = Process(setup.relay_args("--once", "--json")).finish()
    assert code == 0 and (stats["delivered"], stats["replayed"]) == (1, 1)  # the server replayed
    row = outbox.get(row_id)
    assert row.state == "DELIVERED" and row.idempotency_key == key and row.attempts == 2
    assert submission_count(setup.orbit, key) == 1 and task_count(setup.orbit, setup.namespace) == 1


@pytest.mark.parametrize("relays", [2, 4])
def test_several_relay_processes_deliver_every_row_once(setup: Setup, relays: int) -> None:
    ids = _enqueue(setup, 60)
    processes = [
        Process(setup.relay_args("--once", "--json", "--batch-size", "10", "--concurrency", "2"))
        for _ in range(relays)
    ]
    results = [p.finish() for p in processes]
    assert [code for code, _ in results] == [0] * relays, [p.stderr for p in processes]
    assert sum(stats["delivered"] for _, stats in results) == 60
    assert sum(stats["replayed"] for _, stats in results) == 0  # no row was ever sent twice
    rows = Outbox(setup.engine, tables=setup.tables).list_rows(limit=1000)
    assert [r.id for r in rows] == ids and {r.state for r in rows} == {"DELIVERED"}
    # Each row was claimed exactly once: never two leases on one row, let alone two live ones.
    assert {(r.attempts, r.send_count) for r in rows} == {(1, 1)}
    with setup.engine.connect() as conn:
        e = setup.tables.events
        per_row = conn.execute(sa.select(e.c.outbox_id, sa.func.count()).group_by(e.c.outbox_id)).all()
    assert sorted(per_row) == [(i, 1) for i in ids]
    assert task_count(setup.orbit, setup.namespace) == 60
    # Structured logs: one JSON object per line, with the row, key and task; params never appear.
    delivered = [json.loads(line) for p in processes for line in p.stderr if '"event": "delivered"' in line]
    assert len(delivered) == 60 and all(
        {"row_id", "idempotency_key", "orbit_task_id"} <= set(d) for d in delivered
    )
    assert not any("s3cr3t" in line for p in processes for line in p.stderr)


def test_sigterm_finishes_the_send_in_flight_records_it_and_claims_nothing_more(setup: Setup) -> None:
    ids = _enqueue(setup, 5)
    relay = Process(setup.relay_args("--json", "--concurrency", "1", "--batch-size", "1"),
                    ORBIT_OUTBOX_FAULT="delay-before-send=1.0")  # fmt: skip
    relay.wait_for_line(f"sending row_id={ids[0]}")
    relay.popen.send_signal(signal.SIGTERM)
    code, stats = relay.finish(timeout=30)
    # A claim leases only what it sends at once (DESIGN §5): the rest was never leased.
    assert code == 0 and (stats["delivered"], stats["claimed"], stats["released"]) == (1, 1, 0), relay.stderr
    rows = Outbox(setup.engine, tables=setup.tables).list_rows()
    assert [r.state for r in rows] == ["DELIVERED"] + ["PENDING"] * 4
    assert all(r.lease_token is None and r.attempts == 0 for r in rows[1:])
    assert task_count(setup.orbit, setup.namespace) == 1
