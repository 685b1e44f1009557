"""Initial server schema: namespaces, api_keys, queues, tasks, submission_keys, task_events.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0001"
down_revision = None
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
        "namespaces",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("name", Key(64), nullable=False, unique=True),
        sa.Column("created_at", Timestamp, nullable=False),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("key_hash", Key(64), nullable=False, unique=True),
        sa.Column("key_prefix", Key(16), nullable=False),
        sa.Column("label", sa.String(255), nullable=True),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("revoked_at", Timestamp, nullable=True),
    )
    op.create_table(
        "queues",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
        sa.Column("name", Key(64), nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.UniqueConstraint("namespace_id", "name", name="uq_queues_namespace_name"),
    )
    op.create_table(
        "tasks",
        sa.Column("id", Key(36), primary_key=True),
        sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
        sa.Column("queue_id", sa.BigInteger, sa.ForeignKey("queues.id"), nullable=False),
        sa.Column("handler", sa.String(255), nullable=False),
        sa.Column("params", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("state_version", sa.Integer, nullable=False),
        sa.Column("attempt_count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("max_attempts", sa.Integer, nullable=False),
        sa.Column("retry_safe", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("available_at", Timestamp, nullable=False),
        sa.Column("deadline", Timestamp, nullable=True),
        sa.Column("cancel_requested", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("result", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("error", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("retry_of", Key(36), nullable=True, unique=True),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("updated_at", Timestamp, nullable=False),
        sa.Column("finished_at", Timestamp, nullable=True),
    )
    op.create_index("ix_tasks_claim", "tasks", ["queue_id", "status", "available_at"])
    op.create_index("ix_tasks_namespace_created", "tasks", ["namespace_id", "created_at"])
    op.create_table(
        "submission_keys",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
        sa.Column("idempotency_key", Key(255), nullable=False),
        sa.Column("request_digest", Key(64), nullable=False),
        sa.Column("task_id", Key(36), nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("expires_at", Timestamp, nullable=False),
        sa.UniqueConstraint("namespace_id", "idempotency_key", name="uq_submission_keys_namespace_key"),
    )
    op.create_table(
        "task_events",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("task_id", Key(36), sa.ForeignKey("tasks.id"), nullable=False),
        sa.Column("state_version", sa.Integer, nullable=False),
        sa.Column("event", sa.String(32), nullable=False),
        sa.Column("from_status", sa.String(16), nullable=True),
        sa.Column("to_status", sa.String(16), nullable=True),
        sa.Column("actor", sa.String(255), nullable=True),
        sa.Column("reason", sa.Text, nullable=True),
        sa.Column("data", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("created_at", Timestamp, nullable=False),
    )
    op.create_index("ix_task_events_task", "task_events", ["task_id", "id"])


def downgrade() -> None:
    op.drop_table("task_events")
    op.drop_table("submission_keys")
    op.drop_table("tasks")
    op.drop_table("queues")
    op.drop_table("api_keys")
    op.drop_table("namespaces")
