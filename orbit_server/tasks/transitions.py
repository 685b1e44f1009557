"""A task's state machine: the allowed transitions, the conditional update that makes one (with its event and
its attempt's conditional update), task locking and lease expiry.

The SQL for executing tasks is split by idea: this module (transitions, task locking, expiry),
:mod:`.attempt_locks` (an attempt call's locking read of its task and attempt, and its lease checks),
:mod:`.leases` (grants and the expiry sweep; PostgreSQL's autocommitted lease: :mod:`.postgres_leases`),
:mod:`.attempts` (start, heartbeat, complete, fail), :mod:`.operations` (cancel, review, manual retry,
history); :func:`orbit_server.db.transact.transact` runs them.

The rules, from §2, §3 and §5 of the reliability model (seed 001) and DESIGN §2, §4:

- A task moves only along :data:`TRANSITIONS`, and only through :func:`apply_transition`: a
  conditional ``UPDATE`` on the status and ``state_version`` it read, which bumps the version,
  checks the affected-row count and appends a ``task_events`` row in the same transaction
  (and, for a result state, a ``result_events`` row with its deliveries: :mod:`.result_events`).
  The one exception is its set-based twin in :func:`lease_tasks`, which makes the same
  conditional update (``WAITING → LEASED``) for every claimed row in one statement, checks
  that every row was updated, and inserts their events in one multi-row ``INSERT``.
- Each grant of a task is a ``task_attempts`` row with a monotonic ``generation`` (the fencing
  number) and a secret lease token (only its SHA-256 is stored). Every later write to an attempt
  is a conditional ``UPDATE`` on its id, token digest and status, and its row count is checked.
  A final attempt is never rewritten; a report that comes too late is kept as evidence only.
- Leases are judged by the database clock (:func:`orbit_server.db.engine.db_now`).
- A queue's execution gate and concurrency limits (:mod:`orbit_server.tasks.permits`): a paused queue
  grants and starts nothing; a limited queue's grant takes a permit, and every transition out of
  ``LEASED``/``RUNNING`` in :func:`apply_transition` releases it.
- Lock order: a transaction locks the task row (``SELECT ... FOR UPDATE``) before it touches the
  task's attempts. Claims and the expiry sweep use ``SKIP LOCKED`` on MySQL/MariaDB and never
  wait for a row; SQLite has one writer at a time (``BEGIN IMMEDIATE``), so there the locking
  clauses are no-ops.
- No transaction stays open across HTTP, a handler or a human: every function here takes the
  caller's :class:`~sqlalchemy.engine.Connection` and does one short unit of work. Run them with
  :func:`~orbit_server.db.transact.transact`, which commits, rolls back or retries, and keeps the transaction visible at
  the call site: ``transact(engine, complete_attempt, namespace_id, attempt_id, token, result)``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import random
import uuid
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from orbit_client import (
    AttemptStatus,
    Task,
    TaskStatus,
)
from orbit_server import _ids, errors
from orbit_server.db import faults as _faults
from orbit_server.db import flow_hooks
from orbit_server.db.driver_sql import DriverSQL, insert_of
from orbit_server.db.engine import by_primary_key, to_utc
from orbit_server.db.sampling import lease_expired
from orbit_server.db.schema import (
    task_attempts,
    task_events,
    tasks,
)
from orbit_server.tasks import permits, result_events, store

__all__ = ["DEFAULT_BACKOFF_BASE_SECONDS", "DEFAULT_BACKOFF_CAP_SECONDS", "TRANSITIONS", "apply_transition"]

log = logging.getLogger("orbit_server.execution")

W, L, R, NR = TaskStatus.WAITING, TaskStatus.LEASED, TaskStatus.RUNNING, TaskStatus.NEEDS_REVIEW
S, F, C = TaskStatus.SUCCEEDED, TaskStatus.FAILED, TaskStatus.CANCELLED

#: Every allowed ``(from, to)`` pair: exactly the arrows of §2 of the reliability model.
TRANSITIONS: Final[frozenset[tuple[TaskStatus, TaskStatus]]] = frozenset(
    {
        (W, L),  # 原子取得执行授权: a worker leased it
        (L, R),  # 确认开始: the worker started it
        (L, W),  # 未授权开始且领取失效: the lease lapsed (or a retryable failure) before start
        (L, F),  # 未授权开始且时限或策略已耗尽: ... and budget or deadline is spent
        (W, C),  # 取消生效
        (L, C),  # 开始前取消生效
        (W, F),  # 时限或策略不再允许执行: the deadline passed while waiting
        (R, S),  # 结果可靠保存
        (R, W),  # 满足安全重试条件: retryable failure, or retry-safe task whose lease lapsed
        (R, F),  # 已知失败且结束
        (R, NR),  # 结果未知且不可安全重试
        (R, C),  # 停止已确认: the worker reported that it stopped after a cancel request
        (NR, S),  # 核查确认成功
        (NR, F),  # 核查确认失败并结束
    }
)

_LIVE = (AttemptStatus.LEASED.value, AttemptStatus.RUNNING.value)
#: The task states with a live attempt.
_LIVE_TASK = (TaskStatus.LEASED, TaskStatus.RUNNING)

#: Retry backoff of a task that sets none, in seconds.
DEFAULT_BACKOFF_BASE_SECONDS: Final = 1.0
DEFAULT_BACKOFF_CAP_SECONDS: Final = 300.0

_TASK_COLUMNS = (
    tasks.c.id,
    tasks.c.namespace_id,
    tasks.c.queue_id,
    tasks.c.status,
    tasks.c.state_version,
    tasks.c.attempt_count,
    tasks.c.max_attempts,
    tasks.c.retry_safe,
    tasks.c.deadline,
    tasks.c.cancel_requested,
    tasks.c.current_attempt_id,
    tasks.c.backoff_base_seconds,
    tasks.c.backoff_cap_seconds,
    tasks.c.holds_permit,
    # The flow step this task is (NULL for plain tasks): read with the row, so a terminal transition
    # knows without a statement more whether it must write a flow event (orbit_server.db.flow_hooks).
    tasks.c.flow_instance_id,
    tasks.c.flow_token_id,
    tasks.c.flow_activation,
)

# Statements built once (the SET columns come from the parameters of each execution).
#: The conditional update of :func:`apply_transition`: ``:b_id``, ``:b_status``, ``:b_version``.
# Both pinned to the primary key: with a status in the WHERE, MariaDB may otherwise read (and lock) a
# range of the status index, every RUNNING attempt with a live lease (db/engine.by_primary_key).
_UPDATE_TASK = by_primary_key(
    tasks.update().where(
        tasks.c.id == sa.bindparam("b_id"),
        tasks.c.status == sa.bindparam("b_status"),
        tasks.c.state_version == sa.bindparam("b_version"),
    )
)
#: :func:`_update_attempt`: ``:b_id``, ``:b_hash``, ``:b_status``, ``:b_now``.
_UPDATE_LIVE_ATTEMPT = by_primary_key(
    task_attempts.update().where(
        task_attempts.c.id == sa.bindparam("b_id"),
        task_attempts.c.lease_token_hash == sa.bindparam("b_hash"),
        task_attempts.c.status == sa.bindparam("b_status"),
        task_attempts.c.lease_expires_at > sa.bindparam("b_now", type_=task_attempts.c.lease_expires_at.type),
    )
)
#: :func:`_update_attempt` with ``renews``: also fenced on the lease's end as read (``:b_expires``). Written
#: ``IS NOT DISTINCT FROM`` (the column is never NULL): as an ``=`` PostgreSQL takes it with the status for an
#: index condition on ``(status, lease_expires_at)`` and leaves the primary key (tests/integration/test_lock_plans).
_UPDATE_RENEWED_ATTEMPT = _UPDATE_LIVE_ATTEMPT.where(
    task_attempts.c.lease_expires_at.is_not_distinct_from(
        sa.bindparam("b_expires", type_=task_attempts.c.lease_expires_at.type)
    )
)
_INSERT_EVENT = task_events.insert()  # also flows.advance's (its rows may leave columns out)
#: :func:`_append_event`'s ``INSERT`` (and a lease's or a batch's, a list of rows): the row ``_INSERT_EVENT`` writes,
#: every column given, through the driver (:mod:`~orbit_server.db.driver_sql`), without the work SQLAlchemy does
#: for a compiled single-row ``INSERT``; a list of rows is one multi-row ``INSERT`` (on PostgreSQL SQLAlchemy's
#: multi-row form, as ``task_events.insert()`` sent it).
_EVENT_COLUMNS = tuple(c.name for c in task_events.c if c.name != "id")
APPEND_EVENTS = insert_of(task_events, _EVENT_COLUMNS)


@functools.lru_cache(maxsize=256)
def _setting(update: sa.Update, columns: tuple[str, ...]) -> DriverSQL:
    """``update`` setting ``columns`` of its table from parameters of the same names, through the driver
    (:mod:`~orbit_server.db.driver_sql`): what ``Connection.execute(update, {<column>: ...})`` runs, built once
    per set of columns."""
    table = update.table
    assert isinstance(table, sa.Table)
    return DriverSQL(update.values({name: sa.bindparam(name, type_=table.c[name].type) for name in columns}))


#: :func:`_update_both_statement`'s statements, by the task and attempt columns they set and ``renews``.
_UPDATE_BOTH: dict[tuple[tuple[str, ...], tuple[str, ...], bool], DriverSQL] = {}


def _update_both_statement(
    task_columns: tuple[str, ...], attempt_columns: tuple[str, ...], renews: bool = False
) -> DriverSQL:
    """MySQL/MariaDB: one ``UPDATE`` of a task (fenced on its id, status and ``state_version``: ``:b_id``,
    ``:b_status``, ``:b_version``) and its live attempt (fenced as :func:`_update_attempt` fences it:
    ``:a_id``, ``:a_hash``, ``:a_status``, ``:a_now``, and with ``renews`` ``:a_expires``), setting
    ``task_columns`` from parameters of the same names and ``attempt_columns`` from ``:a_set_<name>``; both
    rows are read through the primary key (:func:`orbit_server.db.engine.by_primary_key` says why). Built
    once per set of columns. (Text: the dialect's compiler drops the first table's index hint of a
    multi-table ``UPDATE``.)"""
    key = (task_columns, attempt_columns, renews)
    statement = _UPDATE_BOTH.get(key)
    if statement is None:
        sets = [f"tasks.{c} = :{c}" for c in task_columns]
        sets += [f"task_attempts.{c} = :a_set_{c}" for c in attempt_columns]
        statement = _UPDATE_BOTH[key] = DriverSQL(
            sa.text(
                "UPDATE tasks FORCE INDEX (PRIMARY), task_attempts FORCE INDEX (PRIMARY) SET "
                + ", ".join(sets)
                + " WHERE tasks.id = :b_id AND tasks.status = :b_status AND tasks.state_version = :b_version"
                " AND task_attempts.id = :a_id AND task_attempts.task_id = tasks.id"
                " AND task_attempts.lease_token_hash = :a_hash AND task_attempts.status = :a_status"
                " AND task_attempts.lease_expires_at > :a_now"
                + (" AND task_attempts.lease_expires_at = :a_expires" if renews else "")
            ).bindparams(
                *(sa.bindparam(c, type_=tasks.c[c].type) for c in task_columns),
                *(sa.bindparam(f"a_set_{c}", type_=task_attempts.c[c].type) for c in attempt_columns),
                sa.bindparam("a_now", type_=task_attempts.c.lease_expires_at.type),
                *(
                    (sa.bindparam("a_expires", type_=task_attempts.c.lease_expires_at.type),)
                    if renews
                    else ()
                ),
            )
        )
    return statement


#: :func:`_update_both_postgres`'s statements, by the task and attempt columns they set, ``result_event`` and
#: ``renews``.
_UPDATE_BOTH_POSTGRES: dict[tuple[tuple[str, ...], tuple[str, ...], bool, bool], DriverSQL] = {}


def _update_both_postgres(
    task_columns: tuple[str, ...], attempt_columns: tuple[str, ...], result_event: bool = False,
    renews: bool = False,
) -> DriverSQL:  # fmt: skip
    """PostgreSQL: :func:`_update_both_statement`'s update in one statement (same parameters), with the
    transition's ``task_events`` row: the live attempt's conditional ``UPDATE`` in a data-modifying ``WITH``,
    the task's conditional ``UPDATE`` only when it changed a row, and the event (``:e_<column>``) inserted
    only for a task row changed. It answers how many task rows changed: one means all three were written;
    none, that the task or the attempt had moved on (the attempt may then be changed alone: the caller's
    ``ConcurrentUpdate`` rolls back its transaction or savepoint, as for the statements this replaces).
    ``result_event``: the transition's result event and its deliveries too, in the same statement
    (:func:`~orbit_server.tasks.result_events.postgres_event_ctes`, parameters ``:r_<name>``), written only
    for a task row changed. ``renews``: the attempt also fenced on ``:a_expires``, as :func:`_update_both_statement`.
    Built once per set of columns."""
    key = (task_columns, attempt_columns, result_event, renews)
    statement = _UPDATE_BOTH_POSTGRES.get(key)
    if statement is None:
        returning = (
            ("tasks.id", *(f"tasks.{c}" for c in result_events.COPIED)) if result_event else ("tasks.id",)
        )
        event_sql, event_params = result_events.postgres_event_ctes("changed") if result_event else ("", ())
        attempt_sets = ", ".join(f"{c} = :a_set_{c}" for c in attempt_columns)
        task_sets = ", ".join(f"{c} = :{c}" for c in task_columns)
        event_columns = [c.name for c in task_events.c if c.name not in ("id", "task_id")]
        statement = _UPDATE_BOTH_POSTGRES[key] = DriverSQL(
            sa.text(
                f"WITH live AS (UPDATE task_attempts SET {attempt_sets}"
                " WHERE task_attempts.id = :a_id AND task_attempts.task_id = :b_id"
                " AND task_attempts.lease_token_hash = :a_hash AND task_attempts.status = :a_status"
                " AND task_attempts.lease_expires_at > :a_now"
                # not "=": see _UPDATE_RENEWED_ATTEMPT
                + (" AND task_attempts.lease_expires_at IS NOT DISTINCT FROM :a_expires" if renews else "")
                + " RETURNING task_attempts.id),"
                f" changed AS (UPDATE tasks SET {task_sets}"
                " WHERE tasks.id = :b_id AND tasks.status = :b_status AND tasks.state_version = :b_version"
                f" AND EXISTS (SELECT FROM live) RETURNING {', '.join(returning)}),"
                f" logged AS (INSERT INTO task_events (task_id, {', '.join(event_columns)})"
                f" SELECT changed.id, {', '.join(f':e_{c}' for c in event_columns)} FROM changed)"
                + (f", {event_sql}" if result_event else "")
                + " SELECT count(*) FROM changed"
            ).bindparams(
                *(sa.bindparam(c, type_=tasks.c[c].type) for c in task_columns),
                *(sa.bindparam(f"a_set_{c}", type_=task_attempts.c[c].type) for c in attempt_columns),
                sa.bindparam("a_now", type_=task_attempts.c.lease_expires_at.type),
                *(
                    (sa.bindparam("a_expires", type_=task_attempts.c.lease_expires_at.type),)
                    if renews
                    else ()
                ),
                *(sa.bindparam(f"e_{c}", type_=task_events.c[c].type) for c in event_columns),
                *event_params,
            )
        )
    return statement


# ---------------------------------------------------------------- transitions


def apply_transition(
    conn: Connection,
    task: Mapping[str, Any],
    to: TaskStatus,
    *,
    event: str,
    now: datetime,
    actor: str | None = None,
    reason: str | None = None,
    data: Any = None,
    values: Mapping[str, Any] | None = None,
    attempt: tuple[Mapping[Any, Any], Mapping[str, Any]] | None = None,
    recorded: str | None = None,
    renews: bool = False,
) -> dict[str, Any]:
    """Move ``task`` to ``to``: the one way any task changes state.

    A conditional ``UPDATE`` on the task's id, status and ``state_version`` as read (the
    caller holds the row's lock), which bumps ``state_version``, sets ``updated_at`` (and
    ``finished_at`` for a terminal state) and the extra column ``values``; then a
    ``task_events`` row in the same transaction (§4 of DESIGN, invariant 4 of seed 001).
    A transition to ``SUCCEEDED``, ``FAILED``, ``CANCELLED`` or ``NEEDS_REVIEW`` also writes
    its ``result_events`` row and the deliveries to matching subscriptions, in the same
    transaction (:func:`orbit_server.tasks.result_events.record_result_event`; DESIGN §4, §6.2 of seed 001),
    and, for a flow step's task, its internal event (:mod:`orbit_server.db.flow_hooks`, §6.3).

    Args:
        task: the task row as read, with at least ``id``, ``status`` and ``state_version``.
        now: the database time of the transaction (naive UTC).
        attempt: ``(attempt row as read, values)``: also make :func:`_update_attempt`'s conditional
            update of the task's live attempt (same id, token digest and status, lease not lapsed),
            setting ``values``; on MySQL/MariaDB in the same statement as the task's (a multi-table
            ``UPDATE`` that changes both rows or neither), on PostgreSQL too (the attempt's update in a
            ``WITH``), on SQLite just before it.
        recorded: the id of the transition's result event, already written in this transaction by the
            statement that locked the task (:func:`~orbit_server.tasks.attempt_locks._lock_and_record`,
            MariaDB): not written again here (its deliveries are).
        renews: ``values`` give the attempt a new lease computed from the attempt as read: its update is
            also fenced on the lease's end as read (:func:`_update_attempt`).

    Returns:
        ``task`` with the new status, version and values: pass it to a following transition.

    Raises:
        errors.InvalidTransition: ``(task status, to)`` is not in :data:`TRANSITIONS` (409).
        errors.ConcurrentUpdate: the row was not at the version read (nothing written).
    """
    current = TaskStatus(task["status"])
    if (current, to) not in TRANSITIONS and attempt is not None:
        # The task (read under its lock) has moved on from the live attempt (read by a subquery, possibly
        # older: attempt_locks._locked_attempt): a concurrent change landed in between. The attempt's
        # conditional update would miss; say so, so that transact runs the call again on fresh rows.
        raise errors.ConcurrentUpdate(f"task {task['id']} is {current.value}: its attempt changed meanwhile")
    if (current, to) not in TRANSITIONS:
        raise errors.InvalidTransition(
            f"a {current.value} task cannot become {to.value} (§2 of the reliability model)"
        )
    version = int(task["state_version"]) + 1
    changes: dict[str, Any] = {
        "status": to.value,
        "state_version": version,
        "updated_at": now,
        **(values or {}),
    }
    if to.is_terminal:
        changes["finished_at"] = now
    if task.get("holds_permit") and to not in _LIVE_TASK:
        # The attempt ends here: so does its concurrency permit (§5 "完成 … 额度释放").
        permits.release(conn, [task["current_attempt_id"]])
        changes["holds_permit"] = False
    fence = {"b_id": task["id"], "b_status": current.value, "b_version": task["state_version"]}
    event_id: str | None = None  # the result event's, when the update's statement writes it (PostgreSQL)
    if attempt is not None and conn.dialect.name in ("mysql", "mariadb", "postgresql"):
        row, attempt_values = attempt
        postgres = conn.dialect.name == "postgresql"
        read = task.get("subscribers")
        if postgres and to in result_events.RESULT_STATUSES and read is not None and read.retry_of is None:
            # The result event and its deliveries in the update's statement, under the locks taken by the
            # statement that locked the task (read ahead: result_events.locked_subscribers).
            event_id = str(uuid.uuid4())
            statement = _update_both_postgres(
                tuple(changes), tuple(attempt_values), result_event=True, renews=renews
            )
            written = {
                "r_id": event_id,
                "r_now": now,
                "r_namespace_id": read.namespace_id,
                "r_queue": read.queue_name,
            }
        elif postgres:
            statement, written = (
                _update_both_postgres(tuple(changes), tuple(attempt_values), renews=renews),
                {},
            )
        else:
            statement, written = _update_both_statement(tuple(changes), tuple(attempt_values), renews), {}
        result = statement.execute(
            conn,
            {
                **fence, **changes, **{f"a_set_{k}": v for k, v in attempt_values.items()},
                "a_id": row["id"], "a_hash": row["lease_token_hash"], "a_status": row["status"], "a_now": now,
                **({"a_expires": row["lease_expires_at"]} if renews else {}),
                **(_event_values(version, event, current, to, now, actor, reason, data) if postgres else {}),
                **written,
            },
        )  # fmt: skip
        # the MySQL dialects count both rows found; PostgreSQL answers the task rows changed (its event too)
        if (result.scalar_one() != 1) if postgres else (result.rowcount != 2):
            raise errors.ConcurrentUpdate(
                f"task {task['id']} or its attempt {row['id']} changed while they were being updated"
            )
    else:
        if attempt is not None:
            _update_attempt(conn, attempt[0], now, renews=renews, **attempt[1])
        result = _setting(_UPDATE_TASK, tuple(changes)).execute(conn, {**fence, **changes})
        if result.rowcount != 1:
            raise errors.ConcurrentUpdate(f"task {task['id']} changed while it was being updated")
    if not (attempt is not None and conn.dialect.name == "postgresql"):  # there: written with the update
        _append_event(
            conn, task["id"], version, event, current, to, now, actor=actor, reason=reason, data=data
        )
    if to in result_events.RESULT_STATUSES:
        if event_id is None:
            event_id = result_events.record_result_event(
                conn, task["id"], now, read=task.get("subscribers"), written=recorded
            )
        if task.get("flow_instance_id") is not None:  # a flow step: its internal event, same transaction
            flow_hooks.record_events(conn, [({**task, **changes}, event_id)], now)
    return {**task, **changes}


def _event_values(
    version: int, event: str, current: TaskStatus, to: TaskStatus, now: datetime, actor: str | None,
    reason: str | None, data: Any,
) -> dict[str, Any]:  # fmt: skip
    """The ``:e_<column>`` parameters of :func:`_update_both_postgres`'s event row."""
    return {
        "e_state_version": version, "e_event": event, "e_from_status": current.value, "e_to_status": to.value,
        "e_actor": actor, "e_reason": reason, "e_data": data, "e_created_at": now,
    }  # fmt: skip


