"""Settling ``NEEDS_RECONCILE`` rows: ``Outbox.reconcile`` by each row's original key, and
``Outbox.resolve`` by a person's decision (README "Outbox", "Reconcile").

Each row is decided on its own: the lookup happens outside any transaction, and the update is
conditional on the row still being ``NEEDS_RECONCILE``, audited in the transaction that applies it.
Works on anything shaped like :class:`~outbox_adapter.Outbox` (:class:`OutboxAccess`), so it
imports no ``_manager``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Protocol

from sqlalchemy.engine import Connection

from orbit_client import NotFoundError, OrbitClient, OrbitError, Task
from outbox_adapter import _flow_sending as flow_sending
from outbox_adapter import _operator_queries as oq
from outbox_adapter import _queries as q
from outbox_adapter._db import db_now
from outbox_adapter._exceptions import InvalidStateError, OutboxRowError, OutboxUsageError
from outbox_adapter._models import DeliveredRow, OutboxRow, ReconcileDecision
from outbox_adapter._sending import KeyWindow
from outbox_adapter._tables import OutboxTables, RowKind

__all__ = ["DeliveredHook", "OutboxAccess", "reconcile", "resolve"]

log = logging.getLogger("outbox_adapter")

DeliveredHook = Callable[[Connection, DeliveredRow], None]


class OutboxAccess(Protocol):
    """What reconciling needs of an :class:`~outbox_adapter.Outbox`: its tables, its transactions, a row."""

    @property
    def tables(self) -> OutboxTables: ...

    def transaction(self, what: str, *, row_id: int | None = None) -> AbstractContextManager[Connection]: ...

    def get(self, row_id: int) -> OutboxRow: ...


def resolve(
    outbox: OutboxAccess,
    row_id: int,
    *,
    actor: str,
    reason: str,
    delivered_as: str | None = None,
    abandon: bool = False,
    client: OrbitClient | None = None,
    on_delivered: DeliveredHook | None = None,
) -> OutboxRow:
    """:meth:`Outbox.resolve` (its docstring says what and why)."""
    if (delivered_as is None) == (not abandon):
        raise OutboxUsageError("give exactly one of delivered_as= (a task id) and abandon=True")
    if not reason or not reason.strip():
        raise OutboxUsageError("give a reason for the audit trail, e.g. reason='task found in the queue'")
    if delivered_as is not None and client is None:
        raise OutboxUsageError("delivered_as= needs client= to check that the task exists")
    row = outbox.get(row_id)
    _require_needs_reconcile(row)
    if delivered_as is not None and row.kind == RowKind.FLOW.value:
        assert client is not None
        try:
            instance = flow_sending.get_flow_instance(client, row.namespace, delivered_as)
        except NotFoundError:
            raise _not_on_server("flow instance", "instance", delivered_as, row) from None
        to_state, error = q.DELIVERED, None
        detail = f"delivered as flow instance {instance.id} (flow {instance.flow!r})"
    elif delivered_as is not None:
        assert client is not None
        try:
            task = client.get_task(row.namespace, delivered_as)
        except NotFoundError:
            raise _not_on_server("task", "task", delivered_as, row) from None
        to_state, error = q.DELIVERED, None
        detail = f"delivered as task {task.id} (queue {task.queue!r}, handler {task.handler!r})"
    else:
        to_state, error = q.ABANDONED, f"abandoned by operator: {reason}"
        detail = "abandoned"
    with outbox.transaction(f"resolve row {row_id}", row_id=row_id) as conn:
        now = db_now(conn)
        if delivered_as is not None:
            changed = oq.record_reconciled_delivered(
                conn, outbox.tables, row_id, now=now, task_id=delivered_as
            )
        else:
            assert error is not None
            changed = oq.abandon_row(conn, outbox.tables, row_id, now=now, error=error)
        if not changed:
            now_row = q.get_row(conn, outbox.tables, row_id)
            state = now_row.state if now_row is not None else "purged"
            raise InvalidStateError(
                f"row {row_id} changed meanwhile and is now {state}, not NEEDS_RECONCILE; nothing was "
                f"changed; see `orbit-outbox show {row_id}`",
                row_id=row_id,
                state=state,
            )
        if delivered_as is not None and on_delivered is not None:
            on_delivered(conn, _delivered(row, delivered_as))
        event = q.event_values(
            row_id,
            q.NEEDS_RECONCILE,
            to_state,
            reason=f"resolved by an operator ({detail}): {reason}",
            actor=actor,
            now=now,
            task_id=delivered_as,
        )
        q.add_events(conn, outbox.tables, [event])
        after = q.get_row(conn, outbox.tables, row_id)
    assert after is not None
    log.info(
        "row %d (key %s) resolved by %s: %s",
        row_id,
        row.idempotency_key,
        actor,
        detail,
        extra={
            "event": "resolved",
            "row_id": row_id,
            "idempotency_key": row.idempotency_key,
            "orbit_task_id": delivered_as,
            "state": to_state,
        },
    )
    return after


def reconcile(
    outbox: OutboxAccess,
    client: OrbitClient,
    *,
    actor: str,
    dry_run: bool = False,
    key_window_seconds: float | None = None,
    batch_size: int = 100,
    on_decision: Callable[[ReconcileDecision], None] | None = None,
    on_delivered: DeliveredHook | None = None,
) -> list[ReconcileDecision]:
    """:meth:`Outbox.reconcile` (its docstring says what and why)."""
    decisions: list[ReconcileDecision] = []
    after = 0
    limit = KeyWindow(client).limit() if key_window_seconds is None else key_window_seconds
    window = None if limit is None else timedelta(seconds=limit)  # None: the server never forgets a key
    while True:
        with outbox.transaction("read the rows to reconcile") as conn:
            rows = oq.rows_to_reconcile(conn, outbox.tables, after_id=after, limit=batch_size)
            now = db_now(conn)
        if not rows:
            return decisions
        for row in rows:
            decision = _reconcile_one(
                outbox,
                client,
                row,
                actor=actor,
                dry_run=dry_run,
                too_old=None if window is None else now - window,
                on_delivered=on_delivered,
            )
            decisions.append(decision)
            if on_decision is not None:
                on_decision(decision)
        after = rows[-1].id


def _reconcile_one(
    outbox: OutboxAccess,
    client: OrbitClient,
    row: OutboxRow,
    *,
    actor: str,
    dry_run: bool,
    too_old: Any,
    on_delivered: DeliveredHook | None,
) -> ReconcileDecision:
    key = row.idempotency_key
    if row.kind == RowKind.FLOW.value:
        return _reconcile_flow_row(
            outbox, client, row, actor=actor, dry_run=dry_run, on_delivered=on_delivered
        )
    try:
        task = client.find_submission(row.namespace, key)
    except OrbitError as exc:
        return _lookup_failed(row, exc)
    if task is not None and _same_submission(task, row):
        decision, to_state = "delivered", q.DELIVERED
        detail = f"the server has task {task.id} for this key: delivered"
    elif task is not None:
        decision, to_state = "mismatch", q.NEEDS_RECONCILE
        detail = (
            f"the key names task {task.id} of a different submission (queue {task.queue!r}, handler "
            f"{task.handler!r}); a person must decide ({_resolve_hint(row.id)}); the row stays NEEDS_RECONCILE"
        )
    elif too_old is not None and row.created_at.replace(tzinfo=None) < too_old:
        decision, to_state = "too_old", q.NEEDS_RECONCILE
        detail = (
            "no task for this key, but the row is older than the server's key window, so the server may "
            "have forgotten it; resending could create a second task; a person must decide "
            f"({_resolve_hint(row.id)}); the row stays NEEDS_RECONCILE"
        )
    else:
        decision, to_state = "pending", q.PENDING
        detail = "no task was created with this key: sent again with the same key"
    task_id = task.id if task is not None else None
    return _apply_decision(
        outbox,
        row,
        decision,
        to_state,
        detail,
        task_id,
        actor=actor,
        dry_run=dry_run,
        on_delivered=on_delivered,
    )


def _reconcile_flow_row(
    outbox: OutboxAccess,
    client: OrbitClient,
    row: OutboxRow,
    *,
    actor: str,
    dry_run: bool,
    on_delivered: DeliveredHook | None,
) -> ReconcileDecision:
    """Settle a flow row by its key (``GET .../flow-instances?idempotency_key=K``): the instance of
    this flow and input → ``DELIVERED``; another start → ``mismatch``; none → ``PENDING`` (a flow
    start's key lives as long as its instance, so "none" proves nothing was started)."""
    key = row.idempotency_key
    try:
        found = flow_sending.find_flow_start(client, row.namespace, key)
    except OrbitError as exc:
        return _lookup_failed(row, exc)
    if found is not None and flow_sending.same_start(found, row.flow, row.params):
        decision, to_state = "delivered", q.DELIVERED
        detail = f"the server has flow instance {found.id} for this key: delivered"
    elif found is not None:
        decision, to_state = "mismatch", q.NEEDS_RECONCILE
        detail = (
            f"the key names flow instance {found.id} of another start (flow {found.flow!r}); a person must "
            f"decide ({_resolve_hint(row.id)}); the row stays NEEDS_RECONCILE"
        )
    else:
        decision, to_state = "pending", q.PENDING
        detail = "no flow instance was started with this key: sent again with the same key"
    return _apply_decision(
        outbox,
        row,
        decision,
        to_state,
        detail,
        found.id if found is not None else None,
        actor=actor,
        dry_run=dry_run,
        on_delivered=on_delivered,
    )


def _apply_decision(
    outbox: OutboxAccess,
    row: OutboxRow,
    decision: str,
    to_state: str,
    detail: str,
    task_id: str | None,
    *,
    actor: str,
    dry_run: bool,
    on_delivered: DeliveredHook | None,
) -> ReconcileDecision:
    """Write one reconcile decision (conditional on the row still being ``NEEDS_RECONCILE``), audited."""
    key = row.idempotency_key
    if dry_run:
        return ReconcileDecision(
            row_id=row.id,
            idempotency_key=key,
            decision=decision,
            applied=False,
            detail=detail,
            orbit_task_id=task_id,
        )
    with outbox.transaction(f"record the reconcile decision for row {row.id}", row_id=row.id) as conn:
        now = db_now(conn)
        if decision == "delivered":
            assert task_id is not None
            written = oq.record_reconciled_delivered(conn, outbox.tables, row.id, now=now, task_id=task_id)
            if written and on_delivered is not None:
                on_delivered(conn, _delivered(row, task_id))
        elif decision == "pending":
            written = oq.record_reconciled_pending(conn, outbox.tables, row.id, now=now)
        else:  # left for a person: only last_error and the audit event are written
            written = oq.record_reconcile_mismatch(conn, outbox.tables, row.id, now=now, error=detail)
        if written:
            event = q.event_values(
                row.id,
                q.NEEDS_RECONCILE,
                to_state,
                reason=f"reconcile: {detail}",
                actor=actor,
                now=now,
                task_id=task_id,
            )
            q.add_events(conn, outbox.tables, [event])
    if not written:
        detail = "another process decided this row first; nothing was changed"
    applied = written and to_state != q.NEEDS_RECONCILE
    log.info(
        "reconcile row %d (key %s): %s",
        row.id,
        key,
        decision,
        extra={
            "event": "reconciled",
            "row_id": row.id,
            "idempotency_key": key,
            "orbit_task_id": task_id,
            "decision": decision,
        },
    )
    return ReconcileDecision(
        row_id=row.id,
        idempotency_key=key,
        decision=decision,
        applied=applied,
        detail=detail,
        orbit_task_id=task_id,
    )


def _resolve_hint(row_id: int) -> str:
    return (
        f"`orbit-outbox resolve {row_id} --delivered-as TASK_ID --reason TEXT` or `--abandon --reason TEXT`"
    )


def _require_needs_reconcile(row: OutboxRow) -> None:
    if row.state != q.NEEDS_RECONCILE:
        hint = (
            f"use `orbit-outbox retry {row.id}` to send a DEAD row again"
            if row.state == q.DEAD
            else "there is nothing to resolve"
        )
        raise InvalidStateError(
            f"row {row.id} is {row.state}, not NEEDS_RECONCILE; only NEEDS_RECONCILE rows can be resolved ({hint})",
            row_id=row.id,
            state=row.state,
        )


def _same_submission(task: Task, row: OutboxRow) -> bool:
    """Whether the task the key names is this row's submission (queue, handler and params)."""
    return (
        task.namespace == row.namespace
        and task.queue == row.queue
        and task.handler == row.handler
        and task.params == row.params
    )


def _delivered(row: OutboxRow, task_id: str) -> DeliveredRow:
    """What ``on_delivered`` is given for a row settled as delivered (``replayed``: the task existed)."""
    return DeliveredRow(row_id=row.id, idempotency_key=row.idempotency_key, business_ref=row.business_ref,
                        orbit_task_id=task_id, replayed=True, kind=row.kind)  # fmt: skip


def _lookup_failed(row: OutboxRow, exc: OrbitError) -> ReconcileDecision:
    """The row stays: its lookup failed; the next run tries again."""
    return ReconcileDecision(row_id=row.id, idempotency_key=row.idempotency_key, decision="error", applied=False,
                             detail=f"lookup failed: {exc}")  # fmt: skip


def _not_on_server(what: str, id_name: str, delivered_as: str, row: OutboxRow) -> OutboxRowError:
    """``resolve --delivered-as`` named a task (or flow instance) the server answered 404 for."""
    return OutboxRowError(
        f"there is no {what} {delivered_as!r} in namespace {row.namespace!r} (the server answered 404); "
        f"check the {id_name} id; row {row.id} stays NEEDS_RECONCILE",
        row_id=row.id,
        state=row.state,
    )
