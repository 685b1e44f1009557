"""Worker liveness: the last lease call of each worker on each queue, for the console's overview (issue 23).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

Timestamp = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def Key(length: int) -> sa.types.TypeEngine[str]:
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, charset="ascii", collation="ascii_bin"), "mysql", "mariadb"
    )


def upgrade() -> None:
    op.create_table(
        "worker_sightings",
        sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), primary_key=True),
        sa.Column("queue", Key(64), primary_key=True),
        sa.Column("worker_id", sa.String(255), primary_key=True),
        sa.Column("last_seen_at", Timestamp, nullable=False),
    )
    op.create_index("ix_worker_sightings_seen", "worker_sightings", ["namespace_id", "queue", "last_seen_at"])


def downgrade() -> None:
    op.drop_index("ix_worker_sightings_seen", table_name="worker_sightings")
    op.drop_table("worker_sightings")
