"""An attempt call's reads and checks: lock the attempt's task and read it with the attempt and the
database clock in one statement (:func:`_locked_attempt`; on MariaDB, a ``complete``'s plain path also
writes its result event in that statement: :func:`_lock_and_record`), judge the attempt's lease
(:func:`_check_token`, :func:`_holds`, :func:`_lapsed`, :func:`_lost`, :func:`_confirmed`) and answer the
call from the rows as written (:func:`_state`); :func:`gate_paused`, a column that tells whether the task's
queue is paused.

Used by :mod:`.attempts` (start, heartbeat, complete, fail) and :mod:`.attempt_sets` (their batches). The
writes these reads lead to are :mod:`.transitions`' (:func:`~orbit_server.tasks.transitions.apply_transition`,
``_update_attempt``, and ``_expire_attempt`` for a lapsed lease), which this module imports and which imports
nothing of it; the lock order (the task row before its attempts) is the one :mod:`.transitions` states.
"""

from __future__ import annotations

import hmac
import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from orbit_client import AttemptState, AttemptStatus, TaskStatus
from orbit_server import _ids, errors
from orbit_server.db.driver_sql import DriverSQL
from orbit_server.db.packed_rows import packed, packs, unpacked
from orbit_server.db.schema import queue_gates, task_attempts, tasks
from orbit_server.tasks import result_events
from orbit_server.tasks.transitions import (
    _LIVE,
    _TASK_COLUMNS,
    _at,
    _clock,
    _expire_attempt,
    _hash_token,
    _naive,
)

#: An attempt's identity and lease: what every report's checks read (also :mod:`.attempt_sets`' batches).
_LEASE_COLUMNS = (
    task_attempts.c.id,
    task_attempts.c.task_id,
    task_attempts.c.generation,
    task_attempts.c.lease_token_hash,
    task_attempts.c.worker_id,
    task_attempts.c.status,
    task_attempts.c.lease_seconds,
    task_attempts.c.lease_expires_at,
)
#: The attempt columns :func:`_locked_attempt` reads.
_ATTEMPT_COLUMNS = (
    *_LEASE_COLUMNS,
    task_attempts.c.result,
    task_attempts.c.error,
    task_attempts.c.leased_at,
    task_attempts.c.started_at,
)
#: The columns only the rare paths of a start, heartbeat or complete need (an expiry, a paused queue's give-back,
#: a repeated or conflicting report): a ``lean`` :func:`_locked_attempt` leaves them out (each column of a
#: result costs the server the parsing of its description, whatever its value: issue 28).
_RARE_TASK_COLUMNS = frozenset(
    {"attempt_count", "max_attempts", "retry_safe", "deadline", "backoff_base_seconds", "backoff_cap_seconds"}
)
_RARE_ATTEMPT_COLUMNS = frozenset({"result", "error"})
#: :func:`_locked_attempt`'s statements, built once per dialect and kind.
_LOCKED_ATTEMPT: dict[tuple[str, bool, bool, bool], sa.Executable] = {}
#: The packed forms (MariaDB) run through the driver: every column comes as the driver gives it (strings, the
#: clock as a ``datetime``), as :func:`_locked_attempt` reads them (:mod:`~orbit_server.db.driver_sql`).
_LOCKED_ATTEMPT_SQL: dict[tuple[str, bool, bool], DriverSQL] = {}


_LEAN_COLUMNS = (
    tuple(c for c in _TASK_COLUMNS if c.name not in _RARE_TASK_COLUMNS),
    tuple(c for c in _ATTEMPT_COLUMNS if c.name not in _RARE_ATTEMPT_COLUMNS),
)


def _columns(lean: bool) -> tuple[tuple[sa.Column[Any], ...], tuple[sa.Column[Any], ...]]:
    """The task and attempt columns :func:`_locked_attempt` reads (``lean``: without the rare ones)."""
    return _LEAN_COLUMNS if lean else (_TASK_COLUMNS, _ATTEMPT_COLUMNS)


