# examples/inbox_example.py
"""Bring Orbit's result events back into the business database: each applied once, with its follow-ups."""

import os

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
    conn.execute(orders.update().where(orders.c.orbit_task_id == event.task_id).values(status=status))
    if status == "COMPLETED":  # a follow-up task, committed with the order's change or not at all
        enqueue(
            conn,
            namespace=event.namespace,
            queue="fulfilment",
            handler="orders.send_receipt",
            params={"task_id": event.task_id},
            idempotency_key=f"receipt-{event.id}",
        )


# Usually `orbit-outbox consume --subscription order-results --handler shop.results:apply_result`.
with OrbitClient(os.environ["ORBIT_URL"], api_key=os.environ["ORBIT_API_KEY"]) as client:  # a work key
    consumer = ResultConsumer(engine, client, "shop", "order-results", apply_result)
    stats = consumer.run_once()  # lease, apply each event in its transaction, ack after the commit

with engine.connect() as conn:
    statuses = sorted(conn.scalars(sa.select(orders.c.status)))
print(stats.applied, stats.duplicates, stats.acked, ",".join(statuses))
