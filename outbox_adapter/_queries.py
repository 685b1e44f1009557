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

This module holds the statements of the delivery path (enqueue, claim, record, audit) and
the row lookup; the operators' reads and repairs are ``_operator_queries``, the inbox's
statements ``_inbox_queries``.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
import weakref
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RowMapping

from outbox_adapter._db import now_sql, record_of
from outbox_adapter._models import OutboxRow
from outbox_adapter._tables import OutboxState, OutboxTables, RowKind

__all__ = [
    "UNSENT",
    "Claim",
    "Finish",
    "add_events",
    "claim_batch",
    "clip",
    "event_values",
    "finish_claims",
    "get_row",
    "insert_row",
    "insert_statement",
    "live_claims",
    "record_dead",
    "record_delivered",
    "row_parameters",
    "row_shape",
    "select_due",
    "take_rows",
]

#: ``to_state`` of the audit event a purged ``DEAD`` row leaves behind (the row itself is deleted).
PURGED = "PURGED"
PENDING, DELIVERED, DEAD, NEEDS_RECONCILE, ABANDONED = (
    OutboxState.PENDING.value,
    OutboxState.DELIVERED.value,
    OutboxState.DEAD.value,
    OutboxState.NEEDS_RECONCILE.value,
    OutboxState.ABANDONED.value,
)
#: States that hold back later rows of the same ordering key: everything neither delivered nor abandoned.
UNSENT = (PENDING, DEAD, NEEDS_RECONCILE)
_UNSENT = UNSENT
#: Longest ``last_error`` / ``reason`` stored, in characters.
_ERROR_MAX = 2000


def clip(text: str | None) -> str | None:
    """``text`` cut to the longest ``last_error`` / ``reason`` stored."""
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
    claimed_at: datetime | None = None
    options: dict[str, Any] | None = field(default=None, repr=False)
    params: Any = field(default=None, repr=False)
    #: When the row was enqueued (database clock): the relay's key-window check compares it.
    created_at: datetime | None = None
    #: W3C Trace Context stored at enqueue (README "Tracing"); ``None``: none.
    traceparent: str | None = None
    tracestate: str | None = None
    #: ``"task"`` or ``"flow"`` (README "Starting flows from the outbox"); a flow row's flow is ``flow``.
    kind: str = "task"
    flow: str | None = None

    @property
    def is_flow(self) -> bool:
        """Whether the row starts a flow instance (``params`` is its input) rather than a task."""
        return self.kind == RowKind.FLOW.value


# --- enqueue -----------------------------------------------------------------------------------------


_insert_statements: weakref.WeakKeyDictionary[OutboxTables, dict[tuple[str, frozenset[str]], sa.Insert]] = (
    weakref.WeakKeyDictionary()
)
#: The values every new row binds, one parameter each.
_INSERT_COLUMNS = ("idempotency_key", "namespace", "queue", "handler", "params", "kind")
#: Nullable columns without a default, bound only when the row has a value: one left out is NULL, so
#: the ``INSERT`` of a row without them is shorter (less for the database to parse and store for
#: nothing). ``available_at`` too: left out, it is the database clock.
_OPTIONAL_COLUMNS = (
    "options", "ordering_key", "business_ref", "max_attempts", "traceparent", "tracestate", "flow", "available_at",
)  # fmt: skip
_PARAMETER = {c: f"b_{c}" for c in (*_INSERT_COLUMNS, *_OPTIONAL_COLUMNS)}


def row_shape(values: Mapping[str, Any]) -> frozenset[str]:
    """The optional columns (:data:`_OPTIONAL_COLUMNS`) that ``values`` gives a value (not ``None``):
    which :func:`insert_statement` inserts them."""
    return frozenset(c for c in _OPTIONAL_COLUMNS if values.get(c) is not None)


