"""Queue gates and concurrency limits: queue_gates, concurrency_permits, queue_events and the
tasks' concurrency_key (DESIGN §9; §3, §5 and invariant 12 of seed 001).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

Timestamp = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def Key(length: int) -> sa.types.TypeEngine[str]:
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, charset="ascii", collation="ascii_bin"), "mysql", "mariadb"
    )


def upgrade() -> None:
    with op.batch_alter_table("tasks") as batch:
        batch.add_column(sa.Column("concurrency_key", Key(255), nullable=True))
        batch.add_column(sa.Column("holds_permit", sa.Boolean, nullable=False, server_default=sa.false()))
    op.create_table(
        "queue_gates",
        sa.Column(
            "queue_id", sa.BigInteger, sa.ForeignKey("queues.id"), primary_key=True, autoincrement=False
        ),
        sa.Column("paused", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("max_concurrency_per_key", sa.Integer, nullable=True),
        sa.Column("max_concurrency", sa.Integer, nullable=True),
        sa.Column("control_version", sa.Integer, nullable=False, server_default="1"),
        sa.Column("updated_at", Timestamp, nullable=False),
        sa.Column("updated_by", sa.String(255), nullable=True),
    )
    # Every existing queue gets its (open, unlimited) gate.
    op.execute(
        "INSERT INTO queue_gates (queue_id, paused, control_version, updated_at) "
        "SELECT id, false, 1, created_at FROM queues"
    )
    op.create_table(
        "concurrency_permits",
        sa.Column("attempt_id", Key(36), primary_key=True),
        sa.Column("queue_id", sa.BigInteger, nullable=False),
        sa.Column("concurrency_key", Key(255), nullable=True),
        sa.Column("task_id", Key(36), nullable=False),
        sa.Column("granted_at", Timestamp, nullable=False),
    )
    op.create_index(
        "ix_concurrency_permits_queue_key", "concurrency_permits", ["queue_id", "concurrency_key"]
    )
    op.create_table(
        "queue_events",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
        sa.Column("queue_id", sa.BigInteger, nullable=False),
        sa.Column("queue_name", Key(64), nullable=False),
        sa.Column("event", sa.String(32), nullable=False),
        sa.Column("control_version", sa.Integer, nullable=False),
        sa.Column("actor", sa.String(255), nullable=True),
        sa.Column("data", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("created_at", Timestamp, nullable=False),
    )
    op.create_index("ix_queue_events_queue", "queue_events", ["queue_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_queue_events_queue", table_name="queue_events")
    op.drop_table("queue_events")
    op.drop_index("ix_concurrency_permits_queue_key", table_name="concurrency_permits")
    op.drop_table("concurrency_permits")
    op.drop_table("queue_gates")
    with op.batch_alter_table("tasks") as batch:
        batch.drop_column("holds_permit")
        batch.drop_column("concurrency_key")
