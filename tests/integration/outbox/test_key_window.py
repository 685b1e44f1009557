"""The key window end to end (README "Retention and the key window"): the server publishes it, purges keys only after
it, and a relay never sends a row older than it without first settling the row by its key."""

from __future__ import annotations

from datetime import timedelta

import pytest
import sqlalchemy as sa

from orbit_client import OrbitAPIError, OrbitClient
from orbit_server.db.engine import db_now as server_now
from orbit_server.db.schema import submission_keys
from orbit_server.db.schema import tasks as server_tasks
from orbit_server.retention import purge as retention
from outbox_adapter import Outbox, OutboxTables, enqueue
from tests.conftest import DatabaseFactory
from tests.integration.outbox.conftest import Biz, Namespace, RelayFactory
from tests.outbox_support import submission_count, task_count
from tests.servers import RunningServer, run_server

WEEK = 7 * 24 * 3600


def _enqueue(biz: Biz, tables: OutboxTables, ns: Namespace, n: int) -> int:
    with biz.engine.begin() as conn:
        entry = enqueue(conn, namespace=ns.name, queue="default", handler="h", params={"n": n}, tables=tables)
    return entry.id


def _age(biz: Biz, tables: OutboxTables, row_ids: list[int], *, lost: bool) -> None:
    """Move rows' enqueue time 8 days back; with ``lost``, also undo their recorded delivery, as when
    a relay died after the server accepted the send and before it recorded it."""
    o = tables.outbox
    with biz.engine.begin() as conn:
        for row_id in row_ids:
            created = conn.scalar(sa.select(o.c.created_at).where(o.c.id == row_id))
            values: dict[str, object] = {
                "created_at": created - timedelta(days=8),
                "available_at": created - timedelta(days=8),
            }
            if lost:
                values |= {"state": "PENDING", "orbit_task_id": None, "delivered_at": None}
            conn.execute(o.update().where(o.c.id == row_id).values(**values))


def test_a_row_older_than_the_key_window_is_settled_by_its_key_and_never_makes_a_second_task(
    biz: Biz, tables: OutboxTables, ns: Namespace, orbit: RunningServer, make_relay: RelayFactory
) -> None:
    with OrbitClient(orbit.base_url, api_key=ns.keys["read"]) as client:
        assert client.get_settings().submission_key_ttl_seconds == WEEK
    forgotten, known, purged = (_enqueue(biz, tables, ns, n) for n in (1, 2, 3))
    assert make_relay().run_once().delivered == 3
    outbox = Outbox(biz.engine, tables=tables)
    task_of = {row_id: outbox.get(row_id).orbit_task_id for row_id in (forgotten, known, purged)}
    _age(biz, tables, [forgotten, known, purged], lost=True)

    # On the server: the tasks of `forgotten` and `purged` finished 40 days ago and are purged; the key
    # of `forgotten` also expired and is purged, so the server no longer knows it at all.
    with OrbitClient(orbit.base_url, api_key=ns.keys["admin"]) as admin:
        for row_id in (forgotten, purged):
            admin.cancel_task(ns.name, task_of[row_id], reason="test")
    with orbit.engine.begin() as conn:
        now = server_now(conn)
        for row_id in (forgotten, purged):
            conn.execute(
                server_tasks.update()
                .where(server_tasks.c.id == task_of[row_id])
                .values(finished_at=now - timedelta(days=40))
            )
        conn.execute(
            submission_keys.update()
            .where(submission_keys.c.task_id == task_of[forgotten])
            .values(expires_at=now - timedelta(days=1))
        )
        cutoff = now - timedelta(days=30)
        assert retention.inventory(conn, cutoff).purge.submission_keys >= 1
    retention.purge(orbit.engine, actor="test", tasks_before=cutoff, keys=True)
    forgotten_key = outbox.get(forgotten).idempotency_key
    assert submission_count(orbit, forgotten_key) == 0
    assert submission_count(orbit, outbox.get(purged).idempotency_key) == 1  # kept until its own expiry
    with OrbitClient(
        orbit.base_url, api_key=ns.keys["submit"]
    ) as client:  # its task is gone: 410, nothing new
        with pytest.raises(OrbitAPIError) as refused:
            client.submit_task(
                ns.name, "default", "h", {"n": 3}, idempotency_key=outbox.get(purged).idempotency_key
            )
        assert (refused.value.status_code, refused.value.code) == (410, "task_purged")

    # A row just as old that was never claimed before was never sent: it is sent as usual.
    never_sent = _enqueue(biz, tables, ns, 4)
    _age(biz, tables, [never_sent], lost=False)
    before = task_count(orbit, ns.name)

    stats = make_relay().run_once()

    assert task_count(orbit, ns.name) == before + 1  # only `never_sent` made a task
    row = outbox.get(forgotten)
    assert row.state == "NEEDS_RECONCILE" and "key window" in (row.last_error or ""), row.last_error
    assert submission_count(orbit, forgotten_key) == 0  # never sent again
    assert (outbox.get(known).state, outbox.get(known).orbit_task_id) == ("DELIVERED", task_of[known])
    assert (outbox.get(purged).state, outbox.get(purged).orbit_task_id) == ("DELIVERED", task_of[purged])
    assert outbox.get(never_sent).state == "DELIVERED"
    assert stats.needs_reconcile == 1

    # Reconcile does not resend it either: too old to trust a "not found".
    with OrbitClient(orbit.base_url, api_key=ns.keys["read"]) as client:
        [decision] = outbox.reconcile(client, actor="test")
    assert (decision.decision, decision.applied) == ("too_old", False)
    assert task_count(orbit, ns.name) == before + 1


def test_reconcile_by_default_uses_the_server_s_key_window_not_a_week(
    biz: Biz, tables: OutboxTables, make_database: DatabaseFactory
) -> None:
    """A server that keeps keys 1 h: a row 2 h old with no task for its key must not be re-sent by a
    reconcile given no --key-window (the key may have been purged after it made a task). It was: the
    default was 7 days whatever the server said."""
    with run_server(make_database("sqlite"), submission_key_ttl_seconds=3600) as short:
        keys = short.add_namespace("short", ("default",))
        outbox = Outbox(biz.engine, tables=tables)
        with biz.engine.begin() as conn:
            old = enqueue(conn, namespace="short", queue="default", handler="h", params={}, tables=tables).id
            young = enqueue(
                conn, namespace="short", queue="default", handler="h", params={}, tables=tables
            ).id
        o = tables.outbox
        with biz.engine.begin() as conn:
            conn.execute(o.update().values(state="NEEDS_RECONCILE"))
            created = conn.scalar(sa.select(o.c.created_at).where(o.c.id == old))
            conn.execute(o.update().where(o.c.id == old).values(created_at=created - timedelta(hours=2)))
        with OrbitClient(short.base_url, api_key=keys["read"]) as client:
            decisions = {d.row_id: d.decision for d in outbox.reconcile(client, actor="test")}
        assert decisions == {old: "too_old", young: "pending"}
        assert outbox.get(old).state == "NEEDS_RECONCILE" and outbox.get(young).state == "PENDING"
