"""The inbox on each business database (SQLite, MariaDB, PostgreSQL): result events from a real Orbit
server applied once each although an ack is lost, ``orbit-outbox consume``, two consumers racing on the
same event (they serialise on the inbox's unique key), and a business database outage."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.engine import Connection

from orbit_client import OrbitClient, ResultEvent, RetryPolicy, TaskStatus
from outbox_adapter import Backoff, ConsumerStats, Outbox, OutboxTables, ResultConsumer, enqueue
from outbox_adapter.cli import main
from tests.inbox_support import NS, SUB, FakeSubscription, result_event
from tests.integration.outbox.conftest import Biz, Namespace
from tests.integration.outbox.test_outage import _Events
from tests.outbox_support import TcpProxy, run_fault_proxy
from tests.servers import RunningServer


@pytest.fixture
def orders(biz: Biz) -> Iterator[sa.Table]:
    """A business table of its own for each test."""
    table = sa.Table(
        f"orders_{uuid.uuid4().hex[:8]}",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("applied", sa.Integer, nullable=False),
        sa.Column("task_id", sa.String(64), nullable=True),
    )
    table.create(biz.engine)
    with biz.engine.begin() as conn:
        conn.execute(table.insert(), [{"id": 1, "status": "PENDING", "applied": 0}])
    yield table
    table.drop(biz.engine)


def make_handler(orders: sa.Table, tables: OutboxTables, gate: threading.Event | None = None) -> Any:
    def handler(conn: Connection, event: ResultEvent) -> None:
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
    fake.publish(result_event("e1", "task-1", TaskStatus.SUCCEEDED, result={"order_id": 1}))
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
    fake.publish(result_event("e1", "task-1", TaskStatus.SUCCEEDED))
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
            fake.publish(result_event(f"e{n}", f"task-{n}", TaskStatus.SUCCEEDED))
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


# --- against a real Orbit server ---------------------------------------------------------------------


def finished_task(orbit: RunningServer, ns: Namespace, *, succeed: bool) -> str:
    """A task of queue ``default`` that reached SUCCEEDED (through a worker's calls) or CANCELLED."""
    with OrbitClient(orbit.base_url, api_key=ns.keys["admin"]) as admin:
        task = admin.submit_task(
            ns.name, "default", "orders.fulfil", {}, idempotency_key=str(uuid.uuid4())
        ).task
        if not succeed:
            admin.cancel_task(ns.name, task.id, reason="customer cancelled")
            return task.id
        [grant] = admin.lease_tasks(ns.name, "default", worker_id="test-worker")
        admin.start_attempt(ns.name, grant.attempt.id, grant.attempt.lease_token)
        admin.complete_attempt(ns.name, grant.attempt.id, grant.attempt.lease_token, {"receipt": "r-1"})
        return task.id


def status_handler(orders: sa.Table, tables: OutboxTables) -> Any:
    """Set the order of the event's task to the task's status, count it, enqueue a follow-up."""

    def handler(conn: Connection, event: ResultEvent) -> None:
        conn.execute(
            sa.update(orders)
            .where(orders.c.task_id == event.task_id)
            .values(status=event.status.value, applied=orders.c.applied + 1)
        )
        enqueue(
            conn, namespace=event.namespace, queue="default", handler="orders.notify",
            params={"task_id": event.task_id, "status": event.status.value}, tables=tables,
        )  # fmt: skip

    return handler


def orders_of(biz: Biz, orders: sa.Table, tasks: list[str]) -> None:
    with biz.engine.begin() as conn:
        conn.execute(sa.delete(orders))
        conn.execute(
            orders.insert(),
            [{"id": i, "status": "PENDING", "applied": 0, "task_id": t} for i, t in enumerate(tasks)],
        )


def test_results_from_a_real_server_apply_once_although_an_ack_is_lost(
    biz: Biz, tables: OutboxTables, orders: sa.Table, orbit: RunningServer, ns: Namespace
) -> None:
    """DESIGN §5 "Inbox": a result delivered twice applies once and enqueues its follow-ups once."""
    with OrbitClient(orbit.base_url, api_key=ns.keys["admin"]) as admin:
        admin.create_subscription(ns.name, "results", queues=["default"])
    done, cancelled = finished_task(orbit, ns, succeed=True), finished_task(orbit, ns, succeed=False)
    orders_of(biz, orders, [done, cancelled])
    with run_fault_proxy(orbit.base_url) as (proxy_url, proxy), contextlib.ExitStack() as stack:
        lost = proxy.add("respond", path_contains="/ack", times=1, status=503, body={"code": "unavailable"})
        client = OrbitClient(proxy_url, api_key=ns.keys["work"], retry=RetryPolicy(max_attempts=1))
        stack.callback(client.close)
        consumer = ResultConsumer(
            biz.engine,
            client,
            ns.name,
            "results",
            status_handler(orders, tables),
            tables=tables,
            lease_seconds=2.0,  # long enough that a loaded machine applies both before it lapses
        )
        first = consumer.run_once()
        assert (first.applied, first.ack_failures) == (2, 1) and lost.hits == 1
        total = first
        deadline = time.monotonic() + 20
        while (
            total.duplicates < 1
        ):  # the unacked delivery's lease lapses: the server delivers the event again
            assert time.monotonic() < deadline, total
            time.sleep(0.2)
            stats = consumer.run_once()
            total = ConsumerStats(**{k: getattr(total, k) + v for k, v in stats.to_dict().items()})
        assert (total.leased, total.applied, total.duplicates, total.acked, total.ack_failures) == (
            3,
            2,
            1,
            2,
            1,
        )
        time.sleep(2.1)
        assert consumer.run_once().leased == 0  # acked for good
    with biz.engine.connect() as conn:
        rows = {r.task_id: (r.status, r.applied) for r in conn.execute(sa.select(orders))}
        follow_ups = [r.params for r in conn.execute(sa.select(tables.outbox).order_by(tables.outbox.c.id))]
    assert rows == {done: ("SUCCEEDED", 1), cancelled: ("CANCELLED", 1)}
    assert sorted(f["task_id"] for f in follow_ups) == sorted([done, cancelled])
    inbox = Outbox(biz.engine, tables=tables).inbox_rows()
    assert sorted((r.task_id, r.status, r.outcome) for r in inbox) == sorted(
        [(done, "SUCCEEDED", "APPLIED"), (cancelled, "CANCELLED", "APPLIED")]
    )


def test_orbit_outbox_consume(
    biz: Biz, orders: sa.Table, orbit: RunningServer, ns: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = f"cli_{uuid.uuid4().hex[:8]}"
    url = biz.url.render_as_string(hide_password=False)
    monkeypatch.setenv("INBOX_TEST_ORDERS", orders.name)
    env = {"ORBIT_URL": orbit.base_url, "ORBIT_API_KEY": ns.keys["work"], "ORBIT_NAMESPACE": ns.name}
    consume = ["consume", "--database-url", url, "--table", table, "--subscription", "cli-results", "--once"]
    handler = ["--handler", "tests.integration.outbox.inbox_handlers:record"]
    runner = CliRunner()

    assert runner.invoke(main, ["migrate", "--database-url", url, "--table", table]).exit_code == 0
    missing = runner.invoke(main, [*consume, *handler], env=env)
    assert missing.exit_code == 4 and "create the subscription first" in missing.stderr  # no subscription yet
    for key in ("orbit_not-a-key", ns.keys["submit"]):  # 401, and 403 (the wrong role): stop, naming the key
        refused = runner.invoke(main, [*consume, *handler], env={**env, "ORBIT_API_KEY": key})
        assert refused.exit_code == 4 and f"the key {key[:12]}…" in refused.stderr, refused.output
        assert "work (or admin) key" in refused.stderr and key not in refused.stderr
    with OrbitClient(orbit.base_url, api_key=ns.keys["admin"]) as admin:
        admin.create_subscription(ns.name, "cli-results")
    tasks = [finished_task(orbit, ns, succeed=True), finished_task(orbit, ns, succeed=False)]
    orders_of(biz, orders, tasks)

    failing = runner.invoke(
        main,
        [
            *consume,
            "--handler",
            "tests.integration.outbox.inbox_handlers:broken",
            "--lease-seconds",
            "2",
            "--json",
        ],
        env=env,
    )  # fmt: skip  (a 2 s lease: both deliveries are still leased when a loaded machine reaches the second)
    assert failing.exit_code == 0, failing.output
    assert json.loads(failing.stdout)["failed"] == 2 and json.loads(failing.stdout)["acked"] == 0
    time.sleep(2.1)  # the failed deliveries come back only once their lease has lapsed
    applied = runner.invoke(main, [*consume, *handler, "--json"], env=env)
    assert applied.exit_code == 0, applied.output
    assert {k: json.loads(applied.stdout)[k] for k in ("applied", "acked", "failed")} == {
        "applied": 2,
        "acked": 2,
        "failed": 0,
    }
    with biz.engine.connect() as conn:
        assert sorted(conn.execute(sa.select(orders.c.status, orders.c.applied))) == [
            ("CANCELLED", 1),
            ("SUCCEEDED", 1),
        ]
    inbox = Outbox(biz.engine, tables=OutboxTables(name=table)).inbox_rows()
    assert all(r.delivery_count >= 2 for r in inbox) and inbox[0].subscription == "cli-results"
