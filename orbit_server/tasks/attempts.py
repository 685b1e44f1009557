"""A worker's reports on an attempt it holds: start, heartbeat, complete, fail, each fenced by the lease
token (a stale or expired attempt gets ``409 lease_lost``); the rules are in :mod:`.transitions`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.engine import Connection

from orbit_client import (
    AttemptError,
    AttemptState,
    AttemptStatus,
    TaskStatus,
)
from orbit_server import errors
from orbit_server.db.schema import (
    task_attempts,
)
from orbit_server.tasks.attempt_locks import (
    _check_token,
    _confirmed,
    _holds,
    _lapsed,
    _lock_and_record,
    _locked_attempt,
    _lost,
    _records_as_it_locks,
    _state,
)
from orbit_server.tasks.transitions import (
    _deadline_error,
    _expire_attempt,
    _past_deadline,
    _retry_delay,
    _update_attempt,
    apply_transition,
)

__all__ = ["complete_attempt", "fail_attempt", "heartbeat", "start_attempt"]

_LEASED = AttemptStatus.LEASED.value


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
    task, attempt, now = _locked_attempt(conn, namespace_id, attempt_id, lean=True)
    _check_token(attempt, lease_token)
    if not _holds(attempt, now) or (task["gate_paused"] and attempt["status"] == _LEASED):
        # A rare path (a lapsed or ended lease, a start on a paused queue): every column, still locked.
        task, attempt, now = _locked_attempt(conn, namespace_id, attempt_id)
    if (lapsed := _lapsed(conn, task, attempt, now)) is not None:
        raise _lost(attempt, lapsed)
    if attempt["status"] == AttemptStatus.RUNNING.value:
        return _state(task, attempt)
    if task["gate_paused"]:
        raise _give_back(conn, task, attempt, now)
    expires = now + timedelta(seconds=attempt["lease_seconds"])
    task = apply_transition(
        conn,
        task,
        TaskStatus.RUNNING,
        event="started",
        now=now,
        actor=f"worker:{attempt['worker_id']}",
        data={"attempt_id": attempt_id},
        attempt=(
            attempt,
            {"status": AttemptStatus.RUNNING.value, "started_at": now, "lease_expires_at": expires},
        ),
        renews=True,  # the new lease is computed from the attempt as read: its lease_seconds
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
    task, attempt, now = _locked_attempt(conn, namespace_id, attempt_id, lean=True)
    _check_token(attempt, lease_token)
    if not _holds(attempt, now):
        task, attempt, now = _locked_attempt(conn, namespace_id, attempt_id)  # a rare path: every column
    if (lapsed := _lapsed(conn, task, attempt, now)) is not None:
        raise _lost(attempt, lapsed)
    seconds = float(attempt["lease_seconds"] if lease_seconds is None else lease_seconds)
    expires = now + timedelta(seconds=seconds)
    _update_attempt(
        conn,
        attempt,
        now,
        renews=True,  # the new lease is computed from the attempt as read (without lease_seconds, its own)
        heartbeat_at=now,
        lease_seconds=seconds,
        lease_expires_at=expires,
        **_confirmed(attempt),
    )
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


def _reported(
    conn: Connection, attempt: Mapping[Any, Any], now: datetime, report: dict[str, Any]
) -> errors.ReportConflict | None:
    """The conflict of ``report`` with an outcome the attempt's worker already reported (a success, or a
    failure with its error), the report kept as evidence; else ``None`` (a live attempt, or one that
    ended otherwise: its lease was lost)."""
    status = attempt["status"]
    ended = (AttemptStatus.FAILED.value, AttemptStatus.CANCELLED.value)
    if status != AttemptStatus.SUCCEEDED.value and not (status in ended and attempt["error"] is not None):
        return None
    kept = _keep_late_report(conn, attempt, now, report)
    return errors.ReportConflict(
        f"attempt {attempt['generation']} already reported {status} with another "
        f"{'result' if status == AttemptStatus.SUCCEEDED.value else 'error'}: an attempt's outcome never "
        "changes (the same report again answers 200); this one was "
        + ("kept as evidence" if kept else "not kept: evidence was already recorded"),
        evidence_recorded=kept,
    )


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
        errors.ReportConflict: the attempt already reported another result or a failure (409).
        errors.LeaseLost: wrong token, or the attempt is no longer live (409). With the right
            token the report is kept on the attempt as late evidence; the task is unchanged.
    """
    if _records_as_it_locks(conn.dialect):
        # MariaDB: the plain path's first statement locks, reads and writes the result event (4 commands in all)
        plain = _lock_and_record(conn, namespace_id, attempt_id, lease_token, to=TaskStatus.SUCCEEDED,
                                 values={"result": result, "error": None})  # fmt: skip
        if plain is not None:
            task, attempt, now, event_id = plain
            return _succeed(conn, task, attempt, now, result, recorded=event_id)
        task, attempt, now = _locked_attempt(conn, namespace_id, attempt_id, ending=True)  # a rare path
        _check_token(attempt, lease_token)
    else:
        task, attempt, now = _locked_attempt(conn, namespace_id, attempt_id, ending=True, lean=True)
        _check_token(attempt, lease_token)
        if not _holds(attempt, now):  # a repeated or conflicting report, a lost lease: every column
            task, attempt, now = _locked_attempt(conn, namespace_id, attempt_id, ending=True)
    status = attempt["status"]
    if status == AttemptStatus.SUCCEEDED.value and _canonical(attempt["result"]) == _canonical(result):
        return _state(task, attempt)
    if (conflict := _reported(conn, attempt, now, {"outcome": "succeeded", "result": result})) is not None:
        raise conflict
    if (lapsed := _lapsed(conn, task, attempt, now)) is not None:
        kept = _keep_late_report(conn, attempt, now, {"outcome": "succeeded", "result": result})
        raise _lost(attempt, lapsed, kept=kept)
    if status == AttemptStatus.LEASED.value:
        raise errors.InvalidTransition(
            "start the attempt before completing it (LEASED cannot become SUCCEEDED)"
        )
    return _succeed(conn, task, attempt, now, result)


