"""The outbox and inbox tables, as SQLAlchemy Core, with configurable names.

``OutboxTables()`` builds ``orbit_outbox``, ``orbit_outbox_events`` and ``orbit_inbox``
on a ``MetaData`` of their own (what ``orbit-outbox migrate`` creates); an application
with its own Alembic history passes its ``MetaData`` instead, and autogenerate
then sees the tables beside its own (DESIGN §2, §5).

Conventions (DESIGN §2): ``DATETIME(6)`` in UTC stored naive, ``JSON`` params,
``BIGINT`` ids, binary collation for keys on MySQL/MariaDB.
"""

from __future__ import annotations

import enum
import re

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from outbox_adapter._exceptions import OutboxUsageError

__all__ = [
    "DEFAULT_TABLE_NAME",
    "InboxOutcome",
    "OutboxState",
    "OutboxTables",
    "RowKind",
    "default_inbox_name",
]

#: Name of the outbox table unless configured otherwise.
DEFAULT_TABLE_NAME = "orbit_outbox"

#: Table names: short enough that ``ix_<name>_ordering`` fits PostgreSQL's 63 characters.
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,47}")

#: Microsecond timestamps, stored naive in UTC.
_Timestamp = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
#: Auto-increment ids: BIGINT, except SQLite where only INTEGER PRIMARY KEY auto-increments.
_BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _ascii(length: int) -> sa.types.TypeEngine[str]:
    """An ASCII string compared byte for byte (``ascii_bin`` on MySQL/MariaDB)."""
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, charset="ascii", collation="ascii_bin"), "mysql", "mariadb"
    )


def _text(length: int) -> sa.types.TypeEngine[str]:
    """A Unicode string compared exactly (``utf8mb4_bin`` on MySQL/MariaDB)."""
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
    )


class OutboxState(enum.StrEnum):
    """The states of an outbox row (README "Outbox").

    ``PENDING`` → ``DELIVERED`` | ``DEAD`` | ``NEEDS_RECONCILE``;
    ``NEEDS_RECONCILE`` → ``DELIVERED`` | ``PENDING`` (``reconcile``);
    ``DEAD`` → ``PENDING`` only through an operator's ``retry``, keeping the key;
    ``DEAD`` | ``NEEDS_RECONCILE`` → ``ABANDONED`` by an operator (``abandon``, ``resolve --abandon``):
    never to be sent, terminal, and no longer holding back later rows of its ordering key.
    A row being sent is ``PENDING`` with a live lease.
    """

    PENDING = "PENDING"
    DELIVERED = "DELIVERED"
    DEAD = "DEAD"
    NEEDS_RECONCILE = "NEEDS_RECONCILE"
    ABANDONED = "ABANDONED"


class RowKind(enum.StrEnum):
    """What an outbox row starts on the server (README "Starting flows from the outbox").

    ``TASK``: a task (``POST .../tasks``, batched). ``FLOW``: an instance of the flow named in the
    row's ``flow`` column (``POST .../flows/{name}/instances``, one request per row).
    """

    TASK = "task"
    FLOW = "flow"


class InboxOutcome(enum.StrEnum):
    """What became of a result event recorded in the inbox (README "Consuming results (inbox)").

    ``APPLIED``: the handler ran and its changes committed with the inbox row.
    ``FAILED``: the handler kept failing until the consumer's ``max_deliveries``; the
    event was recorded (with its payload and the last error) and acked without its
    business change, for a person to look at (see :class:`~outbox_adapter.ResultConsumer`).
    """

    APPLIED = "APPLIED"
    FAILED = "FAILED"


def default_inbox_name(outbox_name: str) -> str:
    """The inbox table's name when none is given: ``orbit_outbox`` → ``orbit_inbox``,
    ``shop_outbox`` → ``shop_inbox``, any other ``name`` → ``f"{name}_inbox"``."""
    if outbox_name.endswith("outbox"):
        return outbox_name[: -len("outbox")] + "inbox"
    return f"{outbox_name}_inbox"


