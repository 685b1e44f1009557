"""Handlers for ``orbit-outbox consume --handler tests.integration.outbox.inbox_handlers:...`` in tests.

The business table is named by the environment variable ``INBOX_TEST_ORDERS`` (read at each call).
"""

from __future__ import annotations

import os

import sqlalchemy as sa

from orbit_client import ResultEvent


def record(conn: sa.Connection, event: ResultEvent) -> None:
    """Set the order of the event's task to the task's status and count the application."""
    orders = sa.table(
        os.environ["INBOX_TEST_ORDERS"], sa.column("task_id"), sa.column("status"), sa.column("applied")
    )
    conn.execute(
        sa.update(orders)
        .where(orders.c.task_id == event.task_id)
        .values(status=event.status.value, applied=orders.c.applied + 1)
    )


def broken(conn: sa.Connection, event: ResultEvent) -> None:
    raise RuntimeError(f"handler bug on {event.id}")