def _append_event(
    conn: Connection,
    task_id: str,
    state_version: int,
    event: str,
    from_status: TaskStatus | None,
    to_status: TaskStatus | None,
    now: datetime,
    *,
    actor: str | None = None,
    reason: str | None = None,
    data: Any = None,
) -> None:
    APPEND_EVENTS.execute(
        conn,
        {
            "task_id": task_id,
            "state_version": state_version,
            "event": event,
            "from_status": from_status.value if from_status else None,
            "to_status": to_status.value if to_status else None,
            "actor": actor,
            "reason": reason,
            "data": data,
            "created_at": now,
        },
    )


def _lock_task(conn: Connection, task_id: str, *, skip_locked: bool = False) -> dict[str, Any] | None:
    """Read a task row and lock it (``FOR UPDATE [SKIP LOCKED]`` on MySQL/MariaDB; a ``skip_locked``
    read locks nothing under the test-only ``ORBIT_TEST_CLAIMS_WITHOUT_LOCKS``, see :mod:`._faults`)."""
    select = sa.select(*_TASK_COLUMNS).where(tasks.c.id == task_id)
    row = (
        conn.execute(_faults.skip_locked(select) if skip_locked else select.with_for_update())
        .mappings()
        .first()
    )
    return dict(row) if row is not None else None


