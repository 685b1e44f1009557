"""Results back into ``business_orders``, exactly once per event (the inbox does the dedup).

Run by ``orbit-outbox consume --subscription order-results --handler
examples.order_service.consumer:apply_result``: the consumer calls
:func:`apply_result` inside the business transaction that records the event in
``orbit_inbox``, so a redelivered event changes nothing.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from orbit_client import ResultEvent, TaskStatus

from .db import business_orders
from .flow import SETTLE_HANDLER

__all__ = ["HANDLER", "apply_result"]

HANDLER = "orders.fulfil"
#: What a settled flow may make of an order (``orders.settle``'s ``status``).
_SETTLED = ("COMPLETED", "FAILED", "CANCELLED", "NEEDS_REVIEW")


class UnknownOrder(LookupError):
    """The event names a fulfilment key no order has (it is not acked; it comes back later)."""


def _reason(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error.get("type") or error)[:1000]
    return str(error)[:1000] if error is not None else "no reason given"


def apply_result(conn: sa.Connection, event: ResultEvent) -> None:
    """Apply one result event of an ``orders.fulfil`` task to its order.

    ``SUCCEEDED`` → ``COMPLETED`` with the reservation, payment and receipt ids;
    ``FAILED`` / ``CANCELLED`` → ``FAILED`` with the reason; ``NEEDS_REVIEW`` →
    ``NEEDS_REVIEW`` (a later review outcome arrives as another event). The update
    is conditional: an order already final is left alone, and so is an order already
    linked to another task.

    A task created by manual retry (``event.retry_of`` set) carries the fulfilment key of
    its chain's first task: its outcome replaces its predecessor's, so an order ``FAILED``
    by the predecessor becomes ``COMPLETED`` when the retry succeeds. A late event of the
    predecessor never overwrites the successor's outcome.

    The ``orders.settle`` step of the fulfilment flow (README "The order service as a flow") is
    applied by :func:`apply_settlement`; the flow's other steps change nothing here.

    Raises:
        UnknownOrder: no order has the event's fulfilment key (or, for a settle step, its order id).
    """
    if event.handler == SETTLE_HANDLER:
        apply_settlement(conn, event)
        return
    if event.handler != HANDLER:
        return
    key_match = business_orders.c.fulfilment_key == event.idempotency_key
    if conn.scalar(sa.select(business_orders.c.id).where(key_match)) is None:
        raise UnknownOrder(f"no order with fulfilment key {event.idempotency_key!r} (event {event.id})")
    orders = business_orders.c
    open_states = orders.status.in_(("PENDING", "NEEDS_REVIEW"))
    # This task's own outcome, or the first outcome of the order (no task linked yet).
    mine = sa.and_(open_states, sa.or_(orders.task_id.is_(None), orders.task_id == event.task_id))
    if event.retry_of is not None:  # a manual retry replaces its predecessor's outcome, FAILED included
        mine = sa.or_(
            mine,
            sa.and_(
                orders.task_id == event.retry_of, orders.status.in_(("PENDING", "NEEDS_REVIEW", "FAILED"))
            ),
        )
    values: dict[str, Any] = {"task_id": event.task_id, "updated_at": sa.func.current_timestamp()}
    if event.status is TaskStatus.SUCCEEDED:
        result = event.result if isinstance(event.result, dict) else {}
        values.update(
            status="COMPLETED",
            reservation_id=result.get("reservation_id"),
            payment_id=result.get("payment_id"),
            receipt_id=result.get("receipt_id"),
            failure_reason=None,
        )
    elif event.status in (TaskStatus.FAILED, TaskStatus.CANCELLED):
        values.update(status="FAILED", failure_reason=f"{event.status.value.lower()}: {_reason(event.error)}")
    elif event.status is TaskStatus.NEEDS_REVIEW:
        values.update(
            status="NEEDS_REVIEW", failure_reason="the outcome is unknown; an operator must review it"
        )
    else:
        return
    conn.execute(business_orders.update().where(key_match, mine).values(values))


def apply_settlement(conn: sa.Connection, event: ResultEvent) -> None:
    """Apply the outcome a fulfilment flow settled on (the ``orders.settle`` step's result) to its order.

    ``{order_id, flow_instance_id, status, reservation_id, payment_id, receipt_id, reason}``; the
    update is conditional on the order still being ``PENDING``, so a redelivered event (which the
    inbox already dedups) or a late one never changes a final order. A settle task that did not
    succeed carries no outcome and changes nothing (the instance's own status tells an operator).

    Raises:
        UnknownOrder: no order has the result's ``order_id``.
    """
    result = event.result if isinstance(event.result, dict) else None
    if event.status is not TaskStatus.SUCCEEDED or result is None or result.get("status") not in _SETTLED:
        return
    orders = business_orders.c
    mine = orders.order_id == result.get("order_id")
    if conn.scalar(sa.select(orders.id).where(mine)) is None:
        raise UnknownOrder(f"no order {result.get('order_id')!r} (settle event {event.id})")
    conn.execute(
        business_orders.update()
        .where(mine, orders.status == "PENDING")
        .values(
            status=result["status"],
            flow_instance_id=result.get("flow_instance_id"),
            reservation_id=result.get("reservation_id"),
            payment_id=result.get("payment_id"),
            receipt_id=result.get("receipt_id"),
            failure_reason=None if result["status"] == "COMPLETED" else str(result.get("reason"))[:1000],
            updated_at=sa.func.current_timestamp(),
        )
    )
