"""The set-based path of batched ``start`` and ``complete`` calls (DESIGN §4, "Batched attempt calls").

A batch whose every item is the plain case (the attempt exists in the namespace, its token is
right, it holds a live lease, it is ``LEASED`` for a start or ``RUNNING`` for a complete, its task
is at the matching status with this attempt current, and no attempt appears twice) is written
with one statement per table instead of one per item:

1. read the batch's task ids from its attempts, without a lock (lock order stays task first), and
   lock those tasks by primary key: ``SELECT ... FROM tasks FORCE INDEX (PRIMARY) WHERE id IN
   (...) AND namespace_id = :ns FOR UPDATE``, with the database clock. (Not one statement with an
   ``IN (SELECT ...)``: MariaDB then scans and locks the whole table; and every by-key statement
   here is pinned to the primary key, :func:`orbit_server.db.engine.by_primary_key`);
2. read the attempts, now that their tasks are locked (every change to an attempt is made under
   its task's lock, and the server reads at ``READ COMMITTED``, so these rows are current: what a
   heartbeat changed before the lock is seen, such as the ``lease_seconds`` a start's new lease is
   computed from, or the lease's end a complete answers);
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

Every statement is built once (per batch size where it holds one ``CASE`` branch per item). The
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
from orbit_server.db.engine import by_primary_key
from orbit_server.db.packed_rows import packed, packs, unpacked
from orbit_server.db.schema import task_attempts, task_events, tasks
from orbit_server.tasks import attempt_locks, permits, result_events, transitions

__all__ = ["complete_all", "start_all"]

_TASK_COLUMNS = (*transitions._TASK_COLUMNS, tasks.c.handler, tasks.c.retry_of)
_ATTEMPT_COLUMNS = attempt_locks._LEASE_COLUMNS
_IDS = sa.bindparam("attempt_ids", expanding=True, type_=task_attempts.c.id.type)
_READ_ATTEMPTS = sa.select(*_ATTEMPT_COLUMNS).where(task_attempts.c.id.in_(_IDS))
#: The same on MariaDB, each row packed into one column (every column small: far below max_allowed_packet).
_READ_PACKED_ATTEMPTS = sa.select(packed(_ATTEMPT_COLUMNS).label("attempt_row")).where(
    task_attempts.c.id.in_(_IDS)
)
#: The batch's task ids, read without a lock (step 1 of the module docstring).
_TASK_IDS = sa.select(task_attempts.c.task_id).where(task_attempts.c.id.in_(_IDS))
#: :func:`_lock_tasks`'s statement, built once per dialect and whether it packs its rows.
_LOCK_TASKS: dict[tuple[str, bool], sa.Executable] = {}
#: Most statements a batch size keeps built (:func:`_attempts_update`, :func:`_tasks_update`): the batches
#: of a server's workers come in a few sizes; an unusual size builds its statements again.
_SIZES_KEPT = 128


def _lock_tasks_statement(conn: Connection, pack: bool) -> sa.Executable:
    """The locking read of the batch's tasks, with the clock and their queues' pause; ``pack``: each
    task's columns as one, ``task_row`` (MariaDB, :mod:`orbit_server.db.packed_rows`)."""
    key = (conn.dialect.name, pack)
    statement = _LOCK_TASKS.get(key)
    if statement is None:
        task = (packed(_TASK_COLUMNS).label("task_row"),) if pack else _TASK_COLUMNS
        statement = _LOCK_TASKS[key] = by_primary_key(
            sa.select(*task, transitions._clock(conn).label("db_now"), attempt_locks.gate_paused())
            .where(
                tasks.c.id.in_(sa.bindparam("task_ids", expanding=True, type_=tasks.c.id.type)),
                tasks.c.namespace_id == sa.bindparam("namespace_id"),
            )
            .with_for_update(),
            tasks,
        )
    return statement