def insert_statement(t: OutboxTables, dialect_name: str, shape: frozenset[str]) -> sa.Insert:
    """The ``INSERT`` of a new ``PENDING`` row binding the columns every row has and the optional ones
    in ``shape`` (:func:`row_shape`), built once per tables, dialect and shape: each value a bound
    parameter ``b_<column>``; the optional columns outside ``shape`` are left to their default
    (``NULL``); ``created_at``, ``updated_at`` (and ``available_at`` outside ``shape``) from the
    database clock, in the same statement."""
    key = (dialect_name, shape)
    with _statements_lock:
        found = _insert_statements.setdefault(t, {}).get(key)
    if found is not None:
        return found
    o = t.outbox
    now = now_sql(dialect_name)
    columns = [c for c in (*_INSERT_COLUMNS, *_OPTIONAL_COLUMNS) if c in _INSERT_COLUMNS or c in shape]
    values: dict[str, Any] = {c: sa.bindparam(_PARAMETER[c], type_=o.c[c].type) for c in columns}
    values.update(
        # Constants of every new row, written into the SQL (no parameters to convert and escape).
        state=sa.literal_column(f"'{PENDING}'", o.c.state.type),
        attempts=sa.literal_column("0", o.c.attempts.type),
        send_count=sa.literal_column("0", o.c.send_count.type),
        created_at=now,
        updated_at=now,
    )
    if "available_at" not in shape:
        values["available_at"] = now
    stmt = o.insert().values(values)
    with _statements_lock:
        _insert_statements[t][key] = stmt
    return stmt


def insert_row(
    t: OutboxTables, values: Mapping[str, Any], dialect_name: str
) -> tuple[sa.Insert, dict[str, Any]]:
    """The statement (:func:`insert_statement` of the row's shape) and parameters inserting one new
    ``PENDING`` row with ``values`` (the columns of ``_INSERT_COLUMNS`` and ``_OPTIONAL_COLUMNS``; a
    missing or ``None`` optional one is ``NULL``, ``available_at`` the database clock). The caller
    executes it on its own connection."""
    shape = row_shape(values)
    return insert_statement(t, dialect_name, shape), row_parameters(values, shape)


def row_parameters(values: Mapping[str, Any], shape: frozenset[str]) -> dict[str, Any]:
    """The parameters of :func:`insert_statement` of ``shape`` (:func:`row_shape` of ``values``)."""
    params = {_PARAMETER[c]: values.get(c) for c in _INSERT_COLUMNS}
    params["b_kind"] = params["b_kind"] or RowKind.TASK.value
    for c in shape:
        params[_PARAMETER[c]] = values[c]
    return params


# --- relay -------------------------------------------------------------------------------------------


