"""The server's tables (SQLAlchemy Core). The Alembic history under
``migrations/server`` creates exactly these; a test compares the two.

Conventions (DESIGN §2): ``DATETIME(6)`` in UTC, ``JSON`` payloads, ``BIGINT``
ids where order matters, ``VARCHAR(36)`` UUIDs, and binary (case- and
accent-sensitive) collation for keys and names on MySQL/MariaDB.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

__all__ = [
    "BigId",
    "Json",
    "Key",
    "Timestamp",
    "api_keys",
    "concurrency_permits",
    "console_sessions",
    "event_deliveries",
    "flow_definitions",
    "flow_events",
    "flow_history",
    "flow_instances",
    "flow_signals",
    "flow_start_tombstones",
    "flow_steps",
    "flow_timers",
    "flow_tokens",
    "flow_versions",
    "metadata",
    "namespaces",
    "purge_runs",
    "queue_events",
    "queue_gates",
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
    "worker_sightings",
]

metadata = sa.MetaData()

#: Microsecond timestamps, stored naive in UTC.
Timestamp = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
#: Auto-increment ids: BIGINT, except SQLite where only INTEGER PRIMARY KEY auto-increments.
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


class _SQLiteLosslessJSON(sa.types.TypeDecorator[Any]):
    """SQLite's JSON, except that a top-level number is stored as a BLOB of its JSON text.

    SQLite gives a column declared ``JSON`` NUMERIC affinity: the text of a top-level number
    is converted on insert, so ``18446744073709551616`` came back as a float, ``-0.0`` and
    ``1.0`` as integers and ``10**400`` as ``null``. A BLOB is never converted, and it is read
    back with the same JSON rules as every other value, so what is read is what was written,
    as on MySQL/MariaDB (README "HTTP API"). Rows written before keep what SQLite made of
    them. The column's DDL stays ``JSON``: nothing to migrate.
    """

    impl = sa.JSON
    cache_ok = True

    def bind_processor(self, dialect: sa.Dialect) -> Callable[[Any], Any] | None:
        base = self.impl_instance.bind_processor(dialect)

        def process(value: Any) -> Any:
            text = base(value) if base is not None else value
            if isinstance(value, int | float) and not isinstance(value, bool) and isinstance(text, str):
                return text.encode("utf-8")
            return text

        return process

    def result_processor(self, dialect: sa.Dialect, coltype: object) -> Callable[[Any], Any] | None:
        base = self.impl_instance.result_processor(dialect, coltype)

        def process(value: Any) -> Any:
            if isinstance(value, bytes):
                value = value.decode("utf-8")
            return base(value) if base is not None else value

        return process


def Json() -> sa.types.TypeEngine[Any]:  # capitalised: it reads like a type
    """A JSON column (``NULL`` for ``None``) that gives back exactly the JSON value stored in it."""
    return sa.JSON(none_as_null=True).with_variant(_SQLiteLosslessJSON(none_as_null=True), "sqlite")


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

#: Web console sessions (README "Web console"): a row per signed-in browser, deleted by sign-out,
#: by the key's revocation and once expired. The cookie carries the random token; only its
#: SHA-256 is stored.
console_sessions = sa.Table(
    "console_sessions",
    metadata,
    sa.Column("token_hash", Key(64), primary_key=True),
    sa.Column("api_key_id", sa.BigInteger, sa.ForeignKey("api_keys.id"), nullable=False, index=True),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Column("expires_at", Timestamp, nullable=False, index=True),
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
    sa.Column("params", Json(), nullable=True),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("state_version", sa.Integer, nullable=False),
    sa.Column("attempt_count", sa.Integer, nullable=False, server_default="0"),
    sa.Column("max_attempts", sa.Integer, nullable=False),
    sa.Column("retry_safe", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("available_at", Timestamp, nullable=False),
    sa.Column("deadline", Timestamp, nullable=True),
    sa.Column("cancel_requested", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("result", Json(), nullable=True),
    sa.Column("error", Json(), nullable=True),
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
    # --- concurrency limits (revision 0005) ---
    # The business key whose live attempts a queue's max_concurrency_per_key limits; NULL: none.
    sa.Column("concurrency_key", Key(255), nullable=True),
    # Whether the live attempt holds a row in concurrency_permits (released when it ends).
    sa.Column("holds_permit", sa.Boolean, nullable=False, server_default=sa.false()),
    # --- trace context (revision 0008): W3C traceparent/tracestate as submitted, NULL when none ---
    sa.Column("traceparent", Key(55), nullable=True),
    sa.Column("tracestate", Key(512), nullable=True),
    # --- flows (revision 0009): the step of a flow instance this task is, NULL for plain tasks. Read with
    # the task row by every transition, so a terminal one knows, without a statement more, that it must
    # write a flow_events row (README "Flows: running them").
    sa.Column("flow_instance_id", Key(36), nullable=True),
    sa.Column("flow_token_id", Key(36), nullable=True),
    sa.Column("flow_activation", sa.Integer, nullable=True),
    # --- priority (revision 0013): -100..100, a lease grants the highest first (README "Task priority") ---
    sa.Column("priority", sa.SmallInteger, nullable=False, server_default=sa.text("0")),
    sa.Index("ix_tasks_namespace_created", "namespace_id", "created_at"),
    # Serves the sweep of waiting tasks whose deadline has passed.
    sa.Index("ix_tasks_status_deadline", "status", "deadline"),
    # Serves retention (0007): finished tasks of one status oldest first, walked by (finished_at, id).
    sa.Index("ix_tasks_finished", "status", "finished_at", "id"),
)
# Serves the lease query: one queue's waiting tasks in lease order (priority DESC, available_at, id), read
# from the index with no sort (MySQL 8, MariaDB 10.8+, PostgreSQL and SQLite keep DESC; ``id`` is written
# out because only InnoDB appends the primary key to a secondary index). Revision 0013 (was
# ``ix_tasks_claim (queue_id, status, available_at)``).
sa.Index(
    "ix_tasks_claim_order",
    tasks.c.queue_id, tasks.c.status, tasks.c.priority.desc(), tasks.c.available_at, tasks.c.id,
)  # fmt: skip

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
    # Serves the purge of expired keys (0007).
    sa.Index("ix_submission_keys_expires", "expires_at"),
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
    sa.Column("data", Json(), nullable=True),
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
    sa.Column("result", Json(), nullable=True),
    sa.Column("error", Json(), nullable=True),
    # The first complete/fail body that arrived after the attempt lost its lease: evidence only.
    sa.Column("late_report", Json(), nullable=True),
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
    sa.Column("result", Json(), nullable=True),
    sa.Column("error", Json(), nullable=True),
    # The task's state_version after the transition: one event per (task, version) at most.
    sa.Column("state_version", sa.Integer, nullable=False),
    sa.Column("occurred_at", Timestamp, nullable=False),
    # --- retry chains (revision 0006) ---
    # The task's retry_of (a manual retry's predecessor), copied when the event is written.
    sa.Column("retry_of", Key(36), nullable=True),
    # For a task created by manual retry: the Idempotency-Key of its chain's first task, found when
    # the event is written. NULL otherwise (the task's own key is read from submission_keys).
    sa.Column("idempotency_key", Key(255), nullable=True),
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
    sa.Column("queues", Json(), nullable=True),
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
    # Serves retention (0007): an event's deliveries, to protect unacked ones and purge acked ones.
    sa.Index("ix_event_deliveries_event", "event_id", "state"),
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
    sa.Column("params", Json(), nullable=True),
    # The SubmitOptions of every task it creates (JSON object), or NULL.
    sa.Column("options", Json(), nullable=True),
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
    # Serves retention (0007): the occurrences of purged tasks.
    sa.Index("ix_schedule_occurrences_task", "task_id"),
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
    sa.Column("data", Json(), nullable=True),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Index("ix_schedule_events_schedule", "schedule_id", "id"),
)

# --- queue gates and concurrency permits (revision 0005): DESIGN §9, §3/§5 and invariant 12 of seed 001 ---

# A queue's execution gate: paused flag, concurrency limits and control version. Its row is also
# the lock that serialises the grants of a queue with a limit (``SELECT ... FOR UPDATE``).
queue_gates = sa.Table(
    "queue_gates",
    metadata,
    sa.Column("queue_id", sa.BigInteger, sa.ForeignKey("queues.id"), primary_key=True, autoincrement=False),
    sa.Column("paused", sa.Boolean, nullable=False, server_default=sa.false()),
    # Live attempts allowed per concurrency_key, and in the whole queue; NULL means no limit.
    sa.Column("max_concurrency_per_key", sa.Integer, nullable=True),
    sa.Column("max_concurrency", sa.Integer, nullable=True),
    # Bumped by every change (pause, resume, limits).
    sa.Column("control_version", sa.Integer, nullable=False, server_default="1"),
    sa.Column("updated_at", Timestamp, nullable=False),
    sa.Column("updated_by", sa.String(255), nullable=True),
)

# One row per live attempt granted under a limit: its permit. Inserted by the lease transaction,
# deleted by the transaction that ends the attempt.
concurrency_permits = sa.Table(
    "concurrency_permits",
    metadata,
    sa.Column("attempt_id", Key(36), primary_key=True),
    sa.Column("queue_id", sa.BigInteger, nullable=False),
    sa.Column("concurrency_key", Key(255), nullable=True),
    sa.Column("task_id", Key(36), nullable=False),
    sa.Column("granted_at", Timestamp, nullable=False),
    sa.Index("ix_concurrency_permits_queue_key", "queue_id", "concurrency_key"),
)

# Audit of queue control changes: who paused, resumed or changed limits, when, before and after.
queue_events = sa.Table(
    "queue_events",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
    sa.Column("queue_id", sa.BigInteger, nullable=False),
    sa.Column("queue_name", Key(64), nullable=False),
    sa.Column("event", sa.String(32), nullable=False),
    sa.Column("control_version", sa.Integer, nullable=False),
    sa.Column("actor", sa.String(255), nullable=True),
    sa.Column("data", sa.JSON(none_as_null=True), nullable=True),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Index("ix_queue_events_queue", "queue_id", "id"),
)

# --- worker liveness (revision 0010): the console's "is anything leasing from this queue?" ---

# The last lease call of each worker on each queue (database clock), written at most every few seconds per
# worker and server process (orbit_server.tasks.worker_sightings); the console's overview reads it.
worker_sightings = sa.Table(
    "worker_sightings",
    metadata,
    sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), primary_key=True),
    sa.Column("queue", Key(64), primary_key=True),
    sa.Column("worker_id", sa.String(255), primary_key=True),
    sa.Column("last_seen_at", Timestamp, nullable=False),
    sa.Index("ix_worker_sightings_seen", "namespace_id", "queue", "last_seen_at"),
)

# --- retention (revision 0007): DESIGN §9 "Retention", §7 of seed 001 ---

# Audit of purge runs: who purged what up to which cut-off, written in every batch's transaction.
purge_runs = sa.Table(
    "purge_runs",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("actor", sa.String(255), nullable=False),
    # Tasks finished before this time (UTC) were purged; NULL when the run purged keys only.
    sa.Column("tasks_before", Timestamp, nullable=True),
    # Submission keys that expired before this time (database clock at the start) were purged; NULL: none.
    sa.Column("keys_before", Timestamp, nullable=True),
    sa.Column("batch_size", sa.Integer, nullable=False),
    # running, finished, failed (a run that died leaves running with the counts of its committed batches).
    sa.Column("status", sa.String(16), nullable=False),
    # What was deleted so far: {"tasks": n, "task_attempts": n, ...}; exact, same transaction as the deletes.
    sa.Column("counts", sa.JSON(none_as_null=True), nullable=False),
    sa.Column("error", sa.Text, nullable=True),
    sa.Column("started_at", Timestamp, nullable=False),
    sa.Column("finished_at", Timestamp, nullable=True),
    sa.Index("ix_purge_runs_started", "started_at"),
)


# --- flows (revision 0009): DESIGN §12, seed 001 §4-§6.3 and invariants 9-12, the token engine of seed 002 ---

flow_definitions = sa.Table(
    "flow_definitions",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
    sa.Column("name", Key(64), nullable=False),
    # The newest version's number (versions are 1, 2, ...); bumped under this row's lock by a publish.
    sa.Column("latest_version", sa.Integer, nullable=False),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Column("updated_at", Timestamp, nullable=False),
    sa.UniqueConstraint("namespace_id", "name", name="uq_flow_definitions_namespace_name"),
)

# Immutable once written: a publish of the same graph (same digest) finds its version again.
flow_versions = sa.Table(
    "flow_versions",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("definition_id", sa.BigInteger, sa.ForeignKey("flow_definitions.id"), nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("graph", Json(), nullable=False),
    # SHA-256 (hex) of the graph's canonical JSON.
    sa.Column("digest", Key(64), nullable=False),
    sa.Column("description", sa.Text, nullable=True),
    sa.Column("published_at", Timestamp, nullable=False),
    sa.Column("published_by", sa.String(255), nullable=True),
    sa.UniqueConstraint("definition_id", "version", name="uq_flow_versions_definition_version"),
    sa.UniqueConstraint("definition_id", "digest", name="uq_flow_versions_definition_digest"),
)

flow_instances = sa.Table(
    "flow_instances",
    metadata,
    sa.Column("id", Key(36), primary_key=True),
    sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
    sa.Column("definition_id", sa.BigInteger, sa.ForeignKey("flow_definitions.id"), nullable=False),
    # Bound for life (invariant 10): publishing never changes a running instance.
    sa.Column("version_id", sa.BigInteger, sa.ForeignKey("flow_versions.id"), nullable=False),
    sa.Column("input", Json(), nullable=False),
    # RUNNING, PAUSED, COMPLETED, FAILED, CANCELLED.
    sa.Column("status", sa.String(16), nullable=False),
    # The execution gate: a paused instance starts no task, timer or poll round (invariant 12).
    sa.Column("paused", sa.Boolean, nullable=False, server_default=sa.false()),
    # Bumped by every pause, resume and cancel, in the transaction that changes the gate.
    sa.Column("control_version", sa.Integer, nullable=False),
    # Bumped by every change of this row.
    sa.Column("state_version", sa.Integer, nullable=False),
    sa.Column("output", Json(), nullable=True),
    sa.Column("error", Json(), nullable=True),
    sa.Column("idempotency_key", Key(255), nullable=False),
    # SHA-256 (hex) of the canonical JSON of the start request (flow, version asked for, input).
    sa.Column("request_digest", Key(64), nullable=False),
    sa.Column("created_by", sa.String(255), nullable=True),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Column("updated_at", Timestamp, nullable=False),
    sa.Column("finished_at", Timestamp, nullable=True),
    sa.Column("traceparent", Key(55), nullable=True),
    sa.UniqueConstraint("namespace_id", "idempotency_key", name="uq_flow_instances_namespace_key"),
    # Serves the listing, newest first.
    sa.Index("ix_flow_instances_namespace_created", "namespace_id", "created_at", "id"),
    # Serves retention's walk of finished instances (revision 0011).
    sa.Index("ix_flow_instances_finished", "status", "finished_at", "id"),
)

# What retention keeps of a purged instance's start (revision 0011): its key, for the key window
# after the instance finished, so that a replayed start answers 410 and never starts a second instance.
flow_start_tombstones = sa.Table(
    "flow_start_tombstones",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("namespace_id", sa.BigInteger, sa.ForeignKey("namespaces.id"), nullable=False),
    sa.Column("idempotency_key", Key(255), nullable=False),
    sa.Column("request_digest", Key(64), nullable=False),
    sa.Column("instance_id", Key(36), nullable=False),
    sa.Column("finished_at", Timestamp, nullable=False),
    sa.Column("expires_at", Timestamp, nullable=False),
    sa.UniqueConstraint("namespace_id", "idempotency_key", name="uq_flow_start_tombstones_namespace_key"),
    sa.Index("ix_flow_start_tombstones_expires", "expires_at"),
)

# A position in an instance (seed 002 §4): every update is conditional on (id, version).
flow_tokens = sa.Table(
    "flow_tokens",
    metadata,
    sa.Column("id", Key(36), primary_key=True),
    sa.Column("instance_id", Key(36), sa.ForeignKey("flow_instances.id"), nullable=False),
    sa.Column("node_id", sa.String(64), nullable=False),
    # ACTIVE (on node_id, its entry not done yet), WAITING, FORKED, ARRIVED, DONE, CANCELLED.
    sa.Column("state", sa.String(16), nullable=False),
    # Bumped each time the token enters a node: a task, timer or event belongs to one activation.
    sa.Column("activation", sa.Integer, nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    # The token that forked this one (NULL for the root token).
    sa.Column("parent_id", Key(36), nullable=True),
    # For a FORKED token: children that have not arrived at the join yet (the join passes at 0).
    sa.Column("children_open", sa.Integer, nullable=False, server_default="0"),
    # The node's current task (task step, poll round), if any.
    sa.Column("task_id", Key(36), nullable=True),
    # What a WAITING token waits for: task, timer, signal:<name>, poll, review, join.
    sa.Column("waiting_for", sa.String(80), nullable=True),
    sa.Column("fire_at", Timestamp, nullable=True),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Column("updated_at", Timestamp, nullable=False),
    sa.Index("ix_flow_tokens_instance", "instance_id", "created_at"),
    sa.Index("ix_flow_tokens_parent", "parent_id"),
    # Serves the recovery scan: ACTIVE tokens, and WAITING signal tokens.
    sa.Index("ix_flow_tokens_state", "state", "waiting_for"),
)

# One row per task a node created: a task step (round 0) or a poll round (1, 2, ...).
flow_steps = sa.Table(
    "flow_steps",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("instance_id", Key(36), sa.ForeignKey("flow_instances.id"), nullable=False),
    sa.Column("token_id", Key(36), nullable=False),
    sa.Column("node_id", sa.String(64), nullable=False),
    sa.Column("activation", sa.Integer, nullable=False),
    sa.Column("round", sa.Integer, nullable=False, server_default="0"),
    sa.Column("task_id", Key(36), nullable=False, unique=True),
    # The task's outcome as the engine applied it (NULL until then).
    sa.Column("status", sa.String(16), nullable=True),
    sa.Column("result", Json(), nullable=True),
    sa.Column("error", Json(), nullable=True),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Column("finished_at", Timestamp, nullable=True),
    # A poll's budget is these rows (invariant 11): one per (token, activation, round), whatever restarts.
    sa.UniqueConstraint("token_id", "activation", "round", name="uq_flow_steps_token_activation_round"),
    sa.Index("ix_flow_steps_instance", "instance_id", "id"),
)

flow_timers = sa.Table(
    "flow_timers",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("instance_id", Key(36), sa.ForeignKey("flow_instances.id"), nullable=False),
    sa.Column("token_id", Key(36), nullable=False),
    sa.Column("activation", sa.Integer, nullable=False),
    # timer, signal_timeout, poll_round.
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("round", sa.Integer, nullable=False, server_default="0"),
    sa.Column("fire_at", Timestamp, nullable=False),
    # PENDING, FIRED, CANCELLED.
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Column("fired_at", Timestamp, nullable=True),
    sa.UniqueConstraint("token_id", "activation", "kind", "round", name="uq_flow_timers_token_activation"),
    # Serves the loop's claim of due timers.
    sa.Index("ix_flow_timers_due", "state", "fire_at"),
    sa.Index("ix_flow_timers_instance", "instance_id", "state"),
)

# Signals are buffered: kept unconsumed until a matching wait takes the oldest.
flow_signals = sa.Table(
    "flow_signals",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("instance_id", Key(36), sa.ForeignKey("flow_instances.id"), nullable=False),
    # The Idempotency-Key it was sent with: a repeat is a replay.
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
    sa.Index("ix_flow_signals_instance_name", "instance_id", "name", "consumed_at"),
)

# Internal events (seed 001 §6.3): written by a step task's terminal (or NEEDS_REVIEW) transition in its
# transaction, consumed by the transaction that advances the token.
flow_events = sa.Table(
    "flow_events",
    metadata,
    # The result event's id: one internal event per task transition.
    sa.Column("id", Key(36), primary_key=True),
    sa.Column("instance_id", Key(36), nullable=False),
    sa.Column("token_id", Key(36), nullable=False),
    sa.Column("activation", sa.Integer, nullable=False),
    sa.Column("task_id", Key(36), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("state_version", sa.Integer, nullable=False),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Column("consumed_at", Timestamp, nullable=True),
    # applied, stale (not the token's current activation or task), finished (instance over).
    sa.Column("outcome", sa.String(16), nullable=True),
    # Serves the loop: pending events, oldest first; and an instance's pending count.
    sa.Index("ix_flow_events_pending", "consumed_at", "created_at"),
    sa.Index("ix_flow_events_instance", "instance_id", "consumed_at"),
)

# Append-only, written in the transaction of every token and instance change (seed 002 §8).
flow_history = sa.Table(
    "flow_history",
    metadata,
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
    sa.Index("ix_flow_history_instance", "instance_id", "id"),
)
