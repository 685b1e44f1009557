"""Sampled server gauges and the process-wide lease counters of ``/metrics`` (README "Operations").

The gauges (live tasks per queue and status, the review backlog, unacked result deliveries and
the oldest one's age) are read by :func:`sample` once per ``ORBIT_METRICS_SAMPLE_INTERVAL_SECONDS``
in a background task of the app, never per scrape: a scrape only reads the last sample. Each
statement is served by an index of ``schema.py``:

- tasks per queue and status: ``queue_id IN (every queue) AND status IN (live statuses)`` over
  ``ix_tasks_claim (queue_id, status, available_at)``, index only, a range per (queue, status):
  terminal tasks (the bulk of a big table) are never read;
- the oldest ``NEEDS_REVIEW`` task per namespace: ``ix_tasks_status_deadline (status, ...)``;
- unacked deliveries per subscription: ``subscription_id IN (...) AND state = 'PENDING'`` over
  ``ix_event_deliveries_claim (subscription_id, state, id)``, index only, whose ``MIN(id)`` is
  the oldest; their ``created_at`` by primary key.

No label carries a task id, key or params: namespace, queue, subscription and status names.
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

from ._db import db_now
from .schema import event_deliveries, namespaces, queues, subscriptions, tasks

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
    #: namespace -> age of its oldest NEEDS_REVIEW task, in seconds
    review_oldest: dict[str, float] = field(default_factory=dict)
    #: (namespace, subscription) -> (unacked deliveries, age of the oldest in seconds or 0)
    deliveries: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)


def _as_datetime(value: Any) -> datetime:
    return datetime.fromisoformat(value) if isinstance(value, str) else value.replace(tzinfo=None)


def sample(conn: Connection) -> Sample:
    """Read every sampled gauge; a handful of index-served statements (module docstring)."""
    now = db_now(conn)
    out = Sample()
    names = {
        qid: (ns, name)
        for qid, ns, name in conn.execute(
            sa.select(queues.c.id, namespaces.c.name, queues.c.name).join(
                namespaces, namespaces.c.id == queues.c.namespace_id
            )
        )
    }
    live = [s.value for s in LIVE_STATUSES]
    for ns, name in names.values():
        for status in live:
            out.tasks[(ns, name, status)] = 0
    if names:
        counts = (
            sa.select(tasks.c.queue_id, tasks.c.status, sa.func.count())
            .where(tasks.c.queue_id.in_(list(names)), tasks.c.status.in_(live))
            .group_by(tasks.c.queue_id, tasks.c.status)
        )
        for qid, status, n in conn.execute(counts):
            ns, name = names[qid]
            out.tasks[(ns, name, status)] = int(n)
    review = (
        sa.select(namespaces.c.name, sa.func.min(tasks.c.updated_at))
        .join(namespaces, namespaces.c.id == tasks.c.namespace_id)
        .where(tasks.c.status == TaskStatus.NEEDS_REVIEW.value)
        .group_by(namespaces.c.name)
    )
    for ns, oldest in conn.execute(review):
        if oldest is not None:
            out.review_oldest[ns] = max(0.0, (now - _as_datetime(oldest)).total_seconds())
    subs = {
        sid: (ns, name)
        for sid, ns, name in conn.execute(
            sa.select(subscriptions.c.id, namespaces.c.name, subscriptions.c.name).join(
                namespaces, namespaces.c.id == subscriptions.c.namespace_id
            )
        )
    }
    for key in subs.values():
        out.deliveries[key] = (0, 0.0)
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
            dict(conn.execute(sa.select(d.c.id, d.c.created_at).where(d.c.id.in_(oldest_ids))).tuples().all())
            if oldest_ids
            else {}
        )
        for sid, n, oldest in rows:
            at = created.get(oldest)
            age = max(0.0, (now - _as_datetime(at)).total_seconds()) if at is not None else 0.0
            out.deliveries[subs[sid]] = (int(n), age)
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
        review = GaugeMetricFamily(
            "orbit_review_backlog_tasks", "NEEDS_REVIEW tasks per namespace, sampled.", labels=["namespace"]
        )
        per_namespace: dict[str, int] = {}
        for (ns, queue, status), n in value.tasks.items():
            gauge.add_metric([ns, queue, status], n)
            if status == TaskStatus.NEEDS_REVIEW.value:
                per_namespace[ns] = per_namespace.get(ns, 0) + n
        for ns, n in per_namespace.items():
            review.add_metric([ns], n)
        yield gauge
        yield review
        oldest_review = GaugeMetricFamily(
            "orbit_review_backlog_oldest_age_seconds",
            "Seconds the oldest NEEDS_REVIEW task of a namespace has waited (since its last change), sampled.",
            labels=["namespace"],
        )
        for ns in per_namespace:
            age = value.review_oldest.get(ns)
            oldest_review.add_metric([ns], age + since if age is not None else 0.0)
        yield oldest_review
        unacked = GaugeMetricFamily(
            "orbit_result_deliveries_unacked",
            "Result deliveries not acked yet, per subscription (the delivery backlog), sampled.",
            labels=["namespace", "subscription"],
        )
        oldest = GaugeMetricFamily(
            "orbit_result_delivery_oldest_unacked_age_seconds",
            "Age of the oldest unacked result delivery of a subscription in seconds (0: none), sampled.",
            labels=["namespace", "subscription"],
        )
        for (ns, sub), (n, age) in value.deliveries.items():
            unacked.add_metric([ns, sub], n)
            oldest.add_metric([ns, sub], age + since if n else 0.0)
        yield unacked
        yield oldest
        yield GaugeMetricFamily(
            "orbit_metrics_sampled_timestamp_seconds",
            "Unix time of the last successful sample of the task and delivery gauges.",
            value=unix,
        )
