"""``apply(event)``: a fulfilment result applied to its order through the ORM, in the atomic block of
the event's inbox row (``manage.py orbit_consume --handler examples.django_shop.orders.results:apply``)."""

from __future__ import annotations

import json

from django.db import connection
from django.db.models import F

from examples.django_shop.orders.models import Order
from orbit_client import ResultEvent


def _order_id(event: ResultEvent) -> int | None:
    if isinstance(event.result, dict) and isinstance(event.result.get("order_id"), int):
        return int(event.result["order_id"])
    # A failed task has no result: its outbox row, delivered as this task, holds the order's id.
    with connection.cursor() as cursor:
        cursor.execute("SELECT params FROM orbit_outbox WHERE orbit_task_id = %s", [event.task_id])
        found = cursor.fetchone()
    params = json.loads(found[0]) if found and isinstance(found[0], str) else (found[0] if found else None)
    args = params.get("args") if isinstance(params, dict) else None
    return int(args[0]) if args and isinstance(args[0], int) else None


def apply(event: ResultEvent) -> None:
    order_id = _order_id(event)
    if order_id is None:
        return  # not one of ours
    status = {"SUCCEEDED": "COMPLETED", "NEEDS_REVIEW": "NEEDS_REVIEW"}.get(event.status.value, "FAILED")
    receipt = event.result.get("receipt", "") if isinstance(event.result, dict) else ""
    Order.objects.filter(pk=order_id).update(
        status=status, receipt=receipt, results_applied=F("results_applied") + 1
    )
