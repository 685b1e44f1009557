# examples/outbox_example.py
"""Commit an order and the intent to fulfil it in one transaction; a relay turns the intent into one task."""

import os

import sqlalchemy as sa

from outbox_adapter import DeliveredRow, Outbox, OutboxSettings, Relay, enqueue

os.environ.setdefault("ORBIT_OUTBOX_DATABASE_URL", "sqlite:///./shop.db")
settings = OutboxSettings()  # reads ORBIT_OUTBOX_DATABASE_URL, ORBIT_URL and ORBIT_API_KEY
engine = sa.create_engine(settings.database_url)

metadata = sa.MetaData()
orders = sa.Table(
    "orders",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("status", sa.String(20), nullable=False),
    sa.Column("orbit_task_id", sa.String(64)),
)
metadata.create_all(engine)
Outbox(engine).migrate()  # the outbox tables; in production: orbit-outbox migrate --database-url ...

# 1. The order and the outbox row commit together: a rollback leaves nothing to send.
with engine.begin() as conn:
    order_id = conn.execute(orders.insert().values(status="PENDING")).inserted_primary_key[0]
    entry = enqueue(
        conn,
        namespace="shop",
        queue="fulfilment",
        handler="orders.fulfil",
        params={"order_id": order_id},
        # No idempotency_key: a new UUID, fixed for the row's life (every resend reuses it) and never repeated.
        # A key built from order_id would repeat after a database reset, and the server would replay the old task.
        business_ref=f"order:{order_id}",
    )


# 2. The relay (usually `orbit-outbox relay` in its own processes) submits it with that key.
def link(conn: sa.Connection, row: DeliveredRow) -> None:
    """Runs in the transaction that marks the row DELIVERED: the order learns its task id atomically."""
    order = int(row.business_ref.split(":")[1]) if row.business_ref else None
    conn.execute(orders.update().where(orders.c.id == order).values(orbit_task_id=row.orbit_task_id))


with Relay.from_settings(settings, engine=engine, on_delivered=link) as relay:
    stats = relay.run_once()

with engine.connect() as conn:
    order_row = conn.execute(sa.select(orders).where(orders.c.id == order_id)).one()
print(entry.id, entry.idempotency_key, order_row.orbit_task_id, stats.delivered)
