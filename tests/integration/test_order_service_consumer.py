"""The order service's result handler on real business databases (SQLite, MariaDB): a manual retry's
result reaches the order of its chain's first task (regression, issue 9)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa

from examples.order_service.consumer import apply_result
from examples.order_service.db import business_orders, create_business_tables
from orbit_client import ResultEvent, TaskStatus
from tests.conftest import DatabaseFactory


def _event(
    task_id: str, status: TaskStatus, key: str, retry_of: str | None = None, **fields: Any
) -> ResultEvent:
    return ResultEvent(id=str(uuid.uuid4()), task_id=task_id, namespace="shop", queue="fulfilment",
                       handler="orders.fulfil", status=status, occurred_at=datetime.now(UTC), idempotency_key=key,
                       retry_of=retry_of, **fields)  # fmt: skip


@pytest.mark.parametrize(
    "kind",
    [
        "sqlite",
        pytest.param("mariadb", marks=pytest.mark.mariadb),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
def test_a_retried_tasks_success_completes_the_order_its_predecessor_failed(
    kind: str, make_database: DatabaseFactory
) -> None:
    engine = sa.create_engine(make_database(kind))
    try:
        create_business_tables(engine)
        key = "ord_1:fulfil"
        with engine.begin() as conn:
            conn.execute(business_orders.insert().values(order_id="ord_1", request_key="r1", sku="sku", quantity=1,
                                                         amount=10, status="PENDING", fulfilment_key=key))  # fmt: skip

        def order() -> Any:
            with engine.connect() as conn:
                return conn.execute(
                    sa.select(business_orders).where(business_orders.c.fulfilment_key == key)
                ).one()

        def apply(event: ResultEvent) -> None:
            with engine.begin() as conn:
                apply_result(conn, event)

        apply(_event("t1", TaskStatus.FAILED, key, error={"message": "card declined"}))
        assert (order().status, order().task_id) == ("FAILED", "t1")
        # An operator retried t1 as t2; t2 succeeded and charged: the order follows it.
        success = _event("t2", TaskStatus.SUCCEEDED, key, retry_of="t1", result={"payment_id": "p-9"})
        apply(success)
        assert (order().status, order().task_id, order().payment_id, order().failure_reason) == (
            "COMPLETED", "t2", "p-9", None,
        )  # fmt: skip
        apply(_event("t1", TaskStatus.FAILED, key, error="late copy"))  # a late event of t1 changes nothing
        assert (order().status, order().task_id) == ("COMPLETED", "t2")

        # Out of order: the retry's outcome arrives before its predecessor's; the predecessor's never overwrites it.
        with engine.begin() as conn:
            conn.execute(business_orders.update().values(status="PENDING", task_id=None))
        apply(_event("t4", TaskStatus.NEEDS_REVIEW, key, retry_of="t3"))
        apply(_event("t3", TaskStatus.FAILED, key, error="first try"))
        assert (order().status, order().task_id) == ("NEEDS_REVIEW", "t4")
    finally:
        engine.dispose()