def _locked_attempt_statement(conn: Connection, *, ending: bool = False, lean: bool = False) -> sa.Executable:
    """``SELECT <task>, <clock>, <attempt columns as scalar subqueries> FROM tasks WHERE id = <the
    attempt's task> AND namespace_id = :namespace_id FOR UPDATE``, with ``:attempt_id``.

    The attempt's columns come from subqueries, so the locking clause locks the task row alone
    (MySQL/MariaDB and PostgreSQL lock no rows read by a nested subquery): the lock order stays
    task first.

    ``ending`` (a call that may end the attempt with a result event: complete, fail), on MySQL/MariaDB and
    PostgreSQL: also the task's ``retry_of`` and :func:`~orbit_server.tasks.result_events.locked_subscribers`,
    which takes the result event's shared locks (namespace and queue; on MySQL/MariaDB then the
    subscriptions) in this statement rather than later in the transaction: a statement less for the event.

    ``lean``: without the columns only the rare paths read (:data:`_RARE_TASK_COLUMNS`, :data:`_RARE_ATTEMPT_COLUMNS`);
    on MariaDB the task's and the attempt's columns then come as one column each, ``task_row`` and
    ``attempt_row`` (:func:`~orbit_server.db.packed_rows.packed`).
    """
    name = conn.dialect.name
    ending = ending and name in ("mysql", "postgresql")
    pack = lean and packs(conn.dialect)
    statement = _LOCKED_ATTEMPT.get((name, ending, lean, pack))
    if statement is None:
        task_columns, attempt_columns = _columns(lean)
        attempt_id = sa.bindparam("attempt_id", type_=task_attempts.c.id.type)

        def of(column: sa.Column[Any]) -> sa.Label[Any]:
            return (
                sa.select(column)
                .where(task_attempts.c.id == attempt_id)
                .scalar_subquery()
                .label(f"attempt_{column.name}")
            )

        clock = _clock(conn)
        extra = (tasks.c.retry_of, result_events.locked_subscribers(clock, name)) if ending else ()
        task_of_attempt = sa.select(task_attempts.c.task_id).where(task_attempts.c.id == attempt_id)
        if pack:  # every column small: the packed row stays far below max_allowed_packet
            attempt_row = sa.select(packed(attempt_columns)).where(task_attempts.c.id == attempt_id)
            read: tuple[sa.ColumnElement[Any], ...] = (
                packed(task_columns).label("task_row"),
                clock.label("db_now"),
                gate_paused(),
                attempt_row.scalar_subquery().label("attempt_row"),
            )
        else:
            read = (*task_columns, clock.label("db_now"), gate_paused(), *(of(c) for c in attempt_columns))
        statement = _LOCKED_ATTEMPT[(name, ending, lean, pack)] = (
            sa.select(*read, *extra)
            .where(
                tasks.c.id == task_of_attempt.scalar_subquery(),
                tasks.c.namespace_id == sa.bindparam("namespace_id"),
            )
            .with_for_update()
        )
    return statement


def gate_paused() -> sa.Label[Any]:
    """Whether the task's queue is paused, as a column of a statement over ``tasks`` (no lock)."""
    return (
        sa.select(queue_gates.c.paused)
        .where(queue_gates.c.queue_id == tasks.c.queue_id)
        .scalar_subquery()
        .label("gate_paused")
    )


