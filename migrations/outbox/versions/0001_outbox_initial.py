"""Outbox tables: orbit_outbox and orbit_outbox_events (names configurable).

Revision ID: outbox_0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import mysql

revision = "outbox_0001"
down_revision = None
branch_labels = None
depends_on = None

Timestamp = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _ascii(length: int) -> sa.types.TypeEngine[str]:
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, charset="ascii", collation="ascii_bin"), "mysql", "mariadb"
    )


def _text(length: int) -> sa.types.TypeEngine[str]:
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
    )


def _names() -> tuple[str, str]:
    attributes = context.config.attributes
    x = context.get_x_argument(as_dictionary=True)
    name = str(attributes.get("outbox_table") or x.get("table") or "orbit_outbox")
    events = str(attributes.get("outbox_events_table") or x.get("events_table") or f"{name}_events")
    return name, events


def upgrade() -> None:
    name, events = _names()
    op.create_table(
        name,
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("idempotency_key", _ascii(255), nullable=False),
        sa.Column("namespace", _ascii(64), nullable=False),
        sa.Column("queue", _ascii(64), nullable=False),
        sa.Column("handler", _ascii(255), nullable=False),
        sa.Column("params", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("options", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("ordering_key", _text(255), nullable=True),
        sa.Column("business_ref", _text(255), nullable=True),
        sa.Column("state", _ascii(20), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("send_count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("max_attempts", sa.Integer, nullable=True),
        sa.Column("available_at", Timestamp, nullable=False),
        sa.Column("lease_owner", sa.String(255), nullable=True),
        sa.Column("lease_token", _ascii(36), nullable=True),
        sa.Column("lease_expires_at", Timestamp, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("last_status_code", sa.Integer, nullable=True),
        sa.Column("orbit_task_id", _ascii(64), nullable=True),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("updated_at", Timestamp, nullable=False),
        sa.Column("delivered_at", Timestamp, nullable=True),
        sa.UniqueConstraint("idempotency_key", name=f"uq_{name}_idempotency_key"),
    )
    op.create_index(f"ix_{name}_claim", name, ["state", "available_at", "id"])
    op.create_index(f"ix_{name}_ordering", name, ["ordering_key", "state", "id"])
    op.create_index(f"ix_{name}_delivered", name, ["state", "delivered_at"])
    op.create_index(f"ix_{name}_business_ref", name, ["business_ref"])
    op.create_table(
        events,
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("outbox_id", sa.BigInteger, nullable=False),
        sa.Column("from_state", _ascii(20), nullable=True),
        sa.Column("to_state", _ascii(20), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.Column("orbit_task_id", _ascii(64), nullable=True),
        sa.Column("at", Timestamp, nullable=False),
    )
    op.create_index(f"ix_{events}_outbox_id", events, ["outbox_id", "id"])


def downgrade() -> None:
    name, events = _names()
    op.drop_table(events)
    op.drop_table(name)
