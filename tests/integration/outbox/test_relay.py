"""The relay against a real server (through a fault-injecting proxy where a fault is needed),
on SQLite, MariaDB and PostgreSQL business databases: the outcome classes of DESIGN §5."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa

from orbit_client import AuthenticationError, OrbitClient, RetryPolicy
from orbit_server.tasks import store
from outbox_adapter import Outbox, OutboxTables, enqueue
from outbox_adapter._db import db_now
from tests.integration.outbox.conftest import Biz, Namespace, RelayFactory
from tests.outbox_support import (
    closed_port,
    run_fault_proxy,
    submission_count,
    task_count,
    tasks_in_creation_order,
    wait_until,
)
from tests.servers import RunningServer


def _enqueue(biz: Biz, tables: OutboxTables, ns: Namespace, n: int = 1, **kwargs: Any) -> list[int]:
    ids = []
    with biz.engine.begin() as conn:
        for i in range(n):
            options = {
                "namespace": ns.name,
                "queue": "default",
                "handler": "orders.fulfil",
                "params": {"i": i},
            }
            ids.append(enqueue(conn, tables=tables, **{**options, **kwargs}).id)
    return ids


def test_503_with_retry_after_is_honoured_then_delivered(
    biz: Biz, tables: OutboxTables, ns: Namespace, orbit: RunningServer, make_relay: RelayFactory
) -> None:
    [row_id] = _enqueue(biz, tables, ns)
    outbox = Outbox(biz.engine, tables=tables)
    with run_fault_proxy(orbit.base_url) as (url, proxy):
        proxy.add("respond", status=503, times=1, headers={"Retry-After": "120"},
                  body={"title": "Unavailable", "status": 503, "code": "unavailable"})  # fmt: skip
        stats = make_relay(base_url=url).run_once()
    assert (stats.retried, stats.delivered) == (1, 0)
    row = outbox.get(row_id)
    # Back to PENDING, not counted (the server did nothing), due exactly Retry-After later by the DB clock.
    assert (
        row.state == "PENDING" and row.attempts == 0 and row.send_count == 1 and row.last_status_code == 503
    )
    assert abs((row.available_at - row.updated_at).total_seconds() - 120) < 0.01
    assert row.lease_token is None and "503" in (row.last_error or "")
    assert make_relay().run_once().claimed == 0  # not due yet, even with a zero backoff
    with biz.engine.begin() as conn:  # let the time pass
        conn.execute(sa.update(tables.outbox).values(available_at=db_now(conn)))
    assert make_relay().run_once().delivered == 1
    assert task_count(orbit, ns.name) == 1


def test_connection_refused_is_retried_and_not_counted_as_unknown(
    biz: Biz, tables: OutboxTables, ns: Namespace, orbit: RunningServer, make_relay: RelayFactory
) -> None:
    [row_id] = _enqueue(biz, tables, ns)
    stats = make_relay(base_url=f"http://127.0.0.1:{closed_port()}", max_attempts=1).run_once()
    assert (stats.claimed, stats.retried, stats.needs_reconcile) == (1, 1, 0)
    row = Outbox(biz.engine, tables=tables).get(row_id)
    # Even with a budget of 1, a refused connection leaves the row PENDING with its attempt given back.
    assert row.state == "PENDING" and row.attempts == 0 and row.send_count == 1
    assert "could not connect" in (row.last_error or "")
    assert make_relay(max_attempts=1).run_once().delivered == 1
    assert task_count(orbit, ns.name) == 1


def test_read_timeout_after_the_server_accepted_until_the_budget_is_spent_then_reconcile_finds_the_task(
    biz: Biz, tables: OutboxTables, ns: Namespace, orbit: RunningServer, make_relay: RelayFactory
) -> None:
    [row_id] = _enqueue(biz, tables, ns, max_attempts=2)
    outbox = Outbox(biz.engine, tables=tables)
    key = outbox.get(row_id).idempotency_key
    with run_fault_proxy(orbit.base_url) as (url, proxy):
        proxy.add("forward_then_drop", key=key)  # the server accepts; the answer never comes
        stats = make_relay(base_url=url, timeout=2.0).run_once()
    assert (stats.retried, stats.needs_reconcile, stats.dead) == (1, 1, 0)
    row = outbox.get(row_id)
    assert (
        row.state == "NEEDS_RECONCILE" and row.attempts == 2 and "outcome unknown" in (row.last_error or "")
    )
    assert row.idempotency_key == key
    assert submission_count(orbit, key) == 1 and task_count(orbit, ns.name) == 1  # two sends, one task

    with OrbitClient(orbit.base_url, api_key=ns.keys["read"]) as client:
        decisions = outbox.reconcile(client, actor="test")
    assert [(d.row_id, d.decision, d.applied) for d in decisions] == [(row_id, "delivered", True)]
    row = outbox.get(row_id)
    assert row.state == "DELIVERED" and row.orbit_task_id == decisions[0].orbit_task_id
    trail = [(e.from_state, e.to_state, e.actor) for e in outbox.events(row_id)]
    assert trail[0][:2] == ("PENDING", "NEEDS_RECONCILE") and trail[1] == (
        "NEEDS_RECONCILE",
        "DELIVERED",
        "test",
    )


def test_a_row_never_accepted_is_reconciled_to_pending_with_the_same_key_then_delivered(
    biz: Biz, tables: OutboxTables, ns: Namespace, orbit: RunningServer, make_relay: RelayFactory
) -> None:
    [row_id] = _enqueue(biz, tables, ns, max_attempts=1)
    outbox = Outbox(biz.engine, tables=tables)
    key = outbox.get(row_id).idempotency_key
    with run_fault_proxy(orbit.base_url) as (url, proxy):
        proxy.add("drop", key=key)  # lost on the way: the server never sees it
        assert make_relay(base_url=url, timeout=2.0).run_once().needs_reconcile == 1
    assert task_count(orbit, ns.name) == 0
    with OrbitClient(orbit.base_url, api_key=ns.keys["read"]) as client:
        assert [d.decision for d in outbox.reconcile(client, actor="test", dry_run=True)] == ["pending"]
        assert outbox.get(row_id).state == "NEEDS_RECONCILE"  # a dry run changes nothing
        [decision] = outbox.reconcile(client, actor="test")
    assert (decision.decision, decision.applied) == ("pending", True)
    row = outbox.get(row_id)
    assert row.state == "PENDING" and row.idempotency_key == key and row.attempts == 0
    assert make_relay().run_once().delivered == 1
    assert outbox.get(row_id).idempotency_key == key and submission_count(orbit, key) == 1


def test_rows_the_server_refuses_are_dead_without_stopping_the_batch_and_retry_after_the_fix(
    biz: Biz, tables: OutboxTables, ns: Namespace, orbit: RunningServer, make_relay: RelayFactory
) -> None:
    first = _enqueue(biz, tables, ns)
    [missing_queue] = _enqueue(biz, tables, ns, queue="later")
    with biz.engine.begin() as conn:  # over the server's 256 KiB body limit: refused with 413
        [too_big] = [enqueue(conn, namespace=ns.name, queue="default", handler="h", params={"b": "x" * 300_000},
                             tables=tables, max_params_bytes=1 << 20).id]  # fmt: skip
    last = _enqueue(biz, tables, ns)
    stats = make_relay(queue_cache_ttl=0).run_once()
    assert (stats.delivered, stats.dead) == (2, 2)
    outbox = Outbox(biz.engine, tables=tables)
    assert [outbox.get(i).state for i in (*first, *last)] == ["DELIVERED", "DELIVERED"]
    dead = outbox.get(missing_queue)
    assert dead.state == "DEAD" and dead.last_status_code == 404
    assert "queue 'later'" in (dead.last_error or "") and f"orbit-outbox retry {missing_queue}" in (
        dead.last_error or ""
    )
    assert f"orbit-server queue create {ns.name} later" in (dead.last_error or "")
    assert f"orbit-outbox purge --dead-older-than 0s --row {missing_queue}" in (dead.last_error or "")
    assert outbox.get(too_big).state == "DEAD" and outbox.get(too_big).last_status_code == 413

    with orbit.engine.begin() as conn:  # the fix: create the queue
        store.create_queue(conn, ns.name, "later")
    retried = outbox.retry(missing_queue, actor="operator:test", reason="queue created")
    assert (
        retried.state == "PENDING"
        and retried.idempotency_key == dead.idempotency_key
        and retried.attempts == 0
    )
    assert make_relay(queue_cache_ttl=0).run_once().delivered == 1
    assert outbox.get(missing_queue).state == "DELIVERED"
    trail = [(e.from_state, e.to_state) for e in outbox.events(missing_queue)]
    assert trail == [("PENDING", "DEAD"), ("DEAD", "PENDING"), ("PENDING", "DELIVERED")]
    assert task_count(orbit, ns.name) == 3


def test_a_relay_whose_lease_expired_cannot_record(
    biz: Biz, tables: OutboxTables, ns: Namespace, orbit: RunningServer, make_relay: RelayFactory
) -> None:
    [row_id] = _enqueue(biz, tables, ns)
    outbox = Outbox(biz.engine, tables=tables)
    with run_fault_proxy(orbit.base_url) as (url, proxy):
        gate = proxy.add("block", times=1)
        slow = make_relay(base_url=url, lease_seconds=0.3, owner="slow")
        result: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: result.update(stats=slow.run_once()))
        thread.start()
        assert gate.arrived.wait(10)  # relay "slow" has claimed and is sending
        row = outbox.get(row_id)
        assert row.lease_owner == "slow"
        with biz.engine.connect() as conn:  # the database clock passes the lease's end
            wait_until(lambda: db_now(conn) > row.lease_expires_at.replace(tzinfo=None))  # type: ignore[union-attr]
        # Another relay takes the row over and delivers it. "slow" keeps polling (every 0.05 s) while
        # its send hangs; its claim select excludes the row it has in flight, but InnoDB still locks
        # that row for the select's short transaction, and a SKIP LOCKED claim made in that moment
        # passes it by (found in CI): the taker runs again until it has claimed, as a polling relay would.
        taker_relay = make_relay(owner="taker")
        runs: list[Any] = []
        wait_until(lambda: runs.append(taker_relay.run_once()) or runs[-1].claimed > 0, timeout=10)
        taker = runs[-1]
        assert taker.delivered == 1 and taker.replayed == 0
        gate.release.set()  # the slow send now completes (the server replays)...
        thread.join(10)
    stats = result["stats"]
    assert stats.lost_leases == 1 and stats.delivered == 0  # ...but records nothing
    row = outbox.get(row_id)
    assert row.state == "DELIVERED" and row.attempts == 2
    assert [(e.to_state, e.actor) for e in outbox.events(row_id)] == [("DELIVERED", "relay:taker")]
    assert task_count(orbit, ns.name) == 1


def test_one_slow_send_does_not_hold_up_other_rows(
    biz: Biz, tables: OutboxTables, ns: Namespace, orbit: RunningServer, make_relay: RelayFactory
) -> None:
    [slow_id] = _enqueue(biz, tables, ns)
    others = _enqueue(biz, tables, ns, n=6)
    outbox = Outbox(biz.engine, tables=tables)
    delivered: list[int] = []
    all_others = threading.Event()

    def on_delivered(conn: sa.Connection, row: Any) -> None:
        delivered.append(row.row_id)
        if set(others) <= set(delivered):
            all_others.set()

    with run_fault_proxy(orbit.base_url) as (url, proxy):
        gate = proxy.add("block", key=outbox.get(slow_id).idempotency_key)
        # One row per request: the slow request holds its own slot, the other slot keeps delivering.
        relay = make_relay(base_url=url, concurrency=2, batch_size=1, on_delivered=on_delivered)
        thread = threading.Thread(target=relay.run)
        thread.start()
        try:
            assert gate.arrived.wait(10)
            assert all_others.wait(20), "the other rows waited for the slow one"
            assert outbox.get(slow_id).state == "PENDING"
            gate.release.set()
            wait_until(lambda: slow_id in delivered)
        finally:
            relay.stop()
            thread.join(10)
    assert delivered[-1] == slow_id and not thread.is_alive()
    assert task_count(orbit, ns.name) == 7


def test_the_order_of_an_ordering_key_holds_with_several_relays(
    biz: Biz, tables: OutboxTables, ns: Namespace, orbit: RunningServer, make_relay: RelayFactory
) -> None:
    with biz.engine.begin() as conn:
        for i in range(24):
            enqueue(conn, namespace=ns.name, queue="default", handler="h", params={"key": f"k{i % 3}", "seq": i},
                    ordering_key=f"k{i % 3}", tables=tables)  # fmt: skip
    relays = [make_relay(owner=f"r{i}", batch_size=4) for i in range(3)]
    threads = [threading.Thread(target=r.run_once) for r in relays]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    rows = Outbox(biz.engine, tables=tables).list_rows()
    assert {r.state for r in rows} == {"DELIVERED"} and len(rows) == 24
    created: dict[str, list[int]] = {}
    for task in tasks_in_creation_order(orbit, ns.name):
        created.setdefault(task["params"]["key"], []).append(task["params"]["seq"])
    assert created == {f"k{k}": list(range(k, 24, 3)) for k in range(3)}


def test_a_blocked_ordering_key_waits_behind_a_dead_row(
    biz: Biz, tables: OutboxTables, ns: Namespace, orbit: RunningServer, make_relay: RelayFactory
) -> None:
    [dead_id] = _enqueue(biz, tables, ns, queue="nope", ordering_key="c1")
    [behind] = _enqueue(biz, tables, ns, ordering_key="c1")
    [free] = _enqueue(biz, tables, ns, ordering_key="c2")
    stats = make_relay().run_once()
    assert (stats.dead, stats.delivered) == (1, 1)
    outbox = Outbox(biz.engine, tables=tables)
    assert [outbox.get(i).state for i in (dead_id, behind, free)] == ["DEAD", "PENDING", "DELIVERED"]
    assert outbox.get(behind).send_count == 0  # never claimed while an earlier row of its key is unsent


def test_unknown_api_key_blames_the_relay_not_the_rows(
    biz: Biz, tables: OutboxTables, ns: Namespace, orbit: RunningServer
) -> None:
    from outbox_adapter import Backoff, Relay

    [row_id] = _enqueue(biz, tables, ns)
    with OrbitClient(orbit.base_url, api_key="wrong", retry=RetryPolicy(max_attempts=1)) as client:
        relay = Relay(client=client, engine=biz.engine, tables=tables, backoff=Backoff(base=60, cap=60))
        with pytest.raises(AuthenticationError):
            relay.run_once()
    outbox = Outbox(biz.engine, tables=tables)
    row = outbox.get(row_id)
    assert row.state == "PENDING" and row.attempts == 0 and row.last_status_code == 401
    assert row.available_at <= row.updated_at  # due now: no backoff spent on the relay's key
