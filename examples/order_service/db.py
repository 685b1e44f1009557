"""The business database of the order service: orders, the step journal, provider records.

``business_orders`` follows seed 000, with two changes: money is ``NUMERIC(12, 2)``
(never a float), and the order is linked to Orbit by its outbox idempotency key
(``fulfilment_key``), known when the order is written, and by the task id once known.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

__all__ = [
    "business_engine",
    "business_orders",
    "create_business_tables",
    "journal_entries",
    "metadata",
    "provider_calls",
    "provider_effects",
    "provider_tally",
]

metadata = sa.MetaData()
_Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_now = sa.func.current_timestamp()

business_orders = sa.Table(
    "business_orders",
    metadata,
    sa.Column("id", _Id, primary_key=True, autoincrement=True),
    sa.Column("order_id", sa.String(64), nullable=False, unique=True),
    # The client's Idempotency-Key of POST /orders: a retried request finds its order.
    sa.Column("request_key", sa.String(255), nullable=False, unique=True),
    sa.Column("customer", sa.String(200), nullable=True),
    sa.Column("sku", sa.String(100), nullable=False),
    sa.Column("quantity", sa.Integer, nullable=False),
    sa.Column("amount", sa.Numeric(12, 2), nullable=False),
    # PENDING, COMPLETED, FAILED, NEEDS_REVIEW, and CANCELLED (only when fulfilled as a flow)
    sa.Column("status", sa.String(32), nullable=False),
    sa.Column("fulfilment_key", sa.String(255), nullable=False, unique=True),
    sa.Column("task_id", sa.String(36), nullable=True),
    # Fulfilled as a flow (README "The order service as a flow"): the instance, once it has settled.
    sa.Column("flow_instance_id", sa.String(36), nullable=True),
    sa.Column("reservation_id", sa.String(64), nullable=True),
    sa.Column("payment_id", sa.String(64), nullable=True),
    sa.Column("receipt_id", sa.String(64), nullable=True),
    sa.Column("failure_reason", sa.Text, nullable=True),
    sa.Column("created_at", sa.DateTime, nullable=False, server_default=_now),
    sa.Column("updated_at", sa.DateTime, nullable=False, server_default=_now),
    sa.Index("ix_business_orders_status", "status"),
)

# One row per durable step that finished: unique (task, step) makes each step commit once (seed 000).
journal_entries = sa.Table(
    "journal_entries",
    metadata,
    sa.Column("id", _Id, primary_key=True, autoincrement=True),
    sa.Column("task_id", sa.String(36), nullable=False),
    sa.Column("step_index", sa.Integer, nullable=False),
    sa.Column("step_name", sa.String(255), nullable=False),
    sa.Column("status", sa.String(32), nullable=False),
    sa.Column("result", sa.JSON, nullable=True),
    sa.Column("generation", sa.Integer, nullable=False),
    sa.Column("created_at", sa.DateTime, nullable=False, server_default=_now),
    sa.UniqueConstraint("task_id", "step_index", name="uq_journal_task_step"),
)

# Every request a fake provider received, including replays and refusals: the audit trail.
provider_calls = sa.Table(
    "provider_calls",
    metadata,
    sa.Column("id", _Id, primary_key=True, autoincrement=True),
    sa.Column("provider", sa.String(16), nullable=False),  # reserve, charge, receipt
    sa.Column("order_id", sa.String(64), nullable=False),
    sa.Column("idempotency_key", sa.String(255), nullable=False),
    # The fencing token: the Orbit task and its attempt's generation.
    sa.Column("task_id", sa.String(36), nullable=False),
    sa.Column("generation", sa.Integer, nullable=False),
    sa.Column("outcome", sa.String(16), nullable=False),  # performed, replayed, declined, stale
    sa.Column("created_at", sa.DateTime, nullable=False, server_default=_now),
    sa.Index("ix_provider_calls_order", "order_id", "task_id"),
)

# The side effects themselves: what a real provider would have done (reserved, charged, issued).
provider_effects = sa.Table(
    "provider_effects",
    metadata,
    sa.Column("id", _Id, primary_key=True, autoincrement=True),
    sa.Column("provider", sa.String(16), nullable=False),
    sa.Column("order_id", sa.String(64), nullable=False),
    sa.Column("idempotency_key", sa.String(255), nullable=False, unique=True),
    sa.Column("result_id", sa.String(64), nullable=False),
    sa.Column("generation", sa.Integer, nullable=False),
    sa.Column("created_at", sa.DateTime, nullable=False, server_default=_now),
)


def business_engine(url: str) -> Engine:
    """An engine for the business database. On SQLite: WAL, a 30 s busy timeout, and
    ``BEGIN IMMEDIATE`` so the API, relay, worker and consumer processes queue for the
    one write lock instead of failing with "database is locked"."""
    if sa.make_url(url).get_backend_name() != "sqlite":
        return sa.create_engine(url, pool_pre_ping=True)
    engine = sa.create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

    @sa.event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: object) -> None:
        dbapi_connection.isolation_level = None
        dbapi_connection.execute("PRAGMA journal_mode=WAL")
        dbapi_connection.execute("PRAGMA busy_timeout=30000")

    @sa.event.listens_for(engine, "begin")
    def _begin(connection: sa.Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def create_business_tables(engine: Engine) -> None:
    """Create the business tables if missing (the example keeps them out of Alembic for brevity)."""
    metadata.create_all(engine)


def provider_tally(
    conn: Connection, order_ids: Collection[str]
) -> tuple[list[tuple[str, str, int]], Counter[str]]:
    """What the providers did for these orders, for the demo's invariants: ``(provider, order_id,
    effects)`` per provider and order, and the provider requests by outcome (performed, replayed,
    declined)."""
    effects = [
        (provider, order_id, int(n))
        for provider, order_id, n in conn.execute(
            sa.select(provider_effects.c.provider, provider_effects.c.order_id, sa.func.count())
            .where(provider_effects.c.order_id.in_(order_ids))
            .group_by(provider_effects.c.provider, provider_effects.c.order_id)
        )
    ]
    requests: Counter[str] = Counter(
        dict(
            conn.execute(
                sa.select(provider_calls.c.outcome, sa.func.count())
                .where(provider_calls.c.order_id.in_(order_ids))
                .group_by(provider_calls.c.outcome)
            ).all()
        )
    )
    return effects, requests
