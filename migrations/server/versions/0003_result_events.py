"""Result events: result_events, subscriptions and event_deliveries (DESIGN §4, §6.2 of seed 001).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

Timestamp = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def Key(length: int) -> sa.types.TypeEngine[str]:
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, charset="ascii", collation="ascii_bin"), "mysql", "mariadb"
    )


def upgrade() -> None:
    op.create_table(
        "result_events",
        sa.Column("id", Key(36), primary_key=True),
        sa.Column("task_id", Key(36), sa.ForeignKey("tasks.id"), nullable=False),
        sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
        sa.Column("queue_id", sa.BigInteger, sa.ForeignKey("queues.id"), nullable=False),
        sa.Column("handler", sa.String(255), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("result", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("error", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("state_version", sa.Integer, nullable=False),
        sa.Column("occurred_at", Timestamp, nullable=False),
        sa.UniqueConstraint("task_id", "state_version", name="uq_result_events_task_version"),
    )
    op.create_index("ix_result_events_namespace_occurred", "result_events", ["namespace_id", "occurred_at"])
    op.create_table(
        "subscriptions",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
        sa.Column("name", Key(64), nullable=False),
        sa.Column("queues", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.UniqueConstraint("namespace_id", "name", name="uq_subscriptions_namespace_name"),
    )
    op.create_table(
        "event_deliveries",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("subscription_id", sa.BigInteger, sa.ForeignKey("subscriptions.id"), nullable=False),
        sa.Column("event_id", Key(36), sa.ForeignKey("result_events.id"), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("delivery_count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("leased_by", sa.String(255), nullable=True),
        sa.Column("lease_expires_at", Timestamp, nullable=True),
        sa.Column("acked_at", Timestamp, nullable=True),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.UniqueConstraint("subscription_id", "event_id", name="uq_event_deliveries_subscription_event"),
    )
    op.create_index("ix_event_deliveries_claim", "event_deliveries", ["subscription_id", "state", "id"])

    # Result events name the idempotency key that created their task: found by task id.
    op.create_index("ix_submission_keys_task", "submission_keys", ["task_id"])


def downgrade() -> None:
    op.drop_index("ix_submission_keys_task", table_name="submission_keys")
    op.drop_index("ix_event_deliveries_claim", table_name="event_deliveries")
    op.drop_table("event_deliveries")
    op.drop_table("subscriptions")
    op.drop_index("ix_result_events_namespace_occurred", table_name="result_events")
    op.drop_table("result_events")
