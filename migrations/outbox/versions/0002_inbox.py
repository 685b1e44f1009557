"""Inbox table: orbit_inbox (name configurable), where result events are deduplicated (DESIGN §5).

Revision ID: outbox_0002
Revises: outbox_0001
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import mysql

revision = "outbox_0002"
down_revision = "outbox_0001"
branch_labels = None
depends_on = None

Timestamp = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _ascii(length: int) -> sa.types.TypeEngine[str]:
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, charset="ascii", collation="ascii_bin"), "mysql", "mariadb"
    )


def _name() -> str:
    """The inbox table's name: as given, else derived from the outbox's as ``OutboxTables`` does."""
    attributes = context.config.attributes
    x = context.get_x_argument(as_dictionary=True)
    given = attributes.get("inbox_table") or x.get("inbox_table")
    if given:
        return str(given)
    outbox = str(attributes.get("outbox_table") or x.get("table") or "orbit_outbox")
    return outbox[: -len("outbox")] + "inbox" if outbox.endswith("outbox") else f"{outbox}_inbox"


def upgrade() -> None:
    name = _name()
    op.create_table(
        name,
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("event_id", _ascii(64), nullable=False),
        sa.Column("subscription", _ascii(64), nullable=False),
        sa.Column("namespace", _ascii(64), nullable=False),
        sa.Column("task_id", _ascii(64), nullable=False),
        sa.Column("status", _ascii(20), nullable=False),
        sa.Column("outcome", _ascii(20), nullable=False),
        sa.Column("delivery_count", sa.Integer, nullable=False),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("event", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("received_at", Timestamp, nullable=False),
        sa.Column("processed_at", Timestamp, nullable=True),
        sa.UniqueConstraint("subscription", "event_id", name=f"uq_{name}_event"),
    )
    op.create_index(f"ix_{name}_task_id", name, ["task_id"])
    op.create_index(f"ix_{name}_outcome", name, ["outcome", "id"])


def downgrade() -> None:
    op.drop_table(_name())