class OutboxTables:
    """The outbox table and its audit table, on ``metadata``.

    Args:
        metadata: where to define the tables; ``None`` means a new ``MetaData``.
            Pass the application's own to manage the tables with its Alembic history.
        name: the outbox table's name, default ``"orbit_outbox"``.
        events_name: the audit table's name; ``None`` means ``f"{name}_events"``.
        inbox_name: the inbox table's name; ``None`` means ``default_inbox_name(name)``
            (``orbit_inbox`` for the default outbox name).
        keys_name: the ordering keys' table's name; ``None`` means ``f"{name}_keys"``.

    Attributes:
        metadata: the ``MetaData`` holding the four tables.
        outbox: one row per intended Orbit call (README "Outbox").
        events: one row per state change of an outbox row: ``outbox_id``, ``from_state``,
            ``to_state``, ``reason``, ``actor``, ``orbit_task_id``, ``at`` (UTC).
        inbox: one row per result event a :class:`~outbox_adapter.ResultConsumer` recorded,
            unique on ``(subscription, event_id)`` (README "Consuming results (inbox)"; source event
            and consumer unique): ``event_id``, ``subscription``, ``namespace``, ``task_id``,
            ``status`` (the task's terminal status in the event), ``outcome`` (an
            :class:`InboxOutcome`), ``delivery_count`` (deliveries of the event when recorded),
            ``error`` and ``event`` (the event as JSON; ``FAILED`` rows only), ``received_at``
            and ``processed_at`` (UTC, database clock).
        keys: one row per ordering key ever enqueued: ``ordering_key`` and ``last_seq``, the
            ``ordering_seq`` of its newest row. ``enqueue`` locks it (an upsert) in the caller's
            transaction, so enqueues of one key are serialised and its rows are numbered in
            commit order (README "Ordering keys").

    Raises:
        OutboxUsageError: a name is not 1-48 letters, digits or ``_`` starting with a
            letter or ``_``, or a table of that name is already on ``metadata``.
    """

    def __init__(
        self,
        metadata: sa.MetaData | None = None,
        *,
        name: str = DEFAULT_TABLE_NAME,
        events_name: str | None = None,
        inbox_name: str | None = None,
        keys_name: str | None = None,
    ) -> None:
        events_name = events_name or f"{name}_events"
        inbox_name = inbox_name or (default_inbox_name(name) if isinstance(name, str) else name)
        keys_name = keys_name or f"{name}_keys"
        named = (
            ("name", name),
            ("events_name", events_name),
            ("inbox_name", inbox_name),
            ("keys_name", keys_name),
        )
        for label, value in named:
            if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
                raise OutboxUsageError(
                    f"{label} {value!r} is not a usable table name: use 1-48 letters, digits or _, "
                    "starting with a letter or _"
                )
        self.metadata = metadata if metadata is not None else sa.MetaData()
        if len({name, events_name, inbox_name, keys_name}) < 4:
            raise OutboxUsageError(
                f"the outbox, events, inbox and keys tables need four different names, not {name!r}, "
                f"{events_name!r}, {inbox_name!r} and {keys_name!r}"
            )
        for value in (name, events_name, inbox_name, keys_name):
            if value in self.metadata.tables:
                raise OutboxUsageError(f"table {value!r} is already defined on this MetaData")
        self.name = name
        self.events_name = events_name
        self.inbox_name = inbox_name
        self.keys_name = keys_name
        self.outbox = sa.Table(
            name,
            self.metadata,
            sa.Column("id", _BigId, primary_key=True, autoincrement=True),
            sa.Column("idempotency_key", _ascii(255), nullable=False),
            sa.Column("namespace", _ascii(64), nullable=False),
            sa.Column("queue", _ascii(64), nullable=False),
            sa.Column("handler", _ascii(255), nullable=False),
            sa.Column("params", sa.JSON(none_as_null=True), nullable=True),
            sa.Column("options", sa.JSON(none_as_null=True), nullable=True),
            sa.Column("ordering_key", _text(255), nullable=True),
            sa.Column("business_ref", _text(255), nullable=True),
            sa.Column("state", _ascii(20), nullable=False),
            # Sends that count against the budget: +1 at each claim, given back when the
            # answer proves the server did nothing (see Relay's docstring).
            sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
            # Every claim for sending, whatever came of it (drives the backoff exponent).
            sa.Column("send_count", sa.Integer, nullable=False, server_default="0"),
            # Budget of attempts whose outcome may be unknown; NULL means the relay's default.
            sa.Column("max_attempts", sa.Integer, nullable=True),
            sa.Column("available_at", _Timestamp, nullable=False),
            sa.Column("lease_owner", sa.String(255), nullable=True),
            sa.Column("lease_token", _ascii(36), nullable=True),
            sa.Column("lease_expires_at", _Timestamp, nullable=True),
            sa.Column("last_error", sa.Text, nullable=True),
            sa.Column("last_status_code", sa.Integer, nullable=True),
            sa.Column("orbit_task_id", _ascii(64), nullable=True),
            sa.Column("created_at", _Timestamp, nullable=False),
            sa.Column("updated_at", _Timestamp, nullable=False),
            sa.Column("delivered_at", _Timestamp, nullable=True),
            # The row's place in its ordering key, in commit order (from the keys table); NULL without a key.
            sa.Column("ordering_seq", sa.BigInteger, nullable=True),
            # W3C Trace Context of the span active at enqueue (README "Tracing"); NULL when none.
            sa.Column("traceparent", _ascii(55), nullable=True),
            sa.Column("tracestate", _ascii(512), nullable=True),
            # What the row starts (outbox_0005): ``task`` (queue + handler) or ``flow`` (a flow instance
            # of the flow named in ``flow``; ``queue`` and ``handler`` are empty, ``params`` is the
            # instance's input, ``options`` ``{"version": N}`` or NULL). README "Starting flows from the outbox".
            sa.Column("kind", _ascii(8), nullable=False, server_default=RowKind.TASK.value),
            sa.Column("flow", _ascii(64), nullable=True),
            sa.UniqueConstraint("idempotency_key", name=f"uq_{name}_idempotency_key"),
            # The claim: state = PENDING AND available_at <= now ORDER BY available_at, id.
            sa.Index(f"ix_{name}_claim", "state", "available_at", "id"),
            # "Is an earlier row with my ordering key still unsent?"
            sa.Index(f"ix_{name}_ordering", "ordering_key", "state", "ordering_seq"),
            # purge: state = DELIVERED AND delivered_at < cutoff.
            sa.Index(f"ix_{name}_delivered", "state", "delivered_at"),
            sa.Index(f"ix_{name}_business_ref", "business_ref"),
        )
        self.events = sa.Table(
            events_name,
            self.metadata,
            sa.Column("id", _BigId, primary_key=True, autoincrement=True),
            sa.Column("outbox_id", sa.BigInteger, nullable=False),
            sa.Column("from_state", _ascii(20), nullable=True),
            sa.Column("to_state", _ascii(20), nullable=False),
            sa.Column("reason", sa.Text, nullable=False),
            sa.Column("actor", sa.String(255), nullable=False),
            sa.Column("orbit_task_id", _ascii(64), nullable=True),
            sa.Column("at", _Timestamp, nullable=False),
            sa.Index(f"ix_{events_name}_outbox_id", "outbox_id", "id"),
        )
        self.inbox = sa.Table(
            inbox_name,
            self.metadata,
            sa.Column("id", _BigId, primary_key=True, autoincrement=True),
            sa.Column("event_id", _ascii(64), nullable=False),
            sa.Column("subscription", _ascii(64), nullable=False),
            sa.Column("namespace", _ascii(64), nullable=False),
            sa.Column("task_id", _ascii(64), nullable=False),
            sa.Column("status", _ascii(20), nullable=False),
            sa.Column("outcome", _ascii(20), nullable=False),
            sa.Column("delivery_count", sa.Integer, nullable=False),
            sa.Column("error", sa.Text, nullable=True),
            sa.Column("event", sa.JSON(none_as_null=True), nullable=True),
            sa.Column("received_at", _Timestamp, nullable=False),
            sa.Column("processed_at", _Timestamp, nullable=True),
            # The dedup: an event is applied once per subscription (DESIGN §5; seed 001 §4).
            sa.UniqueConstraint("subscription", "event_id", name=f"uq_{inbox_name}_event"),
            sa.Index(f"ix_{inbox_name}_task_id", "task_id"),
            sa.Index(f"ix_{inbox_name}_outcome", "outcome", "id"),
        )

        self.keys = sa.Table(
            keys_name,
            self.metadata,
            sa.Column("ordering_key", _text(255), primary_key=True),
            sa.Column("last_seq", sa.BigInteger, nullable=False),
        )

    def __repr__(self) -> str:
        return (
            f"OutboxTables(name={self.name!r}, events_name={self.events_name!r}, inbox_name={self.inbox_name!r}, "
            f"keys_name={self.keys_name!r})"
        )