def _clock(conn: Connection) -> sa.ColumnElement[Any]:
    """The database's current UTC time as a column, to read it in a statement that runs anyway."""
    return clock_of(conn.dialect.name)


def clock_of(name: str) -> sa.ColumnElement[Any]:
    """:func:`_clock` for the database of dialect ``name`` (``sqlite``, ``mysql``, ``postgresql``)."""
    if name == "sqlite":
        return sa.func.strftime("%Y-%m-%d %H:%M:%f", "now")
    if name == "mysql":
        return sa.func.utc_timestamp(sa.literal_column("6"))
    return sa.func.timezone("UTC", sa.func.clock_timestamp())  # PostgreSQL: the statement's clock, not now()


def _naive(value: Any) -> datetime:
    """A value of :func:`_clock` as the naive UTC datetime every timestamp is stored as."""
    if isinstance(value, str):
        return datetime.fromisoformat(value)
    assert isinstance(value, datetime)
    return value.replace(tzinfo=None)


def _lock_task_in(conn: Connection, namespace_id: int, task_id: str) -> dict[str, Any]:
    if not _ids.can_exist(task_id):  # never a row; MariaDB would not even compare it
        raise errors.TaskNotFound(f"no task {task_id!r} in this namespace")
    task = _lock_task(conn, task_id)
    if task is None or task["namespace_id"] != namespace_id:
        raise errors.TaskNotFound(f"no task {task_id!r} in this namespace")
    return task


