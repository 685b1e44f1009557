"""Sampled server gauges and the process-wide lease counters of ``/metrics`` (README "Operations").

The gauges (live tasks per queue and status, the review backlog, unacked result deliveries and
the oldest one's age) are read by :func:`sample` once per ``ORBIT_METRICS_SAMPLE_INTERVAL_SECONDS``
in a background task of the app, never per scrape: a scrape only reads the last sample. Each
statement is served by an index of ``db/schema.py``:

- tasks per queue and status: ``queue_id IN (every queue) AND status IN (live statuses)`` over
  ``ix_tasks_claim_order (queue_id, status, ...)``, index only, a range per (queue, status):
  terminal tasks (the bulk of a big table) are never read;
- the oldest ``NEEDS_REVIEW`` task per namespace: ``ix_tasks_status_deadline (status, ...)``;
- unacked deliveries per subscription: ``subscription_id IN (...) AND state = 'PENDING'`` over
  ``ix_event_deliveries_claim (subscription_id, state, id)``, index only, whose ``MIN(id)`` is
  the oldest; their ``created_at`` by primary key.

Labels carry namespace, queue, subscription and status names, no task id, key or params: a queue
or subscription name used in several namespaces is one series per namespace (issue 21: they were
added together). They name every namespace: set ``ORBIT_METRICS_TOKEN`` (README "Security").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from sqlalchemy.engine import Connection

from orbit_client import TaskStatus
from orbit_server.db.engine import db_now
from orbit_server.db.schema import (
    event_deliveries,
    flow_events,
    flow_instances,
    namespaces,
    queues,
    subscriptions,
    tasks,
)

__all__ = ["LEASE_EXPIRIES", "Sample", "SampledGauges", "lease_expired", "sample"]

#: Statuses whose tasks are counted per queue: the live ones (terminal tasks grow without bound).
LIVE_STATUSES = (TaskStatus.WAITING, TaskStatus.LEASED, TaskStatus.RUNNING, TaskStatus.NEEDS_REVIEW)

#: Attempts whose lease lapsed, by what the attempt was doing; process-wide, so that the sweep
#: (which knows no app) can count; every app's registry exposes it.
LEASE_EXPIRIES = Counter(
    "orbit_lease_expiries",
    "Attempts whose lease lapsed and were expired by the sweep, by the attempt's status then "
    "(LEASED: never started; RUNNING: the task went back to WAITING or to NEEDS_REVIEW).",
    ["attempt_status"],
    registry=None,
)
_EXPIRED = {status: LEASE_EXPIRIES.labels(status) for status in ("LEASED", "RUNNING")}


def lease_expired(attempt_status: str) -> None:
    """Hook of the expiry sweep: one attempt expired (``attempt_status``: LEASED or RUNNING)."""
    child = _EXPIRED.get(attempt_status)
    if child is not None:
        child.inc()


@dataclass
class Sample:
    """One reading of the gauges (database clock)."""

    #: (namespace, queue, status) -> live tasks
    tasks: dict[tuple[str, str, str], int] = field(default_factory=dict)
    #: age of the oldest NEEDS_REVIEW task, in seconds (``None``: none)
    review_oldest: float | None = None
    #: (namespace, subscription) -> (unacked deliveries, age of the oldest in seconds or 0)
    deliveries: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)
    #: internal flow events recorded but not yet applied (the flow backlog)
    flow_events_pending: int = 0
    #: age of the oldest of them whose instance is not paused, in seconds (``None``: none)
    flow_events_oldest: float | None = None


def _as_datetime(value: Any) -> datetime:
    return datetime.fromisoformat(value) if isinstance(value, str) else value.replace(tzinfo=None)


def sample(conn: Connection) -> Sample:
    """Read every sampled gauge; a handful of index-served statements (module docstring)."""
    now = db_now(conn)
    out = Sample()
    # One statement: a namespace and its queue created between two reads (READ COMMITTED) once made
    # the queue's namespace unknown here (KeyError, no gauges for 15 s).
    names = {
        qid: (ns_name, name)
        for qid, ns_name, name in conn.execute(
            sa.select(queues.c.id, namespaces.c.name, queues.c.name).join(
                namespaces, namespaces.c.id == queues.c.namespace_id
            )
        )
    }
    live = [s.value for s in LIVE_STATUSES]
    for ns_name, name in names.values():
        for status in live:
            out.tasks[(ns_name, name, status)] = 0
    if names:
        counts = (
            sa.select(tasks.c.queue_id, tasks.c.status, sa.func.count())
            .where(tasks.c.queue_id.in_(list(names)), tasks.c.status.in_(live))
            .group_by(tasks.c.queue_id, tasks.c.status)
        )
        for qid, status, n in conn.execute(counts):
            out.tasks[(*names[qid], status)] += int(n)
    oldest_review = conn.execute(
        sa.select(sa.func.min(tasks.c.updated_at)).where(tasks.c.status == TaskStatus.NEEDS_REVIEW.value)
    ).scalar()
    if oldest_review is not None:
        out.review_oldest = max(0.0, (now - _as_datetime(oldest_review)).total_seconds())
    subs = {
        sid: (ns_name, name)
        for sid, ns_name, name in conn.execute(
            sa.select(subscriptions.c.id, namespaces.c.name, subscriptions.c.name).join(
                namespaces, namespaces.c.id == subscriptions.c.namespace_id
            )
        )
    }
    for sub in subs.values():
        out.deliveries[sub] = (0, 0.0)
    if subs:
        d = event_deliveries
        pending = (
            sa.select(d.c.subscription_id, sa.func.count(), sa.func.min(d.c.id))
            .where(d.c.subscription_id.in_(list(subs)), d.c.state == "PENDING")
            .group_by(d.c.subscription_id)
        )
        rows = conn.execute(pending).all()
        oldest_ids = [oldest for _, _, oldest in rows if oldest is not None]
        created = (
            dict(conn.execute(sa.select(d.c.id, d.c.created_at).where(d.c.id.in_(oldest_ids))).all())
            if oldest_ids
            else {}
        )
        for sid, n, oldest in rows:
            at = created.get(oldest)
            age = max(0.0, (now - _as_datetime(at)).total_seconds()) if at is not None else 0.0
            had, had_age = out.deliveries[subs[sid]]
            out.deliveries[subs[sid]] = (had + int(n), max(had_age, age))
    # Served by ix_flow_events_pending (consumed_at, created_at): only the unconsumed rows are read.
    out.flow_events_pending = int(
        conn.execute(
            sa.select(sa.func.count()).select_from(flow_events).where(flow_events.c.consumed_at.is_(None))
        ).scalar_one()
    )
    if out.flow_events_pending:  # a paused instance's results wait for its resume on purpose: not counted
        oldest_event = conn.execute(
            sa.select(sa.func.min(flow_events.c.created_at))
            .join(flow_instances, flow_instances.c.id == flow_events.c.instance_id)
            .where(flow_events.c.consumed_at.is_(None), flow_instances.c.status != "PAUSED")
        ).scalar()
        if oldest_event is not None:
            out.flow_events_oldest = max(0.0, (now - _as_datetime(oldest_event)).total_seconds())
    return out


class SampledGauges:
    """A collector over the last :class:`Sample`: a scrape never touches the database.

    Ages grow between samples by the time elapsed since (the oldest row is still there or
    the next sample says otherwise).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sample: Sample | None = None
        self._at = 0.0  # monotonic
        self._unix = 0.0
        self.failures = Counter(
            "orbit_metrics_sample_failures",
            "Samples of the task and delivery gauges that failed (database unreachable).",
            registry=None,
        )

    def store(self, value: Sample) -> None:
        with self._lock:
            self._sample, self._at, self._unix = value, time.monotonic(), time.time()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            value, at, unix = self._sample, self._at, self._unix
        if value is None:
            return
        since = time.monotonic() - at
        gauge = GaugeMetricFamily(
            "orbit_tasks",
            "Live tasks per namespace, queue and status (WAITING, LEASED, RUNNING, NEEDS_REVIEW), sampled.",
            labels=["namespace", "queue", "status"],
        )
        review = 0
        for (ns, queue, status), n in value.tasks.items():
            gauge.add_metric([ns, queue, status], n)
            if status == TaskStatus.NEEDS_REVIEW.value:
                review += n
        yield gauge
        yield GaugeMetricFamily(
            "orbit_review_backlog_tasks", "Tasks waiting in NEEDS_REVIEW for a person, sampled.", value=review
        )
        age = value.review_oldest
        yield GaugeMetricFamily(
            "orbit_review_backlog_oldest_age_seconds",
            "Seconds the oldest NEEDS_REVIEW task has waited since its last change (0: none), sampled.",
            value=age + since if age is not None and review else 0.0,
        )
        unacked = GaugeMetricFamily(
            "orbit_result_deliveries_unacked",
            "Result deliveries not acked yet, per namespace and subscription (the delivery backlog), sampled.",
            labels=["namespace", "subscription"],
        )
        oldest = GaugeMetricFamily(
            "orbit_result_delivery_oldest_unacked_age_seconds",
            "Age of the oldest unacked result delivery of a subscription in seconds (0: none), sampled.",
            labels=["namespace", "subscription"],
        )
        for (ns, sub), (n, age_seconds) in value.deliveries.items():
            unacked.add_metric([ns, sub], n)
            oldest.add_metric([ns, sub], age_seconds + since if n else 0.0)
        yield unacked
        yield oldest
        yield GaugeMetricFamily(
            "orbit_flow_events_pending",
            "Task results recorded for flow instances and not yet applied to them (paused instances' "
            "included): the flow engine's backlog, sampled.",
            value=value.flow_events_pending,
        )
        flow_age = value.flow_events_oldest
        yield GaugeMetricFamily(
            "orbit_flow_events_oldest_pending_age_seconds",
            "Seconds the oldest task result of a flow instance that is not paused has waited to be applied "
            "(0: none), sampled.",
            value=flow_age + since if flow_age is not None else 0.0,
        )
        yield GaugeMetricFamily(
            "orbit_metrics_sampled_timestamp_seconds",
            "Unix time of the last successful sample of the task and delivery gauges.",
            value=unix,
        )
