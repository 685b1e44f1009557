"""The inbox on each business database (SQLite, MariaDB, PostgreSQL): two consumers racing on the same
event serialise on the inbox's unique key, so the business change and its follow-ups happen once."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from orbit_client import TaskStatus
from outbox_adapter import Backoff, OutboxTables, ResultConsumer, enqueue
from tests.inbox_support import NS, SUB, Event, FakeSubscription
from tests.integration.outbox.conftest import Biz
from tests.integration.outbox.test_outage import _Events
from tests.outbox_support import TcpProxy


@pytest.fixture
def orders(biz: Biz) -> Iterator[sa.Table]:
    """A business table of its own for each test."""
    table = sa.Table(
        f"orders_{uuid.uuid4().hex[:8]}",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("applied", sa.Integer, nullable=False),
    )
    table.create(biz.engine)
    with biz.engine.begin() as conn:
        conn.execute(table.insert(), [{"id": 1, "status": "PENDING", "applied": 0}])
    yield table
    table.drop(biz.engine)


def make_handler(orders: sa.Table, tables: OutboxTables, gate: threading.Event | None = None) -> Any:
    def handler(conn: Connection, event: Event) -> None:
        conn.execute(
            sa.update(orders).where(orders.c.id == 1).values(status="COMPLETED", applied=orders.c.applied + 1)
        )
        enqueue(
            conn,
            namespace=NS,
            queue="mail",
            handler="orders.notify",
            params={"event": event.id},
            tables=tables,
        )
        if gate is not None and not gate.is_set():
            assert gate.wait(30), "the test never opened the gate"

    return handler


def test_two_consumers_racing_on_one_event_apply_it_once(
    biz: Biz, tables: OutboxTables, orders: sa.Table
) -> None:
    fake = FakeSubscription()
    fake.publish(Event("e1", "task-1", TaskStatus.SUCCEEDED, result={"order_id": 1}))
    gate = threading.Event()
    options: dict[str, Any] = {"tables": tables, "db_backoff": Backoff.no_wait(), "poll_interval": 0.01}
    first = ResultConsumer(biz.engine, fake, NS, SUB, make_handler(orders, tables, gate), **options)
    second = ResultConsumer(biz.engine, fake, NS, SUB, make_handler(orders, tables), **options)
    results: dict[str, Any] = {}
    conflicts: list[str] = []
    after_conflict = second._after_conflict

    def spy(*args: Any) -> str:
        conflicts.append(biz.kind)
        return after_conflict(*args)

    second._after_conflict = spy  # type: ignore[method-assign]

    def run(name: str, consumer: ResultConsumer) -> None:
        results[name] = consumer.run_once()

    a = threading.Thread(target=run, args=("first", first))
    a.start()
    assert fake.leased_event.wait(10)  # the first holds the event, its transaction open in the handler
    time.sleep(0.2)
    fake.leased_event.clear()
    fake.expire_leases()  # ... for longer than its lease: the server delivers the event again
    b = threading.Thread(target=run, args=("second", second))
    b.start()
    assert fake.leased_event.wait(10)
    time.sleep(0.3)  # the second is now waiting on the inbox's unique key (SQLite: on the write lock)
    gate.set()
    a.join(30)
    b.join(30)
    assert (results["first"].applied, results["first"].acked) == (1, 1)
    assert (results["second"].applied, results["second"].duplicates, results["second"].acked) == (0, 1, 1)
    with biz.engine.connect() as conn:
        assert conn.execute(sa.select(orders.c.status, orders.c.applied)).one() == ("COMPLETED", 1)
        assert conn.scalar(sa.select(sa.func.count()).select_from(tables.outbox)) == 1
        inbox = conn.execute(sa.select(tables.inbox.c.event_id, tables.inbox.c.outcome)).all()
    assert inbox == [("e1", "APPLIED")]
    assert fake.acks == ["d-e1", "d-e1"]  # both acked; acks are idempotent
    # MariaDB/PostgreSQL: the second's INSERT waited on the unique key, then failed on it; SQLite: the
    # second's BEGIN IMMEDIATE waited, then its lookup found the row.
    assert conflicts == ([] if biz.kind == "sqlite" else [biz.kind])


def test_the_consumer_waits_out_a_business_database_outage_and_recovers(
    biz: Biz, tables: OutboxTables, orders: sa.Table
) -> None:
    if biz.kind == "sqlite":
        pytest.skip("a database server to take away: MariaDB and PostgreSQL")
    fake = FakeSubscription(instant_expiry=True)  # what is not acked comes back at the next lease
    fake.publish(Event("e1", "task-1", TaskStatus.SUCCEEDED))
    proxy = TcpProxy(biz.url.host or "127.0.0.1", biz.url.port or (3306 if biz.kind == "mariadb" else 5432))
    proxy.up()
    events = _Events()
    adapter_log = logging.getLogger("outbox_adapter")
    adapter_log.addHandler(events)
    level = adapter_log.level
    adapter_log.setLevel(logging.INFO)  # setLevel, not .level =: it clears the loggers' isEnabledFor cache
    consumer = ResultConsumer(
        biz.url.set(host="127.0.0.1", port=proxy.port),
        fake,
        NS,
        SUB,
        make_handler(orders, tables),
        tables=tables,
        db_backoff=Backoff(base=0.1, cap=0.2, random=lambda: 1.0),
        poll_interval=0.05,
        max_deliveries=2,  # an outage is not a handler failure: nothing may be parked
    )
    thread = threading.Thread(target=consumer.run)
    thread.start()
    try:
        events.wait_for("applied")
        proxy.down()
        for n in (2, 3):
            fake.publish(Event(f"e{n}", f"task-{n}", TaskStatus.SUCCEEDED))
        events.wait_for("database_unavailable", count=3)
        proxy.up()
        events.wait_for("applied", count=3)
        events.wait_for("database_recovered")
    finally:
        consumer.stop()
        thread.join(20)
        consumer.close()
        proxy.down()
        adapter_log.removeHandler(events)
        adapter_log.setLevel(level)
    assert not thread.is_alive()
    assert sorted(fake.acks) == ["d-e1", "d-e2", "d-e3"]
    with biz.engine.connect() as conn:
        assert conn.execute(sa.select(orders.c.applied)).scalar_one() == 3
        inbox = conn.execute(sa.select(tables.inbox.c.event_id, tables.inbox.c.outcome)).all()
    assert sorted(inbox) == [("e1", "APPLIED"), ("e2", "APPLIED"), ("e3", "APPLIED")]
    assert events.count("parked") == events.count("handler_failed") == 0