def _succeed(
    conn: Connection, task: dict[str, Any], attempt: Mapping[Any, Any], now: datetime, result: Any,
    *, recorded: str | None = None,
) -> AttemptState:  # fmt: skip
    """:func:`complete_attempt`'s transition of a running attempt that holds its lease (``recorded``: the id of its
    result event, written already: :func:`~orbit_server.tasks.attempt_locks._lock_and_record`)."""
    task = apply_transition(
        conn,
        task,
        TaskStatus.SUCCEEDED,
        event="completed",
        now=now,
        actor=f"worker:{attempt['worker_id']}",
        data={"attempt_id": attempt["id"]},
        values={"result": result, "error": None},
        attempt=(
            attempt,
            {
                "status": AttemptStatus.SUCCEEDED.value,
                "result": result,
                "finished_at": now,
                **_confirmed(attempt),
            },
        ),
        recorded=recorded,
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
        errors.ReportConflict: the attempt already reported a success or another error (409).
        errors.LeaseLost: wrong token, or the attempt is no longer live (409). With the right
            token the report is kept on the attempt as late evidence; the task is unchanged.
    """
    task, attempt, now = _locked_attempt(conn, namespace_id, attempt_id, ending=True)
    _check_token(attempt, lease_token)
    reported = error.model_dump(mode="json")
    finished = (AttemptStatus.FAILED.value, AttemptStatus.CANCELLED.value)
    if attempt["status"] in finished and _canonical(attempt["error"]) == _canonical(reported):
        return _state(task, attempt)
    if (conflict := _reported(conn, attempt, now, {"outcome": "failed", "error": reported})) is not None:
        raise conflict
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
