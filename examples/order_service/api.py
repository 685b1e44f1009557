"""The order API: ``POST /orders`` writes the order and its outbox row in one transaction.

    python -m examples.order_service.api --database-url URL [--port 8000]

``POST /orders {sku, quantity, amount, customer?}`` with an ``Idempotency-Key``
header: 201 with the new order; 200 with the same order when the key was seen
before (a client retry), 422 if the key was used for a different order.
``GET /orders/{order_id}``: the order and, once Orbit has answered, its ids.

With ``--flow`` (or ``ORDER_FULFILMENT=flow``) an order starts an instance of the
``order-fulfilment`` flow (:mod:`.flow`) through the outbox instead of one task.
"""

from __future__ import annotations

import argparse
import os
import uuid
from decimal import Decimal
from typing import Annotated, Any

import sqlalchemy as sa
import uvicorn
from fastapi import FastAPI, Header, HTTPException, Response
from pydantic import BaseModel, Field
from sqlalchemy.engine import Engine

from outbox_adapter import enqueue, enqueue_flow

from . import flow as fulfilment_flow
from .db import business_engine, business_orders

try:  # optional: with opentelemetry-api, each order's transaction is the root of its trace
    from opentelemetry import trace as _trace
except ImportError:  # pragma: no cover - the otel extra is not installed
    _trace = None  # type: ignore[assignment]

__all__ = ["OrderRequest", "create_app", "main"]

NAMESPACE, QUEUE, HANDLER = "shop", "fulfilment", "orders.fulfil"


class OrderRequest(BaseModel):
    sku: str = Field(min_length=1, max_length=100)
    quantity: int = Field(ge=1, le=10_000)
    amount: Decimal = Field(gt=0, max_digits=12, decimal_places=2)
    customer: str | None = Field(default=None, max_length=200)


def _order_json(row: Any) -> dict[str, Any]:
    return {
        "order_id": row.order_id,
        "status": row.status,
        "sku": row.sku,
        "quantity": row.quantity,
        "amount": f"{row.amount:.2f}",
        "customer": row.customer,
        "task_id": row.task_id,
        "flow_instance_id": row.flow_instance_id,
        "reservation_id": row.reservation_id,
        "payment_id": row.payment_id,
        "receipt_id": row.receipt_id,
        "failure_reason": row.failure_reason,
    }


def _insert_order(conn: sa.Connection, order: OrderRequest, request_key: str, *, as_flow: bool) -> Any:
    order_id = f"ord_{uuid.uuid4().hex[:20]}"
    fulfilment_key = f"{order_id}:fulfil"
    conn.execute(
        business_orders.insert().values(
            order_id=order_id, request_key=request_key, customer=order.customer, sku=order.sku,
            quantity=order.quantity, amount=order.amount, status="PENDING", fulfilment_key=fulfilment_key,
        )
    )  # fmt: skip
    params = {
        "order_id": order_id,
        "sku": order.sku,
        "quantity": order.quantity,
        "amount": f"{order.amount:.2f}",
    }
    if as_flow:  # the fulfilment flow's instance, started by the relay (README "The order service as a flow")
        enqueue_flow(
            conn, namespace=NAMESPACE, flow=fulfilment_flow.FLOW_NAME, input={**params, "customer": order.customer},
            idempotency_key=fulfilment_key, business_ref=f"order:{order_id}",
        )  # fmt: skip
    else:
        enqueue(
            conn, namespace=NAMESPACE, queue=QUEUE, handler=HANDLER, idempotency_key=fulfilment_key,
            business_ref=f"order:{order_id}", options={"retry_safe": True, "max_attempts": 5}, params=params,
        )  # fmt: skip
    return conn.execute(sa.select(business_orders).where(business_orders.c.order_id == order_id)).one()


def create_app(engine: Engine, *, as_flow: bool = False) -> FastAPI:
    """The order API over ``engine``; with ``as_flow``, each order starts an instance of the
    ``order-fulfilment`` flow instead of one ``orders.fulfil`` task (both through the outbox)."""
    app = FastAPI(title="Order service (Orbit reference)")

    @app.post("/orders", status_code=201)
    def place_order(
        order: OrderRequest,
        response: Response,
        idempotency_key: Annotated[str, Header(alias="Idempotency-Key")],
    ) -> dict[str, Any]:
        """Write the order (PENDING) and the intent to fulfil it, together or not at all."""
        if _trace is None:
            return _place(order, response, idempotency_key)
        # The span ``enqueue`` finds active: the task's trace starts here (README "Tracing").
        with _trace.get_tracer("examples.order_service").start_as_current_span("POST /orders") as span:
            placed = _place(order, response, idempotency_key)
            span.set_attribute("order.id", placed["order_id"])
            span.set_attribute("order.replayed", response.status_code == 200)
            return placed

    def _place(order: OrderRequest, response: Response, idempotency_key: str) -> dict[str, Any]:
        same_key = business_orders.c.request_key == idempotency_key
        try:
            with engine.begin() as conn:
                existing = conn.execute(sa.select(business_orders).where(same_key)).first()
                if existing is None:
                    return _order_json(_insert_order(conn, order, idempotency_key, as_flow=as_flow))
        except sa.exc.IntegrityError:  # a concurrent retry of the same request won the unique key
            with engine.begin() as conn:
                existing = conn.execute(sa.select(business_orders).where(same_key)).one()
        same = (existing.sku, existing.quantity, existing.amount) == (order.sku, order.quantity, order.amount)
        if not same:
            raise HTTPException(422, "this Idempotency-Key was used for a different order")
        response.status_code = 200
        return _order_json(existing)

    @app.get("/orders/{order_id}")
    def get_order(order_id: str) -> dict[str, Any]:
        with engine.begin() as conn:
            row = conn.execute(
                sa.select(business_orders).where(business_orders.c.order_id == order_id)
            ).first()
        if row is None:
            raise HTTPException(404, f"no order {order_id}")
        return _order_json(row)

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve the order API.")
    parser.add_argument("--database-url", default=os.environ.get("ORDER_DATABASE_URL"))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--flow",
        action="store_true",
        default=os.environ.get("ORDER_FULFILMENT") == "flow",
        help='fulfil each order as an instance of the order-fulfilment flow (README "The order service as a flow")',
    )
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error("missing --database-url (or ORDER_DATABASE_URL)")
    uvicorn.run(
        create_app(business_engine(args.database_url), as_flow=args.flow),
        host=args.host,
        port=args.port,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
