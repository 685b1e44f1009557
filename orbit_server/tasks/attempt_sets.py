"""The set-based path of batched ``start`` and ``complete`` calls (DESIGN §4, "Batched attempt calls").

A batch whose every item is the plain case (the attempt exists in the namespace, its token is
right, it holds a live lease, it is ``LEASED`` for a start or ``RUNNING`` for a complete, its task
is at the matching status with this attempt current, and no attempt appears twice) is written
with one statement per table instead of one per item:

1. read the batch's task ids from its attempts, without a lock (lock order stays task first), unless
   every item names its task (``task_id``, as the lease granted it: :func:`_lock_tasks`);
2. lock those tasks by primary key and their current attempts with them, and read both, in one
   statement: ``SELECT ... FROM tasks FORCE INDEX (PRIMARY) JOIN task_attempts ON task_attempts.id =
   tasks.current_attempt_id WHERE tasks.id IN (...) AND namespace_id = :ns FOR UPDATE``, with the
   database clock (``STRAIGHT_JOIN`` on MariaDB: each task, then its attempt, the order every path
   locks them in). Not one statement with an ``IN (SELECT ...)``: MariaDB then scans and locks the
   whole table; and every by-key statement here is pinned to the primary key,
   :func:`orbit_server.db.engine.by_primary_key`. A locking read reads the newest row, so the
   attempts are current: what a heartbeat changed before the lock is seen, such as the
   ``lease_seconds`` a start's new lease is computed from, or the lease's end a complete answers (on
   PostgreSQL, a row changed while the statement waited for a lock is read again as it is now). An
   attempt that is not its task's current one is not read: the batch is declined;
3. one conditional ``UPDATE`` of the attempts fenced on ``(id, lease_token_hash)``, status and an
   unexpired lease, and one of the tasks fenced on ``(id, state_version)`` and status; both row
   counts are checked (a mismatch raises :class:`errors.ConcurrentUpdate`: the whole request is
   rolled back and run again);
4. one multi-row ``INSERT`` of the task events; for completes, the result events and their
   deliveries in the same transaction (:func:`orbit_server.tasks.result_events.record_result_events`), and for
   the tasks that are flow steps one multi-row ``INSERT`` of their internal events
   (:mod:`orbit_server.db.flow_hooks`; none for plain tasks).

A start whose queue is paused is declined (the per-item start gives its lease back), and a
complete deletes the concurrency permits of the tasks that hold one (:mod:`orbit_server.tasks.permits`).

Every statement is built once per batch size (an ``IN`` list of that many parameters, a ``CASE`` branch per
item), not rewritten per call. The
rows written are exactly those the per-item functions
(:func:`orbit_server.tasks.attempts.start_attempt`, :func:`~orbit_server.tasks.attempts.complete_attempt`)
write. Any other batch is declined before anything is written (``None``), and the caller runs
it item by item in the same transaction (:func:`orbit_server.api.attempt_batches.run_items`),
which answers every refusal exactly as the single call does.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from orbit_client import AttemptState, AttemptStatus, CompleteItem, StartItem, TaskStatus
from orbit_server import _ids, errors
from orbit_server.db import flow_hooks
from orbit_server.db.driver_sql import DriverSQL
from orbit_server.db.engine import by_primary_key
from orbit_server.db.packed_rows import packed, packs, unpacked
from orbit_server.db.schema import task_attempts, tasks
from orbit_server.tasks import attempt_locks, permits, result_events, transitions

__all__ = ["complete_all", "start_all"]

_TASK_COLUMNS = (*transitions._TASK_COLUMNS, tasks.c.handler, tasks.c.retry_of)
_ATTEMPT_COLUMNS = attempt_locks._LEASE_COLUMNS
#: Most statements a batch size keeps built (:func:`_task_ids`, :func:`_lock_statement`, :func:`_attempts_update`,
#: :func:`_tasks_update`): the batches of a server's workers come in a few sizes; an unusual size builds its
#: statements again.
_SIZES_KEPT = 128


def _keys(column: sa.Column[Any], name: str, n: int) -> list[sa.BindParameter[Any]]:
    """``:name_0 ... :name_{n-1}``, typed as ``column``: an ``IN`` list built once for ``n`` items (an
    ``expanding`` parameter would rewrite the statement's text on every call)."""
    return [sa.bindparam(f"{name}_{i}", type_=column.type) for i in range(n)]


def _key_params(name: str, values: Sequence[Any]) -> dict[str, Any]:
    return {f"{name}_{i}": value for i, value in enumerate(values)}


@functools.lru_cache(maxsize=_SIZES_KEPT)
def _task_ids(n: int) -> sa.Select[Any]:
    """The task ids of ``n`` attempts ``:a_0 ...``, read without a lock (step 1 of the module docstring)."""
    return sa.select(task_attempts.c.task_id).where(task_attempts.c.id.in_(_keys(task_attempts.c.id, "a", n)))


@functools.lru_cache(maxsize=_SIZES_KEPT)
def _lock_statement(dialect: str, pack: bool, n: int) -> sa.Select[Any]:
    """The locking read of ``n`` tasks ``:t_0 ...`` and their current attempts (steps 1 and 2 of the module
    docstring), with the clock and the queues' pause; ``pack``: each task's and attempt's columns as one,
    ``task_row`` and ``attempt_row`` (MariaDB, :mod:`orbit_server.db.packed_rows`)."""
    if pack:
        read: tuple[sa.ColumnElement[Any], ...] = (
            packed(_TASK_COLUMNS).label("task_row"), packed(_ATTEMPT_COLUMNS).label("attempt_row"),
        )  # fmt: skip
    else:
        read = (*_TASK_COLUMNS, *(column.label(f"attempt_{column.name}") for column in _ATTEMPT_COLUMNS))
    statement = by_primary_key(
        sa.select(*read, transitions.clock_of(dialect).label("db_now"), attempt_locks.gate_paused())
        .select_from(tasks.join(task_attempts, task_attempts.c.id == tasks.c.current_attempt_id))
        .where(
            tasks.c.id.in_(_keys(tasks.c.id, "t", n)), tasks.c.namespace_id == sa.bindparam("namespace_id")
        )
        .with_for_update(),
        tasks,
    )
    # the attempts by key too: on small tables MariaDB would read (and lock) every attempt through a join buffer
    statement = by_primary_key(statement, task_attempts)
    # MariaDB: each task, then its attempt (by primary key), the order every path locks them in
    return statement.prefix_with("STRAIGHT_JOIN", dialect="mysql") if dialect == "mysql" else statement


def _lock_tasks(
    conn: Connection, namespace_id: int, attempt_ids: list[str], named: Sequence[str | None] = ()
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Lock the tasks of the attempts ``attempt_ids`` in ``namespace_id`` and their current attempts, and
    read them (steps 1 and 2 of the module docstring), with the database clock (``db_now``) and their
    queue's pause (``gate_paused``): ``(tasks, current attempts by id)``, nothing when no attempt exists.
    On MariaDB the rows come packed (:mod:`orbit_server.db.packed_rows`): PyMySQL parses each column's
    description in Python, and this read returns 30 columns.

    ``named``: the task id each item names (``StartItem.task_id``), when every item names one: the tasks
    are then locked without reading their ids first (step 1). A wrong one locks another task of the namespace
    (or none) for the transaction, and leaves its attempt unread, so the batch is declined."""
    if named and all(task_id is not None and _ids.can_exist(task_id) for task_id in named):
        task_ids: list[str] = sorted({task_id for task_id in named if task_id is not None})
    else:
        task_ids = list(
            DriverSQL.of(_task_ids(len(attempt_ids))).execute(conn, _key_params("a", attempt_ids)).scalars()
        )
    if not task_ids:
        return [], {}
    pack = packs(conn.dialect)
    statement = _lock_statement(conn.dialect.name, pack, len(task_ids))
    params = {"namespace_id": namespace_id, **_key_params("t", task_ids)}
    # packed: every column as the driver gives it is as this reads it (the queue's pause for its truth)
    rows = (
        (DriverSQL.of(statement).execute(conn, params) if pack else conn.execute(statement, params))
        .mappings()
        .all()
    )
    locked: list[dict[str, Any]] = []
    attempts: list[dict[str, Any]] = []
    for row in rows:
        if pack:
            task = unpacked(row["task_row"], _TASK_COLUMNS)
            attempts.append(unpacked(row["attempt_row"], _ATTEMPT_COLUMNS))
        else:
            task = {column.name: row[column.name] for column in _TASK_COLUMNS}
            attempts.append({column.name: row[f"attempt_{column.name}"] for column in _ATTEMPT_COLUMNS})
        task["db_now"], task["gate_paused"] = row["db_now"], bool(row["gate_paused"])
        locked.append(task)
    return locked, {attempt["id"]: attempt for attempt in attempts}


def _read(
    conn: Connection, namespace_id: int, items: Sequence[StartItem | CompleteItem], attempt_status: AttemptStatus,
    task_status: TaskStatus,
) -> tuple[list[tuple[dict[str, Any], dict[str, Any]]], datetime] | None:  # fmt: skip
    """Lock and read the batch; ``(task, attempt)`` per item and the clock, or ``None`` to decline."""
    attempt_ids = [item.attempt_id for item in items]
    tokens = [item.lease_token for item in items]
    if len(set(attempt_ids)) != len(attempt_ids) or not all(map(_ids.can_exist, attempt_ids)):
        return None  # item by item: a repeated id sees the first item's effect; a bad id is a 404
    locked, by_attempt = _lock_tasks(conn, namespace_id, attempt_ids, [item.task_id for item in items])
    if not locked:
        return None
    now = transitions._naive(locked[0]["db_now"])
    by_task = {row["id"]: row for row in locked}
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for attempt_id, token in zip(attempt_ids, tokens, strict=True):
        attempt = by_attempt.get(attempt_id)
        task = by_task.get(attempt["task_id"]) if attempt is not None else None
        if (
            attempt is None
            or task is None
            or attempt["status"] != attempt_status.value
            or attempt["lease_expires_at"] <= now
            or attempt["lease_token_hash"] != transitions._hash_token(token)
            or task["status"] != task_status.value
            or task["current_attempt_id"] != attempt_id
            or (task["gate_paused"] and attempt_status is AttemptStatus.LEASED)  # a start on a paused queue
        ):
            return None
        task.pop("db_now", None)
        task.pop("gate_paused", None)
        pairs.append((task, attempt))
    return pairs, now


def _by_id(column: sa.Column[Any], n: int, type_: Any) -> sa.ColumnElement[Any]:
    """``CASE column WHEN :id_0 THEN :value_0 ...`` for ``n`` items (:func:`_row_params`)."""
    return sa.case(*zip(_keys(column, "id", n), _values(type_, n), strict=True), value=column)


def _values(type_: Any, n: int) -> list[sa.BindParameter[Any]]:
    return [sa.bindparam(f"value_{i}", type_=type_) for i in range(n)]


def _fenced(column: sa.Column[Any], fence: sa.Column[Any], n: int) -> list[sa.ColumnElement[bool]]:
    """``column IN (:id_0, ...) AND (column, fence) IN ((:id_0, :fence_0), ...)`` for ``n`` rows: the plain
    ``IN`` beside the row ``IN`` gives MariaDB a range of the key for one item too
    (:func:`~orbit_server.db.engine.by_primary_key`)."""
    ids = _keys(column, "id", n)
    fences = [sa.bindparam(f"fence_{i}", type_=fence.type) for i in range(n)]
    return [
        column.in_(ids),
        sa.tuple_(column, fence).in_([sa.tuple_(*pair) for pair in zip(ids, fences, strict=True)]),
    ]


def _row_params(keys: Sequence[Any], fences: Sequence[Any], values: Sequence[Any] = ()) -> dict[str, Any]:
    """The parameters of a statement of :func:`_attempts_update` or :func:`_tasks_update`: each row's key, its
    fence and (where it has a ``CASE``) its value."""
    return {
        **_key_params("id", keys),
        **_key_params("fence", fences),
        **_key_params("value", values),
    }


#: The database clock the batch read (every timestamp it writes).
_NOW = sa.bindparam("now", type_=tasks.c.updated_at.type)


@functools.lru_cache(maxsize=_SIZES_KEPT)
def _attempts_update(to: AttemptStatus, n: int) -> sa.Update:
    """The conditional ``UPDATE`` of ``n`` attempts becoming ``to`` (``RUNNING`` or ``SUCCEEDED``), each fenced
    on ``(id, lease_token_hash)`` (step 3 of the module docstring)."""
    if to is AttemptStatus.RUNNING:
        values: dict[str, Any] = {
            "started_at": _NOW,
            "lease_expires_at": _by_id(task_attempts.c.id, n, task_attempts.c.lease_expires_at.type),
        }
    else:  # a lease-and-start attempt's report confirms it: started_at = the grant's time (execution._confirmed)
        values = {
            "result": _by_id(task_attempts.c.id, n, task_attempts.c.result.type),
            "finished_at": _NOW,
            "started_at": sa.func.coalesce(task_attempts.c.started_at, task_attempts.c.leased_at),
        }
    return by_primary_key(
        task_attempts.update()
        .where(
            *_fenced(task_attempts.c.id, task_attempts.c.lease_token_hash, n),
            task_attempts.c.status == sa.bindparam("from_status"),
            task_attempts.c.lease_expires_at > _NOW,
        )
        .values(status=to.value, **values)
    )


@functools.lru_cache(maxsize=_SIZES_KEPT)
def _tasks_update(to: TaskStatus, n: int) -> sa.Update:
    """The conditional ``UPDATE`` of ``n`` tasks becoming ``to`` (``RUNNING`` or ``SUCCEEDED``), each fenced on
    ``(id, state_version)`` (step 3 of the module docstring)."""
    values: dict[str, Any] = {"status": to.value, "updated_at": _NOW}
    if to.is_terminal:
        values |= {
            "finished_at": _NOW, "result": _by_id(tasks.c.id, n, tasks.c.result.type),
            "error": None, "holds_permit": False,
        }  # fmt: skip
    return by_primary_key(
        tasks.update()
        .where(*_fenced(tasks.c.id, tasks.c.state_version, n), tasks.c.status == sa.bindparam("from_status"))
        .values(state_version=tasks.c.state_version + 1, **values)
    )


def _update_attempts(
    conn: Connection, pairs: Sequence[tuple[dict[str, Any], dict[str, Any]]], now: datetime, to: AttemptStatus,
    values: Sequence[Any],
) -> None:  # fmt: skip
    """Write ``to`` on the batch's attempts, with each its value (its lease's end for ``RUNNING``, its
    result for ``SUCCEEDED``); every row fenced, or :class:`errors.ConcurrentUpdate`."""
    attempts = [attempt for _, attempt in pairs]
    done = DriverSQL.of(_attempts_update(to, len(pairs))).execute(
        conn,
        {
            "now": now, "from_status": attempts[0]["status"],
            **_row_params([a["id"] for a in attempts], [a["lease_token_hash"] for a in attempts], values),
        },
    )  # fmt: skip
    if done.rowcount != len(pairs):
        raise errors.ConcurrentUpdate("an attempt of the batch changed while it was being updated")


def _update_tasks(
    conn: Connection, pairs: Sequence[tuple[dict[str, Any], dict[str, Any]]], to: TaskStatus, now: datetime,
    results: Sequence[Any] = (),
) -> None:  # fmt: skip
    current = TaskStatus(pairs[0][0]["status"])
    if (current, to) not in transitions.TRANSITIONS:
        raise errors.InvalidTransition(f"a {current.value} task cannot become {to.value}")
    done = DriverSQL.of(_tasks_update(to, len(pairs))).execute(
        conn,
        {
            "now": now, "from_status": current.value,
            **_row_params([task["id"] for task, _ in pairs], [task["state_version"] for task, _ in pairs],
                          results if to.is_terminal else ()),
        },
    )  # fmt: skip
    if done.rowcount != len(pairs):
        raise errors.ConcurrentUpdate("a task of the batch changed while it was being updated")
    transitions.APPEND_EVENTS.execute(
        conn,
        [
            {
                "task_id": task["id"], "state_version": int(task["state_version"]) + 1,
                "event": "started" if to is TaskStatus.RUNNING else "completed",
                "from_status": current.value, "to_status": to.value,
                "actor": f"worker:{attempt['worker_id']}", "reason": None,
                "data": {"attempt_id": attempt["id"]}, "created_at": now,
            }
            for task, attempt in pairs
        ],
    )  # fmt: skip
    changes: dict[str, Any] = {"status": to.value, "updated_at": now}
    if to.is_terminal:
        changes |= {"finished_at": now, "error": None, "holds_permit": False}
    for task, _ in pairs:
        task.update(changes, state_version=int(task["state_version"]) + 1)


def start_all(conn: Connection, namespace_id: int, items: Sequence[StartItem]) -> list[AttemptState] | None:
    """Start every attempt of the batch set-based, or ``None`` (nothing written) to run it item by item."""
    read = _read(conn, namespace_id, items, AttemptStatus.LEASED, TaskStatus.LEASED)
    if read is None:
        return None
    pairs, now = read
    expires = [now + timedelta(seconds=attempt["lease_seconds"]) for _, attempt in pairs]
    _update_attempts(conn, pairs, now, AttemptStatus.RUNNING, expires)
    _update_tasks(conn, pairs, TaskStatus.RUNNING, now)
    return [
        attempt_locks._state(task, attempt, status=AttemptStatus.RUNNING, lease_expires_at=expiry)
        for (task, attempt), expiry in zip(pairs, expires, strict=True)
    ]


def complete_all(
    conn: Connection, namespace_id: int, items: Sequence[CompleteItem]
) -> list[AttemptState] | None:
    """Complete every attempt of the batch set-based, or ``None`` (nothing written) to run it item by item."""
    read = _read(conn, namespace_id, items, AttemptStatus.RUNNING, TaskStatus.RUNNING)
    if read is None:
        return None
    pairs, now = read
    results = [item.result for item in items]  # in the order of pairs: one pair per item, in order
    _update_attempts(conn, pairs, now, AttemptStatus.SUCCEEDED, results)
    holders = [attempt["id"] for task, attempt in pairs if task["holds_permit"]]
    if holders:  # the attempts end here: so do their concurrency permits (orbit_server.tasks.permits)
        permits.release(conn, holders)
    _update_tasks(conn, pairs, TaskStatus.SUCCEEDED, now, results)
    for (task, _), result in zip(pairs, results, strict=True):
        task["result"] = result
    event_ids = result_events.record_result_events(conn, namespace_id, [task for task, _ in pairs], now)
    steps = [(task, event_id) for (task, _), event_id in zip(pairs, event_ids, strict=True)
             if task["flow_instance_id"] is not None]  # fmt: skip
    if steps:  # flow steps: their internal events, in this transaction (orbit_server.db.flow_hooks)
        flow_hooks.record_events(conn, steps, now)
    return [attempt_locks._state(task, attempt, status=AttemptStatus.SUCCEEDED) for task, attempt in pairs]
