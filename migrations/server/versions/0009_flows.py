"""Flows: definitions, versions, instances, tokens, steps, timers, signals, internal events, history,
and the three task columns that link a step's task to its token (DESIGN §12; seed 001 §4-§6.3, seed 002).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

Timestamp = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def Key(length: int) -> sa.types.TypeEngine[str]:
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, charset="ascii", collation="ascii_bin"), "mysql", "mariadb"
    )


def Json() -> sa.types.TypeEngine[object]:
    return sa.JSON(none_as_null=True)


def upgrade() -> None:
    with op.batch_alter_table("tasks") as batch:
        batch.add_column(sa.Column("flow_instance_id", Key(36), nullable=True))
        batch.add_column(sa.Column("flow_token_id", Key(36), nullable=True))
        batch.add_column(sa.Column("flow_activation", sa.Integer, nullable=True))
    op.create_table(
        "flow_definitions",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
        sa.Column("name", Key(64), nullable=False),
        sa.Column("latest_version", sa.Integer, nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("updated_at", Timestamp, nullable=False),
        sa.UniqueConstraint("namespace_id", "name", name="uq_flow_definitions_namespace_name"),
    )
    op.create_table(
        "flow_versions",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("definition_id", sa.BigInteger, sa.ForeignKey("flow_definitions.id"), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("graph", Json(), nullable=False),
        sa.Column("digest", Key(64), nullable=False),
        sa.Column("description", sa.Text, nullable=True),
        sa.Column("published_at", Timestamp, nullable=False),
        sa.Column("published_by", sa.String(255), nullable=True),
        sa.UniqueConstraint("definition_id", "version", name="uq_flow_versions_definition_version"),
        sa.UniqueConstraint("definition_id", "digest", name="uq_flow_versions_definition_digest"),
    )
    op.create_table(
        "flow_instances",
        sa.Column("id", Key(36), primary_key=True),
        sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
        sa.Column("definition_id", sa.BigInteger, sa.ForeignKey("flow_definitions.id"), nullable=False),
        sa.Column("version_id", sa.BigInteger, sa.ForeignKey("flow_versions.id"), nullable=False),
        sa.Column("input", Json(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("paused", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("control_version", sa.Integer, nullable=False),
        sa.Column("state_version", sa.Integer, nullable=False),
        sa.Column("output", Json(), nullable=True),
        sa.Column("error", Json(), nullable=True),
        sa.Column("idempotency_key", Key(255), nullable=False),
        sa.Column("request_digest", Key(64), nullable=False),
        sa.Column("created_by", sa.String(255), nullable=True),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("updated_at", Timestamp, nullable=False),
        sa.Column("finished_at", Timestamp, nullable=True),
        sa.Column("traceparent", Key(55), nullable=True),
        sa.UniqueConstraint("namespace_id", "idempotency_key", name="uq_flow_instances_namespace_key"),
    )
    op.create_index(
        "ix_flow_instances_namespace_created", "flow_instances", ["namespace_id", "created_at", "id"]
    )
    op.create_table(
        "flow_tokens",
        sa.Column("id", Key(36), primary_key=True),
        sa.Column("instance_id", Key(36), sa.ForeignKey("flow_instances.id"), nullable=False),
        sa.Column("node_id", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("activation", sa.Integer, nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("parent_id", Key(36), nullable=True),
        sa.Column("children_open", sa.Integer, nullable=False, server_default="0"),
        sa.Column("task_id", Key(36), nullable=True),
        sa.Column("waiting_for", sa.String(80), nullable=True),
        sa.Column("fire_at", Timestamp, nullable=True),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("updated_at", Timestamp, nullable=False),
    )
    op.create_index("ix_flow_tokens_instance", "flow_tokens", ["instance_id", "created_at"])
    op.create_index("ix_flow_tokens_parent", "flow_tokens", ["parent_id"])
    op.create_index("ix_flow_tokens_state", "flow_tokens", ["state", "waiting_for"])
    op.create_table(
        "flow_steps",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("instance_id", Key(36), sa.ForeignKey("flow_instances.id"), nullable=False),
        sa.Column("token_id", Key(36), nullable=False),
        sa.Column("node_id", sa.String(64), nullable=False),
        sa.Column("activation", sa.Integer, nullable=False),
        sa.Column("round", sa.Integer, nullable=False, server_default="0"),
        sa.Column("task_id", Key(36), nullable=False, unique=True),
        sa.Column("status", sa.String(16), nullable=True),
        sa.Column("result", Json(), nullable=True),
        sa.Column("error", Json(), nullable=True),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("finished_at", Timestamp, nullable=True),
        sa.UniqueConstraint("token_id", "activation", "round", name="uq_flow_steps_token_activation_round"),
    )
    op.create_index("ix_flow_steps_instance", "flow_steps", ["instance_id", "id"])
    op.create_table(
        "flow_timers",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("instance_id", Key(36), sa.ForeignKey("flow_instances.id"), nullable=False),
        sa.Column("token_id", Key(36), nullable=False),
        sa.Column("activation", sa.Integer, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("round", sa.Integer, nullable=False, server_default="0"),
        sa.Column("fire_at", Timestamp, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("fired_at", Timestamp, nullable=True),
        sa.UniqueConstraint(
            "token_id", "activation", "kind", "round", name="uq_flow_timers_token_activation"
        ),
    )
    op.create_index("ix_flow_timers_due", "flow_timers", ["state", "fire_at"])
    op.create_index("ix_flow_timers_instance", "flow_timers", ["instance_id", "state"])
    op.create_table(
        "flow_signals",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("instance_id", Key(36), sa.ForeignKey("flow_instances.id"), nullable=False),
        sa.Column("identity", Key(255), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("payload", Json(), nullable=True),
        sa.Column("digest", Key(64), nullable=False),
        sa.Column("actor", sa.String(255), nullable=True),
        sa.Column("received_at", Timestamp, nullable=False),
        sa.Column("consumed_by_token", Key(36), nullable=True),
        sa.Column("consumed_activation", sa.Integer, nullable=True),
        sa.Column("consumed_at", Timestamp, nullable=True),
        sa.UniqueConstraint("instance_id", "identity", name="uq_flow_signals_instance_identity"),
    )
    op.create_index("ix_flow_signals_instance_name", "flow_signals", ["instance_id", "name", "consumed_at"])
    op.create_table(
        "flow_events",
        sa.Column("id", Key(36), primary_key=True),
        sa.Column("instance_id", Key(36), nullable=False),
        sa.Column("token_id", Key(36), nullable=False),
        sa.Column("activation", sa.Integer, nullable=False),
        sa.Column("task_id", Key(36), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("state_version", sa.Integer, nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("consumed_at", Timestamp, nullable=True),
        sa.Column("outcome", sa.String(16), nullable=True),
    )
    op.create_index("ix_flow_events_pending", "flow_events", ["consumed_at", "created_at"])
    op.create_index("ix_flow_events_instance", "flow_events", ["instance_id", "consumed_at"])
    op.create_table(
        "flow_history",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("instance_id", Key(36), nullable=False),
        sa.Column("at", Timestamp, nullable=False),
        sa.Column("event", sa.String(32), nullable=False),
        sa.Column("token_id", Key(36), nullable=True),
        sa.Column("node_id", sa.String(64), nullable=True),
        sa.Column("activation", sa.Integer, nullable=True),
        sa.Column("from_state", sa.String(16), nullable=True),
        sa.Column("to_state", sa.String(16), nullable=True),
        sa.Column("actor", sa.String(255), nullable=True),
        sa.Column("data", Json(), nullable=True),
    )
    op.create_index("ix_flow_history_instance", "flow_history", ["instance_id", "id"])


def downgrade() -> None:
    # Dropping a table drops its indexes (MySQL/MariaDB refuse to drop one a foreign key needs first).
    for table in (
        "flow_history", "flow_events", "flow_signals", "flow_timers", "flow_steps", "flow_tokens",
        "flow_instances", "flow_versions", "flow_definitions",
    ):  # fmt: skip
        op.drop_table(table)
    with op.batch_alter_table("tasks") as batch:
        batch.drop_column("flow_activation")
        batch.drop_column("flow_token_id")
        batch.drop_column("flow_instance_id")
