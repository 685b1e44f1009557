"""Schedules: schedules, schedule_occurrences and schedule_events (DESIGN §9, §4/§5 of seed 001).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0004"
down_revision = "0003"
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
        "schedules",
        sa.Column("id", Key(36), primary_key=True),
        sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
        sa.Column("name", Key(64), nullable=False),
        sa.Column("queue_id", sa.BigInteger, sa.ForeignKey("queues.id"), nullable=False),
        sa.Column("handler", sa.String(255), nullable=False),
        sa.Column("params", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("options", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("cron", sa.String(255), nullable=True),
        sa.Column("interval_seconds", sa.Integer, nullable=True),
        sa.Column("timezone", sa.String(64), nullable=False),
        sa.Column("start_at", Timestamp, nullable=False),
        sa.Column("end_at", Timestamp, nullable=True),
        sa.Column("next_fire_at", Timestamp, nullable=True),
        sa.Column("misfire_policy", sa.String(16), nullable=False),
        sa.Column("catch_up_max", sa.Integer, nullable=False),
        sa.Column("misfire_grace_seconds", sa.Integer, nullable=False),
        sa.Column("overlap_policy", sa.String(16), nullable=False),
        sa.Column("paused", sa.Boolean, nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("last_fired_at", Timestamp, nullable=True),
        sa.Column("last_task_id", Key(36), nullable=True),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("updated_at", Timestamp, nullable=False),
        sa.UniqueConstraint("namespace_id", "name", name="uq_schedules_namespace_name"),
    )
    op.create_index("ix_schedules_due", "schedules", ["paused", "next_fire_at"])
    op.create_table(
        "schedule_occurrences",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("schedule_id", Key(36), sa.ForeignKey("schedules.id"), nullable=False),
        sa.Column("scheduled_at", Timestamp, nullable=False),
        sa.Column("schedule_version", sa.Integer, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("task_id", Key(36), nullable=True),
        sa.Column("skip_reason", sa.String(255), nullable=True),
        sa.Column("misfired", sa.Boolean, nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.UniqueConstraint("schedule_id", "scheduled_at", name="uq_schedule_occurrences_schedule_time"),
    )
    op.create_table(
        "schedule_events",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
        sa.Column("schedule_id", Key(36), nullable=False),
        sa.Column("schedule_name", Key(64), nullable=False),
        sa.Column("event", sa.String(32), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("actor", sa.String(255), nullable=True),
        sa.Column("data", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("created_at", Timestamp, nullable=False),
    )
    op.create_index("ix_schedule_events_schedule", "schedule_events", ["schedule_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_schedule_events_schedule", table_name="schedule_events")
    op.drop_table("schedule_events")
    op.drop_table("schedule_occurrences")
    op.drop_index("ix_schedules_due", table_name="schedules")
    op.drop_table("schedules")
