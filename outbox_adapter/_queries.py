"""Every SQL statement of the outbox, named after what it does (SQLAlchemy Core).

Functions here take a ``Connection`` that is already inside a transaction and never
begin, commit or roll back: the transaction boundary is visible at each call site
(:class:`~outbox_adapter.Outbox`, :class:`~outbox_adapter.Relay`, ``enqueue``), as in
procrastinate's manager. Times are naive UTC from the database clock (DESIGN §2).

Leases (DESIGN §5): a claim sets ``lease_token`` (one fresh UUID per claimed batch),
``lease_expires_at`` and ``available_at`` to the lease's end, so the claim query needs
only ``state = 'PENDING' AND available_at <= now``, which the index
``(state, available_at, id)`` serves in order. Every later write of a claimed row is a
conditional update on ``(id, lease_token)`` with a live lease, and its row count is
checked: a relay whose lease expired or was taken over records nothing.

Inbox (DESIGN §5): the result consumer's business transaction first looks for the event
(:func:`inbox_contains`), then inserts its row (:func:`insert_inbox_row`), whose unique
``(subscription, event_id)`` makes a concurrent duplicate wait for, then fail on, the
first one's commit.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RowMapping

from outbox_adapter._db import db_now, now_sql, to_aware_utc
from outbox_adapter._models import InboxRow, OutboxEvent, OutboxRow, OutboxStatus
from outbox_adapter._tables import InboxOutcome, OutboxState, OutboxTables

__all__ = [
    "Claim",
    "abandon_row",
    "add_events",
    "claim_batch",
    "count_by_state",
    "event_values",
    "get_inbox_row",
    "get_row",
    "inbox_contains",
    "insert_inbox_row",
    "insert_row",
    "list_events",
    "list_inbox",
    "list_rows",
    "mark_inbox_processed",
    "purge_delivered_batch",
    "record_dead",
    "record_delivered",
    "record_needs_reconcile",
    "record_reconcile_mismatch",
    "record_reconciled_delivered",
    "record_reconciled_pending",
    "record_retry",
    "release_claim",
    "retry_dead_row",
    "rows_to_reconcile",
]

PENDING, DELIVERED, DEAD, NEEDS_RECONCILE = (
    OutboxState.PENDING.value,
    OutboxState.DELIVERED.value,
    OutboxState.DEAD.value,
    OutboxState.NEEDS_RECONCILE.value,
)
#: States that hold back later rows of the same ordering key: everything not yet delivered.
_UNSENT = (PENDING, DEAD, NEEDS_RECONCILE)
#: Longest ``last_error`` / ``reason`` stored, in characters.
_ERROR_MAX = 2000


def _clip(text: str | None) -> str | None:
    if text is None or len(text) <= _ERROR_MAX:
        return text
    return text[: _ERROR_MAX - 1] + "…"


@dataclass(frozen=True, kw_only=True)
class Claim:
    """A row a relay holds a lease on, with what it needs to send it.

    ``attempts`` and ``send_count`` are the values after this claim counted itself;
    ``budget`` is the row's ``max_attempts`` or the relay's default.
    """

    id: int
    idempotency_key: str
    namespace: str
    queue: str
    handler: str
    ordering_key: str | None
    business_ref: str | None
    attempts: int
    send_count: int
    budget: int
    token: str = field(repr=False)
    lease_expires_at: datetime
    options: dict[str, Any] | None = field(default=None, repr=False)
    params: Any = field(default=None, repr=False)


# --- enqueue -----------------------------------------------------------------------------------------


def insert_row(t: OutboxTables, values: Mapping[str, Any], dialect_name: str) -> sa.Insert:
    """The ``INSERT`` of a new ``PENDING`` row; ``created_at``/``updated_at`` (and ``available_at``
    unless given) come from the database clock. The caller executes it on its own connection."""
    now = now_sql(dialect_name)
    row = {"state": PENDING, "attempts": 0, "send_count": 0, "created_at": now, "updated_at": now, **values}
    if row.get("available_at") is None:
        row["available_at"] = now
    return t.outbox.insert().values(row)


# --- relay -------------------------------------------------------------------------------------------


def claim_batch(
    conn: Connection,
    t: OutboxTables,
    *,
    owner: str,
    lease_seconds: float,
    limit: int,
    default_max_attempts: int,
    actor: str,
    exclude_ids: Collection[int] = (),
) -> tuple[list[Claim], list[int]]:
    """Lease up to ``limit`` due rows, oldest ``available_at`` first.

    A row is due when it is ``PENDING``, its ``available_at`` has passed (so any lease on
    it has expired) and no earlier row with its ``ordering_key`` is still unsent. The
    select takes ``FOR UPDATE SKIP LOCKED`` on MySQL/MariaDB/PostgreSQL, so concurrent
    relays claim disjoint rows; SQLite relies on the caller's ``BEGIN IMMEDIATE``.

    A due row that still carries a token had its previous lease expire without a
    recorded outcome (its relay died or stalled): that send's outcome is unknown and
    was counted at its claim. If its budget is spent, it goes to ``NEEDS_RECONCILE``
    here instead of being sent (DESIGN §5: never ``DEAD``).

    ``exclude_ids`` are never claimed (a ``--once`` run skips rows it already saw refused).

    Returns:
        The claims, and the ids moved to ``NEEDS_RECONCILE``.
    """
    o = t.outbox
    now = db_now(conn)
    earlier = o.alias("earlier")
    blocked = (
        sa.select(earlier.c.id)
        .where(
            earlier.c.ordering_key == o.c.ordering_key,
            earlier.c.state.in_(_UNSENT),
            earlier.c.id < o.c.id,
        )
        .exists()
    )
    stmt = (
        sa.select(o)
        .where(o.c.state == PENDING, o.c.available_at <= now, sa.or_(o.c.ordering_key.is_(None), ~blocked))
        .order_by(o.c.available_at, o.c.id)
        .limit(limit)
    )
    if exclude_ids:
        stmt = stmt.where(o.c.id.not_in(sorted(exclude_ids)))
    name = conn.dialect.name
    if name == "postgresql":
        stmt = stmt.with_for_update(skip_locked=True, of=o)
    elif name == "mysql":
        stmt = stmt.with_for_update(skip_locked=True)
    rows = conn.execute(stmt).mappings().all()
    if not rows:
        return [], []
    expires = now + timedelta(seconds=lease_seconds)
    token = str(uuid.uuid4())
    claims: list[Claim] = []
    spent: list[RowMapping] = []
    for row in rows:
        budget = row["max_attempts"] or default_max_attempts
        if row["lease_token"] is not None and row["attempts"] >= budget:
            spent.append(row)
            continue
        claims.append(
            Claim(
                id=row["id"],
                idempotency_key=row["idempotency_key"],
                namespace=row["namespace"],
                queue=row["queue"],
                handler=row["handler"],
                ordering_key=row["ordering_key"],
                business_ref=row["business_ref"],
                attempts=row["attempts"] + 1,
                send_count=row["send_count"] + 1,
                budget=budget,
                token=token,
                lease_expires_at=expires,
                options=row["options"],
                params=row["params"],
            )
        )
    if claims:
        conn.execute(
            sa.update(o)
            .where(o.c.id.in_([c.id for c in claims]))
            .values(
                lease_owner=owner,
                lease_token=token,
                lease_expires_at=expires,
                available_at=expires,
                attempts=o.c.attempts + 1,
                send_count=o.c.send_count + 1,
                updated_at=now,
            )
        )
    events = []
    for row in spent:
        reason = (
            f"the lease of {row['lease_owner']} expired without a recorded outcome and the budget of "
            f"{row['attempts']} possibly-accepted sends is spent; the task may exist: run `orbit-outbox reconcile`"
        )
        conn.execute(
            sa.update(o)
            .where(o.c.id == row["id"], o.c.lease_token == row["lease_token"])
            .values(
                state=NEEDS_RECONCILE,
                lease_owner=None,
                lease_token=None,
                lease_expires_at=None,
                available_at=now,
                last_error=_clip(reason),
                updated_at=now,
            )
        )
        events.append(event_values(row["id"], PENDING, NEEDS_RECONCILE, reason=reason, actor=actor, now=now))
    add_events(conn, t, events)
    return claims, [row["id"] for row in spent]


def _finish(
    conn: Connection, t: OutboxTables, claim: Claim, now: datetime, values: Mapping[str, Any]
) -> bool:
    """End ``claim``'s lease with ``values``, only if the lease is still ours and live. ``True`` if written."""
    o = t.outbox
    result = conn.execute(
        sa.update(o)
        .where(
            o.c.id == claim.id,
            o.c.lease_token == claim.token,
            o.c.state == PENDING,
            o.c.lease_expires_at > now,
        )
        .values(lease_owner=None, lease_token=None, lease_expires_at=None, updated_at=now, **values)
    )
    return result.rowcount == 1


