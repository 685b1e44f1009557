"""Regression tests for what a review of the outbox paths found (issue 9, item 4), each replaying
its interleaving against real business databases (SQLite, MariaDB, PostgreSQL) and a real server.

- ``on_delivered`` raising a database error (or leaving the transaction unusable) leaves only
  its row to its lease; the rest of the batch is recorded and the relay keeps running.
- Once a send of a row had an unknown outcome, a later permanent refusal (before the server
  looked at the key) gives ``NEEDS_RECONCILE``, never ``DEAD``: single and batch paths.
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from orbit_client import OrbitClient
from outbox_adapter import Outbox, OutboxTables, enqueue
from outbox_adapter._db import db_now
from tests.integration.outbox.conftest import Biz, Namespace, RelayFactory
from tests.outbox_support import run_fault_proxy, submission_count, task_count
from tests.servers import RunningServer


def _enqueue(biz: Biz, tables: OutboxTables, ns: Namespace, n: int = 1, **kwargs: Any) -> list[int]:
    with biz.engine.begin() as conn:
        return [
            enqueue(conn, tables=tables, **{"namespace": ns.name, "queue": "default", "handler": "orders.fulfil",
                                            "params": {"i": i}, **kwargs}).id
            for i in range(n)
        ]  # fmt: skip


def _expire_leases(biz: Biz, tables: OutboxTables) -> None:
    with biz.engine.begin() as conn:
        now = db_now(conn)
        conn.execute(sa.update(tables.outbox).values(available_at=now, lease_expires_at=now))


# --- on_delivered: a database error in the hook --------------------------------------------------------


@pytest.mark.parametrize("swallowed", [False, True], ids=["raised", "caught-by-the-hook"])
def test_a_database_error_in_on_delivered_leaves_only_its_row_to_its_lease(
    biz: Biz, tables: OutboxTables, ns: Namespace, make_relay: RelayFactory, swallowed: bool
) -> None:
    links = sa.Table(f"{tables.name}_links", sa.MetaData(), sa.Column("ref", sa.String(40), primary_key=True))
    links.create(biz.engine)
    try:
        ids = _enqueue(biz, tables, ns, 3)
        with biz.engine.begin() as conn:
            conn.execute(links.insert().values(ref=f"row-{ids[1]}"))  # row 2's link exists: its insert fails
        broken = {ids[1]}

        def link(conn: sa.Connection, row: Any) -> None:
            if row.row_id not in broken:
                conn.execute(links.insert().values(ref=f"row-{row.row_id}"))
                return
            try:
                conn.execute(links.insert().values(ref=f"row-{row.row_id}"))
            except sa.exc.IntegrityError:
                if not swallowed:
                    raise
                # Caught: on PostgreSQL the transaction is now unusable (only a savepoint saves the batch).

        stats = make_relay(batch_size=10, on_delivered=link).run_once()  # does not raise
        outbox = Outbox(biz.engine, tables=tables)
        if swallowed and biz.kind != "postgres":  # the hook chose to ignore it; nothing is broken
            assert stats.delivered == 3
            return
        assert stats.delivered == 2
        rows = [outbox.get(i) for i in ids]
        assert [r.state for r in rows] == ["DELIVERED", "PENDING", "DELIVERED"]
        assert rows[1].lease_token is not None and rows[1].orbit_task_id is None  # left to its lease
        assert [len(outbox.events(i)) for i in ids] == [1, 0, 1]
        with biz.engine.connect() as conn:
            assert sorted(conn.scalars(sa.select(links.c.ref))) == sorted(f"row-{i}" for i in ids)

        broken.clear()  # the hook is fixed; the lease expires; the row is resent and the server replays
        with biz.engine.begin() as conn:
            conn.execute(links.delete().where(links.c.ref == f"row-{ids[1]}"))
        _expire_leases(biz, tables)
        again = make_relay(on_delivered=link).run_once()
        assert (again.delivered, again.replayed) == (1, 1)
        assert outbox.get(ids[1]).state == "DELIVERED"
    finally:
        links.drop(biz.engine)


# --- once unknown, never DEAD ------------------------------------------------------------------------------


def _refusal(status: int, code: str) -> dict[str, Any]:
    return {
        "title": "refused",
        "status": status,
        "code": code,
        "detail": "refused before the key was looked at",
    }


@pytest.mark.parametrize("path", ["batch", "single"])
def test_a_refusal_after_an_unknown_outcome_needs_reconcile_never_dead(
    biz: Biz, tables: OutboxTables, ns: Namespace, orbit: RunningServer, make_relay: RelayFactory, path: str
) -> None:
    [row_id] = _enqueue(biz, tables, ns)
    outbox = Outbox(biz.engine, tables=tables)
    key = outbox.get(row_id).idempotency_key
    with run_fault_proxy(orbit.base_url) as (url, proxy):
        if path == "single":  # an older server: no batch route, rows go one by one
            proxy.add("respond", path_contains="/tasks/batch", status=404, body=_refusal(404, "not_found"))
        # First send: the server accepts, the answer never comes (outcome unknown; the task exists).
        proxy.add("forward_then_drop", key=key, times=1)
        # Next send: refused before the key is looked at (a stricter body limit after an upgrade).
        proxy.add("respond", key=key, times=1, status=413, body=_refusal(413, "payload_too_large"))
        stats = make_relay(base_url=url, timeout=0.5).run_once()
    assert (stats.retried, stats.dead, stats.needs_reconcile) == (1, 0, 1)
    row = outbox.get(row_id)
    assert row.state == "NEEDS_RECONCILE" and row.last_status_code == 413
    assert "unknown outcome" in (row.last_error or "") and "reconcile" in (row.last_error or "")
    assert submission_count(orbit, key) == 1 and task_count(orbit, ns.name) == 1
    with OrbitClient(orbit.base_url, api_key=ns.keys["read"]) as client:
        [decision] = outbox.reconcile(client, actor="test")
    assert (decision.decision, decision.applied) == ("delivered", True)
    assert outbox.get(row_id).state == "DELIVERED"
