"""What the adapter's functions return: small frozen dataclasses with a useful ``repr``.

Times are aware :class:`datetime.datetime` objects in UTC. ``params`` never appear in a
``repr`` (they may hold personal data; STYLE, DESIGN §8).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

__all__ = [
    "ConsumerStats",
    "DeliveredRow",
    "InboxRow",
    "OutboxEntry",
    "OutboxEvent",
    "OutboxRow",
    "OutboxStatus",
    "ReconcileDecision",
    "RelayStats",
]


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat(timespec="microseconds").replace("+00:00", "Z")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


class _AsDict:
    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready data (datetimes as RFC 3339 strings with ``Z``)."""
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True)
class OutboxEntry(_AsDict):
    """What :func:`enqueue` wrote: the row's id and its idempotency key, fixed for the row's life.

    The id is assigned by the database when the insert runs, inside the caller's
    transaction; if that transaction rolls back, the row (and the id) never existed.
    """

    id: int
    idempotency_key: str
    namespace: str
    queue: str
    handler: str
    ordering_key: str | None = None
    business_ref: str | None = None
    #: ``"task"`` (:func:`enqueue`) or ``"flow"`` (:func:`enqueue_flow`: ``flow`` names the flow;
    #: ``queue`` and ``handler`` are empty).
    kind: str = "task"
    flow: str | None = None


@dataclass(frozen=True, kw_only=True)
class OutboxRow(_AsDict):
    """One outbox row as stored (README "Outbox"). Times are UTC; ``None`` means "not set".

    Attributes:
        attempts: sends counted against the budget (``+1`` per claim, given back when the
            server's answer proves it did nothing); see :class:`Relay`.
        send_count: every claim for sending, whatever came of it.
        max_attempts: the row's budget of possibly-accepted sends; ``None`` means the
            relay's default.
        lease_expires_at: when the current lease ends (database clock); a ``PENDING``
            row whose lease is in the future is being sent.
        ordering_seq: the row's place among the rows of its ``ordering_key``, in commit order
            (README "Ordering keys"); ``None`` without a key.
        kind: ``"task"`` or ``"flow"`` (README "Starting flows from the outbox"). A flow row has
            ``flow`` (the flow's name), empty ``queue`` and ``handler``, its instance's input in
            ``params``, ``options`` ``{"version": N}`` or ``None``, and, once delivered, the flow
            instance's id in ``orbit_task_id``.
    """

    id: int
    idempotency_key: str
    namespace: str
    queue: str
    handler: str
    state: str
    attempts: int
    send_count: int
    max_attempts: int | None
    available_at: datetime
    created_at: datetime
    updated_at: datetime
    ordering_key: str | None = None
    ordering_seq: int | None = None
    business_ref: str | None = None
    options: dict[str, Any] | None = None
    lease_owner: str | None = None
    lease_token: str | None = field(default=None, repr=False)
    lease_expires_at: datetime | None = None
    last_error: str | None = None
    last_status_code: int | None = None
    orbit_task_id: str | None = None
    delivered_at: datetime | None = None
    params: Any = field(default=None, repr=False)
    kind: str = "task"
    flow: str | None = None


@dataclass(frozen=True, kw_only=True)
class OutboxEvent(_AsDict):
    """One audited state change of an outbox row (the ``orbit_outbox_events`` table).

    ``from_state`` equals ``to_state`` for a decision that changed no state (e.g. a
    reconcile that found a mismatching task).
    """

    id: int
    outbox_id: int
    from_state: str | None
    to_state: str
    reason: str
    actor: str
    orbit_task_id: str | None
    at: datetime


@dataclass(frozen=True, kw_only=True)
class OutboxStatus(_AsDict):
    """A summary of the outbox, as ``orbit-outbox status`` prints it.

    Attributes:
        counts: rows per state; every state is present, ``0`` when empty.
        leased: ``PENDING`` rows a relay holds a live lease on right now.
        oldest_pending_age_seconds: age, in seconds, of the oldest ``PENDING`` row
            (from its ``created_at`` to the database's now); ``None`` when none is pending.
        next_due_at: the earliest ``available_at`` of a ``PENDING`` row (UTC); ``None``
            when none is pending. A time in the past means the row is due now.
        now: the database clock when the summary was taken (UTC).
    """

    counts: dict[str, int]
    leased: int
    oldest_pending_age_seconds: float | None
    next_due_at: datetime | None
    now: datetime


