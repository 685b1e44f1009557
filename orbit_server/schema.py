"""The server's tables (SQLAlchemy Core). The Alembic history under
``migrations/server`` creates exactly these; a test compares the two.

Conventions (DESIGN §2): ``DATETIME(6)`` in UTC, ``JSON`` payloads, ``BIGINT``
ids where order matters, ``VARCHAR(36)`` UUIDs, and binary (case- and
accent-sensitive) collation for keys and names on MySQL/MariaDB.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

__all__ = [
    "BigId",
    "Key",
    "Timestamp",
    "api_keys",
    "event_deliveries",
    "metadata",
    "namespaces",
    "queues",
    "result_events",
    "schedule_events",
    "schedule_occurrences",
    "schedules",
    "submission_keys",
    "subscriptions",
    "task_attempts",
    "task_events",
    "tasks",
]

metadata = sa.MetaData()

#: Microsecond timestamps, stored naive in UTC.
Timestamp = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
#: Auto-increment ids: BIGINT, except SQLite where only INTEGER PRIMARY KEY auto-increments.
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def Key(length: int) -> sa.types.TypeEngine[str]:  # capitalised: it reads like a type
    """An ASCII string compared byte for byte (``ascii_bin`` on MySQL/MariaDB)."""
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, charset="ascii", collation="ascii_bin"), "mysql", "mariadb"
    )


namespaces = sa.Table(
    "namespaces",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("name", Key(64), nullable=False, unique=True),
    sa.Column("created_at", Timestamp, nullable=False),
)

api_keys = sa.Table(
    "api_keys",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
    sa.Column("role", sa.String(16), nullable=False),
    # SHA-256 of the whole key, hex. Keys are 256-bit random, so a fast hash is enough.
    sa.Column("key_hash", Key(64), nullable=False, unique=True),
    sa.Column("key_prefix", Key(16), nullable=False),
    sa.Column("label", sa.String(255), nullable=True),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Column("revoked_at", Timestamp, nullable=True),
)

queues = sa.Table(
    "queues",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
    sa.Column("name", Key(64), nullable=False),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.UniqueConstraint("namespace_id", "name", name="uq_queues_namespace_name"),
)

tasks = sa.Table(
    "tasks",
    metadata,
    sa.Column("id", Key(36), primary_key=True),
    sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
    sa.Column("queue_id", sa.BigInteger, sa.ForeignKey("queues.id"), nullable=False),
    sa.Column("handler", sa.String(255), nullable=False),
    sa.Column("params", sa.JSON(none_as_null=True), nullable=True),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("state_version", sa.Integer, nullable=False),
    sa.Column("attempt_count", sa.Integer, nullable=False, server_default="0"),
    sa.Column("max_attempts", sa.Integer, nullable=False),
    sa.Column("retry_safe", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("available_at", Timestamp, nullable=False),
    sa.Column("deadline", Timestamp, nullable=True),
    sa.Column("cancel_requested", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("result", sa.JSON(none_as_null=True), nullable=True),
    sa.Column("error", sa.JSON(none_as_null=True), nullable=True),
    # At most one direct successor per task (manual retry): enforced by the unique index.
    sa.Column("retry_of", Key(36), nullable=True, unique=True),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Column("updated_at", Timestamp, nullable=False),
    sa.Column("finished_at", Timestamp, nullable=True),
    # --- execution (revision 0002) ---
    # The newest attempt; no foreign key, to keep tasks <-> task_attempts acyclic.
    sa.Column("current_attempt_id", Key(36), nullable=True),
    sa.Column("cancel_reason", sa.Text, nullable=True),
    # Retry backoff of this task, in seconds; NULL means the server's default (1 s base, 300 s cap).
    sa.Column("backoff_base_seconds", sa.Float, nullable=True),
    sa.Column("backoff_cap_seconds", sa.Float, nullable=True),
    # --- trace context (revision 0008): W3C traceparent/tracestate as submitted, NULL when none ---
    sa.Column("traceparent", Key(55), nullable=True),
    sa.Column("tracestate", Key(512), nullable=True),
    # Serves the lease query: one queue, due tasks in order.
    sa.Index("ix_tasks_claim", "queue_id", "status", "available_at"),
    sa.Index("ix_tasks_namespace_created", "namespace_id", "created_at"),
    # Serves the sweep of waiting tasks whose deadline has passed.
    sa.Index("ix_tasks_status_deadline", "status", "deadline"),
)

submission_keys = sa.Table(
    "submission_keys",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
    sa.Column("idempotency_key", Key(255), nullable=False),
    # SHA-256 (hex) of the canonical JSON of queue, handler, params and options.
    sa.Column("request_digest", Key(64), nullable=False),
    sa.Column("task_id", Key(36), nullable=False),
    sa.Column("created_at", Timestamp, nullable=False),
    # Kept at least this long, even when the task itself is purged (§7 of the reliability model).
    sa.Column("expires_at", Timestamp, nullable=False),
    sa.UniqueConstraint("namespace_id", "idempotency_key", name="uq_submission_keys_namespace_key"),
    # Result events carry the key that created their task (0003).
    sa.Index("ix_submission_keys_task", "task_id"),
)

task_events = sa.Table(
    "task_events",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("task_id", Key(36), sa.ForeignKey("tasks.id"), nullable=False),
    sa.Column("state_version", sa.Integer, nullable=False),
    sa.Column("event", sa.String(32), nullable=False),
    sa.Column("from_status", sa.String(16), nullable=True),
    sa.Column("to_status", sa.String(16), nullable=True),
    sa.Column("actor", sa.String(255), nullable=True),
    sa.Column("reason", sa.Text, nullable=True),
    sa.Column("data", sa.JSON(none_as_null=True), nullable=True),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Index("ix_task_events_task", "task_id", "id"),
)

task_attempts = sa.Table(
    "task_attempts",
    metadata,
    sa.Column("id", Key(36), primary_key=True),
    sa.Column("task_id", Key(36), sa.ForeignKey("tasks.id"), nullable=False),
    # The fencing number: 1, 2, ... per task. Unique, so two grants can never share one.
    sa.Column("generation", sa.Integer, nullable=False),
    # SHA-256 (hex) of the lease token. The token is 256 random bits and a bearer secret:
    # storing only its digest means a database reader (backup, replica, support query)
    # cannot act as the worker; a fast hash suffices for a random 256-bit secret.
    sa.Column("lease_token_hash", Key(64), nullable=False),
    sa.Column("worker_id", sa.String(255), nullable=False),
    # LEASED, RUNNING (live); SUCCEEDED, FAILED, CANCELLED, EXPIRED (final, never rewritten).
    sa.Column("status", sa.String(16), nullable=False),
    # The duration a start or heartbeat renews the lease by, in seconds.
    sa.Column("lease_seconds", sa.Float, nullable=False),
    sa.Column("leased_at", Timestamp, nullable=False),
    sa.Column("started_at", Timestamp, nullable=True),
    sa.Column("heartbeat_at", Timestamp, nullable=True),
    sa.Column("lease_expires_at", Timestamp, nullable=False),
    sa.Column("finished_at", Timestamp, nullable=True),
    sa.Column("result", sa.JSON(none_as_null=True), nullable=True),
    sa.Column("error", sa.JSON(none_as_null=True), nullable=True),
    # The first complete/fail body that arrived after the attempt lost its lease: evidence only.
    sa.Column("late_report", sa.JSON(none_as_null=True), nullable=True),
    sa.Column("late_reported_at", Timestamp, nullable=True),
    sa.UniqueConstraint("task_id", "generation", name="uq_task_attempts_task_generation"),
    # Serves the expiry sweep: live attempts by expiry.
    sa.Index("ix_task_attempts_status_expiry", "status", "lease_expires_at"),
)

# --- result events (revision 0003): DESIGN §4 "Result events", §6.2 of the reliability model ---

result_events = sa.Table(
    "result_events",
    metadata,
    # A UUID: the id receivers dedupe on (their inbox's unique key), stable across redeliveries.
    sa.Column("id", Key(36), primary_key=True),
    sa.Column("task_id", Key(36), sa.ForeignKey("tasks.id"), nullable=False),
    sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
    sa.Column("queue_id", sa.BigInteger, sa.ForeignKey("queues.id"), nullable=False),
    sa.Column("handler", sa.String(255), nullable=False),
    # SUCCEEDED, FAILED, CANCELLED or NEEDS_REVIEW: the state the transition reached.
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("result", sa.JSON(none_as_null=True), nullable=True),
    sa.Column("error", sa.JSON(none_as_null=True), nullable=True),
    # The task's state_version after the transition: one event per (task, version) at most.
    sa.Column("state_version", sa.Integer, nullable=False),
    sa.Column("occurred_at", Timestamp, nullable=False),
    sa.UniqueConstraint("task_id", "state_version", name="uq_result_events_task_version"),
    sa.Index("ix_result_events_namespace_occurred", "namespace_id", "occurred_at"),
)

subscriptions = sa.Table(
    "subscriptions",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
    sa.Column("name", Key(64), nullable=False),
    # Sorted queue names whose events it receives; NULL means every queue of the namespace.
    sa.Column("queues", sa.JSON(none_as_null=True), nullable=True),
    # It receives exactly the events with occurred_at >= created_at (both database clock).
    sa.Column("created_at", Timestamp, nullable=False),
    sa.UniqueConstraint("namespace_id", "name", name="uq_subscriptions_namespace_name"),
)

event_deliveries = sa.Table(
    "event_deliveries",
    metadata,
    # Ordered, so leases hand out older deliveries first; never used as a "done up to here" cursor.
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("subscription_id", sa.BigInteger, sa.ForeignKey("subscriptions.id"), nullable=False),
    sa.Column("event_id", Key(36), sa.ForeignKey("result_events.id"), nullable=False),
    # PENDING (leasable once lease_expires_at is NULL or past) or ACKED (final).
    sa.Column("state", sa.String(16), nullable=False),
    # How many times it was leased.
    sa.Column("delivery_count", sa.Integer, nullable=False, server_default="0"),
    # Who holds (or last held) the lease, e.g. ``api_key:12``; for operators.
    sa.Column("leased_by", sa.String(255), nullable=True),
    sa.Column("lease_expires_at", Timestamp, nullable=True),
    sa.Column("acked_at", Timestamp, nullable=True),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.UniqueConstraint("subscription_id", "event_id", name="uq_event_deliveries_subscription_event"),
    # Serves the lease query: one subscription's pending deliveries, oldest first.
    sa.Index("ix_event_deliveries_claim", "subscription_id", "state", "id"),
)

# --- schedules (revision 0004): DESIGN §9 "Schedules", §4/§5 "调度触发" of seed 001 ---

schedules = sa.Table(
    "schedules",
    metadata,
    # A UUID, never reused: the idempotency keys of its tasks are built from it.
    sa.Column("id", Key(36), primary_key=True),
    sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
    sa.Column("name", Key(64), nullable=False),
    sa.Column("queue_id", sa.BigInteger, sa.ForeignKey("queues.id"), nullable=False),
    sa.Column("handler", sa.String(255), nullable=False),
    sa.Column("params", sa.JSON(none_as_null=True), nullable=True),
    # The SubmitOptions of every task it creates (JSON object), or NULL.
    sa.Column("options", sa.JSON(none_as_null=True), nullable=True),
    # Exactly one of cron (evaluated in timezone) and interval_seconds (UTC, from start_at).
    sa.Column("cron", sa.String(255), nullable=True),
    sa.Column("interval_seconds", sa.Integer, nullable=True),
    sa.Column("timezone", sa.String(64), nullable=False),
    # Fire-time bounds, inclusive; start_at is set to the creation time when none is given.
    sa.Column("start_at", Timestamp, nullable=False),
    sa.Column("end_at", Timestamp, nullable=True),
    # The next fire time; NULL once end_at is passed.
    sa.Column("next_fire_at", Timestamp, nullable=True),
    sa.Column("misfire_policy", sa.String(16), nullable=False),
    sa.Column("catch_up_max", sa.Integer, nullable=False),
    sa.Column("misfire_grace_seconds", sa.Integer, nullable=False),
    sa.Column("overlap_policy", sa.String(16), nullable=False),
    sa.Column("paused", sa.Boolean, nullable=False),
    # Bumped by every change of the definition; fires are conditional on it.
    sa.Column("version", sa.Integer, nullable=False),
    # The latest fire time handled, and the task of the latest occurrence that created one.
    sa.Column("last_fired_at", Timestamp, nullable=True),
    sa.Column("last_task_id", Key(36), nullable=True),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Column("updated_at", Timestamp, nullable=False),
    sa.UniqueConstraint("namespace_id", "name", name="uq_schedules_namespace_name"),
    # Serves the scheduler's claim: unpaused schedules by next fire time.
    sa.Index("ix_schedules_due", "paused", "next_fire_at"),
)

schedule_occurrences = sa.Table(
    "schedule_occurrences",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("schedule_id", Key(36), sa.ForeignKey("schedules.id"), nullable=False),
    # The fire time, UTC: one occurrence per schedule and fire time, whatever the versions.
    sa.Column("scheduled_at", Timestamp, nullable=False),
    sa.Column("schedule_version", sa.Integer, nullable=False),
    # created (task_id set) or skipped (task_id NULL, skip_reason says why).
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("task_id", Key(36), nullable=True),
    sa.Column("skip_reason", sa.String(255), nullable=True),
    sa.Column("misfired", sa.Boolean, nullable=False),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.UniqueConstraint("schedule_id", "scheduled_at", name="uq_schedule_occurrences_schedule_time"),
)

# Audit of schedule changes: who did what (create, update, pause, resume, delete), when.
schedule_events = sa.Table(
    "schedule_events",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
    # No foreign key: the audit outlives a deleted schedule.
    sa.Column("schedule_id", Key(36), nullable=False),
    sa.Column("schedule_name", Key(64), nullable=False),
    sa.Column("event", sa.String(32), nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("actor", sa.String(255), nullable=True),
    sa.Column("data", sa.JSON(none_as_null=True), nullable=True),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Index("ix_schedule_events_schedule", "schedule_id", "id"),
)