class _ClaimStatements:
    """The claim's statements for one ``OutboxTables`` and dialect, built once (they were rebuilt on
    every claim, most of the relay's CPU); every value is a bound parameter."""

    def __init__(self, t: OutboxTables, dialect_name: str) -> None:
        o = t.outbox
        now = now_sql(dialect_name)
        earlier = o.alias("earlier")
        blocked = (
            sa.select(earlier.c.id)
            .where(
                earlier.c.ordering_key == o.c.ordering_key,
                earlier.c.state.in_(_UNSENT),
                # Commit order of the key (README "Ordering keys"), not id order.
                earlier.c.ordering_seq < o.c.ordering_seq,
            )
            .exists()
        )
        # The database clock rides along with the rows, so a claim needs no separate clock read.
        select = (
            sa.select(o, now.label("claim_now"))
            .where(
                o.c.state == PENDING, o.c.available_at <= now, sa.or_(o.c.ordering_key.is_(None), ~blocked)
            )
            .order_by(o.c.available_at, o.c.id)
            .limit(sa.bindparam("b_limit", type_=sa.Integer))
        )
        self.select = self._lock(select, o, dialect_name)
        self.select_excluding = self._lock(
            select.where(o.c.id.not_in(sa.bindparam("b_exclude", expanding=True))), o, dialect_name
        )
        # The claim itself is a conditional update: still PENDING, still due, still carrying the
        # token the select saw. With a locking clause that locks nothing (TiDB), a row another
        # relay claimed meanwhile no longer matches, so it is never claimed twice.
        take = (
            sa.update(o)
            .where(
                o.c.id.in_(sa.bindparam("b_ids", expanding=True)),
                o.c.state == PENDING,
                o.c.available_at <= sa.bindparam("b_now", type_=o.c.available_at.type),
            )
            .values(
                lease_owner=sa.bindparam("b_owner"),
                lease_token=sa.bindparam("b_token"),
                lease_expires_at=sa.bindparam("b_expires", type_=o.c.lease_expires_at.type),
                available_at=sa.bindparam("b_expires", type_=o.c.available_at.type),
                attempts=o.c.attempts + 1,
                send_count=o.c.send_count + 1,
                updated_at=sa.bindparam("b_now", type_=o.c.updated_at.type),
            )
        )
        self.take_free = take.where(o.c.lease_token.is_(None))
        self.take_expired = take.where(o.c.lease_token == sa.bindparam("b_old_token"))
        self.taken = sa.select(o.c.id).where(
            o.c.id.in_(sa.bindparam("b_ids", expanding=True)), o.c.lease_token == sa.bindparam("b_token")
        )
        self.spend = (
            sa.update(o)
            .where(
                o.c.id == sa.bindparam("b_id"),
                o.c.state == PENDING,
                o.c.available_at <= sa.bindparam("b_now", type_=o.c.available_at.type),
                o.c.lease_token == sa.bindparam("b_old_token"),
            )
            .values(
                state=NEEDS_RECONCILE,
                lease_owner=None,
                lease_token=None,
                lease_expires_at=None,
                available_at=sa.bindparam("b_now", type_=o.c.available_at.type),
                last_error=sa.bindparam("b_error"),
                updated_at=sa.bindparam("b_now", type_=o.c.updated_at.type),
            )
        )

    @staticmethod
    def _lock(stmt: sa.Select[Any], o: sa.Table, dialect_name: str) -> sa.Select[Any]:
        if not LOCK_CLAIMS:
            return stmt
        if dialect_name == "postgresql":
            return stmt.with_for_update(skip_locked=True, of=o)
        if dialect_name == "mysql":
            return stmt.with_for_update(skip_locked=True)
        return stmt


#: Take ``FOR UPDATE SKIP LOCKED`` in the claim's select. Tests turn it off to show that claims
#: stay disjoint without it (DESIGN §5: some MySQL-compatible engines parse it and lock nothing).
#: **Test-only:** a relay process started with ``ORBIT_TEST_CLAIMS_WITHOUT_LOCKS=1`` starts with it
#: off (``python -m bench.chaos --no-skip-locked``; the server reads the same variable).
LOCK_CLAIMS = os.environ.get("ORBIT_TEST_CLAIMS_WITHOUT_LOCKS", "").strip().lower() not in {
    "1",
    "true",
    "yes",
}

_claim_statements: weakref.WeakKeyDictionary[OutboxTables, dict[tuple[str, bool], _ClaimStatements]] = (
    weakref.WeakKeyDictionary()
)
_statements_lock = threading.Lock()


def claim_statements(t: OutboxTables, dialect_name: str) -> _ClaimStatements:
    """The claim statements of ``t`` on ``dialect_name``, built on first use and kept with ``t``."""
    key = (dialect_name, LOCK_CLAIMS)
    with _statements_lock:
        per_tables = _claim_statements.setdefault(t, {})
        found = per_tables.get(key)
        if found is None:
            found = per_tables[key] = _ClaimStatements(t, dialect_name)
            if not LOCK_CLAIMS:
                logging.getLogger("outbox_adapter.relay").warning(
                    "ORBIT_TEST_CLAIMS_WITHOUT_LOCKS is set: claims take no FOR UPDATE SKIP LOCKED (a test-only "
                    "switch; never in production)"
                )
        return found


