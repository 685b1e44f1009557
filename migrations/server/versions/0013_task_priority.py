"""Task priority (issue 31 item 5): ``tasks.priority`` (-100..100, default 0) and the claim index in lease
order, ``ix_tasks_claim_order (queue_id, status, priority DESC, available_at, id)``, replacing
``ix_tasks_claim (queue_id, status, available_at)``.

The new index is created before the old one is dropped: on MySQL/MariaDB an index whose first column is
``queue_id`` must always back the ``tasks.queue_id`` foreign key. Existing tasks get priority 0, so the
lease order of a queue without priorities is unchanged (oldest due first).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "tasks", sa.Column("priority", sa.SmallInteger, nullable=False, server_default=sa.text("0"))
    )
    op.create_index(
        "ix_tasks_claim_order",
        "tasks",
        ["queue_id", "status", sa.text("priority DESC"), "available_at", "id"],
    )
    op.drop_index("ix_tasks_claim", table_name="tasks")


def downgrade() -> None:
    op.create_index("ix_tasks_claim", "tasks", ["queue_id", "status", "available_at"])
    op.drop_index("ix_tasks_claim_order", table_name="tasks")
    with op.batch_alter_table("tasks") as batch:
        batch.drop_column("priority")
