"""Retention: indexes for purges and inventories, and the purge_runs audit (DESIGN §9, §7 of seed 001).

Revision ID: 0007
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

Timestamp = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_index("ix_tasks_finished", "tasks", ["status", "finished_at", "id"])
    op.create_index("ix_submission_keys_expires", "submission_keys", ["expires_at"])
    op.create_index("ix_event_deliveries_event", "event_deliveries", ["event_id", "state"])
    op.create_index("ix_schedule_occurrences_task", "schedule_occurrences", ["task_id"])
    op.create_table(
        "purge_runs",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.Column("tasks_before", Timestamp, nullable=True),
        sa.Column("keys_before", Timestamp, nullable=True),
        sa.Column("batch_size", sa.Integer, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("counts", sa.JSON(none_as_null=True), nullable=False),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("started_at", Timestamp, nullable=False),
        sa.Column("finished_at", Timestamp, nullable=True),
    )
    op.create_index("ix_purge_runs_started", "purge_runs", ["started_at"])


def downgrade() -> None:
    op.drop_index("ix_purge_runs_started", table_name="purge_runs")
    op.drop_table("purge_runs")
    op.drop_index("ix_schedule_occurrences_task", table_name="schedule_occurrences")
    # MySQL/MariaDB use ix_event_deliveries_event for the event_id foreign key once it exists; the
    # foreign key's own index is created back when it is dropped.
    op.drop_index("ix_event_deliveries_event", table_name="event_deliveries")
    op.drop_index("ix_submission_keys_expires", table_name="submission_keys")
    op.drop_index("ix_tasks_finished", table_name="tasks")
