"""The statements an operator runs on the outbox (SQLAlchemy Core): the inventory (list, show,
status) and the audited repairs (retry, reconcile, resolve, abandon, purge). README "Operations".

As in ``_queries``: each takes a ``Connection`` already inside a transaction and never begins,
commits or rolls back; every state change is conditional on the state read, and its row count is
returned for the caller to check.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_adapter._db import aware_utc, db_now, record_of, to_aware_utc
from outbox_adapter._models import OutboxEvent, OutboxRow, OutboxStatus
from outbox_adapter._queries import (
    ABANDONED,
    DEAD,
    DELIVERED,
    NEEDS_RECONCILE,
    PENDING,
    PURGED,
    add_events,
    clip,
    event_values,
)
from outbox_adapter._tables import OutboxState, OutboxTables

__all__ = [
    "abandon_row",
    "count_by_state",
    "ids_of",
    "list_events",
    "list_rows",
    "purge_dead_batch",
    "purge_delivered_batch",
    "record_reconcile_mismatch",
    "record_reconciled_delivered",
    "record_reconciled_pending",
    "retry_dead_row",
    "rows_to_reconcile",
]


def list_rows(
    conn: Connection, t: OutboxTables, *, state: str | None, limit: int, after_id: int = 0
) -> list[OutboxRow]:
    """Rows in ``state`` (``None``: any) with ``id > after_id``, by id, at most ``limit``."""
    o = t.outbox
    stmt = sa.select(o).where(o.c.id > after_id).order_by(o.c.id).limit(limit)
    if state is not None:
        stmt = stmt.where(o.c.state == state)
    return [record_of(OutboxRow, m) for m in conn.execute(stmt).mappings()]


def list_events(conn: Connection, t: OutboxTables, row_id: int) -> list[OutboxEvent]:
    """The audit events of row ``row_id``, oldest first."""
    e = t.events
    stmt = sa.select(e).where(e.c.outbox_id == row_id).order_by(e.c.id)
    return [record_of(OutboxEvent, m) for m in conn.execute(stmt).mappings()]


def count_by_state(conn: Connection, t: OutboxTables) -> OutboxStatus:
    """Rows per state, live leases, the oldest pending row's age and the next due time."""
    o = t.outbox
    now = db_now(conn)
    counts = {s.value: 0 for s in OutboxState}
    for state, n in conn.execute(sa.select(o.c.state, sa.func.count()).group_by(o.c.state)):
        counts[state] = n
    pending = sa.select(
        sa.func.min(o.c.created_at),
        sa.func.min(o.c.available_at),
        sa.func.sum(sa.case((o.c.lease_expires_at > now, 1), else_=0)),
    ).where(o.c.state == PENDING)
    oldest, next_due, leased = conn.execute(pending).one()
    if isinstance(oldest, str):  # SQLite returns aggregates of datetimes as text
        oldest, next_due = datetime.fromisoformat(oldest), datetime.fromisoformat(next_due)
    return OutboxStatus(
        counts=counts,
        leased=int(leased or 0),
        oldest_pending_age_seconds=max(0.0, (now - oldest).total_seconds()) if oldest is not None else None,
        next_due_at=to_aware_utc(next_due),
        now=aware_utc(now),
    )


# --- repairs -----------------------------------------------------------------------------------------


def retry_dead_row(conn: Connection, t: OutboxTables, row_id: int, *, now: datetime) -> bool:
    """``DEAD`` → ``PENDING`` with the same key, a fresh budget, due now. ``False`` if not ``DEAD``."""
    o = t.outbox
    result = conn.execute(
        sa.update(o)
        .where(o.c.id == row_id, o.c.state == DEAD)
        .values(state=PENDING, attempts=0, available_at=now, updated_at=now)
    )
    return result.rowcount == 1


def rows_to_reconcile(conn: Connection, t: OutboxTables, *, after_id: int, limit: int) -> list[OutboxRow]:
    """``NEEDS_RECONCILE`` rows with ``id > after_id``, by id, at most ``limit``."""
    return list_rows(conn, t, state=NEEDS_RECONCILE, limit=limit, after_id=after_id)


def record_reconciled_delivered(
    conn: Connection, t: OutboxTables, row_id: int, *, now: datetime, task_id: str
) -> bool:
    """``NEEDS_RECONCILE`` → ``DELIVERED`` with the task found for the key. ``False`` if no longer there."""
    o = t.outbox
    result = conn.execute(
        sa.update(o)
        .where(o.c.id == row_id, o.c.state == NEEDS_RECONCILE)
        .values(state=DELIVERED, orbit_task_id=task_id, delivered_at=now, last_error=None, updated_at=now)
    )
    return result.rowcount == 1


