"""All of the server's SQL for executing tasks: leases, attempts, expiry, cancel, review, manual retry.

The rules, from §2, §3 and §5 of the reliability model (seed 001) and DESIGN §2, §4:

- A task moves only along :data:`TRANSITIONS`, and only through :func:`apply_transition`: a
  conditional ``UPDATE`` on the status and ``state_version`` it read, which bumps the version,
  checks the affected-row count and appends a ``task_events`` row in the same transaction
  (and, for a result state, a ``result_events`` row with its deliveries: :mod:`.results`).
  The one exception is its set-based twin in :func:`lease_tasks`, which makes the same
  conditional update (``WAITING → LEASED``) for every claimed row in one statement, checks
  that every row was updated, and inserts their events in one multi-row ``INSERT``.
- Each grant of a task is a ``task_attempts`` row with a monotonic ``generation`` (the fencing
  number) and a secret lease token (only its SHA-256 is stored). Every later write to an attempt
  is a conditional ``UPDATE`` on its id, token digest and status, and its row count is checked.
  A final attempt is never rewritten; a report that comes too late is kept as evidence only.
- Leases are judged by the database clock (:func:`orbit_server._db.db_now`).
- A queue's execution gate and concurrency limits (:mod:`orbit_server.permits`): a paused queue
  grants and starts nothing; a limited queue's grant takes a permit, and every transition out of
  ``LEASED``/``RUNNING`` in :func:`apply_transition` releases it.
- Lock order: a transaction locks the task row (``SELECT ... FOR UPDATE``) before it touches the
  task's attempts. Claims and the expiry sweep use ``SKIP LOCKED`` on MySQL/MariaDB and never
  wait for a row; SQLite has one writer at a time (``BEGIN IMMEDIATE``), so there the locking
  clauses are no-ops.
- No transaction stays open across HTTP, a handler or a human: every function here takes the
  caller's :class:`~sqlalchemy.engine.Connection` and does one short unit of work. Run them with
  :func:`transact`, which commits, rolls back or retries, and keeps the transaction visible at
  the call site: ``transact(engine, complete_attempt, namespace_id, attempt_id, token, result)``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import random
import secrets
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Concatenate, Final, ParamSpec, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from orbit_client import (
    Attempt,
    AttemptError,
    AttemptLease,
    AttemptState,
    AttemptStatus,
    LeaseGrant,
    Task,
    TaskEvent,
    TaskStatus,
)

from . import _faults, _ids, errors, permits, results, store
from ._db import db_now, is_lock_conflict, to_naive_utc, to_utc
from ._sampling import lease_expired
from .flows import hooks as flow_hooks
from .schema import concurrency_permits, namespaces, queue_gates, queues, task_attempts, task_events, tasks

__all__ = [
    "DEFAULT_BACKOFF_BASE_SECONDS",
    "DEFAULT_BACKOFF_CAP_SECONDS",
    "TRANSITIONS",
    "apply_transition",
    "cancel_task",
    "complete_attempt",
    "expire_leases",
    "fail_attempt",
    "heartbeat",
    "lease_tasks",
    "list_attempts",
    "list_events",
    "retry_task",
    "review_task",
    "start_attempt",
    "transact",
]

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

#: How many times :func:`transact` runs a unit of work that met a lock conflict.
_TRIES = 5
#: Most expired attempts (and overdue waiting tasks) one sweep pass handles.
_SWEEP_BATCH = 200

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
    # knows without a statement more whether it must write a flow event (orbit_server.flows.hooks).
    tasks.c.flow_instance_id,
    tasks.c.flow_token_id,
    tasks.c.flow_activation,
)

P = ParamSpec("P")
T = TypeVar("T")

# Statements built once (the SET columns come from the parameters of each execution).
#: The conditional update of :func:`apply_transition`: ``:b_id``, ``:b_status``, ``:b_version``.
_UPDATE_TASK = tasks.update().where(
    tasks.c.id == sa.bindparam("b_id"),
    tasks.c.status == sa.bindparam("b_status"),
    tasks.c.state_version == sa.bindparam("b_version"),
)
#: :func:`_update_attempt`: ``:b_id``, ``:b_hash``, ``:b_status``, ``:b_now``.
_UPDATE_LIVE_ATTEMPT = task_attempts.update().where(
    task_attempts.c.id == sa.bindparam("b_id"),
    task_attempts.c.lease_token_hash == sa.bindparam("b_hash"),
    task_attempts.c.status == sa.bindparam("b_status"),
    task_attempts.c.lease_expires_at > sa.bindparam("b_now", type_=task_attempts.c.lease_expires_at.type),
)
_INSERT_EVENT = task_events.insert()


# ---------------------------------------------------------------- transactions


def transact(
    engine: Engine, work: Callable[Concatenate[Connection, P], T], *args: P.args, **kwargs: P.kwargs
) -> T:
    """Run ``work(conn, *args, **kwargs)`` in one transaction and commit it.

    A domain error rolls the transaction back, except one with ``keep_writes`` (e.g.
    :class:`errors.LeaseLost`, whose refusal may have expired the attempt or kept a late
    report as evidence): that is committed, then raised. A deadlock, lock wait timeout or
    :class:`errors.ConcurrentUpdate` rolls back and runs ``work`` again, up to 5 times in all;
    nothing of a rolled-back try is left behind, so this is safe.

    Raises:
        errors.OrbitServerError: whatever ``work`` raised.
        errors.ConcurrentUpdate: the conflicts did not stop (409, retryable by the client).
    """
    for _ in range(_TRIES):
        try:
            with engine.connect() as conn:
                trans = conn.begin()
                try:
                    value = work(conn, *args, **kwargs)
                except errors.OrbitServerError as exc:
                    if exc.keep_writes:
                        trans.commit()
                    else:
                        trans.rollback()
                    raise
                except BaseException:
                    trans.rollback()
                    raise
                trans.commit()
                flow_hooks.after_commit(conn)
                return value
        except errors.ConcurrentUpdate:
            log.debug("concurrent update; running %s again", work.__name__)
        except sa.exc.DBAPIError as exc:
            if not is_lock_conflict(exc):
                raise
            log.debug("lock conflict; running %s again", work.__name__)
    raise errors.ConcurrentUpdate("the task kept changing under concurrent requests; retry shortly")


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
) -> dict[str, Any]:
    """Move ``task`` to ``to``: the one way any task changes state.

    A conditional ``UPDATE`` on the task's id, status and ``state_version`` as read (the
    caller holds the row's lock), which bumps ``state_version``, sets ``updated_at`` (and
    ``finished_at`` for a terminal state) and the extra column ``values``; then a
    ``task_events`` row in the same transaction (§4 of DESIGN, invariant 4 of seed 001).
    A transition to ``SUCCEEDED``, ``FAILED``, ``CANCELLED`` or ``NEEDS_REVIEW`` also writes
    its ``result_events`` row and the deliveries to matching subscriptions, in the same
    transaction (:func:`orbit_server.results.record_result_event`; DESIGN §4, §6.2 of seed 001),
    and, for a flow step's task, its internal event (:mod:`orbit_server.flows.hooks`, §6.3).

    Args:
        task: the task row as read, with at least ``id``, ``status`` and ``state_version``.
        now: the database time of the transaction (naive UTC).

    Returns:
        ``task`` with the new status, version and values: pass it to a following transition.

    Raises:
        errors.InvalidTransition: ``(task status, to)`` is not in :data:`TRANSITIONS` (409).
        errors.ConcurrentUpdate: the row was not at the version read (nothing written).
    """
    current = TaskStatus(task["status"])
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
    result = conn.execute(
        _UPDATE_TASK,
        {"b_id": task["id"], "b_status": current.value, "b_version": task["state_version"], **changes},
    )
    if result.rowcount != 1:
        raise errors.ConcurrentUpdate(f"task {task['id']} changed while it was being updated")
    _append_event(conn, task["id"], version, event, current, to, now, actor=actor, reason=reason, data=data)
    if to in results.RESULT_STATUSES:
        event_id = results.record_result_event(conn, task["id"], now)
        if task.get("flow_instance_id") is not None:  # a flow step: its internal event, same transaction
            flow_hooks.record_events(conn, [({**task, **changes}, event_id)], now)
    return {**task, **changes}


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
    conn.execute(
        _INSERT_EVENT,
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
    name = conn.dialect.name
    if name == "sqlite":
        return sa.func.strftime("%Y-%m-%d %H:%M:%f", "now")
    if name == "mysql":
        return sa.func.utc_timestamp(sa.literal_column("6"))
    return sa.func.timezone("UTC", sa.func.clock_timestamp())  # pragma: no cover - PostgreSQL


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


# ---------------------------------------------------------------------- leases


def lease_tasks(
    conn: Connection,
    namespace_id: int,
    queue: str,
    *,
    worker_id: str,
    max_tasks: int,
    lease_seconds: float,
) -> list[LeaseGrant]:
    """Grant up to ``max_tasks`` due tasks of a queue to one worker (the "领取" transaction of §5).

    First sweeps the queue's expired leases (:func:`expire_leases`), then claims ``WAITING``
    tasks whose ``available_at`` has come (oldest first; ``SKIP LOCKED`` on MySQL/MariaDB).
    Each grant moves the task ``WAITING → LEASED``, counts an attempt, and creates a
    ``task_attempts`` row with the next ``generation``, a new 256-bit lease token and
    ``lease_expires_at = now + lease_seconds`` (database clock).

    A paused queue grants nothing. A queue with a concurrency limit grants only tasks whose
    ``concurrency_key`` (and the queue) have room, and each grant takes a permit in this
    transaction (:mod:`orbit_server.permits`); a queue without one takes the plain path.

    Args:
        lease_seconds: the lease duration, in seconds.

    Returns:
        The grants, oldest task first; empty when nothing is due (or the queue is paused). The lease tokens appear
        here and nowhere else.

    Raises:
        errors.QueueNotFound: no such queue in the namespace (404).
    """
    found = conn.execute(
        sa.select(
            queues.c.id, namespaces.c.name, _clock(conn).label("db_now"), queue_gates.c.paused,
            queue_gates.c.max_concurrency_per_key, queue_gates.c.max_concurrency,
        )
        .select_from(
            queues.join(namespaces, namespaces.c.id == queues.c.namespace_id).outerjoin(
                queue_gates, queue_gates.c.queue_id == queues.c.id
            )
        )
        .where(queues.c.namespace_id == namespace_id, queues.c.name == queue)
    ).first()  # fmt: skip
    if found is None:
        raise errors.QueueNotFound(f"queue {queue!r} does not exist in this namespace")
    queue_id, namespace_name, now = found.id, found.name, _naive(found.db_now)
    _sweep(conn, now, queue_id=queue_id, limit=_SWEEP_BATCH)
    if found.paused:
        return []  # the execution gate is shut: no new grants (invariant 12)
    due: Sequence[Mapping[Any, Any]] | None = None
    claimed_limited = None
    if found.max_concurrency_per_key is not None or found.max_concurrency is not None:
        claimed_limited = permits.claim_limited(conn, queue_id, now, max_tasks, _clock(conn))
    if claimed_limited is not None:
        due, now = claimed_limited
    limited = due is not None
    if due is None:
        due = (
            conn.execute(
                _faults.skip_locked(
                    sa.select(tasks)
                    .where(
                        tasks.c.queue_id == queue_id,
                        tasks.c.status == TaskStatus.WAITING.value,
                        tasks.c.available_at <= now,
                        sa.or_(tasks.c.deadline.is_(None), tasks.c.deadline > now),
                    )
                    .order_by(tasks.c.available_at, tasks.c.id)
                    .limit(max_tasks)
                )
            )
            .mappings()
            .all()
        )
    if not due:
        return []
    # Set-based: one conditional UPDATE of every claimed row (each at the status and version it was
    # read at; the row count is checked, so correctness never rests on SKIP LOCKED alone), then one
    # multi-row INSERT of their events and one of their attempts (WAITING → LEASED, §2).
    expires = now + timedelta(seconds=lease_seconds)
    attempt_ids = {row["id"]: str(uuid.uuid4()) for row in due}
    claimed = conn.execute(
        tasks.update()
        .where(
            sa.tuple_(tasks.c.id, tasks.c.state_version).in_(
                [(row["id"], row["state_version"]) for row in due]
            ),
            tasks.c.status == TaskStatus.WAITING.value,
        )
        .values(
            status=TaskStatus.LEASED.value,
            state_version=tasks.c.state_version + 1,
            attempt_count=tasks.c.attempt_count + 1,
            current_attempt_id=sa.case(attempt_ids, value=tasks.c.id),
            updated_at=now,
            **({"holds_permit": True} if limited else {}),
        )
    )
    if claimed.rowcount != len(due):
        raise errors.ConcurrentUpdate("a claimed task changed while it was being leased")
    actor = f"worker:{worker_id}"
    events: list[dict[str, Any]] = []
    attempts: list[dict[str, Any]] = []
    grants: list[LeaseGrant] = []
    for row in due:
        attempt_id = attempt_ids[row["id"]]
        token = secrets.token_urlsafe(32)
        generation = int(row["attempt_count"]) + 1
        version = int(row["state_version"]) + 1
        events.append(
            {
                "task_id": row["id"], "state_version": version, "event": "leased",
                "from_status": TaskStatus.WAITING.value, "to_status": TaskStatus.LEASED.value,
                "actor": actor, "reason": None, "data": {"attempt_id": attempt_id, "generation": generation},
                "created_at": now,
            }
        )  # fmt: skip
        attempts.append(
            {
                "id": attempt_id, "task_id": row["id"], "generation": generation,
                "lease_token_hash": _hash_token(token), "worker_id": worker_id,
                "status": AttemptStatus.LEASED.value, "lease_seconds": lease_seconds, "leased_at": now,
                "lease_expires_at": expires,
            }
        )  # fmt: skip
        task = store.task_from_row(
            {
                **row, "status": TaskStatus.LEASED.value, "state_version": version,
                "attempt_count": generation, "current_attempt_id": attempt_id, "updated_at": now,
                "namespace_name": namespace_name, "queue_name": queue,
            }  # type: ignore[arg-type]
        )  # fmt: skip
        lease = AttemptLease(
            id=attempt_id, generation=generation, lease_token=token, lease_expires_at=_at(expires)
        )
        grants.append(LeaseGrant(task=task, attempt=lease))
    conn.execute(task_events.insert(), events)
    conn.execute(task_attempts.insert(), attempts)
    if limited:  # the permits, taken in this transaction under the gate's lock (§5 "领取 … 取得额度")
        conn.execute(
            concurrency_permits.insert(),
            permits.permit_rows([(row, attempt_ids[row["id"]]) for row in due], now),
        )
    return grants


def expire_leases(conn: Connection, *, limit: int = _SWEEP_BATCH) -> int:
    """The expiry sweep: settle up to ``limit`` lapsed attempts and overdue waiting tasks.

    For an attempt whose ``lease_expires_at`` has passed (database clock):

    - ``LEASED`` (nothing started) → the task goes back to ``WAITING`` while attempts remain
      and the deadline allows, else ``FAILED`` (``attempts_exhausted``/``deadline_exceeded``);
    - ``RUNNING`` → ``WAITING`` (after the task's backoff) only when the task is
      ``retry_safe``, attempts remain and the deadline allows; otherwise ``NEEDS_REVIEW``,
      because silence is no proof that nothing happened (invariant 7, DESIGN §4). A retry-safe
      task whose cancellation was requested then becomes ``CANCELLED``.

    The attempt becomes ``EXPIRED``. Each update re-checks what it read (attempt status and
    expiry, task status and ``state_version``), so a heartbeat or completion that committed
    first wins and the sweep leaves that task alone. Tasks locked by a concurrent request are
    skipped until the next pass. ``WAITING`` tasks past their deadline become ``FAILED``
    (``deadline_exceeded``).

    Returns:
        How many tasks changed state.
    """
    return _sweep(conn, db_now(conn), queue_id=None, limit=limit)


def _sweep(conn: Connection, now: datetime, *, queue_id: int | None, limit: int) -> int:
    expired = sa.select(task_attempts.c.id, task_attempts.c.task_id).where(
        task_attempts.c.status.in_(_LIVE), task_attempts.c.lease_expires_at <= now
    )
    overdue = sa.select(*_TASK_COLUMNS).where(
        tasks.c.status == TaskStatus.WAITING.value, tasks.c.deadline <= now
    )
    if queue_id is not None:
        expired = expired.join(tasks, tasks.c.id == task_attempts.c.task_id).where(
            tasks.c.queue_id == queue_id
        )
        overdue = overdue.where(tasks.c.queue_id == queue_id)
    changed = 0
    for attempt_id, task_id in conn.execute(
        expired.order_by(task_attempts.c.lease_expires_at).limit(limit)
    ).all():
        task = _lock_task(conn, task_id, skip_locked=True)
        if task is None or task["current_attempt_id"] != attempt_id:
            continue  # locked by a concurrent request: the next pass will see it
        attempt = (
            conn.execute(sa.select(task_attempts).where(task_attempts.c.id == attempt_id)).mappings().one()
        )
        if (
            attempt["status"] in _LIVE
            and attempt["lease_expires_at"] <= now
            and _expire_attempt(conn, task, attempt, now)
        ):
            changed += 1
    for row in conn.execute(_faults.skip_locked(overdue.limit(limit))).mappings().all():
        apply_transition(
            conn,
            dict(row),
            TaskStatus.FAILED,
            event="deadline_exceeded",
            now=now,
            actor="sweeper",
            values={"error": _deadline_error()},
        )
        changed += 1
    return changed


def _expire_attempt(
    conn: Connection, task: dict[str, Any], attempt: Mapping[Any, Any], now: datetime,
    *, reason: str | None = None,
) -> bool:  # fmt: skip
    """Settle one lapsed live attempt of a locked task; ``False`` if it was renewed or finished first."""
    was = AttemptStatus(attempt["status"])
    done = conn.execute(
        task_attempts.update()
        .where(
            task_attempts.c.id == attempt["id"],
            task_attempts.c.status == was.value,
            task_attempts.c.lease_expires_at <= now,
        )
        .values(status=AttemptStatus.EXPIRED.value, finished_at=now)
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
    if was is AttemptStatus.LEASED:
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
        task = apply_transition(
            conn,
            task,
            TaskStatus.WAITING,
            event="lease_expired",
            now=now,
            actor="sweeper",
            data=data,
            values={"available_at": available_at},
        )
        if task["cancel_requested"]:
            apply_transition(
                conn,
                task,
                TaskStatus.CANCELLED,
                event="cancelled",
                now=now,
                actor="sweeper",
                reason="cancellation was requested before the lease lapsed",
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


# -------------------------------------------------------------------- attempts


#: The attempt columns :func:`_locked_attempt` reads.
_ATTEMPT_COLUMNS = (
    task_attempts.c.id,
    task_attempts.c.task_id,
    task_attempts.c.generation,
    task_attempts.c.lease_token_hash,
    task_attempts.c.worker_id,
    task_attempts.c.status,
    task_attempts.c.lease_seconds,
    task_attempts.c.lease_expires_at,
    task_attempts.c.result,
    task_attempts.c.error,
)
#: :func:`_locked_attempt`'s statement, built once per dialect.
_LOCKED_ATTEMPT: dict[str, sa.Executable] = {}


def _locked_attempt_statement(conn: Connection) -> sa.Executable:
    """``SELECT <task>, <clock>, <attempt columns as scalar subqueries> FROM tasks WHERE id = <the
    attempt's task> AND namespace_id = :namespace_id FOR UPDATE``, with ``:attempt_id``.

    The attempt's columns come from subqueries, so the locking clause locks the task row alone
    (MySQL/MariaDB and PostgreSQL lock no rows read by a nested subquery): the lock order stays
    task first.
    """
    name = conn.dialect.name
    statement = _LOCKED_ATTEMPT.get(name)
    if statement is None:
        attempt_id = sa.bindparam("attempt_id", type_=task_attempts.c.id.type)

        def of(column: sa.Column[Any]) -> sa.Label[Any]:
            return (
                sa.select(column)
                .where(task_attempts.c.id == attempt_id)
                .scalar_subquery()
                .label(f"attempt_{column.name}")
            )

        task_of_attempt = sa.select(task_attempts.c.task_id).where(task_attempts.c.id == attempt_id)
        statement = _LOCKED_ATTEMPT[name] = (
            sa.select(
                *_TASK_COLUMNS,
                _clock(conn).label("db_now"),
                gate_paused(),
                *(of(c) for c in _ATTEMPT_COLUMNS),
            )
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
    conn: Connection, namespace_id: int, attempt_id: str
) -> tuple[dict[str, Any], dict[str, Any], datetime]:
    """Lock the attempt's task, and read it, the attempt and the database clock in one statement.

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
    row = (
        conn.execute(
            _locked_attempt_statement(conn), {"attempt_id": attempt_id, "namespace_id": namespace_id}
        )
        .mappings()
        .first()
    )
    if row is None:
        raise errors.AttemptNotFound(f"no attempt {attempt_id!r} in this namespace")
    task = {column.name: row[column.name] for column in _TASK_COLUMNS}
    task["gate_paused"] = bool(row["gate_paused"])
    attempt = {column.name: row[f"attempt_{column.name}"] for column in _ATTEMPT_COLUMNS}
    return task, attempt, _naive(row["db_now"])


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


def _update_attempt(conn: Connection, attempt: Mapping[Any, Any], now: datetime, **values: Any) -> None:
    """The conditional update of a live attempt: same id, token digest and status, lease not lapsed."""
    done = conn.execute(
        _UPDATE_LIVE_ATTEMPT,
        {
            "b_id": attempt["id"],
            "b_hash": attempt["lease_token_hash"],
            "b_status": attempt["status"],
            "b_now": now,
            **values,
        },
    )
    if done.rowcount != 1:
        raise errors.ConcurrentUpdate(f"attempt {attempt['id']} changed while it was being updated")


def start_attempt(conn: Connection, namespace_id: int, attempt_id: str, lease_token: str) -> AttemptState:
    """Confirm that the handler starts (``LEASED → RUNNING``, the "开始" transaction of §5).

    Renews the lease by the attempt's ``lease_seconds`` from now (database clock). Starting an
    attempt that is already ``RUNNING`` with the same token answers its state again and
    changes nothing, so a worker may repeat a start whose answer it lost.

    Raises:
        errors.AttemptNotFound: no such attempt in the namespace (404).
        errors.LeaseLost: wrong token, or the attempt is no longer live (409; nothing changed
            but the expiry of a lapsed lease).
    """
    task, attempt, now = _locked_attempt(conn, namespace_id, attempt_id)
    _check_token(attempt, lease_token)
    if (lapsed := _lapsed(conn, task, attempt, now)) is not None:
        raise _lost(attempt, lapsed)
    if attempt["status"] == AttemptStatus.RUNNING.value:
        return _state(task, attempt)
    if task["gate_paused"]:
        raise _give_back(conn, task, attempt, now)
    expires = now + timedelta(seconds=attempt["lease_seconds"])
    _update_attempt(
        conn, attempt, now, status=AttemptStatus.RUNNING.value, started_at=now, lease_expires_at=expires
    )
    task = apply_transition(
        conn,
        task,
        TaskStatus.RUNNING,
        event="started",
        now=now,
        actor=f"worker:{attempt['worker_id']}",
        data={"attempt_id": attempt_id},
    )
    return _state(task, attempt, status=AttemptStatus.RUNNING, lease_expires_at=expires)


def _give_back(
    conn: Connection, task: dict[str, Any], attempt: Mapping[Any, Any], now: datetime
) -> errors.LeaseLost:
    """A start on a paused queue: end the leased attempt now, as a lapsed lease ends (the task
    waits again, or fails when its budget or deadline is spent), and say so (invariant 12)."""
    done = conn.execute(
        task_attempts.update()
        .where(task_attempts.c.id == attempt["id"], task_attempts.c.status == AttemptStatus.LEASED.value)
        .values(lease_expires_at=now)
    )
    if done.rowcount != 1 or not _expire_attempt(
        conn, task, {**attempt, "lease_expires_at": now}, now, reason="the queue is paused"
    ):
        raise errors.ConcurrentUpdate(f"attempt {attempt['id']} changed while it was being started")
    return errors.LeaseLost(
        "the queue is paused: this attempt may not start, its lease was given back and the task waits "
        "until the queue is resumed; stop working on it",
        queue_paused=True,
    )


def heartbeat(
    conn: Connection,
    namespace_id: int,
    attempt_id: str,
    lease_token: str,
    *,
    lease_seconds: float | None = None,
) -> AttemptState:
    """Renew a live attempt's lease ("续租" of §5): ``lease_expires_at = now + lease_seconds``.

    Args:
        lease_seconds: the new lease, in seconds from now (database clock); ``None`` keeps
            the attempt's duration. A given value also becomes the duration later renewals use.

    Returns:
        The attempt's state, whose ``cancel_requested`` tells the worker to stop.

    Raises:
        errors.AttemptNotFound: no such attempt in the namespace (404).
        errors.LeaseLost: wrong token, or the attempt is no longer live (409).
    """
    task, attempt, now = _locked_attempt(conn, namespace_id, attempt_id)
    _check_token(attempt, lease_token)
    if (lapsed := _lapsed(conn, task, attempt, now)) is not None:
        raise _lost(attempt, lapsed)
    seconds = float(attempt["lease_seconds"] if lease_seconds is None else lease_seconds)
    expires = now + timedelta(seconds=seconds)
    _update_attempt(conn, attempt, now, heartbeat_at=now, lease_seconds=seconds, lease_expires_at=expires)
    return _state(task, attempt, lease_expires_at=expires)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _keep_late_report(
    conn: Connection, attempt: Mapping[Any, Any], now: datetime, report: dict[str, Any]
) -> bool:
    """Keep the first too-late report on the attempt, as evidence only (§2: 迟到结果可以作为证据保存)."""
    done = conn.execute(
        task_attempts.update()
        .where(
            task_attempts.c.id == attempt["id"],
            task_attempts.c.lease_token_hash == attempt["lease_token_hash"],
            task_attempts.c.late_reported_at.is_(None),
        )
        .values(late_report=report, late_reported_at=now)
    )
    return bool(done.rowcount == 1)


def complete_attempt(
    conn: Connection, namespace_id: int, attempt_id: str, lease_token: str, result: Any
) -> AttemptState:
    """Save a running attempt's result: attempt and task ``SUCCEEDED`` in one transaction.

    A success also wins over a pending cancel request: a confirmed success is never
    overwritten (§2). Repeating the call with the same token and an equal result answers
    200 with the same state, so a worker may retry a ``complete`` whose answer it lost.

    Raises:
        errors.AttemptNotFound: no such attempt in the namespace (404).
        errors.InvalidTransition: the attempt was never started (409).
        errors.LeaseLost: wrong token, or the attempt is no longer live (409). With the right
            token the report is kept on the attempt as late evidence; the task is unchanged.
    """
    task, attempt, now = _locked_attempt(conn, namespace_id, attempt_id)
    _check_token(attempt, lease_token)
    status = attempt["status"]
    if status == AttemptStatus.SUCCEEDED.value and _canonical(attempt["result"]) == _canonical(result):
        return _state(task, attempt)
    if (lapsed := _lapsed(conn, task, attempt, now)) is not None:
        kept = _keep_late_report(conn, attempt, now, {"outcome": "succeeded", "result": result})
        raise _lost(attempt, lapsed, kept=kept)
    if status == AttemptStatus.LEASED.value:
        raise errors.InvalidTransition(
            "start the attempt before completing it (LEASED cannot become SUCCEEDED)"
        )
    _update_attempt(conn, attempt, now, status=AttemptStatus.SUCCEEDED.value, result=result, finished_at=now)
    task = apply_transition(
        conn,
        task,
        TaskStatus.SUCCEEDED,
        event="completed",
        now=now,
        actor=f"worker:{attempt['worker_id']}",
        data={"attempt_id": attempt_id},
        values={"result": result, "error": None},
    )
    return _state(task, attempt, status=AttemptStatus.SUCCEEDED)


def fail_attempt(
    conn: Connection, namespace_id: int, attempt_id: str, lease_token: str, error: AttemptError
) -> AttemptState:
    """Record a live attempt's failure and decide what becomes of the task.

    - cancellation was requested: the worker stopped, so the task becomes ``CANCELLED``
      (the attempt ``CANCELLED`` when ``error.type == "cancelled"``, else ``FAILED``);
    - ``error.retryable`` and attempts remain: ``WAITING`` again, ``available_at`` moved on
      by the task's backoff; ``FAILED`` with ``deadline_exceeded`` when that passes the deadline;
    - otherwise: ``FAILED`` with ``error``.

    A failure may be reported from ``LEASED`` (before start) or ``RUNNING``. Repeating the
    call with the same token and an equal error answers 200 with the same state.

    Raises:
        errors.AttemptNotFound: no such attempt in the namespace (404).
        errors.LeaseLost: wrong token, or the attempt is no longer live (409). With the right
            token the report is kept on the attempt as late evidence; the task is unchanged.
    """
    task, attempt, now = _locked_attempt(conn, namespace_id, attempt_id)
    _check_token(attempt, lease_token)
    reported = error.model_dump(mode="json")
    finished = (AttemptStatus.FAILED.value, AttemptStatus.CANCELLED.value)
    if attempt["status"] in finished and _canonical(attempt["error"]) == _canonical(reported):
        return _state(task, attempt)
    if (lapsed := _lapsed(conn, task, attempt, now)) is not None:
        kept = _keep_late_report(conn, attempt, now, {"outcome": "failed", "error": reported})
        raise _lost(attempt, lapsed, kept=kept)
    actor = f"worker:{attempt['worker_id']}"
    data = {"attempt_id": attempt_id, "error_type": error.type}
    if task["cancel_requested"]:
        status = AttemptStatus.CANCELLED if error.type == "cancelled" else AttemptStatus.FAILED
        _update_attempt(conn, attempt, now, status=status.value, error=reported, finished_at=now)
        task = apply_transition(
            conn,
            task,
            TaskStatus.CANCELLED,
            event="cancelled",
            now=now,
            actor=actor,
            reason="the worker stopped after cancellation was requested",
            data=data,
            values={"error": reported},
        )
        return _state(task, attempt, status=status)
    _update_attempt(conn, attempt, now, status=AttemptStatus.FAILED.value, error=reported, finished_at=now)
    budget_left = int(task["attempt_count"]) < int(task["max_attempts"])
    available_at = now + _retry_delay(task)
    if error.retryable and budget_left and not _past_deadline(task, available_at):
        to, event, reason, values = (
            TaskStatus.WAITING,
            "retry_scheduled",
            None,
            {"available_at": available_at},
        )
    elif error.retryable and budget_left:
        to, event, reason, values = TaskStatus.FAILED, "deadline_exceeded", None, {}
        reported = _deadline_error(reported)
    else:
        to, event, values = TaskStatus.FAILED, "failed", {}
        reason = "attempts exhausted" if error.retryable else None
    task = apply_transition(
        conn, task, to, event=event, now=now, actor=actor, reason=reason, data=data,
        values={**values, "error": reported},
    )  # fmt: skip
    return _state(task, attempt, status=AttemptStatus.FAILED)


# ----------------------------------------------------------------- operators


def cancel_task(conn: Connection, namespace_id: int, task_id: str, *, reason: str, actor: str) -> Task:
    """Cancel a task, or record the durable intent to (DESIGN §4, §2 of the reliability model).

    ``WAITING`` and ``LEASED`` become ``CANCELLED`` at once (a leased attempt becomes
    ``CANCELLED`` too, so its start is refused). ``RUNNING`` gets ``cancel_requested``: the
    worker sees it on its next heartbeat, and the task becomes ``CANCELLED`` when the worker
    reports that it stopped, or ``SUCCEEDED`` if its success lands first. Cancelling a
    ``CANCELLED`` task, or a running one already asked to stop, changes nothing. Audited as a
    task event with ``actor`` and ``reason`` in the same transaction.

    Raises:
        errors.TaskNotFound: no such task in the namespace (404).
        errors.InvalidTransition: the task is ``SUCCEEDED``, ``FAILED`` or ``NEEDS_REVIEW`` (409).
    """
    task = _lock_task_in(conn, namespace_id, task_id)
    now = db_now(conn)
    status = TaskStatus(task["status"])
    values = {"cancel_requested": True, "cancel_reason": reason}
    if status is TaskStatus.WAITING:
        apply_transition(
            conn,
            task,
            TaskStatus.CANCELLED,
            event="cancelled",
            now=now,
            actor=actor,
            reason=reason,
            values=values,
        )
    elif status is TaskStatus.LEASED:
        done = conn.execute(
            task_attempts.update()
            .where(
                task_attempts.c.id == task["current_attempt_id"],
                task_attempts.c.status == AttemptStatus.LEASED.value,
            )
            .values(status=AttemptStatus.CANCELLED.value, finished_at=now)
        )
        if done.rowcount != 1:
            raise errors.ConcurrentUpdate(f"the leased attempt of task {task_id} changed while cancelling")
        apply_transition(
            conn,
            task,
            TaskStatus.CANCELLED,
            event="cancelled",
            now=now,
            actor=actor,
            reason=reason,
            data={"attempt_id": task["current_attempt_id"]},
            values=values,
        )
    elif status is TaskStatus.RUNNING and not task["cancel_requested"]:
        done = conn.execute(
            tasks.update()
            .where(
                tasks.c.id == task_id,
                tasks.c.status == TaskStatus.RUNNING.value,
                tasks.c.state_version == task["state_version"],
            )
            .values(updated_at=now, **values)
        )
        if done.rowcount != 1:
            raise errors.ConcurrentUpdate(f"task {task_id} changed while cancelling")
        # An intent, not a transition: the event carries the unchanged state_version.
        _append_event(
            conn,
            task_id,
            task["state_version"],
            "cancel_requested",
            None,
            None,
            now,
            actor=actor,
            reason=reason,
            data={"attempt_id": task["current_attempt_id"]},
        )
    elif status not in (TaskStatus.CANCELLED, TaskStatus.RUNNING):
        raise errors.InvalidTransition(f"a {status.value} task cannot be cancelled")
    return _task(conn, namespace_id, task_id)


def review_task(
    conn: Connection,
    namespace_id: int,
    task_id: str,
    *,
    outcome: str,
    reason: str,
    evidence_ref: str,
    result: Any = None,
    actor: str,
    on_behalf_of: str | None = None,
) -> Task:
    """Settle a ``NEEDS_REVIEW`` task as ``SUCCEEDED`` (with ``result``) or ``FAILED``.

    The decision is audited in the same transaction: a ``reviewed`` event with ``actor``,
    ``reason`` and ``evidence_ref`` (and the person ``on_behalf_of``), per §2 of the
    reliability model (核查操作需要证据引用、权限和审计).

    Args:
        outcome: ``"succeeded"`` or ``"failed"``.

    Raises:
        errors.TaskNotFound: no such task in the namespace (404).
        errors.InvalidTransition: the task is not ``NEEDS_REVIEW`` (409).
    """
    task = _lock_task_in(conn, namespace_id, task_id)
    if task["status"] != TaskStatus.NEEDS_REVIEW.value:
        raise errors.InvalidTransition(
            f"only a NEEDS_REVIEW task can be reviewed; this one is {task['status']}"
        )
    now = db_now(conn)
    data = {"outcome": outcome, "evidence_ref": evidence_ref, "on_behalf_of": on_behalf_of}
    if outcome == "succeeded":
        apply_transition(
            conn,
            task,
            TaskStatus.SUCCEEDED,
            event="reviewed",
            now=now,
            actor=actor,
            reason=reason,
            data=data,
            values={"result": result, "error": None},
        )
    else:
        error = {"type": "review_failed", "message": reason, "retryable": False, "evidence_ref": evidence_ref}
        apply_transition(
            conn,
            task,
            TaskStatus.FAILED,
            event="reviewed",
            now=now,
            actor=actor,
            reason=reason,
            data=data,
            values={"error": error},
        )
    return _task(conn, namespace_id, task_id)


def retry_task(
    conn: Connection,
    namespace_id: int,
    task_id: str,
    *,
    reason: str,
    actor: str,
    deadline: datetime | None = None,
) -> Task:
    """Create the one direct successor of a ``FAILED`` or ``CANCELLED`` task (manual retry, §2).

    The new task copies queue, handler, params, attempt budget, retry safety, backoff and
    ``concurrency_key``, has
    ``retry_of`` set and starts ``WAITING`` now; the old task's state never goes back. Both
    tasks get an audit event in the same transaction.

    Args:
        deadline: the new task's deadline (aware, any zone); ``None`` means none.

    Raises:
        errors.TaskNotFound: no such task in the namespace (404).
        errors.NotRetryable: the task is not ``FAILED`` or ``CANCELLED``, or it is a flow step's
            task (its flow applies the result; 409, with ``flow_instance_id``).
        errors.SuccessorExists: the task was retried already (409, with ``successor_id``).
    """
    old = _lock_task_in(conn, namespace_id, task_id)
    if old["flow_instance_id"] is not None:
        # Its flow already took (or will take) this result: a successor would run the step again
        # outside the flow, its result reaching nothing (README "Flows: running them").
        raise errors.NotRetryable(
            f"task {task_id} is a step of flow instance {old['flow_instance_id']}, which applies this "
            "result itself; a manual retry would run the step outside the flow. Give the node a retry "
            'policy (max_attempts) or an on_failure branch, or start a new instance (README "Flows: '
            'running them")',
            extra={"flow_instance_id": old["flow_instance_id"]},
        )
    if old["status"] not in (TaskStatus.FAILED.value, TaskStatus.CANCELLED.value):
        raise errors.NotRetryable(
            f"this task is {old['status']}; only a FAILED or CANCELLED task can be retried "
            "(review a NEEDS_REVIEW task first)"
        )
    successor = conn.execute(sa.select(tasks.c.id).where(tasks.c.retry_of == task_id)).scalar()
    if successor is not None:
        raise errors.SuccessorExists(
            f"task {task_id} was already retried as {successor}", successor_id=successor
        )
    now = db_now(conn)
    source = conn.execute(sa.select(tasks).where(tasks.c.id == task_id)).mappings().one()
    new_id = str(uuid.uuid4())
    try:
        with conn.begin_nested():
            conn.execute(
                tasks.insert().values(
                    id=new_id,
                    namespace_id=namespace_id,
                    queue_id=source["queue_id"],
                    handler=source["handler"],
                    params=source["params"],
                    status=TaskStatus.WAITING.value,
                    state_version=1,
                    attempt_count=0,
                    max_attempts=source["max_attempts"],
                    retry_safe=source["retry_safe"],
                    backoff_base_seconds=source["backoff_base_seconds"],
                    backoff_cap_seconds=source["backoff_cap_seconds"],
                    available_at=now,
                    deadline=to_naive_utc(deadline),
                    concurrency_key=source["concurrency_key"],
                    cancel_requested=False,
                    retry_of=task_id,
                    created_at=now,
                    updated_at=now,
                )
            )
    except sa.exc.IntegrityError:  # a concurrent retry got in first (unique retry_of)
        successor = conn.execute(sa.select(tasks.c.id).where(tasks.c.retry_of == task_id)).scalar()
        raise errors.SuccessorExists(
            f"task {task_id} was already retried as {successor}", successor_id=str(successor)
        ) from None
    _append_event(
        conn,
        new_id,
        1,
        "accepted",
        None,
        TaskStatus.WAITING,
        now,
        actor=actor,
        reason=reason,
        data={"retry_of": task_id},
    )
    _append_event(
        conn,
        task_id,
        old["state_version"],
        "retried",
        None,
        None,
        now,
        actor=actor,
        reason=reason,
        data={"successor_id": new_id},
    )
    return _task(conn, namespace_id, new_id)


# ---------------------------------------------------------------------- reads


def _check_task(conn: Connection, namespace_id: int, task_id: str) -> None:
    if not _ids.can_exist(task_id):
        raise errors.TaskNotFound(f"no task {task_id!r} in this namespace")
    found = conn.execute(
        sa.select(tasks.c.id).where(tasks.c.id == task_id, tasks.c.namespace_id == namespace_id)
    ).first()
    if found is None:
        raise errors.TaskNotFound(f"no task {task_id!r} in this namespace")


def list_attempts(conn: Connection, namespace_id: int, task_id: str) -> list[Attempt]:
    """A task's attempts, first generation first (never their tokens).

    Raises:
        errors.TaskNotFound: no such task in the namespace (404).
    """
    _check_task(conn, namespace_id, task_id)
    rows = conn.execute(
        sa.select(task_attempts)
        .where(task_attempts.c.task_id == task_id)
        .order_by(task_attempts.c.generation)
    ).mappings()
    return [
        Attempt(
            id=row["id"],
            task_id=row["task_id"],
            generation=row["generation"],
            worker_id=row["worker_id"],
            status=AttemptStatus(row["status"]),
            leased_at=_at(row["leased_at"]),
            started_at=to_utc(row["started_at"]),
            heartbeat_at=to_utc(row["heartbeat_at"]),
            lease_expires_at=_at(row["lease_expires_at"]),
            finished_at=to_utc(row["finished_at"]),
            result=row["result"],
            error=row["error"],
            late_report=row["late_report"],
            late_reported_at=to_utc(row["late_reported_at"]),
        )
        for row in rows
    ]


def list_events(conn: Connection, namespace_id: int, task_id: str) -> list[TaskEvent]:
    """A task's history, oldest first.

    Raises:
        errors.TaskNotFound: no such task in the namespace (404).
    """
    _check_task(conn, namespace_id, task_id)
    rows = conn.execute(
        sa.select(task_events).where(task_events.c.task_id == task_id).order_by(task_events.c.id)
    ).mappings()
    return [
        TaskEvent(
            id=row["id"],
            task_id=row["task_id"],
            state_version=row["state_version"],
            event=row["event"],
            from_status=TaskStatus(row["from_status"]) if row["from_status"] else None,
            to_status=TaskStatus(row["to_status"]) if row["to_status"] else None,
            actor=row["actor"],
            reason=row["reason"],
            data=row["data"],
            created_at=_at(row["created_at"]),
        )
        for row in rows
    ]
