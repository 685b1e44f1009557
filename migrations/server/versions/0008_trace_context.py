"""Trace context: tasks.traceparent and tasks.tracestate (W3C Trace Context, README "Tracing").

Result events carry their task's trace context by joining ``tasks`` when delivered, so
``result_events`` is unchanged.

Revision ID: 0008
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def Key(length: int) -> sa.types.TypeEngine[str]:
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, charset="ascii", collation="ascii_bin"), "mysql", "mariadb"
    )


def upgrade() -> None:
    with op.batch_alter_table("tasks") as batch:
        batch.add_column(sa.Column("traceparent", Key(55), nullable=True))
        batch.add_column(sa.Column("tracestate", Key(512), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tasks") as batch:
        batch.drop_column("tracestate")
        batch.drop_column("traceparent")