@dataclass(frozen=True, kw_only=True)
class ReconcileDecision(_AsDict):
    """What ``reconcile`` decided for one ``NEEDS_RECONCILE`` row (README "Outbox").

    Attributes:
        decision: ``"delivered"`` (the server has a task for the key and it is this
            row's submission), ``"pending"`` (no task for the key: send again with the same
            key), ``"mismatch"`` (the key names a *different* submission: a person must
            decide; the row stays), ``"too_old"`` (the row is older than the server's key
            window, so "not found" proves nothing; the row stays) or ``"error"`` (the
            lookup failed; the row stays and the next run tries again).
        applied: ``True`` when the row's state changed (``delivered``, ``pending``);
            ``False`` for a dry run, a row left for a person (``mismatch``, ``too_old``: only
            its ``last_error`` and an audit event were written; settle it with ``resolve``), a
            failed lookup, or when another process decided the row first.
        detail: a sentence for people.
    """

    row_id: int
    idempotency_key: str
    decision: str
    applied: bool
    detail: str
    orbit_task_id: str | None = None


@dataclass(frozen=True, kw_only=True)
class DeliveredRow:
    """Passed to the relay's ``on_delivered`` hook, inside the transaction that records the delivery.

    Attributes:
        row_id, idempotency_key, business_ref: the outbox row.
        orbit_task_id: the task the server accepted (or replayed) for the key; for a flow row
            (``kind == "flow"``), the flow instance's id.
        replayed: ``True`` when the server answered with the original task of an earlier send.
        kind: ``"task"`` or ``"flow"`` (README "Starting flows from the outbox").
    """

    row_id: int
    idempotency_key: str
    business_ref: str | None
    orbit_task_id: str
    replayed: bool
    kind: str = "task"


@dataclass(kw_only=True)
class RelayStats(_AsDict):
    """Counters of one :meth:`Relay.run`; every field counts rows.

    Attributes:
        claimed: rows claimed for sending.
        delivered: rows recorded ``DELIVERED`` (``replayed`` of them were answered by a replay).
        retried: rows sent back to ``PENDING`` with a backoff.
        dead: rows recorded ``DEAD`` (permanently refused).
        needs_reconcile: rows recorded ``NEEDS_RECONCILE``.
        released: rows given back unsent (attempt given back): at shutdown, or because too
            little of their lease was left to start the send.
        lost_leases: outcomes not recorded because the lease had expired or been taken over.
        orbit_unavailable: rows left ``PENDING`` at the end of the run because the Orbit
            server was unreachable (no answer, or 503) or refused the relay's API key
            (401/403); ``orbit-outbox relay --once`` then exits 4.
    """

    claimed: int = 0
    delivered: int = 0
    replayed: int = 0
    retried: int = 0
    dead: int = 0
    needs_reconcile: int = 0
    released: int = 0
    lost_leases: int = 0
    orbit_unavailable: int = 0


@dataclass(frozen=True, kw_only=True)
class InboxRow(_AsDict):
    """One result event recorded in the inbox (README "Consuming results (inbox)"). Times are UTC, from the database clock.

    Attributes:
        event_id: the result event's id (unique per ``subscription``).
        subscription: the subscription it was delivered through.
        namespace, task_id: the task the event is about.
        status: the task's status in the event (``SUCCEEDED``, ``FAILED``, ``CANCELLED``,
            ``NEEDS_REVIEW``).
        outcome: ``APPLIED`` (the handler's changes committed with this row) or ``FAILED``
            (recorded without them after ``max_deliveries``; see :class:`ResultConsumer`).
        delivery_count: how many times the server had delivered the event when this row
            was written (1 for a first delivery).
        error: the handler's last error (``FAILED`` rows), else ``None``.
        event: the event as JSON, kept on ``FAILED`` rows so a person can act on it; else ``None``.
        received_at: when the transaction that wrote the row inserted it.
        processed_at: when the handler returned (``APPLIED``) or the failure was recorded.
    """

    id: int
    event_id: str
    subscription: str
    namespace: str
    task_id: str
    status: str
    outcome: str
    delivery_count: int
    error: str | None
    received_at: datetime
    processed_at: datetime | None
    event: dict[str, Any] | None = field(default=None, repr=False)


@dataclass(kw_only=True)
class ConsumerStats(_AsDict):
    """Counters of one :meth:`ResultConsumer.run`; every field counts deliveries.

    Attributes:
        leased: deliveries leased from the server.
        applied: events whose handler ran and committed with their inbox row.
        duplicates: deliveries of events already in the inbox (nothing changed; acked).
        failed: deliveries whose handler raised: rolled back, not acked; the server delivers
            them again after their lease.
        parked: events recorded ``FAILED`` after ``max_deliveries`` and acked without their
            business change.
        acked: deliveries acked (applied, duplicate or parked).
        ack_failures: acks that failed after the commit; those deliveries come back after
            their lease and are acked as duplicates.
        unprocessed: leased deliveries left untouched (stop, the business database went
            away mid-batch, or too little of their lease was left to apply them); they come
            back after their lease.
        ack_skipped: deliveries applied but not acked because their lease ran out meanwhile;
            they come back and are acked as duplicates.
    """

    leased: int = 0
    applied: int = 0
    duplicates: int = 0
    failed: int = 0
    parked: int = 0
    acked: int = 0
    ack_failures: int = 0
    unprocessed: int = 0
    ack_skipped: int = 0