def record_delivered(
    conn: Connection, t: OutboxTables, claim: Claim, *, now: datetime, task_id: str, status_code: int
) -> bool:
    """``PENDING`` (leased) → ``DELIVERED`` with the Orbit task id. ``False``: lease lost, nothing written."""
    return _finish(
        conn,
        t,
        claim,
        now,
        {
            "state": DELIVERED,
            "orbit_task_id": task_id,
            "delivered_at": now,
            "last_error": None,
            "last_status_code": status_code,
        },
    )


def record_retry(
    conn: Connection,
    t: OutboxTables,
    claim: Claim,
    *,
    now: datetime,
    available_at: datetime,
    error: str,
    status_code: int | None,
    counted: bool,
) -> bool:
    """Back to ``PENDING`` until ``available_at``, same key. ``counted=False`` gives the attempt back
    (the server did nothing). ``False``: lease lost, nothing written."""
    o = t.outbox
    values: dict[str, Any] = {
        "state": PENDING,
        "available_at": available_at,
        "last_error": _clip(error),
        "last_status_code": status_code,
    }
    if not counted:
        values["attempts"] = o.c.attempts - 1
    return _finish(conn, t, claim, now, values)


def record_dead(
    conn: Connection, t: OutboxTables, claim: Claim, *, now: datetime, error: str, status_code: int | None
) -> bool:
    """``PENDING`` (leased) → ``DEAD``: permanently refused. ``False``: lease lost, nothing written."""
    values = {"state": DEAD, "last_error": _clip(error), "last_status_code": status_code}
    return _finish(conn, t, claim, now, values)