def _locked_attempt(
    conn: Connection, namespace_id: int, attempt_id: str, *, ending: bool = False, lean: bool = False
) -> tuple[dict[str, Any], dict[str, Any], datetime]:
    """Lock the attempt's task, and read it, the attempt and the database clock in one statement.

    ``ending``: the call may end the attempt with a result event (complete, fail); on MySQL/MariaDB and
    PostgreSQL the same statement then takes the result event's shared locks (MySQL/MariaDB: and reads its
    subscriptions)
    (:func:`_locked_attempt_statement`), kept on the task as ``subscribers`` for
    :func:`~orbit_server.tasks.transitions.apply_transition`.

    ``lean``: the rows without the columns only the rare paths need (:data:`_RARE_TASK_COLUMNS`,
    :data:`_RARE_ATTEMPT_COLUMNS`: the dictionaries lack those keys); a caller that finds itself on such a path
    (:func:`_holds` is false) reads everything again, still under the task's lock.

    Returns ``(task, attempt, now)``. The task row is read under its lock; the attempt row is
    read by a subquery of the same statement, without a lock (lock order: task first), so it
    may be as old as the statement's start. Every change to an attempt is made under its task's
    lock, so a change that landed in between can only make a later conditional update miss: it
    then raises :class:`errors.ConcurrentUpdate` and :func:`transact` runs the call again on
    fresh rows.

    Raises:
        errors.AttemptNotFound: no such attempt in the namespace (404).
    """
    if not _ids.can_exist(attempt_id):  # never a row; MariaDB would not even compare it
        raise errors.AttemptNotFound(f"no attempt {attempt_id!r} in this namespace")
    params = {"attempt_id": attempt_id, "namespace_id": namespace_id}
    if lean and packs(conn.dialect):
        key = (conn.dialect.name, ending, lean)
        driver = _LOCKED_ATTEMPT_SQL.get(key)
        if driver is None:
            driver = _LOCKED_ATTEMPT_SQL[key] = DriverSQL(
                _locked_attempt_statement(conn, ending=ending, lean=lean)
            )
        result = driver.execute(conn, params)
    else:
        result = conn.execute(_locked_attempt_statement(conn, ending=ending, lean=lean), params)
    row = result.mappings().first()
    if row is None:
        raise errors.AttemptNotFound(f"no attempt {attempt_id!r} in this namespace")
    task_columns, attempt_columns = _columns(lean)
    is_packed = "task_row" in row
    task = (
        unpacked(row["task_row"], task_columns)
        if is_packed
        else {column.name: row[column.name] for column in task_columns}
    )
    task["gate_paused"] = bool(row["gate_paused"])
    if "subscribers" in row:
        task["retry_of"] = row["retry_of"]
        task["subscribers"] = result_events.subscribers(task, row["subscribers"], conn.dialect.name)
    if is_packed:
        attempt = unpacked(row["attempt_row"], attempt_columns)
    else:
        attempt = {column.name: row[f"attempt_{column.name}"] for column in attempt_columns}
    return task, attempt, _naive(row["db_now"])


def _records_as_it_locks(dialect: sa.Dialect) -> bool:
    """Whether :func:`_lock_and_record` runs on this database: MariaDB 10.5 and later (``INSERT ... RETURNING``;
    MySQL has none)."""
    return (
        dialect.name == "mysql"
        and bool(getattr(dialect, "is_mariadb", False))
        and (dialect.server_version_info or (0,)) >= (10, 5)
    )


#: The task columns :func:`_lock_and_record` returns by locking reads of the row it has locked (the newest row).
_RECORDED_TASK_COLUMNS = (
    "cancel_requested",
    "holds_permit",
    "flow_instance_id",
    "flow_token_id",
    "flow_activation",
)
#: The attempt columns it returns (read as :func:`_locked_attempt` reads them: without a lock).
_RECORDED_ATTEMPT_COLUMNS = ("generation", "worker_id", "lease_expires_at", "leased_at", "started_at")
#: The same as columns, to read their packed values back (:func:`~orbit_server.db.packed_rows.unpacked`).
_RECORDED_TASK_ROW = tuple(tasks.c[name] for name in _RECORDED_TASK_COLUMNS)
_RECORDED_ATTEMPT_ROW = tuple(task_attempts.c[name] for name in _RECORDED_ATTEMPT_COLUMNS)
#: :func:`_lock_and_record`'s statement, built once.
_LOCK_AND_RECORD: list[DriverSQL] = []


