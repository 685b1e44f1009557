"""Task execution: task_attempts (leases with fencing), and the task columns leases, cancel and backoff need.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

Timestamp = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def Key(length: int) -> sa.types.TypeEngine[str]:
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, charset="ascii", collation="ascii_bin"), "mysql", "mariadb"
    )


def upgrade() -> None:
    with op.batch_alter_table("tasks") as batch:
        batch.add_column(sa.Column("current_attempt_id", Key(36), nullable=True))
        batch.add_column(sa.Column("cancel_reason", sa.Text, nullable=True))
        batch.add_column(sa.Column("backoff_base_seconds", sa.Float, nullable=True))
        batch.add_column(sa.Column("backoff_cap_seconds", sa.Float, nullable=True))
    op.create_index("ix_tasks_status_deadline", "tasks", ["status", "deadline"])
    op.create_table(
        "task_attempts",
        sa.Column("id", Key(36), primary_key=True),
        sa.Column("task_id", Key(36), sa.ForeignKey("tasks.id"), nullable=False),
        sa.Column("generation", sa.Integer, nullable=False),
        sa.Column("lease_token_hash", Key(64), nullable=False),
        sa.Column("worker_id", sa.String(255), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("lease_seconds", sa.Float, nullable=False),
        sa.Column("leased_at", Timestamp, nullable=False),
        sa.Column("started_at", Timestamp, nullable=True),
        sa.Column("heartbeat_at", Timestamp, nullable=True),
        sa.Column("lease_expires_at", Timestamp, nullable=False),
        sa.Column("finished_at", Timestamp, nullable=True),
        sa.Column("result", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("error", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("late_report", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("late_reported_at", Timestamp, nullable=True),
        sa.UniqueConstraint("task_id", "generation", name="uq_task_attempts_task_generation"),
    )
    op.create_index("ix_task_attempts_status_expiry", "task_attempts", ["status", "lease_expires_at"])


def downgrade() -> None:
    op.drop_index("ix_task_attempts_status_expiry", table_name="task_attempts")
    op.drop_table("task_attempts")
    op.drop_index("ix_tasks_status_deadline", table_name="tasks")
    with op.batch_alter_table("tasks") as batch:
        batch.drop_column("backoff_cap_seconds")
        batch.drop_column("backoff_base_seconds")
        batch.drop_column("cancel_reason")
        batch.drop_column("current_attempt_id")
