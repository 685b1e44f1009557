"""The result consumer on a SQLite file with an in-memory fake subscription (DESIGN §5 "Inbox"):
duplicates, handler failures, lost acks, poison events, outages and shutdown. Fast and deterministic."""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.engine import Connection

from orbit_client import NotFoundError, OrbitConnectError, ResultEvent, TaskStatus
from outbox_adapter import (
    Backoff,
    ConsumerMetrics,
    InboxOutcome,
    Outbox,
    OutboxDatabaseError,
    OutboxSchemaError,
    OutboxTables,
    OutboxUsageError,
    ResultConsumer,
    enqueue,
)
from outbox_adapter.cli import load_handler, main
from tests.inbox_support import NS, SUB, FakeSubscription, connect_error, result_event

business = sa.MetaData()
orders = sa.Table(
    "orders",
    business,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("status", sa.String(20), nullable=False),
    sa.Column("applied", sa.Integer, nullable=False, server_default="0"),
)


def succeeded(event_id: str, order_id: int) -> ResultEvent:
    return result_event(event_id, f"task-{order_id}", TaskStatus.SUCCEEDED, result={"order_id": order_id})


def apply_result(conn: Connection, event: ResultEvent) -> None:
    """The business handler: mark the order, count the application, enqueue a follow-up."""
    order_id = event.result["order_id"]
    conn.execute(
        sa.update(orders)
        .where(orders.c.id == order_id)
        .values(status="COMPLETED", applied=orders.c.applied + 1)
    )
    enqueue(
        conn,
        namespace=NS,
        queue="mail",
        handler="orders.notify",
        params={"order_id": order_id},
        idempotency_key=None,
    )


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[sa.Engine]:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'biz.db'}")
    Outbox(engine).migrate()
    business.create_all(engine)
    with engine.begin() as conn:
        conn.execute(orders.insert(), [{"id": i, "status": "PENDING"} for i in (1, 2, 3)])
    yield engine
    engine.dispose()


def consumer(
    engine: sa.Engine, fake: FakeSubscription, handler: Any = apply_result, **options: Any
) -> ResultConsumer:
    options.setdefault("poll_interval", 0.01)
    options.setdefault("orbit_backoff", Backoff.no_wait())
    options.setdefault("db_backoff", Backoff.no_wait())
    return ResultConsumer(engine, fake, NS, SUB, handler, **options)


def state(engine: sa.Engine) -> dict[str, Any]:
    """The business outcome: orders, follow-up outbox rows, inbox rows."""
    tables = OutboxTables()
    with engine.connect() as conn:
        return {
            "orders": {r.id: (r.status, r.applied) for r in conn.execute(sa.select(orders))},
            "follow_ups": [r.params for r in conn.execute(sa.select(tables.outbox))],
            "inbox": [
                (r.event_id, r.outcome, r.delivery_count)
                for r in conn.execute(sa.select(tables.inbox).order_by("id"))
            ],
        }


def test_a_result_delivered_twice_applies_once_and_enqueues_its_follow_ups_once(engine: sa.Engine) -> None:
    fake = FakeSubscription()
    fake.publish(succeeded("e1", 1))
    fake.ack_errors.append(connect_error())  # committed, then the ack is lost
    first = consumer(engine, fake).run_once()
    assert (first.applied, first.acked, first.ack_failures) == (1, 0, 1)
    fake.expire_leases()  # the server delivers it again after its lease
    second = consumer(engine, fake).run_once()
    assert (second.applied, second.duplicates, second.acked) == (0, 1, 1)
    # The same event through a second delivery (another consumer's lease expired, a server retry...).
    fake.publish(succeeded("e1", 1), delivery_id="d-e1-again")
    third = consumer(engine, fake).run_once()
    assert (third.applied, third.duplicates, third.acked) == (0, 1, 1)
    after = state(engine)
    assert after["orders"][1] == ("COMPLETED", 1)
    assert after["follow_ups"] == [{"order_id": 1}]
    assert after["inbox"] == [("e1", "APPLIED", 1)]
    assert fake.acks == ["d-e1", "d-e1-again"]
    row = Outbox(engine).inbox_row(SUB, "e1")
    assert row is not None and row.task_id == "task-1" and row.status == "SUCCEEDED" and row.event is None
    assert row.processed_at is not None and row.processed_at >= row.received_at


