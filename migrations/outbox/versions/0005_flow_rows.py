"""Flow rows: an outbox row may start a flow instance instead of a task (README "Starting flows from the outbox").

``kind`` is ``task`` (every existing row) or ``flow``; ``flow`` names the flow of a ``flow`` row.

Revision ID: outbox_0005
Revises: outbox_0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import mysql

revision = "outbox_0005"
down_revision = "outbox_0004"
branch_labels = None
depends_on = None


def _ascii(length: int) -> sa.types.TypeEngine[str]:
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, charset="ascii", collation="ascii_bin"), "mysql", "mariadb"
    )


def _name() -> str:
    attributes = context.config.attributes
    x = context.get_x_argument(as_dictionary=True)
    return str(attributes.get("outbox_table") or x.get("table") or "orbit_outbox")


def upgrade() -> None:
    # A constant server default: existing rows become ``task`` rows without a table rewrite on
    # MariaDB 10.3+ and PostgreSQL 11+ (instant ADD COLUMN).
    with op.batch_alter_table(_name()) as batch:
        batch.add_column(sa.Column("kind", _ascii(8), nullable=False, server_default="task"))
        batch.add_column(sa.Column("flow", _ascii(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table(_name()) as batch:
        batch.drop_column("flow")
        batch.drop_column("kind")
