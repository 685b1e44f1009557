"""Flow retention: the tombstones of purged instances' start keys, and the index retention walks
finished instances by (README "Retention and the key window").

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

Timestamp = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def Key(length: int) -> sa.types.TypeEngine[str]:
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, charset="ascii", collation="ascii_bin"), "mysql", "mariadb"
    )


def upgrade() -> None:
    op.create_index("ix_flow_instances_finished", "flow_instances", ["status", "finished_at", "id"])
    op.create_table(
        "flow_start_tombstones",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
        sa.Column("idempotency_key", Key(255), nullable=False),
        sa.Column("request_digest", Key(64), nullable=False),
        sa.Column("instance_id", Key(36), nullable=False),
        sa.Column("finished_at", Timestamp, nullable=False),
        sa.Column("expires_at", Timestamp, nullable=False),
        sa.UniqueConstraint("namespace_id", "idempotency_key", name="uq_flow_start_tombstones_namespace_key"),
    )
    op.create_index("ix_flow_start_tombstones_expires", "flow_start_tombstones", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_flow_start_tombstones_expires", table_name="flow_start_tombstones")
    op.drop_table("flow_start_tombstones")
    op.drop_index("ix_flow_instances_finished", table_name="flow_instances")