def record_reconciled_pending(conn: Connection, t: OutboxTables, row_id: int, *, now: datetime) -> bool:
    """``NEEDS_RECONCILE`` → ``PENDING``, same key, fresh budget, due now. ``False`` if no longer there."""
    o = t.outbox
    result = conn.execute(
        sa.update(o)
        .where(o.c.id == row_id, o.c.state == NEEDS_RECONCILE)
        .values(state=PENDING, attempts=0, available_at=now, updated_at=now)
    )
    return result.rowcount == 1


def record_reconcile_mismatch(
    conn: Connection, t: OutboxTables, row_id: int, *, now: datetime, error: str
) -> bool:
    """Keep a ``NEEDS_RECONCILE`` row where it is, with why in ``last_error``."""
    o = t.outbox
    result = conn.execute(
        sa.update(o)
        .where(o.c.id == row_id, o.c.state == NEEDS_RECONCILE)
        .values(last_error=clip(error), updated_at=now)
    )
    return result.rowcount == 1


def abandon_row(
    conn: Connection,
    t: OutboxTables,
    row_id: int,
    *,
    now: datetime,
    error: str,
    from_state: str = NEEDS_RECONCILE,
) -> bool:
    """``from_state`` (``NEEDS_RECONCILE`` or ``DEAD``) → ``ABANDONED`` by an operator's decision, with
    why in ``last_error``. ``False`` if no longer ``from_state``."""
    o = t.outbox
    result = conn.execute(
        sa.update(o)
        .where(o.c.id == row_id, o.c.state == from_state)
        .values(state=ABANDONED, last_error=clip(error), updated_at=now)
    )
    return result.rowcount == 1


def purge_delivered_batch(conn: Connection, t: OutboxTables, *, cutoff: datetime, batch_size: int) -> int:
    """Delete up to ``batch_size`` ``DELIVERED`` rows delivered before ``cutoff``, and their events.

    Only ``DELIVERED`` rows are ever deleted (the ``DELETE`` repeats the condition).
    Returns the number of rows deleted.
    """
    o, e = t.outbox, t.events
    ids = list(
        conn.scalars(
            sa.select(o.c.id)
            .where(o.c.state == DELIVERED, o.c.delivered_at < cutoff)
            .order_by(o.c.delivered_at)
            .limit(batch_size)
        )
    )
    if not ids:
        return 0
    deleted = conn.execute(sa.delete(o).where(o.c.id.in_(ids), o.c.state == DELIVERED)).rowcount
    conn.execute(sa.delete(e).where(e.c.outbox_id.in_(ids)))
    return int(deleted)


def purge_dead_batch(
    conn: Connection,
    t: OutboxTables,
    *,
    cutoff: datetime,
    batch_size: int,
    reason: str,
    actor: str,
    now: datetime,
    row_ids: Collection[int] | None = None,
) -> list[int]:
    """Delete up to ``batch_size`` rows ``DEAD`` since before ``cutoff`` (``updated_at``), only rows of
    ``row_ids`` unless it is ``None``; return their ids.

    Each deleted row keeps its audit events and gets one more, ``DEAD`` → ``PURGED`` with
    ``reason`` and ``actor``, in the same transaction. The rows are locked when read (not on
    SQLite: single writer) and the ``DELETE`` repeats the condition; a row that left ``DEAD``
    in between (an operator's ``retry``) is neither deleted nor audited.
    """
    o = t.outbox
    stmt = (
        sa.select(o.c.id).where(o.c.state == DEAD, o.c.updated_at < cutoff).order_by(o.c.id).limit(batch_size)
    )
    if row_ids is not None:
        stmt = stmt.where(o.c.id.in_(sorted(row_ids)))
    if conn.dialect.name != "sqlite":
        stmt = stmt.with_for_update()
    ids = list(conn.scalars(stmt))
    if not ids:
        return []
    deleted = conn.execute(sa.delete(o).where(o.c.id.in_(ids), o.c.state == DEAD)).rowcount
    if deleted != len(ids):
        left = set(conn.scalars(sa.select(o.c.id).where(o.c.id.in_(ids))))
        ids = [i for i in ids if i not in left]
    add_events(conn, t, [event_values(i, DEAD, PURGED, reason=reason, actor=actor, now=now) for i in ids])
    return ids


def ids_of(rows: Iterable[OutboxRow]) -> list[int]:
    """The ids of ``rows``, in order."""
    return [r.id for r in rows]
