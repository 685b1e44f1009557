# examples/inbox_example.py
"""Bring Orbit's result events back into the business database: each applied once, with its follow-ups."""

import os
import time

import sqlalchemy as sa

from orbit_client import OrbitClient, ResultEvent, TaskStatus
from outbox_adapter import Outbox, ResultConsumer, enqueue

engine = sa.create_engine(os.environ.get("ORBIT_OUTBOX_DATABASE_URL", "sqlite:///./shop.db"))
metadata = sa.MetaData()
orders = sa.Table(
    "orders",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("status", sa.String(20), nullable=False),
    sa.Column("orbit_task_id", sa.String(64)),
)
metadata.create_all(engine)
Outbox(engine).migrate()  # the outbox and inbox tables (orbit_inbox)

STATUS = {TaskStatus.SUCCEEDED: "COMPLETED", TaskStatus.NEEDS_REVIEW: "NEEDS_REVIEW"}


def apply_result(conn: sa.Connection, event: ResultEvent) -> None:
    """Runs in the transaction that records the event in orbit_inbox: a redelivered event changes nothing."""
    status = STATUS.get(event.status, "FAILED")  # FAILED or CANCELLED
    changed = conn.execute(
        orders.update().where(orders.c.orbit_task_id == event.task_id).values(status=status)
    )
    if changed.rowcount == 0:
        return  # a result of another task on the queue (the other examples' tasks): not an order of ours
    if status == "COMPLETED":  # a follow-up task, committed with the order's change or not at all
        enqueue(
            conn,
            namespace=event.namespace,
            queue="fulfilment",
            handler="orders.send_receipt",
            params={"task_id": event.task_id},
            idempotency_key=f"receipt-{event.id}",
        )


def pending() -> int:
    """Orders sent to Orbit whose result has not been applied yet."""
    with engine.connect() as conn:
        waiting = sa.select(sa.func.count()).where(
            orders.c.status == "PENDING", orders.c.orbit_task_id.is_not(None)
        )
        return int(conn.scalar(waiting) or 0)


# Usually `orbit-outbox consume --subscription order-results --handler shop.results:apply_result`.
with OrbitClient(os.environ["ORBIT_URL"], api_key=os.environ["ORBIT_API_KEY"]) as client:  # a work key
    consumer = ResultConsumer(engine, client, "shop", "order-results", apply_result)
    applied = duplicates = acked = 0
    deadline = time.monotonic() + 60  # a worker must finish the tasks: the tutorial starts one before this
    while pending() and time.monotonic() < deadline:
        stats = consumer.run_once()  # lease, apply each event in its transaction, ack after the commit
        applied, duplicates, acked = (
            applied + stats.applied,
            duplicates + stats.duplicates,
            acked + stats.acked,
        )
        time.sleep(0.5)

with engine.connect() as conn:
    statuses = sorted(conn.scalars(sa.select(orders.c.status)))
print(applied, duplicates, acked, ",".join(statuses))
