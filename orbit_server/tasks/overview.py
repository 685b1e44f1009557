"""What an operator asks first, read for the web console (README "Web console"): is anything stuck, why.

- :func:`operator_summary`: worker liveness per queue (:mod:`.worker_sightings`), schedules (how many,
  paused, the next fire), flow instances by status, and the top error types of the last hour (attempts that
  ended with an error, by the error's ``type``);
- :func:`pending_deliveries`: a subscription's deliveries not acked yet, oldest first, with their tasks;
- :func:`flow_signals`: an instance's received signals, consumed or buffered.

All times come from the database clock; every read is bounded (``limit``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from orbit_server.db.engine import db_now
from orbit_server.db.schema import (
    event_deliveries,
    flow_instances,
    flow_signals,
    flow_steps,
    queues,
    result_events,
    schedules,
    submission_keys,
    subscriptions,
    task_attempts,
    tasks,
)
from orbit_server.tasks.worker_sightings import QueueLiveness, liveness

__all__ = [
    "ErrorType",
    "OperatorSummary",
    "PendingDelivery",
    "SignalRow",
    "StepOf",
    "flow_signals_of",
    "flow_step_of",
    "idempotency_keys",
    "operator_summary",
    "pending_deliveries",
]

_ERROR_WINDOW = timedelta(hours=1)
_ERROR_SCAN = 5000


def _utc(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, str):  # SQLite's MIN() over a timestamp is text
        value = datetime.fromisoformat(value)
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


@dataclass(frozen=True)
class ErrorType:
    """One error type of the last hour: how many attempts ended with it, and the newest one's task."""

    type: str
    count: int
    example_task_id: str
    example_message: str


@dataclass(frozen=True)
class OperatorSummary:
    liveness: dict[str, QueueLiveness]
    schedules_total: int
    schedules_paused: int
    next_fire_at: datetime | None
    next_fire_schedule: str | None
    flow_instances: dict[str, int]
    top_errors: list[ErrorType]
    errors_scanned: int


def operator_summary(conn: Connection, namespace_id: int, *, top: int = 5) -> OperatorSummary:
    """The overview's operator questions at one instant (see the module docstring)."""
    now = db_now(conn)
    names = list(conn.scalars(sa.select(queues.c.name).where(queues.c.namespace_id == namespace_id)))
    total, paused = conn.execute(
        sa.select(
            sa.func.count(), sa.func.coalesce(sa.func.sum(sa.case((schedules.c.paused, 1), else_=0)), 0)
        ).where(schedules.c.namespace_id == namespace_id)
    ).one()
    upcoming = conn.execute(
        sa.select(schedules.c.name, schedules.c.next_fire_at)
        .where(
            schedules.c.namespace_id == namespace_id,
            ~schedules.c.paused,
            schedules.c.next_fire_at.is_not(None),
        )
        .order_by(schedules.c.next_fire_at)
        .limit(1)
    ).first()
    by_status: dict[str, int] = dict(
        conn.execute(
            sa.select(flow_instances.c.status, sa.func.count())
            .where(flow_instances.c.namespace_id == namespace_id)
            .group_by(flow_instances.c.status)
        ).all()
    )
    failures = conn.execute(
        sa.select(task_attempts.c.task_id, task_attempts.c.error)
        .join(tasks, tasks.c.id == task_attempts.c.task_id)
        .where(
            tasks.c.namespace_id == namespace_id,
            task_attempts.c.finished_at >= now - _ERROR_WINDOW,
            task_attempts.c.error.is_not(None),
        )
        .order_by(task_attempts.c.finished_at.desc())
        .limit(_ERROR_SCAN)
    ).all()
    counts: Counter[str] = Counter()
    example: dict[str, tuple[str, str]] = {}
    for task_id, error in failures:
        kind = str(error.get("type") or "error") if isinstance(error, dict) else "error"
        counts[kind] += 1
        if kind not in example:
            message = str(error.get("message") or "") if isinstance(error, dict) else str(error)
            example[kind] = (task_id, message[:200])
    return OperatorSummary(
        liveness=liveness(conn, namespace_id, names),
        schedules_total=int(total),
        schedules_paused=int(paused),
        next_fire_at=_utc(upcoming.next_fire_at) if upcoming else None,
        next_fire_schedule=upcoming.name if upcoming else None,
        flow_instances={str(k): int(v) for k, v in by_status.items()},
        top_errors=[
            ErrorType(kind, n, example[kind][0], example[kind][1]) for kind, n in counts.most_common(top)
        ],
        errors_scanned=len(failures),
    )