def _lock_and_record_statement() -> DriverSQL:
    """:func:`_lock_and_record`'s ``INSERT INTO result_events ... SELECT ... FROM tasks ... FOR UPDATE RETURNING
    ...``, with ``:r_id`` (the event's id), ``:attempt_id``, ``:hash`` (the token's digest), ``:namespace_id``,
    ``:status`` (the task's and the attempt's), ``:to_status``, ``:result`` and ``:error``."""
    if not _LOCK_AND_RECORD:
        # The task's and the attempt's columns packed, one lookup and one column each (:func:`~orbit_server.db.packed_rows.packed`).
        task_row = ", ".join(f"tasks.{c}" for c in _RECORDED_TASK_COLUMNS)
        attempt_row = ", ".join(f"task_attempts.{c}" for c in _RECORDED_ATTEMPT_COLUMNS)
        returned = [
            "result_events.task_id", "result_events.state_version", "result_events.occurred_at",
            "result_events.retry_of",
            f"(SELECT JSON_ARRAY({task_row}) FROM tasks WHERE tasks.id = result_events.task_id FOR UPDATE)"
            " AS task_row",
            f"(SELECT JSON_ARRAY({attempt_row}) FROM task_attempts WHERE task_attempts.id = :attempt_id)"
            " AS attempt_row",
            f"{result_events.mariadb_subscribers('result_events.task_id')} AS subscribers",
        ]  # fmt: skip
        _LOCK_AND_RECORD.append(
            DriverSQL(
                sa.text(
                    "INSERT INTO result_events (id, task_id, namespace_id, queue_id, handler, status, result, error,"
                    " state_version, occurred_at, retry_of)"
                    " SELECT :r_id, tasks.id, tasks.namespace_id, tasks.queue_id, tasks.handler, :to_status, :result,"
                    " :error, tasks.state_version + 1, UTC_TIMESTAMP(6), tasks.retry_of"
                    " FROM tasks FORCE INDEX (PRIMARY)"
                    " WHERE tasks.id = (SELECT task_attempts.task_id FROM task_attempts WHERE task_attempts.id = :attempt_id"
                    " AND task_attempts.lease_token_hash = :hash AND task_attempts.status = :status"
                    " AND task_attempts.lease_expires_at > UTC_TIMESTAMP(6))"
                    " AND tasks.namespace_id = :namespace_id AND tasks.status = :status"
                    " AND tasks.current_attempt_id = :attempt_id"
                    " FOR UPDATE RETURNING " + ", ".join(returned)
                ).bindparams(
                    sa.bindparam("r_id", type_=tasks.c.id.type),
                    sa.bindparam("attempt_id", type_=task_attempts.c.id.type),
                    sa.bindparam("result", type_=tasks.c.result.type),
                    sa.bindparam("error", type_=tasks.c.error.type),
                )
            )
        )
    return _LOCK_AND_RECORD[0]


def _lock_and_record(
    conn: Connection, namespace_id: int, attempt_id: str, lease_token: str, *, to: TaskStatus,
    values: Mapping[str, Any],
) -> tuple[dict[str, Any], dict[str, Any], datetime, str] | None:  # fmt: skip
    """MariaDB: a ``RUNNING`` attempt's plain ending with a result event (a ``complete``), its first statement
    also writing that event: one statement less than :func:`_locked_attempt` and the event apart.

    One ``INSERT INTO result_events ... SELECT ... FROM tasks ... FOR UPDATE`` locks the attempt's task by
    primary key, as :func:`_locked_attempt` does, and writes the result event of ``RUNNING → to`` only if the
    call is on its plain path: the attempt (read by a subquery, without a lock: lock order task first) is
    ``RUNNING`` with this token's digest and a lease not lapsed at the statement's ``UTC_TIMESTAMP(6)``, and the
    task (read under its lock) is in the namespace, ``RUNNING``, with this attempt current. The event is the
    task row as the transition will leave it: namespace, queue, handler and ``retry_of`` of the locked row,
    status ``to``, ``values``' result and error (what the transition sets), ``state_version`` + 1, and the
    statement's time. Its ``RETURNING`` clause gives what the call needs, reading the locked task again with
    locking reads (the newest row, never an older snapshot), and takes the event's shared locks and reads its
    subscriptions as the ``ending`` :func:`_locked_attempt` does
    (:func:`~orbit_server.tasks.result_events.mariadb_subscribers`: after the task's lock). ``result_events``
    has no ``AUTO_INCREMENT`` column: an ``INSERT ... SELECT`` into ``task_events`` would hold its table-level
    ``AUTO-INC`` lock to the statement's end (``innodb_autoinc_lock_mode`` 1, MariaDB's default), so a complete
    waiting there for a namespace's lock would hold up every task event of the server.

    The caller then makes the transition with ``apply_transition(..., recorded=<event id>)``: its conditional
    update of the task (at the version read under the lock) and the attempt (token, status and lease, as of
    now) must change both rows, or :class:`errors.ConcurrentUpdate` rolls the event back with the transaction
    (or savepoint): an attempt changed since the subquery read it makes it miss. Then the task's event, and
    the event's deliveries (:func:`~orbit_server.tasks.result_events.record_result_event`).

    Returns ``(task, attempt, now, event id)``, the rows as :func:`_locked_attempt` gives them for a transition
    (the task's subscribers included), or ``None``, nothing written, when the call is not on that path (any
    refusal, a repeated report, a lapsed lease) or the database is not MariaDB 10.5+
    (:func:`_records_as_it_locks`): the caller then reads with :func:`_locked_attempt` and decides as before.
    """
    if not _records_as_it_locks(conn.dialect) or not _ids.can_exist(attempt_id):
        return None
    running, digest, event_id = TaskStatus.RUNNING.value, _hash_token(lease_token), str(uuid.uuid4())
    params = {
        "r_id": event_id, "attempt_id": attempt_id, "hash": digest, "namespace_id": namespace_id,
        "status": running, "to_status": to.value, "result": values.get("result"), "error": values.get("error"),
    }  # fmt: skip
    row = _lock_and_record_statement().execute(conn, params).mappings().first()
    if row is None:
        return None
    task: dict[str, Any] = {
        "id": row["task_id"], "namespace_id": namespace_id, "status": running,
        "state_version": row["state_version"] - 1, "current_attempt_id": attempt_id, "retry_of": row["retry_of"],
        **unpacked(row["task_row"], _RECORDED_TASK_ROW),
    }  # fmt: skip
    task["subscribers"] = result_events.subscribers(task, row["subscribers"], conn.dialect.name)
    attempt = {
        "id": attempt_id, "task_id": row["task_id"], "lease_token_hash": digest, "status": running,
        **unpacked(row["attempt_row"], _RECORDED_ATTEMPT_ROW),
    }  # fmt: skip
    return task, attempt, _naive(row["occurred_at"]), event_id


