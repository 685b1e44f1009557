"""Operator operations (status, purge), the Alembic history and the claim's index, on each database."""

from __future__ import annotations

from datetime import timedelta

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from outbox_adapter import Outbox, OutboxTables, enqueue, head_revision
from outbox_adapter import _queries as q
from outbox_adapter._db import db_now
from tests.integration.outbox.conftest import Biz


def _rows(biz: Biz, tables: OutboxTables, n: int) -> list[int]:
    with biz.engine.begin() as conn:
        return [
            enqueue(conn, namespace="shop", queue="q", handler="h", params={}, tables=tables).id
            for _ in range(n)
        ]


def test_purge_deletes_only_old_delivered_rows_in_batches(biz: Biz, tables: OutboxTables) -> None:
    ids = _rows(biz, tables, 8)
    o = tables.outbox
    with biz.engine.begin() as conn:
        now = db_now(conn)
        old, recent = now - timedelta(days=8), now - timedelta(days=1)
        for row_id, state, delivered in zip(
            ids,
            [
                "DELIVERED",
                "DELIVERED",
                "DELIVERED",
                "DELIVERED",
                "PENDING",
                "DEAD",
                "NEEDS_RECONCILE",
                "PENDING",
            ],
            [old, old, old, recent, None, None, None, None],
            strict=True,
        ):
            conn.execute(sa.update(o).where(o.c.id == row_id).values(state=state, delivered_at=delivered,
                                                                    created_at=old, updated_at=old))  # fmt: skip
            q.add_events(
                conn, tables, [q.event_values(row_id, "PENDING", state, reason="setup", actor="t", now=old)]
            )
    outbox = Outbox(biz.engine, tables=tables)
    batches: list[int] = []
    assert outbox.purge_delivered(older_than_seconds=7 * 86400, batch_size=2, on_batch=batches.append) == 3
    assert batches == [2, 1]
    left = {r.id: r.state for r in outbox.list_rows()}
    assert left == dict(
        zip(ids[3:], ["DELIVERED", "PENDING", "DEAD", "NEEDS_RECONCILE", "PENDING"], strict=True)
    )
    assert outbox.events(ids[0]) == [] and len(outbox.events(ids[3])) == 1


def test_status_counts_rows_and_reports_ages_from_the_database_clock(biz: Biz, tables: OutboxTables) -> None:
    outbox = Outbox(biz.engine, tables=tables)
    empty = outbox.status()
    assert empty.counts == {"PENDING": 0, "DELIVERED": 0, "DEAD": 0, "NEEDS_RECONCILE": 0, "ABANDONED": 0}
    assert empty.oldest_pending_age_seconds is None and empty.next_due_at is None
    ids = _rows(biz, tables, 3)
    with biz.engine.begin() as conn:
        conn.execute(sa.update(tables.outbox).where(tables.outbox.c.id == ids[0]).values(
            state="DEAD", created_at=db_now(conn) - timedelta(hours=1)))  # fmt: skip
        conn.execute(sa.update(tables.outbox).where(tables.outbox.c.id == ids[1]).values(
            created_at=db_now(conn) - timedelta(seconds=90)))  # fmt: skip
    status = outbox.status()
    assert status.counts["PENDING"] == 2 and status.counts["DEAD"] == 1 and status.leased == 0
    assert status.oldest_pending_age_seconds is not None and 90 <= status.oldest_pending_age_seconds < 120
    assert status.next_due_at is not None and status.next_due_at <= status.now
    assert status.to_dict()["now"].endswith("Z")


def test_the_alembic_history_creates_exactly_the_tables(biz: Biz, tables: OutboxTables) -> None:
    with biz.engine.connect() as conn:
        ours = {
            tables.name,
            tables.events_name,
            tables.inbox_name,
            tables.keys_name,
        }  # others' tables share it
        context = MigrationContext.configure(
            conn, opts={"include_name": lambda name, kind, _parent: kind != "table" or name in ours}
        )
        diffs = compare_metadata(context, tables.metadata)
        names = set(sa.inspect(conn).get_table_names())
    assert diffs == []
    assert {tables.name, tables.events_name, tables.inbox_name, tables.keys_name,
            f"{tables.name}_alembic_version"} <= names  # fmt: skip
    assert Outbox(biz.engine, tables=tables).migrate() == head_revision() == "outbox_0005"  # idempotent


def test_the_claim_is_served_by_its_index_without_a_filesort(biz: Biz, tables: OutboxTables) -> None:
    if biz.kind != "mariadb":
        pytest.skip("EXPLAIN's 'Using filesort' is MySQL/MariaDB's")
    _rows(biz, tables, 300)
    o = tables.outbox
    with biz.engine.begin() as conn:
        conn.execute(sa.update(o).where(o.c.id % 3 == 0).values(state="DELIVERED"))
        conn.exec_driver_sql(f"ANALYZE TABLE {o.name}")
        claim = (
            sa.select(o.c.id)
            .where(o.c.state == "PENDING", o.c.available_at <= db_now(conn))
            .order_by(o.c.available_at, o.c.id)
            .limit(50)
        )
        sql = str(claim.compile(conn, compile_kwargs={"literal_binds": True}))
        plan = conn.exec_driver_sql(f"EXPLAIN {sql}").mappings().all()
    assert plan[0]["key"] == f"ix_{o.name}_claim", plan
    assert "filesort" not in (plan[0]["Extra"] or ""), plan
