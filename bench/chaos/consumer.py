"""The result handler of a chaos run: the order service's :func:`apply_result`, plus a follow-up.

``orbit-outbox consume --handler bench.chaos.consumer:apply_result`` calls it in the transaction
that records the event in the inbox. Besides updating the order, it

- logs the application in ``chaos_applications`` (no unique key: if the inbox ever let an event
  through twice, two rows show it);
- for a ``SUCCEEDED`` order, enqueues the follow-up ``orders.confirm`` (queue ``confirmations``)
  in the same transaction, with a fresh idempotency key: a second application would enqueue a
  second follow-up, which the checks count.
"""

from __future__ import annotations

import sqlalchemy as sa

from examples.order_service import consumer as order_consumer
from orbit_client import ResultEvent, TaskStatus
from outbox_adapter import enqueue

__all__ = ["CONFIRM_HANDLER", "CONFIRM_QUEUE", "applications", "apply_result", "chaos_metadata"]

CONFIRM_QUEUE, CONFIRM_HANDLER = "confirmations", "orders.confirm"

chaos_metadata = sa.MetaData()
applications = sa.Table(
    "chaos_applications",
    chaos_metadata,
    sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
    sa.Column("event_id", sa.String(36), nullable=False, index=True),
    sa.Column("task_id", sa.String(36), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("fulfilment_key", sa.String(255), nullable=True),
)


def apply_result(conn: sa.Connection, event: ResultEvent) -> None:
    """Apply ``event`` to its order (:func:`examples.order_service.consumer.apply_result`), log it,
    and enqueue the confirmation of a completed order (see the module docstring)."""
    order_consumer.apply_result(conn, event)
    conn.execute(
        applications.insert().values(
            event_id=event.id,
            task_id=event.task_id,
            status=event.status.value,
            fulfilment_key=event.idempotency_key,
        )
    )
    if event.handler == order_consumer.HANDLER and event.status is TaskStatus.SUCCEEDED:
        order_id = str(event.idempotency_key).removesuffix(":fulfil")
        enqueue(
            conn, namespace="shop", queue=CONFIRM_QUEUE, handler=CONFIRM_HANDLER, business_ref=f"confirm:{order_id}",
            params={"order_id": order_id, "payment_id": (event.result or {}).get("payment_id")},
        )  # fmt: skip