def test_a_failing_handler_rolls_back_everything_and_the_delivery_is_not_acked(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeSubscription()
    fake.publish(succeeded("e1", 1))
    fake.publish(succeeded("e2", 2))
    broken = {"e1"}

    def handler(conn: Connection, event: ResultEvent) -> None:
        apply_result(conn, event)  # writes, then fails: all of it must roll back
        if event.id in broken:
            raise RuntimeError("provider says no")

    with caplog.at_level(logging.ERROR, logger="outbox_adapter.inbox"):
        stats = consumer(engine, fake, handler).run_once()
    assert (stats.applied, stats.failed, stats.acked) == (1, 1, 1)
    assert fake.acks == ["d-e2"]
    after = state(engine)
    assert after["orders"][1] == ("PENDING", 0) and after["orders"][2] == ("COMPLETED", 1)
    assert after["follow_ups"] == [{"order_id": 2}] and after["inbox"] == [("e2", "APPLIED", 1)]
    failure = next(r for r in caplog.records if getattr(r, "event", None) == "handler_failed")
    assert failure.event_id == "e1" and "e1" in failure.getMessage()  # type: ignore[attr-defined]

    broken.clear()  # fixed; the server delivers it again after its lease
    fake.expire_leases()
    again = consumer(engine, fake, handler).run_once()
    assert (again.applied, again.acked) == (1, 1)
    assert state(engine)["inbox"] == [("e2", "APPLIED", 1), ("e1", "APPLIED", 2)]


def test_a_poison_event_is_parked_as_failed_and_acked_after_max_deliveries(engine: sa.Engine) -> None:
    fake = FakeSubscription()
    fake.publish(result_event("e9", "task-9", TaskStatus.FAILED, error={"code": "boom"}))

    def handler(conn: Connection, event: ResultEvent) -> None:
        raise KeyError("no order for this task")

    for _ in range(2):
        stats = consumer(engine, fake, handler, max_deliveries=3).run_once()
        assert (stats.failed, stats.parked, stats.acked) == (1, 0, 0)
        fake.expire_leases()
    stats = consumer(engine, fake, handler, max_deliveries=3).run_once()
    assert (stats.failed, stats.parked, stats.acked) == (1, 1, 1)
    assert fake.acks == ["d-e9"]
    [row] = Outbox(engine).inbox_rows(outcome="FAILED")
    assert (row.event_id, row.outcome, row.delivery_count, row.status) == (
        "e9",
        InboxOutcome.FAILED,
        3,
        "FAILED",
    )
    assert row.error is not None and "KeyError" in row.error and "delivery 3" in row.error
    assert (
        row.event is not None and row.event["error"] == {"code": "boom"} and row.event["task_id"] == "task-9"
    )
    assert state(engine)["follow_ups"] == []
    fake.publish(
        result_event("e9", "task-9", TaskStatus.FAILED), delivery_id="d-e9-again"
    )  # parked = in the inbox
    assert consumer(engine, fake, handler, max_deliveries=3).run_once().duplicates == 1


def test_without_max_deliveries_a_failing_event_is_never_parked(engine: sa.Engine) -> None:
    fake = FakeSubscription()
    fake.publish(succeeded("e1", 1))

    def handler(conn: Connection, event: ResultEvent) -> None:
        raise RuntimeError("still broken")

    for _ in range(12):
        stats = consumer(engine, fake, handler, max_deliveries=None).run_once()
        assert (stats.failed, stats.parked, stats.acked) == (1, 0, 0)
        fake.expire_leases()
    assert fake.slots["d-e1"].count == 12 and state(engine)["inbox"] == []


def test_once_ends_even_when_a_failed_delivery_comes_straight_back(engine: sa.Engine) -> None:
    fake = FakeSubscription(instant_expiry=True)  # a lease shorter than the handler
    fake.publish(succeeded("e1", 1))

    def handler(conn: Connection, event: ResultEvent) -> None:
        raise RuntimeError("still broken")

    stats = consumer(engine, fake, handler).run_once()
    assert (stats.leased, stats.failed, stats.unprocessed) == (2, 1, 1)


def test_a_transient_database_error_in_the_handler_is_an_outage_not_a_handler_failure(
    engine: sa.Engine,
) -> None:
    fake = FakeSubscription(instant_expiry=True)
    fake.publish(succeeded("e1", 1))
    calls = []

    def handler(conn: Connection, event: ResultEvent) -> None:
        calls.append(event.id)
        if len(calls) == 1:
            raise sa.exc.OperationalError("UPDATE orders", {}, sqlite3.OperationalError("database is locked"))
        apply_result(conn, event)

    with pytest.raises(OutboxDatabaseError) as raised:  # --once: any database failure ends the run
        consumer(engine, fake, handler, max_deliveries=1).run_once()
    assert raised.value.retryable and state(engine)["inbox"] == []

    calls.clear()
    running = consumer(engine, fake, handler, max_deliveries=1)  # would park at once on a handler failure
    thread = threading.Thread(target=running.run)
    thread.start()
    assert fake.acked_event.wait(10)
    running.stop()
    thread.join(10)
    assert calls == ["e1", "e1"] and state(engine)["inbox"] == [("e1", "APPLIED", 3)]  # 3rd delivery overall


def test_the_consumer_waits_out_an_orbit_outage_and_refuses_for_good_errors(engine: sa.Engine) -> None:
    fake = FakeSubscription()
    fake.publish(succeeded("e1", 1))
    fake.lease_errors[:] = [connect_error(), connect_error()]
    with pytest.raises(OrbitConnectError):
        consumer(engine, fake).run_once()  # --once: a failed lease ends the run
    running = consumer(engine, fake)
    thread = threading.Thread(target=running.run)
    thread.start()
    assert fake.acked_event.wait(10)
    running.stop()
    thread.join(10)
    assert fake.leases >= 3 and fake.acks == ["d-e1"]

    fake.lease_errors.append(NotFoundError("no such subscription", status_code=404, code="not_found"))
    with pytest.raises(NotFoundError):
        consumer(engine, fake).run()  # 404 will not heal by waiting


def test_a_missing_inbox_table_names_the_fix(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'empty.db'}")
    fake = FakeSubscription()
    fake.publish(succeeded("e1", 1))
    with pytest.raises(OutboxSchemaError, match="orbit-outbox migrate"):
        consumer(engine, fake).run()
    assert fake.acks == []
    engine.dispose()


def test_sigterm_finishes_the_delivery_in_hand_and_leaves_the_rest_to_its_lease(engine: sa.Engine) -> None:
    fake = FakeSubscription()
    for i in (1, 2, 3):
        fake.publish(succeeded(f"e{i}", i))

    def handler(conn: Connection, event: ResultEvent) -> None:
        apply_result(conn, event)
        if event.id == "e1":
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while e1's transaction is open

    before = signal.getsignal(signal.SIGTERM)
    stats = consumer(engine, fake, handler, install_signal_handlers=True).run()
    assert signal.getsignal(signal.SIGTERM) == before
    assert (stats.leased, stats.applied, stats.acked, stats.unprocessed) == (3, 1, 1, 2)
    assert fake.acks == ["d-e1"] and state(engine)["inbox"] == [("e1", "APPLIED", 1)]


def test_settings_are_checked() -> None:
    fake = FakeSubscription()
    bad: list[dict[str, Any]] = [
        {"namespace": "no spaces"},
        {"subscription": ""},
        {"handler": "not callable"},
        {"batch_size": 0},
        {"lease_seconds": 0},
        {"max_deliveries": 0},
    ]
    for change in bad:
        args: dict[str, Any] = {"namespace": NS, "subscription": SUB, "handler": apply_result, **change}
        with pytest.raises(OutboxUsageError):
            ResultConsumer(
                "sqlite:///x.db",
                fake,
                args.pop("namespace"),
                args.pop("subscription"),
                args.pop("handler"),
                **args,
            )


def test_the_handler_option_is_imported_with_errors_that_name_the_fix() -> None:
    assert load_handler("tests.unit.outbox.test_consumer_unit:apply_result") is apply_result
    assert load_handler("os.path:join") is os.path.join
    for spec, message in [
        ("apply_result", "must be module:function"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("os.path:no_such_function", "has no attribute 'no_such_function'"),
        ("os:sep", "not a function"),
    ]:
        with pytest.raises(OutboxUsageError, match=message):
            load_handler(spec)
    result = CliRunner().invoke(
        main,
        ["consume", "--database-url", "sqlite:///x.db", "--orbit-url", "http://127.0.0.1:9", "--api-key", "k",
         "--namespace", NS, "--subscription", SUB, "--handler", "no_such_module_xyz:f"],
    )  # fmt: skip
    assert result.exit_code == 2 and "PYTHONPATH" in result.stderr
    missing = CliRunner().invoke(
        main,
        ["consume", "--database-url", "sqlite:///x.db", "--orbit-url", "http://127.0.0.1:9", "--api-key", "k",
         "--subscription", SUB, "--handler", "os.path:join"],
        env={"ORBIT_NAMESPACE": ""},
    )  # fmt: skip
    assert missing.exit_code == 2 and "ORBIT_NAMESPACE" in missing.output + missing.stderr


class _Clock:
    """A monotonic clock the handler moves forward: how long applying an event takes."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_a_delivery_is_applied_only_while_its_lease_allows_and_never_acked_after_it(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _Clock()
    monkeypatch.setattr("outbox_adapter._consumer.time", clock)
    fake = FakeSubscription()
    for n in (1, 2, 3):
        fake.publish(succeeded(f"e{n}", n))
    took = {"e1": 4.0, "e2": 4.0, "e3": 4.0}

    def slow(conn: Connection, event: ResultEvent) -> None:
        apply_result(conn, event)
        clock.now += took[event.id]

    # Lease 10 s (margin 1 s): e1 applied by t=4, e2 by t=8; e3 would need 4 s more with 2 s left.
    stats = consumer(engine, fake, slow, lease_seconds=10.0, batch_size=3).run_once()
    assert (stats.applied, stats.acked, stats.unprocessed) == (2, 2, 1)
    assert fake.acks == ["d-e1", "d-e2"]
    assert [row[:2] for row in state(engine)["inbox"]] == [("e1", "APPLIED"), ("e2", "APPLIED")]

    fake.expire_leases()  # e3 comes back after its lease, and is applied with a fresh one
    took["e3"] = 11.0  # ...but it takes longer than the whole lease: committed, not acked
    stats = consumer(engine, fake, slow, lease_seconds=10.0, batch_size=3).run_once()
    assert (stats.applied, stats.acked, stats.ack_skipped) == (1, 0, 1)
    assert fake.acks == ["d-e1", "d-e2"]
    fake.expire_leases()  # it comes back once more: a duplicate now, acked
    stats = consumer(engine, fake, slow, lease_seconds=10.0, batch_size=3).run_once()
    assert (stats.duplicates, stats.acked) == (1, 1) and fake.acks == ["d-e1", "d-e2", "d-e3"]


def test_one_slow_apply_is_forgotten_and_later_deliveries_are_applied(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An apply that took longer than the whole lease (a lock wait behind another transaction)
    used to make every later delivery look as if too little lease was left, for ever."""
    clock = _Clock()
    monkeypatch.setattr("outbox_adapter._consumer.time", clock)
    with engine.begin() as conn:
        conn.execute(orders.insert(), [{"id": i, "status": "PENDING"} for i in range(10, 30)])
    fake = FakeSubscription()
    fake.publish(succeeded("slow", 1))
    took = {"slow": 12.0}  # lease 10 s + 2 s

    def handler(conn: Connection, event: ResultEvent) -> None:
        apply_result(conn, event)
        clock.now += took.get(event.id, 0.05)

    metrics = ConsumerMetrics()
    one = consumer(engine, fake, handler, lease_seconds=10.0, batch_size=10, metrics=metrics)
    stats = one.run_once()
    assert (stats.applied, stats.ack_skipped) == (1, 1)
    for n in range(10, 30):
        fake.publish(succeeded(f"e{n}", n))
    stats = one.run_once()  # the same consumer, 20 new results
    assert stats.applied == 20 and stats.acked == 20
    assert state(engine)["orders"][29] == ("COMPLETED", 1)
    assert one.apply_estimate < 1.0  # the slow apply is forgotten
    assert "slow_apply" in [getattr(r, "event", None) for r in caplog.records]  # ...but was alerted on
    slow = metrics.registry.get_sample_value("orbit_consumer_slow_applies_total", {"subscription": SUB})
    assert slow == 1.0


def _read_only() -> sa.exc.OperationalError:
    """What PyMySQL raises on an UPDATE against a MariaDB started with --read-only (a failover's old primary)."""
    import pymysql

    orig = pymysql.err.OperationalError(
        1290, "The MariaDB server is running with the --read-only option so it cannot execute this statement"
    )
    return sa.exc.OperationalError("UPDATE orders", {}, orig)


def test_a_read_only_database_is_transient_for_the_relay_the_consumer_and_the_worker(
    engine: sa.Engine,
) -> None:
    """MariaDB 1290 (--read-only) made the relay and the consumer exit 3 and crash-loop."""
    import pymysql

    from outbox_adapter import is_transient_db_error
    from outbox_adapter._db import translate_db_error

    assert is_transient_db_error(_read_only())
    assert translate_db_error(_read_only(), "claim a batch of outbox rows").retryable
    other_option = pymysql.err.OperationalError(1290, "running with the --secure-file-priv option")
    assert not is_transient_db_error(sa.exc.OperationalError("SELECT", {}, other_option))
    assert not is_transient_db_error(ValueError("not a database error"))

    fake = FakeSubscription(instant_expiry=True)
    fake.publish(succeeded("e1", 1))
    calls: list[str] = []

    def handler(conn: Connection, event: ResultEvent) -> None:
        calls.append(event.id)
        if len(calls) == 1:
            raise _read_only()
        apply_result(conn, event)

    running = consumer(engine, fake, handler, max_deliveries=1)  # would park at once on a handler failure
    thread = threading.Thread(target=running.run)
    thread.start()
    assert fake.acked_event.wait(10)
    running.stop()
    thread.join(10)
    assert calls == ["e1", "e1"] and [row[:2] for row in state(engine)["inbox"]] == [("e1", "APPLIED")]