def _task(conn: Connection, namespace_id: int, task_id: str) -> Task:
    found = store.get_task(conn, namespace_id, task_id)
    assert found is not None
    return found


def _at(value: datetime) -> datetime:
    """A stored (naive UTC) timestamp that is never NULL, as an aware UTC datetime."""
    aware = to_utc(value)
    assert aware is not None
    return aware


def _hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _retry_delay(task: Mapping[str, Any]) -> timedelta:
    """Equal-jitter exponential backoff before the next attempt (DESIGN §4)."""
    base = task["backoff_base_seconds"]
    cap = task["backoff_cap_seconds"]
    base = DEFAULT_BACKOFF_BASE_SECONDS if base is None else float(base)
    cap = DEFAULT_BACKOFF_CAP_SECONDS if cap is None else float(cap)
    bound = min(cap, base * 2.0 ** max(0, int(task["attempt_count"]) - 1))
    return timedelta(seconds=bound / 2 + random.uniform(0, bound / 2))


def _past_deadline(task: Mapping[str, Any], when: datetime) -> bool:
    deadline = task["deadline"]
    return deadline is not None and deadline <= when


def _deadline_error(cause: Any = None) -> dict[str, Any]:
    error: dict[str, Any] = {
        "type": "deadline_exceeded",
        "message": "the task's deadline passed before it could run again",
        "retryable": False,
    }
    if cause is not None:
        error["cause"] = cause
    return error