def _lock_tasks(
    conn: Connection, namespace_id: int, attempt_ids: list[str]
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Lock the tasks of the attempts ``attempt_ids`` in ``namespace_id`` (step 1 of the module
    docstring) and read them, with the database clock (``db_now``) and their queue's pause
    (``gate_paused``), then read the attempts (step 2): ``(tasks, attempts by id)``, nothing when no
    attempt exists. On MariaDB the rows come packed (:mod:`orbit_server.db.packed_rows`): PyMySQL
    parses each column's description in Python, and these reads returned 22 and 8 columns."""
    task_ids = list(conn.execute(_TASK_IDS, {"attempt_ids": attempt_ids}).scalars())
    if not task_ids:
        return [], {}
    pack = packs(conn.dialect)
    params = {"task_ids": task_ids, "namespace_id": namespace_id}
    rows = conn.execute(_lock_tasks_statement(conn, pack), params).mappings().all()
    if pack:
        locked = [
            {
                **unpacked(row["task_row"], _TASK_COLUMNS),
                "db_now": row["db_now"],
                "gate_paused": row["gate_paused"],
            }
            for row in rows
        ]
        read = conn.execute(_READ_PACKED_ATTEMPTS, {"attempt_ids": attempt_ids}).scalars()
        attempts = [unpacked(row, _ATTEMPT_COLUMNS) for row in read]
    else:
        locked = [dict(row) for row in rows]
        attempts = [
            dict(row) for row in conn.execute(_READ_ATTEMPTS, {"attempt_ids": attempt_ids}).mappings()
        ]
    return locked, {attempt["id"]: attempt for attempt in attempts}


def _read(
    conn: Connection, namespace_id: int, attempt_ids: list[str], attempt_status: AttemptStatus,
    task_status: TaskStatus, tokens: list[str],
) -> tuple[list[tuple[dict[str, Any], dict[str, Any]]], datetime] | None:  # fmt: skip
    """Lock and read the batch; ``(task, attempt)`` per item and the clock, or ``None`` to decline."""
    if len(set(attempt_ids)) != len(attempt_ids) or not all(map(_ids.can_exist, attempt_ids)):
        return None  # item by item: a repeated id sees the first item's effect; a bad id is a 404
    locked, by_attempt = _lock_tasks(conn, namespace_id, attempt_ids)
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


def _by_id(column: sa.ColumnElement[Any], n: int, type_: Any) -> sa.ColumnElement[Any]:
    """``CASE column WHEN :id_0 THEN :value_0 ...`` for ``n`` items (:func:`_case_params`)."""
    return sa.case(
        *[
            (sa.bindparam(f"id_{i}", type_=column.type), sa.bindparam(f"value_{i}", type_=type_))
            for i in range(n)
        ],
        value=column,
    )


def _case_params(keys: Sequence[Any], values: Sequence[Any]) -> dict[str, Any]:
    return {
        **{f"id_{i}": key for i, key in enumerate(keys)},
        **{f"value_{i}": v for i, v in enumerate(values)},
    }


#: What the ``UPDATE`` of the attempts and the one of the tasks are fenced on, per row (step 3 of the module docstring).
_ATTEMPT_FENCE = sa.tuple_(task_attempts.c.id, task_attempts.c.lease_token_hash)
_TASK_FENCE = sa.tuple_(tasks.c.id, tasks.c.state_version)
#: The database clock the batch read (every timestamp it writes).
_NOW = sa.bindparam("now", type_=tasks.c.updated_at.type)


@functools.lru_cache(maxsize=_SIZES_KEPT)
def _attempts_update(to: AttemptStatus, n: int) -> sa.Update:
    """The conditional ``UPDATE`` of ``n`` attempts becoming ``to`` (``RUNNING`` or ``SUCCEEDED``)."""
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
            task_attempts.c.id.in_(sa.bindparam("ids", expanding=True)),  # a range for one item too
            _ATTEMPT_FENCE.in_(sa.bindparam("fence", expanding=True)),
            task_attempts.c.status == sa.bindparam("from_status"),
            task_attempts.c.lease_expires_at > _NOW,
        )
        .values(status=to.value, **values)
    )


@functools.lru_cache(maxsize=_SIZES_KEPT)
def _tasks_update(to: TaskStatus, n: int) -> sa.Update:
    """The conditional ``UPDATE`` of ``n`` tasks becoming ``to`` (``RUNNING`` or ``SUCCEEDED``)."""
    values: dict[str, Any] = {"status": to.value, "updated_at": _NOW}
    if to.is_terminal:
        values |= {
            "finished_at": _NOW, "result": _by_id(tasks.c.id, n, tasks.c.result.type),
            "error": None, "holds_permit": False,
        }  # fmt: skip
    return by_primary_key(
        tasks.update()
        .where(
            tasks.c.id.in_(sa.bindparam("ids", expanding=True)),  # a range for one item too
            _TASK_FENCE.in_(sa.bindparam("fence", expanding=True)),
            tasks.c.status == sa.bindparam("from_status"),
        )
        .values(state_version=tasks.c.state_version + 1, **values)
    )


def _update_attempts(
    conn: Connection, pairs: Sequence[tuple[dict[str, Any], dict[str, Any]]], now: datetime, to: AttemptStatus,
    values: Sequence[Any],
) -> None:  # fmt: skip
    """Write ``to`` on the batch's attempts, with each its value (its lease's end for ``RUNNING``, its
    result for ``SUCCEEDED``); every row fenced, or :class:`errors.ConcurrentUpdate`."""
    attempts = [attempt for _, attempt in pairs]
    ids = [attempt["id"] for attempt in attempts]
    done = conn.execute(
        _attempts_update(to, len(pairs)),
        {
            "ids": ids, "now": now, "from_status": attempts[0]["status"],
            "fence": [(a["id"], a["lease_token_hash"]) for a in attempts],
            **_case_params(ids, values),
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
    ids = [task["id"] for task, _ in pairs]
    done = conn.execute(
        _tasks_update(to, len(pairs)),
        {
            "ids": ids, "now": now, "from_status": current.value,
            "fence": [(task["id"], task["state_version"]) for task, _ in pairs],
            **(_case_params(ids, results) if to.is_terminal else {}),
        },
    )  # fmt: skip
    if done.rowcount != len(pairs):
        raise errors.ConcurrentUpdate("a task of the batch changed while it was being updated")
    conn.execute(
        task_events.insert(),
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
    read = _read(
        conn, namespace_id, [item.attempt_id for item in items], AttemptStatus.LEASED, TaskStatus.LEASED,
        [item.lease_token for item in items],
    )  # fmt: skip
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
    read = _read(
        conn, namespace_id, [item.attempt_id for item in items], AttemptStatus.RUNNING, TaskStatus.RUNNING,
        [item.lease_token for item in items],
    )  # fmt: skip
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
