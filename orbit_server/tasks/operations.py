"""An operator's or a client's actions on a task: cancel, review, manual retry, and its attempt and event
history; the rules are in :mod:`orbit_server.tasks.transitions`.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from orbit_client import (
    Attempt,
    AttemptStatus,
    Task,
    TaskEvent,
    TaskStatus,
)
from orbit_server import _ids, errors
from orbit_server.db.engine import db_now, to_naive_utc, to_utc
from orbit_server.db.schema import (
    task_attempts,
    task_events,
    tasks,
)
from orbit_server.tasks.transitions import _append_event, _at, _lock_task_in, _task, apply_transition

__all__ = ["cancel_task", "list_attempts", "list_events", "retry_task", "review_task"]

# ----------------------------------------------------------------- operators


def cancel_task(conn: Connection, namespace_id: int, task_id: str, *, reason: str, actor: str) -> Task:
    """Cancel a task, or record the durable intent to (DESIGN §4, §2 of the reliability model).

    ``WAITING`` and ``LEASED`` become ``CANCELLED`` at once (a leased attempt becomes
    ``CANCELLED`` too, so its start is refused). ``RUNNING`` gets ``cancel_requested``: the
    worker sees it on its next heartbeat, and the task becomes ``CANCELLED`` when the worker
    reports that it stopped, or ``SUCCEEDED`` if its success lands first. If the attempt's lease
    lapses instead, the task becomes ``CANCELLED`` too (it is never leased again), unless it is not
    ``retry_safe`` and its start was confirmed: then ``NEEDS_REVIEW``, its outcome unknown. Cancelling a
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

    The new task copies queue, handler, params, attempt budget, retry safety, backoff,
    ``concurrency_key`` and ``priority``, has ``retry_of`` set and starts ``WAITING`` now; the old
    task's state never goes back. Both tasks get an audit event in the same transaction.

    Args:
        deadline: the new task's deadline (aware, any zone); ``None`` means none.

    Raises:
        errors.TaskNotFound: no such task in the namespace (404).
        errors.NotRetryable: the task is not ``FAILED`` or ``CANCELLED``, or it is a flow step's
            task (its flow applies the result; 409, with ``flow_instance_id``).
        errors.SuccessorExists: the task was retried already (409, with ``successor_id``).
        errors.DeadlinePassed: ``deadline`` is not after the database's now (422).
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
    if deadline is not None and deadline.astimezone(UTC).replace(tzinfo=None) <= now:
        raise errors.DeadlinePassed(
            f"the deadline {deadline.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ} is not after now (database clock): "
            "the new task could only fail at once; give a later deadline, or none"
        )
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
                    priority=source["priority"],
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
