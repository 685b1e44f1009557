"""Trace context: the outbox row's traceparent and tracestate (W3C Trace Context, README "Tracing").

Revision ID: outbox_0004
Revises: outbox_0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import mysql

revision = "outbox_0004"
down_revision = "outbox_0003"
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
    with op.batch_alter_table(_name()) as batch:
        batch.add_column(sa.Column("traceparent", _ascii(55), nullable=True))
        batch.add_column(sa.Column("tracestate", _ascii(512), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table(_name()) as batch:
        batch.drop_column("tracestate")
        batch.drop_column("traceparent")