def record_needs_reconcile(
    conn: Connection, t: OutboxTables, claim: Claim, *, now: datetime, error: str, status_code: int | None
) -> bool:
    """``PENDING`` (leased) → ``NEEDS_RECONCILE``: the task may exist. ``False``: lease lost."""
    values = {"state": NEEDS_RECONCILE, "last_error": _clip(error), "last_status_code": status_code}
    return _finish(conn, t, claim, now, values)


def release_claim(conn: Connection, t: OutboxTables, claim: Claim, *, now: datetime) -> bool:
    """Give an unsent claim back: ``PENDING``, due now, attempt given back. ``False``: lease lost."""
    o = t.outbox
    return _finish(conn, t, claim, now, {"state": PENDING, "available_at": now, "attempts": o.c.attempts - 1})


# --- audit -------------------------------------------------------------------------------------------


def add_events(conn: Connection, t: OutboxTables, events: Sequence[Mapping[str, Any]]) -> None:
    """Append audit events (dicts built by :func:`event_values`) in one statement."""
    if events:
        conn.execute(t.events.insert(), list(events))


def event_values(
    row_id: int,
    from_state: str | None,
    to_state: str,
    *,
    reason: str,
    actor: str,
    now: datetime,
    task_id: str | None = None,
) -> dict[str, Any]:
    """The values of one audit event: a state change of row ``row_id`` at ``now`` (UTC)."""
    return {
        "outbox_id": row_id,
        "from_state": from_state,
        "to_state": to_state,
        "reason": _clip(reason),
        "actor": actor[:255],
        "orbit_task_id": task_id,
        "at": now,
    }