@dataclass(frozen=True)
class PendingDelivery:
    """A delivery of a result event not acked yet."""

    delivery_id: int
    task_id: str
    handler: str
    event_status: str
    delivery_count: int
    leased_by: str | None
    lease_expires_at: datetime | None
    created_at: datetime
    age_seconds: float


def pending_deliveries(
    conn: Connection, namespace_id: int, subscription: str, *, limit: int = 100
) -> list[PendingDelivery] | None:
    """The subscription's unacked deliveries, oldest first (``None``: no such subscription)."""
    sub_id = conn.scalar(
        sa.select(subscriptions.c.id).where(
            subscriptions.c.namespace_id == namespace_id, subscriptions.c.name == subscription
        )
    )
    if sub_id is None:
        return None
    now = db_now(conn)
    rows = conn.execute(
        sa.select(
            event_deliveries.c.id,
            result_events.c.task_id,
            result_events.c.handler,
            result_events.c.status,
            event_deliveries.c.delivery_count,
            event_deliveries.c.leased_by,
            event_deliveries.c.lease_expires_at,
            event_deliveries.c.created_at,
        )
        .join(result_events, result_events.c.id == event_deliveries.c.event_id)
        .where(event_deliveries.c.subscription_id == sub_id, event_deliveries.c.state == "PENDING")
        .order_by(event_deliveries.c.id)
        .limit(limit)
    ).all()
    return [
        PendingDelivery(
            delivery_id=r.id,
            task_id=r.task_id,
            handler=r.handler,
            event_status=r.status,
            delivery_count=r.delivery_count,
            leased_by=r.leased_by,
            lease_expires_at=_utc(r.lease_expires_at),
            created_at=_utc(r.created_at) or datetime.now(UTC),
            age_seconds=max(0.0, (now - r.created_at).total_seconds()),
        )
        for r in rows
    ]


@dataclass(frozen=True)
class SignalRow:
    """A signal an instance received: consumed by a wait, or still buffered."""

    name: str
    identity: str
    payload: Any
    actor: str | None
    received_at: datetime
    consumed_at: datetime | None


def flow_signals_of(
    conn: Connection, namespace_id: int, instance_id: str, *, limit: int = 200
) -> list[SignalRow]:
    """The instance's signals, oldest first (empty for an instance of another namespace)."""
    rows = conn.execute(
        sa.select(flow_signals)
        .join(flow_instances, flow_instances.c.id == flow_signals.c.instance_id)
        .where(flow_signals.c.instance_id == instance_id, flow_instances.c.namespace_id == namespace_id)
        .order_by(flow_signals.c.id)
        .limit(limit)
    ).all()
    return [
        SignalRow(
            name=r.name,
            identity=r.identity,
            payload=r.payload,
            actor=r.actor,
            received_at=_utc(r.received_at) or datetime.now(UTC),
            consumed_at=_utc(r.consumed_at),
        )
        for r in rows
    ]


@dataclass(frozen=True)
class StepOf:
    """The flow step a task is: its instance, node and activation."""

    instance_id: str
    node: str
    activation: int


def flow_step_of(conn: Connection, namespace_id: int, task_id: str) -> StepOf | None:
    """The flow step ``task_id`` is, or ``None`` for a plain task (or one of another namespace)."""
    row = conn.execute(
        sa.select(flow_steps.c.instance_id, flow_steps.c.node_id, flow_steps.c.activation)
        .join(flow_instances, flow_instances.c.id == flow_steps.c.instance_id)
        .where(flow_steps.c.task_id == task_id, flow_instances.c.namespace_id == namespace_id)
    ).first()
    return StepOf(row.instance_id, row.node_id, row.activation) if row else None


def idempotency_keys(conn: Connection, namespace_id: int, task_ids: list[str]) -> dict[str, str]:
    """The submission key of each of ``task_ids`` that has one (a task list's "idempotency key" column)."""
    if not task_ids:
        return {}
    return dict(
        conn.execute(
            sa.select(submission_keys.c.task_id, submission_keys.c.idempotency_key).where(
                submission_keys.c.namespace_id == namespace_id, submission_keys.c.task_id.in_(task_ids)
            )
        ).all()
    )