def _holds(attempt: Mapping[Any, Any], now: datetime) -> bool:
    """Whether the attempt is live and its lease not lapsed at ``now``: a report's plain path."""
    return attempt["status"] in _LIVE and attempt["lease_expires_at"] > now


def _check_token(attempt: Mapping[Any, Any], lease_token: str) -> None:
    if not hmac.compare_digest(attempt["lease_token_hash"], _hash_token(lease_token)):
        raise errors.LeaseLost("the lease token does not belong to this attempt")


def _lapsed(
    conn: Connection, task: dict[str, Any], attempt: Mapping[Any, Any], now: datetime
) -> AttemptStatus | None:
    """``None`` while the attempt holds the lease, else its final status (a lapsed lease is expired now)."""
    status = AttemptStatus(attempt["status"])
    if not status.is_live:
        return status
    if attempt["lease_expires_at"] > now:
        return None
    if not _expire_attempt(conn, task, attempt, now):
        raise errors.ConcurrentUpdate(f"attempt {attempt['id']} changed while it was being read")
    return AttemptStatus.EXPIRED


def _state(
    task: Mapping[str, Any],
    attempt: Mapping[Any, Any],
    *,
    status: AttemptStatus | None = None,
    lease_expires_at: datetime | None = None,
) -> AttemptState:
    """The answer to an attempt call, from the rows as written (no second read)."""
    return AttemptState(
        attempt_id=attempt["id"],
        task_id=attempt["task_id"],
        generation=attempt["generation"],
        status=status or AttemptStatus(attempt["status"]),
        task_status=TaskStatus(task["status"]),
        lease_expires_at=_at(lease_expires_at or attempt["lease_expires_at"]),
        cancel_requested=bool(task["cancel_requested"]),
    )


def _lost(attempt: Mapping[Any, Any], status: AttemptStatus, *, kept: bool | None = None) -> errors.LeaseLost:
    why = "its lease lapsed" if status is AttemptStatus.EXPIRED else f"it is {status.value}"
    detail = f"attempt {attempt['generation']} no longer holds the task's lease ({why}); stop working on it"
    if kept is not None:
        detail += "; the report was " + (
            "kept as evidence" if kept else "not kept: evidence was already recorded"
        )
    return errors.LeaseLost(detail, evidence_recorded=bool(kept))


def _confirmed(attempt: Mapping[Any, Any]) -> dict[str, Any]:
    """The value that confirms an unconfirmed lease-and-start attempt (its first heartbeat, or its
    ``complete``): ``started_at`` = the grant's time; nothing for any other attempt. A ``fail``
    ends the attempt without it: the server cannot tell whether a handler began (a worker without
    the handler fails the task at once), so ``started_at`` stays empty."""
    if attempt["status"] == AttemptStatus.RUNNING.value and attempt["started_at"] is None:
        return {"started_at": attempt["leased_at"]}
    return {}
