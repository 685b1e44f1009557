"""Ordering keys in commit order: the keys table, ``ordering_seq`` on outbox rows, and ``ABANDONED``.

``enqueue`` now locks a per-key row of ``<table>_keys`` (an upsert) in the caller's transaction and
numbers the key's rows from it, so the relay sends one key's rows in commit order, not id order
(README "Ordering keys"). Existing rows with an ordering key are numbered by id (the order they
were sent in so far). Rows an operator abandoned (``DEAD`` with ``last_error`` "abandoned by
operator: ...") become ``ABANDONED``, which no longer holds back later rows of their key.

Revision ID: outbox_0003
Revises: outbox_0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import mysql

revision = "outbox_0003"
down_revision = "outbox_0002"
branch_labels = None
depends_on = None


def _text(length: int) -> sa.types.TypeEngine[str]:
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
    )


def _names() -> tuple[str, str]:
    attributes = context.config.attributes
    x = context.get_x_argument(as_dictionary=True)
    name = str(attributes.get("outbox_table") or x.get("table") or "orbit_outbox")
    keys = str(attributes.get("outbox_keys_table") or x.get("keys_table") or f"{name}_keys")
    return name, keys


def upgrade() -> None:
    name, keys = _names()
    op.add_column(name, sa.Column("ordering_seq", sa.BigInteger, nullable=True))
    op.create_table(
        keys,
        sa.Column("ordering_key", _text(255), primary_key=True),
        sa.Column("last_seq", sa.BigInteger, nullable=False),
    )
    op.drop_index(f"ix_{name}_ordering", table_name=name)
    op.create_index(f"ix_{name}_ordering", name, ["ordering_key", "state", "ordering_seq"])
    outbox = sa.table(
        name,
        sa.column("id", sa.BigInteger),
        sa.column("ordering_key", sa.String),
        sa.column("ordering_seq", sa.BigInteger),
        sa.column("state", sa.String),
        sa.column("last_error", sa.Text),
    )
    key_rows = sa.table(keys, sa.column("ordering_key", sa.String), sa.column("last_seq", sa.BigInteger))
    bind = op.get_bind()
    rows = bind.execute(
        sa.select(outbox.c.id, outbox.c.ordering_key)
        .where(outbox.c.ordering_key.is_not(None))
        .order_by(outbox.c.ordering_key, outbox.c.id)
    ).all()
    last: dict[str, int] = {}
    updates = []
    for row_id, key in rows:
        last[key] = last.get(key, 0) + 1
        updates.append({"b_id": row_id, "b_seq": last[key]})
    if updates:
        bind.execute(
            sa.update(outbox)
            .where(outbox.c.id == sa.bindparam("b_id"))
            .values(ordering_seq=sa.bindparam("b_seq")),
            updates,
        )
        bind.execute(key_rows.insert(), [{"ordering_key": k, "last_seq": n} for k, n in last.items()])
    bind.execute(
        sa.update(outbox)
        .where(outbox.c.state == "DEAD", outbox.c.last_error.like("abandoned by operator:%"))
        .values(state="ABANDONED")
    )


def downgrade() -> None:
    name, keys = _names()
    outbox = sa.table(name, sa.column("state", sa.String))
    op.get_bind().execute(sa.update(outbox).where(outbox.c.state == "ABANDONED").values(state="DEAD"))
    op.drop_index(f"ix_{name}_ordering", table_name=name)
    op.create_index(f"ix_{name}_ordering", name, ["ordering_key", "state", "id"])
    op.drop_table(keys)
    op.drop_column(name, "ordering_seq")