def _as_datetime(value: Any) -> datetime:
    if isinstance(value, str):  # SQLite: a bare literal column comes back as text
        return datetime.fromisoformat(value)
    assert isinstance(value, datetime)
    return value.replace(tzinfo=None)


def select_due(
    conn: Connection, t: OutboxTables, *, limit: int, exclude_ids: Collection[int] = ()
) -> list[RowMapping]:
    """The claim's select: up to ``limit`` due rows, oldest ``available_at`` first, each with the
    database clock as ``claim_now``; locked ``FOR UPDATE SKIP LOCKED`` where the dialect has it."""
    stmts = claim_statements(t, conn.dialect.name)
    if exclude_ids:
        result = conn.execute(stmts.select_excluding, {"b_limit": limit, "b_exclude": sorted(exclude_ids)})
    else:
        result = conn.execute(stmts.select, {"b_limit": limit})
    return list(result.mappings().all())


def take_rows(
    conn: Connection,
    t: OutboxTables,
    rows: Sequence[RowMapping],
    *,
    owner: str,
    lease_seconds: float,
    default_max_attempts: int,
    actor: str,
) -> tuple[list[Claim], list[int]]:
    """Lease ``rows`` (as :func:`select_due` saw them) with one conditional update per token they
    carried, and check the row count; see :func:`claim_batch`."""
    if not rows:
        return [], []
    stmts = claim_statements(t, conn.dialect.name)
    now = _as_datetime(rows[0]["claim_now"])
    expires = now + timedelta(seconds=lease_seconds)
    token = str(uuid.uuid4())
    wanted: list[RowMapping] = []
    spent: list[RowMapping] = []
    for row in rows:
        budget = row["max_attempts"] or default_max_attempts
        if row["lease_token"] is not None and row["attempts"] >= budget:
            spent.append(row)
        else:
            wanted.append(row)
    taken_ids: set[int] = set()
    if wanted:
        by_token: dict[str | None, list[int]] = {}
        for row in wanted:
            by_token.setdefault(row["lease_token"], []).append(row["id"])
        params = {"b_owner": owner, "b_token": token, "b_expires": expires, "b_now": now}
        count = 0
        for old_token, ids in by_token.items():
            if old_token is None:
                count += conn.execute(stmts.take_free, {**params, "b_ids": ids}).rowcount
            else:
                count += conn.execute(
                    stmts.take_expired, {**params, "b_ids": ids, "b_old_token": old_token}
                ).rowcount
        all_ids = [row["id"] for row in wanted]
        if count == len(all_ids):
            taken_ids = set(all_ids)
        else:  # another relay claimed some of them since the select: keep only those carrying our token
            taken_ids = set(conn.scalars(stmts.taken, {"b_ids": all_ids, "b_token": token}))
    claims = [
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
            budget=row["max_attempts"] or default_max_attempts,
            token=token,
            lease_expires_at=expires,
            claimed_at=now,
            options=row["options"],
            params=row["params"],
            created_at=_as_datetime(row["created_at"]),
            traceparent=row["traceparent"],
            tracestate=row["tracestate"],
            kind=row["kind"],
            flow=row["flow"],
        )
        for row in wanted
        if row["id"] in taken_ids
    ]
    events = []
    moved: list[int] = []
    for row in spent:
        reason = (
            f"the lease of {row['lease_owner']} expired without a recorded outcome and the budget of "
            f"{row['attempts']} possibly-accepted sends is spent; the task may exist: run `orbit-outbox reconcile`"
        )
        params = {
            "b_id": row["id"],
            "b_now": now,
            "b_old_token": row["lease_token"],
            "b_error": clip(reason),
        }
        if conn.execute(stmts.spend, params).rowcount != 1:
            continue  # another relay decided first
        moved.append(row["id"])
        events.append(event_values(row["id"], PENDING, NEEDS_RECONCILE, reason=reason, actor=actor, now=now))
    add_events(conn, t, events)
    return claims, moved


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

    Correctness does not rest on that lock (DESIGN §5): the claim is a conditional update
    (still ``PENDING``, still due, still carrying the lease token the select saw) whose row
    count is checked; when it is short, the rows that carry this claim's new token are read
    back and only those are returned. A row is never claimed (nor its attempt counted) twice.

    A due row that still carries a token had its previous lease expire without a
    recorded outcome (its relay died or stalled): that send's outcome is unknown and
    was counted at its claim. If its budget is spent, it goes to ``NEEDS_RECONCILE``
    here instead of being sent (DESIGN §5: never ``DEAD``).

    ``exclude_ids`` are never claimed (a ``--once`` run skips rows it already saw refused).

    Returns:
        The claims (all with one token, ``lease_expires_at`` and ``claimed_at``, database
        clock), and the ids moved to ``NEEDS_RECONCILE``.
    """
    rows = select_due(conn, t, limit=limit, exclude_ids=exclude_ids)
    return take_rows(
        conn,
        t,
        rows,
        owner=owner,
        lease_seconds=lease_seconds,
        default_max_attempts=default_max_attempts,
        actor=actor,
    )


@dataclass(frozen=True, kw_only=True)
class Finish:
    """How one claimed row ends its lease (one recorded outcome).

    ``state`` is where the row goes; ``PENDING`` is a retry due at ``available_at`` (a
    release: due now), with the attempt given back when ``give_back``. ``error``,
    ``status_code`` and ``task_id`` go to ``last_error``, ``last_status_code`` and
    ``orbit_task_id``.
    """

    row_id: int
    state: str
    error: str | None = None
    status_code: int | None = None
    task_id: str | None = None
    available_at: datetime | None = None
    give_back: bool = False


#: Columns an outcome writes, besides the lease it ends; a value shared by every row of a group is
#: one bound parameter, one that differs is a CASE on the id.
_FINISH_COLUMNS = ("last_error", "last_status_code", "orbit_task_id", "available_at", "delivered_at")

_finish_statements: weakref.WeakKeyDictionary[OutboxTables, dict[tuple[Any, ...], sa.Update]] = (
    weakref.WeakKeyDictionary()
)


def _finish_values(f: Finish, now: datetime) -> dict[str, Any]:
    values: dict[str, Any] = {"last_error": clip(f.error), "last_status_code": f.status_code}
    if f.state == DELIVERED:
        values.update(orbit_task_id=f.task_id, delivered_at=now, last_error=None)
    if f.state == PENDING:
        values["available_at"] = f.available_at if f.available_at is not None else now
    return values


def _finish_statement(
    t: OutboxTables, state: str, give_back: bool, shape: tuple[tuple[str, bool], ...], n: int
) -> sa.Update:
    """``UPDATE ... WHERE id IN (n ids) AND lease_token = :token AND state = PENDING AND
    lease_expires_at > :now``, built once per shape (kept with ``t``)."""
    key = (state, give_back, shape, n)
    with _statements_lock:
        cached = _finish_statements.setdefault(t, {}).get(key)
    if cached is not None:
        return cached
    o = t.outbox
    ids = [sa.bindparam(f"b_id_{i}", type_=o.c.id.type) for i in range(n)]
    values: dict[str, Any] = {
        "state": state,
        "lease_owner": None,
        "lease_token": None,
        "lease_expires_at": None,
        "updated_at": sa.bindparam("b_now", type_=o.c.updated_at.type),
    }
    for column, varies in shape:
        col_type = o.c[column].type
        if varies:
            values[column] = sa.case(
                *[(o.c.id == ids[i], sa.bindparam(f"b_{column}_{i}", type_=col_type)) for i in range(n)]
            )
        else:
            values[column] = sa.bindparam(f"b_{column}", type_=col_type)
    if give_back:
        values["attempts"] = o.c.attempts - 1
    stmt = (
        sa.update(o)
        .where(
            o.c.id.in_(ids),
            o.c.lease_token == sa.bindparam("b_token"),
            o.c.state == PENDING,
            o.c.lease_expires_at > sa.bindparam("b_now", type_=o.c.lease_expires_at.type),
        )
        .values(values)
    )
    with _statements_lock:
        _finish_statements[t][key] = stmt
    return stmt


def finish_claims(
    conn: Connection, t: OutboxTables, finishes: Sequence[Finish], *, token: str, now: datetime
) -> bool:
    """End the leases of ``finishes`` (rows of one claim, token ``token``): one conditional update
    per outcome class, set-based, fenced on ``(id, lease_token)`` with a live lease at ``now``.

    Returns:
        ``True`` when every row was written; ``False`` when a row count came up short (some
        lease was lost: expired or taken over). The caller then rolls back and records only
        the rows :func:`live_claims` finds.
    """
    groups: dict[tuple[str, bool], list[tuple[int, dict[str, Any]]]] = {}
    for f in finishes:
        groups.setdefault((f.state, f.give_back), []).append((f.row_id, _finish_values(f, now)))
    for (state, give_back), members in groups.items():
        columns = sorted(members[0][1])
        shape = tuple(
            (column, any(values[column] != members[0][1][column] for _, values in members[1:]))
            for column in columns
        )
        stmt = _finish_statement(t, state, give_back, shape, len(members))
        params: dict[str, Any] = {"b_token": token, "b_now": now}
        for i, (row_id, values) in enumerate(members):
            params[f"b_id_{i}"] = row_id
            for column, varies in shape:
                if varies:
                    params[f"b_{column}_{i}"] = values[column]
        for column, varies in shape:
            if not varies:
                params[f"b_{column}"] = members[0][1][column]
        if conn.execute(stmt, params).rowcount != len(members):
            return False
    return True


def live_claims(
    conn: Connection, t: OutboxTables, ids: Collection[int], *, token: str, now: datetime
) -> set[int]:
    """Which of ``ids`` still carry ``token`` with a live lease at ``now``, locked for the rest of the
    transaction (not on SQLite: single writer). One ``SELECT``."""
    o = t.outbox
    stmt = sa.select(o.c.id).where(
        o.c.id.in_(sorted(ids)), o.c.lease_token == token, o.c.state == PENDING, o.c.lease_expires_at > now
    )
    if conn.dialect.name != "sqlite":
        stmt = stmt.with_for_update()
    return set(conn.scalars(stmt))


def record_delivered(
    conn: Connection, t: OutboxTables, claim: Claim, *, now: datetime, task_id: str, status_code: int
) -> bool:
    """``PENDING`` (leased) → ``DELIVERED`` with the Orbit task id. ``False``: lease lost, nothing written."""
    finish = Finish(row_id=claim.id, state=DELIVERED, task_id=task_id, status_code=status_code)
    return finish_claims(conn, t, [finish], token=claim.token, now=now)


def record_dead(
    conn: Connection, t: OutboxTables, claim: Claim, *, now: datetime, error: str, status_code: int | None
) -> bool:
    """``PENDING`` (leased) → ``DEAD``: permanently refused. ``False``: lease lost, nothing written."""
    finish = Finish(row_id=claim.id, state=DEAD, error=error, status_code=status_code)
    return finish_claims(conn, t, [finish], token=claim.token, now=now)


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
        "reason": clip(reason),
        "actor": actor[:255],
        "orbit_task_id": task_id,
        "at": now,
    }


# --- reads -------------------------------------------------------------------------------------------


def get_row(conn: Connection, t: OutboxTables, row_id: int, *, for_update: bool = False) -> OutboxRow | None:
    """The row with id ``row_id``, or ``None``. ``for_update`` locks it (not on SQLite: single writer)."""
    stmt = sa.select(t.outbox).where(t.outbox.c.id == row_id)
    if for_update and conn.dialect.name != "sqlite":
        stmt = stmt.with_for_update()
    found = conn.execute(stmt).mappings().first()
    return record_of(OutboxRow, found) if found is not None else None