# --- reads -------------------------------------------------------------------------------------------


def _row(m: RowMapping) -> OutboxRow:
    return OutboxRow(
        id=m["id"],
        idempotency_key=m["idempotency_key"],
        namespace=m["namespace"],
        queue=m["queue"],
        handler=m["handler"],
        state=m["state"],
        attempts=m["attempts"],
        send_count=m["send_count"],
        max_attempts=m["max_attempts"],
        available_at=_aware(m["available_at"]),
        created_at=_aware(m["created_at"]),
        updated_at=_aware(m["updated_at"]),
        ordering_key=m["ordering_key"],
        business_ref=m["business_ref"],
        options=m["options"],
        lease_owner=m["lease_owner"],
        lease_token=m["lease_token"],
        lease_expires_at=to_aware_utc(m["lease_expires_at"]),
        last_error=m["last_error"],
        last_status_code=m["last_status_code"],
        orbit_task_id=m["orbit_task_id"],
        delivered_at=to_aware_utc(m["delivered_at"]),
        params=m["params"],
    )


def _aware(value: datetime) -> datetime:
    aware = to_aware_utc(value)
    assert aware is not None
    return aware


def get_row(conn: Connection, t: OutboxTables, row_id: int, *, for_update: bool = False) -> OutboxRow | None:
    """The row with id ``row_id``, or ``None``. ``for_update`` locks it (not on SQLite: single writer)."""
    stmt = sa.select(t.outbox).where(t.outbox.c.id == row_id)
    if for_update and conn.dialect.name != "sqlite":
        stmt = stmt.with_for_update()
    found = conn.execute(stmt).mappings().first()
    return _row(found) if found is not None else None


def list_rows(
    conn: Connection, t: OutboxTables, *, state: str | None, limit: int, after_id: int = 0
) -> list[OutboxRow]:
    """Rows in ``state`` (``None``: any) with ``id > after_id``, by id, at most ``limit``."""
    o = t.outbox
    stmt = sa.select(o).where(o.c.id > after_id).order_by(o.c.id).limit(limit)
    if state is not None:
        stmt = stmt.where(o.c.state == state)
    return [_row(m) for m in conn.execute(stmt).mappings()]


def list_events(conn: Connection, t: OutboxTables, row_id: int) -> list[OutboxEvent]:
    """The audit events of row ``row_id``, oldest first."""
    e = t.events
    stmt = sa.select(e).where(e.c.outbox_id == row_id).order_by(e.c.id)
    return [
        OutboxEvent(
            id=m["id"],
            outbox_id=m["outbox_id"],
            from_state=m["from_state"],
            to_state=m["to_state"],
            reason=m["reason"],
            actor=m["actor"],
            orbit_task_id=m["orbit_task_id"],
            at=_aware(m["at"]),
        )
        for m in conn.execute(stmt).mappings()
    ]


def count_by_state(conn: Connection, t: OutboxTables) -> OutboxStatus:
    """Rows per state, live leases, the oldest pending row's age and the next due time."""
    o = t.outbox
    now = db_now(conn)
    counts = {s.value: 0 for s in OutboxState}
    for state, n in conn.execute(sa.select(o.c.state, sa.func.count()).group_by(o.c.state)):
        counts[state] = n
    pending = sa.select(
        sa.func.min(o.c.created_at),
        sa.func.min(o.c.available_at),
        sa.func.sum(sa.case((o.c.lease_expires_at > now, 1), else_=0)),
    ).where(o.c.state == PENDING)
    oldest, next_due, leased = conn.execute(pending).one()
    if isinstance(oldest, str):  # SQLite returns aggregates of datetimes as text
        oldest, next_due = datetime.fromisoformat(oldest), datetime.fromisoformat(next_due)
    return OutboxStatus(
        counts=counts,
        leased=int(leased or 0),
        oldest_pending_age_seconds=max(0.0, (now - oldest).total_seconds()) if oldest is not None else None,
        next_due_at=to_aware_utc(next_due),
        now=_aware(now),
    )