#: The ``error`` of an attempt granted ``RUNNING`` by lease-and-start whose lease lapsed unconfirmed.
_UNCONFIRMED: Final = {
    "type": "unconfirmed",
    "message": (
        "granted RUNNING by lease-and-start; no heartbeat or report confirmed it before its lease lapsed, "
        "so whether its handler began is unknown (the task is retry-safe: settled as not started)"
    ),
    "retryable": True,
}


def _expire_attempt(
    conn: Connection, task: dict[str, Any], attempt: Mapping[Any, Any], now: datetime,
    *, reason: str | None = None,
) -> bool:  # fmt: skip
    """Settle one lapsed live attempt of a locked task; ``False`` if it was renewed or finished first."""
    was = AttemptStatus(attempt["status"])
    # An unconfirmed lease-and-start grant: the attempt says what is known (granted RUNNING, never
    # confirmed), not that nothing started: its answer may have reached a worker that died.
    unconfirmed = (
        {"error": _UNCONFIRMED} if was is AttemptStatus.RUNNING and attempt["started_at"] is None else {}
    )
    done = conn.execute(
        task_attempts.update()
        .where(
            task_attempts.c.id == attempt["id"],
            task_attempts.c.status == was.value,
            task_attempts.c.lease_expires_at <= now,
        )
        .values(status=AttemptStatus.EXPIRED.value, finished_at=now, **unconfirmed)
    )
    if done.rowcount != 1:
        return False
    if task["current_attempt_id"] != attempt["id"] or task["status"] != was.value:
        raise errors.ConcurrentUpdate(f"task {task['id']} does not match its live attempt {attempt['id']}")
    lease_expired(was.value)  # orbit_lease_expiries_total
    budget_left = int(task["attempt_count"]) < int(task["max_attempts"])
    data = {
        "attempt_id": attempt["id"],
        "generation": attempt["generation"],
        "worker_id": attempt["worker_id"],
    }
    # A lease-and-start attempt never confirmed (no heartbeat, no complete: started_at is empty) was
    # never known to be in its worker's hands: settled as a never-started one (DESIGN §4).
    never_started = was is AttemptStatus.LEASED or attempt["started_at"] is None
    if task["cancel_requested"] and (never_started or task["retry_safe"]):
        # The cancel asked for holds: the task never runs again. Only a confirmed attempt of a task not
        # declared retry-safe goes to NEEDS_REVIEW below, cancel or not: its outcome is unknown.
        apply_transition(
            conn,
            task,
            TaskStatus.CANCELLED,
            event="cancelled",
            now=now,
            actor="sweeper",
            reason=f"cancellation was requested and the lease of attempt {attempt['generation']} lapsed",
            data=data,
        )
        return True
    if never_started:
        if was is AttemptStatus.RUNNING and reason is None:
            reason = (
                "lease-and-start grant lapsed unconfirmed (no heartbeat or report came); its handler may "
                "have run: settled as not started, the task being retry-safe"
            )
        if budget_left and not _past_deadline(task, now):
            apply_transition(
                conn,
                task,
                TaskStatus.WAITING,
                event="lease_expired",
                now=now,
                actor="sweeper",
                reason=reason,
                data=data,
                values={"available_at": now},
            )
        else:
            error = (
                _deadline_error()
                if _past_deadline(task, now)
                else {
                    "type": "attempts_exhausted",
                    "message": "every attempt's lease lapsed",
                    "retryable": False,
                }
            )
            apply_transition(
                conn,
                task,
                TaskStatus.FAILED,
                event="lease_expired",
                now=now,
                actor="sweeper",
                reason=reason,
                data=data,
                values={"error": error},
            )
        return True
    available_at = now + _retry_delay(task)
    if task["retry_safe"] and budget_left and not _past_deadline(task, available_at):
        apply_transition(
            conn,
            task,
            TaskStatus.WAITING,
            event="lease_expired",
            now=now,
            actor="sweeper",
            data=data,
            values={"available_at": available_at},
        )
        return True
    error = {
        "type": "outcome_unknown",
        "message": (
            f"the lease of attempt {attempt['generation']} lapsed while it was running and the task is not "
            "declared safe to retry (or its budget or deadline is spent); review it"
        ),
        "retryable": False,
    }
    apply_transition(
        conn,
        task,
        TaskStatus.NEEDS_REVIEW,
        event="lease_expired",
        now=now,
        actor="sweeper",
        data=data,
        values={"error": error},
    )
    return True


