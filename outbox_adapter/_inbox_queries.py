"""The inbox's statements (SQLAlchemy Core), README "Inbox".

The result consumer's business transaction first looks for the event (:func:`inbox_contains`),
then inserts its row (:func:`insert_inbox_row`), whose unique ``(subscription, event_id)`` makes a
concurrent duplicate wait for, then fail on, the first one's commit (DESIGN §5). As in
``_queries``: each takes a ``Connection`` already inside a transaction and never begins, commits
or rolls back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_adapter._db import now_sql, record_of
from outbox_adapter._models import InboxRow
from outbox_adapter._queries import (
    clip,
)
from outbox_adapter._tables import InboxOutcome, OutboxTables

__all__ = [
    "get_inbox_row",
    "inbox_contains",
    "inbox_contains_statement",
    "insert_inbox_row",
    "insert_inbox_statement",
    "list_inbox",
    "mark_inbox_processed",
    "mark_processed_statement",
]


def inbox_contains_statement(t: OutboxTables, *, subscription: str, event_id: str) -> sa.Select[Any]:
    """The ``SELECT`` finding ``event_id``'s inbox row for ``subscription`` (a row: it is there)."""
    i = t.inbox
    return sa.select(i.c.id).where(i.c.subscription == subscription, i.c.event_id == event_id)


def inbox_contains(conn: Connection, t: OutboxTables, *, subscription: str, event_id: str) -> bool:
    """Whether ``event_id`` is already in the inbox for ``subscription`` (applied or recorded ``FAILED``)."""
    stmt = inbox_contains_statement(t, subscription=subscription, event_id=event_id)
    return conn.execute(stmt).first() is not None


def insert_inbox_statement(
    t: OutboxTables,
    dialect_name: str,
    *,
    event_id: str,
    subscription: str,
    namespace: str,
    task_id: str,
    status: str,
    outcome: InboxOutcome,
    delivery_count: int,
    error: str | None = None,
    event: Mapping[str, Any] | None = None,
    processed: bool = False,
) -> sa.Insert:
    """The ``INSERT`` of one event's inbox row (:func:`insert_inbox_row`; the Django consumer runs it
    through Django's connection): one definition of the row."""
    now = now_sql(dialect_name)
    return t.inbox.insert().values(
        event_id=event_id,
        subscription=subscription,
        namespace=namespace,
        task_id=task_id,
        status=status,
        outcome=outcome.value,
        delivery_count=delivery_count,
        error=clip(error),
        event=dict(event) if event is not None else None,
        received_at=now,
        processed_at=now if processed else None,
    )


def insert_inbox_row(
    conn: Connection,
    t: OutboxTables,
    *,
    event_id: str,
    subscription: str,
    namespace: str,
    task_id: str,
    status: str,
    outcome: InboxOutcome,
    delivery_count: int,
    error: str | None = None,
    event: Mapping[str, Any] | None = None,
    processed: bool = False,
) -> int:
    """Insert the inbox row of one event; ``received_at`` (and with ``processed``, ``processed_at``)
    from the database clock. Returns its id.

    Raises:
        sqlalchemy.exc.IntegrityError: the event is already there for this subscription
            (on PostgreSQL the transaction is then aborted: the caller rolls back).
    """
    result = conn.execute(
        insert_inbox_statement(
            t,
            conn.dialect.name,
            event_id=event_id,
            subscription=subscription,
            namespace=namespace,
            task_id=task_id,
            status=status,
            outcome=outcome,
            delivery_count=delivery_count,
            error=error,
            event=event,
            processed=processed,
        )
    )
    key = result.inserted_primary_key
    assert key is not None and key[0] is not None
    return int(key[0])


def mark_processed_statement(t: OutboxTables, dialect_name: str, row_id: int) -> sa.Update:
    """The ``UPDATE`` setting ``processed_at`` of inbox row ``row_id`` to the database's now."""
    i = t.inbox
    return sa.update(i).where(i.c.id == row_id).values(processed_at=now_sql(dialect_name))


def mark_inbox_processed(conn: Connection, t: OutboxTables, row_id: int) -> None:
    """Set ``processed_at`` of inbox row ``row_id`` to the database's now (the handler returned)."""
    conn.execute(mark_processed_statement(t, conn.dialect.name, row_id))


def get_inbox_row(conn: Connection, t: OutboxTables, *, subscription: str, event_id: str) -> InboxRow | None:
    """The inbox row of ``event_id`` for ``subscription``, or ``None``."""
    i = t.inbox
    stmt = sa.select(i).where(i.c.subscription == subscription, i.c.event_id == event_id)
    found = conn.execute(stmt).mappings().first()
    return record_of(InboxRow, found) if found is not None else None


def list_inbox(
    conn: Connection,
    t: OutboxTables,
    *,
    outcome: str | None,
    subscription: str | None = None,
    limit: int,
    after_id: int = 0,
) -> list[InboxRow]:
    """Inbox rows with ``id > after_id`` (of ``outcome`` / ``subscription`` when given), by id, at most ``limit``."""
    i = t.inbox
    stmt = sa.select(i).where(i.c.id > after_id).order_by(i.c.id).limit(limit)
    if outcome is not None:
        stmt = stmt.where(i.c.outcome == outcome)
    if subscription is not None:
        stmt = stmt.where(i.c.subscription == subscription)
    return [record_of(InboxRow, m) for m in conn.execute(stmt).mappings()]