# --- operators ---------------------------------------------------------------------------------------


def retry_dead_row(conn: Connection, t: OutboxTables, row_id: int, *, now: datetime) -> bool:
    """``DEAD`` → ``PENDING`` with the same key, a fresh budget, due now. ``False`` if not ``DEAD``."""
    o = t.outbox
    result = conn.execute(
        sa.update(o)
        .where(o.c.id == row_id, o.c.state == DEAD)
        .values(state=PENDING, attempts=0, available_at=now, updated_at=now)
    )
    return result.rowcount == 1


def rows_to_reconcile(conn: Connection, t: OutboxTables, *, after_id: int, limit: int) -> list[OutboxRow]:
    """``NEEDS_RECONCILE`` rows with ``id > after_id``, by id, at most ``limit``."""
    return list_rows(conn, t, state=NEEDS_RECONCILE, limit=limit, after_id=after_id)


def record_reconciled_delivered(
    conn: Connection, t: OutboxTables, row_id: int, *, now: datetime, task_id: str
) -> bool:
    """``NEEDS_RECONCILE`` → ``DELIVERED`` with the task found for the key. ``False`` if no longer there."""
    o = t.outbox
    result = conn.execute(
        sa.update(o)
        .where(o.c.id == row_id, o.c.state == NEEDS_RECONCILE)
        .values(state=DELIVERED, orbit_task_id=task_id, delivered_at=now, last_error=None, updated_at=now)
    )
    return result.rowcount == 1


def record_reconciled_pending(conn: Connection, t: OutboxTables, row_id: int, *, now: datetime) -> bool:
    """``NEEDS_RECONCILE`` → ``PENDING``, same key, fresh budget, due now. ``False`` if no longer there."""
    o = t.outbox
    result = conn.execute(
        sa.update(o)
        .where(o.c.id == row_id, o.c.state == NEEDS_RECONCILE)
        .values(state=PENDING, attempts=0, available_at=now, updated_at=now)
    )
    return result.rowcount == 1


def record_reconcile_mismatch(
    conn: Connection, t: OutboxTables, row_id: int, *, now: datetime, error: str
) -> bool:
    """Keep a ``NEEDS_RECONCILE`` row where it is, with why in ``last_error``."""
    o = t.outbox
    result = conn.execute(
        sa.update(o)
        .where(o.c.id == row_id, o.c.state == NEEDS_RECONCILE)
        .values(last_error=_clip(error), updated_at=now)
    )
    return result.rowcount == 1


def abandon_row(conn: Connection, t: OutboxTables, row_id: int, *, now: datetime, error: str) -> bool:
    """``NEEDS_RECONCILE`` → ``DEAD`` by an operator's decision, with why in ``last_error``.
    ``False`` if no longer ``NEEDS_RECONCILE``."""
    o = t.outbox
    result = conn.execute(
        sa.update(o)
        .where(o.c.id == row_id, o.c.state == NEEDS_RECONCILE)
        .values(state=DEAD, last_error=_clip(error), updated_at=now)
    )
    return result.rowcount == 1


def purge_delivered_batch(conn: Connection, t: OutboxTables, *, cutoff: datetime, batch_size: int) -> int:
    """Delete up to ``batch_size`` ``DELIVERED`` rows delivered before ``cutoff``, and their events.

    Only ``DELIVERED`` rows are ever deleted (the ``DELETE`` repeats the condition).
    Returns the number of rows deleted.
    """
    o, e = t.outbox, t.events
    ids = list(
        conn.scalars(
            sa.select(o.c.id)
            .where(o.c.state == DELIVERED, o.c.delivered_at < cutoff)
            .order_by(o.c.delivered_at)
            .limit(batch_size)
        )
    )
    if not ids:
        return 0
    deleted = conn.execute(sa.delete(o).where(o.c.id.in_(ids), o.c.state == DELIVERED)).rowcount
    conn.execute(sa.delete(e).where(e.c.outbox_id.in_(ids)))
    return int(deleted)