def _update_attempt(
    conn: Connection, attempt: Mapping[Any, Any], now: datetime, *, renews: bool = False, **values: Any
) -> None:
    """The conditional update of a live attempt: same id, token digest and status, lease not lapsed.

    ``renews``: ``values`` give it a new lease computed from the attempt as read (a start, a heartbeat):
    also fenced on the lease's end as read. The read may be older than the task's lock: the statement that
    locks the task reads the attempt in a subquery, which on MariaDB and PostgreSQL sees the rows as they
    were when the statement began, before it waited for the lock. A renewal committed meanwhile (which
    moves the lease's end, and may change ``lease_seconds``) then makes this update miss:
    :class:`errors.ConcurrentUpdate`, and the call runs again on the rows as they are.
    """
    params = {
        "b_id": attempt["id"],
        "b_hash": attempt["lease_token_hash"],
        "b_status": attempt["status"],
        "b_now": now,
    }
    if renews:
        params["b_expires"] = attempt["lease_expires_at"]
    done = _setting(_UPDATE_RENEWED_ATTEMPT if renews else _UPDATE_LIVE_ATTEMPT, tuple(values)).execute(
        conn, {**params, **values}
    )
    if done.rowcount != 1:
        raise errors.ConcurrentUpdate(f"attempt {attempt['id']} changed while it was being updated")
