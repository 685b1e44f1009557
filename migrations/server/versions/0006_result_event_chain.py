"""Result events of retried tasks: ``retry_of`` and the idempotency key of the chain's first task.

A task created by manual retry has no submission key of its own, so its result events carried
``idempotency_key: null`` and a receiver could not find the business record. Events now copy the
task's ``retry_of`` and, for a retried task, the key of the chain's first task (README "Consuming
results (inbox)"). Existing events are left as they are.

Revision ID: 0006
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def Key(length: int) -> sa.types.TypeEngine[str]:
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, charset="ascii", collation="ascii_bin"), "mysql", "mariadb"
    )


def upgrade() -> None:
    with op.batch_alter_table("result_events") as batch:
        batch.add_column(sa.Column("retry_of", Key(36), nullable=True))
        batch.add_column(sa.Column("idempotency_key", Key(255), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("result_events") as batch:
        batch.drop_column("idempotency_key")
        batch.drop_column("retry_of")