def ids_of(rows: Iterable[OutboxRow]) -> list[int]:
    """The ids of ``rows``, in order."""
    return [r.id for r in rows]


# --- inbox -------------------------------------------------------------------------------------------


def inbox_contains(conn: Connection, t: OutboxTables, *, subscription: str, event_id: str) -> bool:
    """Whether ``event_id`` is already in the inbox for ``subscription`` (applied or recorded ``FAILED``)."""
    i = t.inbox
    stmt = sa.select(i.c.id).where(i.c.subscription == subscription, i.c.event_id == event_id)
    return conn.execute(stmt).first() is not None


def insert_inbox_row(
    conn: Connection,
    t: OutboxTables,
    *,
    event_id: str,
    subscription: str,
    namespace: str,
    task_id: str,
    status: str,
    outcome: InboxOutcome,
    delivery_count: int,
    error: str | None = None,
    event: Mapping[str, Any] | None = None,
    processed: bool = False,
) -> int:
    """Insert the inbox row of one event; ``received_at`` (and with ``processed``, ``processed_at``)
    from the database clock. Returns its id.

    Raises:
        sqlalchemy.exc.IntegrityError: the event is already there for this subscription
            (on PostgreSQL the transaction is then aborted: the caller rolls back).
    """
    now = now_sql(conn.dialect.name)
    result = conn.execute(
        t.inbox.insert().values(
            event_id=event_id,
            subscription=subscription,
            namespace=namespace,
            task_id=task_id,
            status=status,
            outcome=outcome.value,
            delivery_count=delivery_count,
            error=_clip(error),
            event=dict(event) if event is not None else None,
            received_at=now,
            processed_at=now if processed else None,
        )
    )
    key = result.inserted_primary_key
    assert key is not None and key[0] is not None
    return int(key[0])


def mark_inbox_processed(conn: Connection, t: OutboxTables, row_id: int) -> None:
    """Set ``processed_at`` of inbox row ``row_id`` to the database's now (the handler returned)."""
    i = t.inbox
    conn.execute(sa.update(i).where(i.c.id == row_id).values(processed_at=now_sql(conn.dialect.name)))


def _inbox_row(m: RowMapping) -> InboxRow:
    return InboxRow(
        id=m["id"],
        event_id=m["event_id"],
        subscription=m["subscription"],
        namespace=m["namespace"],
        task_id=m["task_id"],
        status=m["status"],
        outcome=m["outcome"],
        delivery_count=m["delivery_count"],
        error=m["error"],
        event=m["event"],
        received_at=_aware(m["received_at"]),
        processed_at=to_aware_utc(m["processed_at"]),
    )


def get_inbox_row(conn: Connection, t: OutboxTables, *, subscription: str, event_id: str) -> InboxRow | None:
    """The inbox row of ``event_id`` for ``subscription``, or ``None``."""
    i = t.inbox
    stmt = sa.select(i).where(i.c.subscription == subscription, i.c.event_id == event_id)
    found = conn.execute(stmt).mappings().first()
    return _inbox_row(found) if found is not None else None


def list_inbox(
    conn: Connection,
    t: OutboxTables,
    *,
    outcome: str | None,
    subscription: str | None = None,
    limit: int,
    after_id: int = 0,
) -> list[InboxRow]:
    """Inbox rows with ``id > after_id`` (of ``outcome`` / ``subscription`` when given), by id, at most ``limit``."""
    i = t.inbox
    stmt = sa.select(i).where(i.c.id > after_id).order_by(i.c.id).limit(limit)
    if outcome is not None:
        stmt = stmt.where(i.c.outcome == outcome)
    if subscription is not None:
        stmt = stmt.where(i.c.subscription == subscription)
    return [_inbox_row(m) for m in conn.execute(stmt).mappings()]
