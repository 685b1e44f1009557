"""Prometheus metrics of the relay and the result consumer (README "Operations").

Counters are incremented at a few call sites of the loops, once per batch where the loop
works in batches (never once per row inside a set-based path). The outbox backlog (rows per
state, age of the oldest ``PENDING`` row) is **sampled** by a background thread every
``sample_interval`` seconds, with two index-served statements, and a scrape only reads the
last sample: scraping never queries the database.

No label carries a row id, key, task id or params. ``prometheus-client`` is imported only
when metrics are asked for (it ships with the ``outbox`` extra).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter as Tally
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_adapter._db import db_now
from outbox_adapter._exceptions import OutboxUsageError
from outbox_adapter._tables import OutboxState, OutboxTables

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

    from outbox_adapter._manager import Outbox

__all__ = ["ConsumerMetrics", "MetricsServer", "RelayMetrics", "sample_backlog"]

log = logging.getLogger("outbox_adapter.metrics")

#: Outbox states whose row counts are sampled (``DELIVERED`` grows without bound and is not counted).
BACKLOG_STATES = (OutboxState.PENDING.value, OutboxState.NEEDS_RECONCILE.value, OutboxState.DEAD.value)

#: Send latency buckets, in seconds (one batch request).
_SEND_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Rows per batch request.
_BATCH_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500)
#: Apply latency buckets, in seconds (one result event's business transaction).
_APPLY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:  # pragma: no cover - the outbox extra installs it
        raise OutboxUsageError(
            "metrics need prometheus-client: pip install 'orbit-tasks[outbox]' (or pip install prometheus-client)"
        ) from None
    return prometheus_client


class MetricsServer:
    """An HTTP server answering ``GET /metrics`` for one registry, on a daemon thread.

    Args:
        registry: what to expose.
        port: TCP port; ``0`` picks a free one (:attr:`port` tells which).
        host: address to listen on. Default ``"127.0.0.1"``; ``"0.0.0.0"`` for every interface
            (what a Prometheus on another host needs; expose it on an internal network only).

    Raises:
        OutboxUsageError: the port cannot be bound (in use, or not allowed).
    """

    def __init__(self, registry: CollectorRegistry, *, port: int, host: str = "127.0.0.1") -> None:
        prometheus_client = _prometheus()
        try:
            self._server, self._thread = prometheus_client.start_http_server(
                port, addr=host, registry=registry
            )
        except OSError as exc:
            raise OutboxUsageError(
                f"cannot serve metrics on {host}:{port} ({exc.strerror or exc}); choose another --metrics-port"
            ) from None
        self.host = host
        self.port: int = self._server.server_port

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop answering and free the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def sample_backlog(conn: Connection, t: OutboxTables) -> tuple[dict[str, int], float | None]:
    """Rows per backlog state and the age of the oldest ``PENDING`` row (seconds, database clock).

    Two statements: a count per state over ``state IN (PENDING, NEEDS_RECONCILE, DEAD)``, served
    by the claim index ``(state, available_at, id)`` alone, and ``MIN(created_at)`` over the
    ``PENDING`` rows (a range of the same index, then the rows: as many as the backlog holds).

    Returns:
        ``({state: rows}, oldest pending age in seconds or None when nothing is pending)``.
    """
    o = t.outbox
    now = db_now(conn)
    counts = dict.fromkeys(BACKLOG_STATES, 0)
    by_state = sa.select(o.c.state, sa.func.count()).where(o.c.state.in_(BACKLOG_STATES)).group_by(o.c.state)
    for state, n in conn.execute(by_state):
        counts[state] = int(n)
    oldest: Any = None
    if counts[OutboxState.PENDING.value]:
        oldest = conn.execute(
            sa.select(sa.func.min(o.c.created_at)).where(o.c.state == OutboxState.PENDING.value)
        ).scalar()
        if isinstance(oldest, str):  # SQLite returns aggregates of datetimes as text
            oldest = datetime.fromisoformat(oldest)
    age = max(0.0, (now - oldest).total_seconds()) if oldest is not None else None
    return counts, age


class _Backlog:
    """The sampled outbox backlog as a collector: a scrape reads the last sample, never the database."""

    def __init__(self) -> None:
        self.counts: dict[str, int] | None = None
        self.oldest_age: float | None = None
        self.sampled_at = 0.0  # monotonic
        self.sampled_unix = 0.0
        self._lock = threading.Lock()

    def store(self, counts: dict[str, int], oldest_age: float | None) -> None:
        with self._lock:
            self.counts, self.oldest_age = counts, oldest_age
            self.sampled_at, self.sampled_unix = time.monotonic(), time.time()

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily

        with self._lock:
            counts, oldest_age, sampled_at, sampled_unix = (
                self.counts,
                self.oldest_age,
                self.sampled_at,
                self.sampled_unix,
            )
        if counts is None:
            return
        rows = GaugeMetricFamily(
            "orbit_outbox_rows",
            "Outbox rows per state (PENDING, NEEDS_RECONCILE, DEAD), sampled by the relay.",
            labels=["state"],
        )
        for state, n in counts.items():
            rows.add_metric([state], n)
        yield rows
        # The age grows between samples as it would in the table (the oldest row is still there).
        age = 0.0 if oldest_age is None else oldest_age + (time.monotonic() - sampled_at)
        yield GaugeMetricFamily(
            "orbit_outbox_oldest_pending_age_seconds",
            "Age of the oldest PENDING outbox row in seconds (database clock; 0 when none), sampled.",
            value=age,
        )
        yield GaugeMetricFamily(
            "orbit_outbox_backlog_sampled_timestamp_seconds",
            "Unix time of the last successful backlog sample.",
            value=sampled_unix,
        )


class RelayMetrics:
    """The relay's metrics, on a registry of their own (or the one given).

    Counters (rows unless named otherwise): ``orbit_relay_rows_claimed_total``,
    ``orbit_relay_rows_delivered_total``, ``orbit_relay_rows_retried_total``,
    ``orbit_relay_rows_dead_total``, ``orbit_relay_rows_needs_reconcile_total``,
    ``orbit_relay_rows_released_total``, ``orbit_relay_lease_lost_total``,
    ``orbit_relay_backlog_sample_failures_total``; histograms ``orbit_relay_send_duration_seconds``
    (one submission request) and ``orbit_relay_batch_size_rows`` (rows per request); sampled
    gauges ``orbit_outbox_rows{state}``, ``orbit_outbox_oldest_pending_age_seconds`` and
    ``orbit_outbox_backlog_sampled_timestamp_seconds``.

    Args:
        registry: where to register; ``None`` means a new ``CollectorRegistry``.

    Raises:
        OutboxUsageError: prometheus-client is not installed.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        p = _prometheus()
        self.registry: CollectorRegistry = registry if registry is not None else p.CollectorRegistry()
        r = self.registry

        def counter(name: str, doc: str) -> Any:
            return p.Counter(name, doc, registry=r)

        self.rows_claimed = counter("orbit_relay_rows_claimed", "Outbox rows claimed for sending.")
        self.rows_delivered = counter(
            "orbit_relay_rows_delivered", "Rows recorded DELIVERED (the server accepted or replayed them)."
        )
        self.rows_retried = counter(
            "orbit_relay_rows_retried", "Rows put back to PENDING after a backoff (not accepted, or unknown)."
        )
        self.rows_dead = counter("orbit_relay_rows_dead", "Rows recorded DEAD (permanently refused).")
        self.rows_needs_reconcile = counter(
            "orbit_relay_rows_needs_reconcile",
            "Rows recorded NEEDS_RECONCILE (the outcome stayed unknown; run `orbit-outbox reconcile`).",
        )
        self.rows_released = counter(
            "orbit_relay_rows_released", "Claimed rows released unsent (too little lease left, or shutdown)."
        )
        self.lease_lost = counter(
            "orbit_relay_lease_lost",
            "Rows whose outcome was not recorded because their lease had expired or was taken over.",
        )
        self.sample_failures = counter(
            "orbit_relay_backlog_sample_failures",
            "Backlog samples that failed (the database was unreachable).",
        )
        self.send_seconds = p.Histogram(
            "orbit_relay_send_duration_seconds",
            "Time one submission request took, in seconds (a batch request, or one row's).",
            buckets=_SEND_BUCKETS,
            registry=r,
        )
        self.batch_rows = p.Histogram(
            "orbit_relay_batch_size_rows",
            "Rows carried by one submission request.",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.backlog = _Backlog()
        r.register(self.backlog)
        self._kinds = {
            "delivered": self.rows_delivered,
            "retry": self.rows_retried,
            "dead": self.rows_dead,
            "needs_reconcile": self.rows_needs_reconcile,
            "released": self.rows_released,
        }

    # --- hooks at the relay's call sites (one call per claim, request or recorded batch) ---

    def claimed(self, rows: int) -> None:
        if rows:
            self.rows_claimed.inc(rows)

    def sent(self, rows: int, seconds: float) -> None:
        self.send_seconds.observe(seconds)
        self.batch_rows.observe(rows)

    def spent_on_claim(self, rows: int) -> None:
        """Rows found with an expired lease and a spent budget at claim time (NEEDS_RECONCILE)."""
        if rows:
            self.rows_needs_reconcile.inc(rows)

    def recorded(self, kinds: Iterable[str], *, lost: int) -> None:
        """One recorded batch: the kind written per row, and how many rows had lost their lease."""
        for kind, n in Tally(kinds).items():
            counter = self._kinds.get(kind)
            if counter is not None:
                counter.inc(n)
        if lost:
            self.lease_lost.inc(lost)


class BacklogSampler:
    """Samples the outbox backlog into ``metrics`` every ``interval`` seconds, on a daemon thread.

    The first sample is taken at once. A failed sample (database unreachable) is counted in
    ``orbit_relay_backlog_sample_failures_total`` and logged once per outage; the gauges keep the
    last good sample (see ``orbit_outbox_backlog_sampled_timestamp_seconds``).
    """

    def __init__(self, outbox: Outbox, metrics: RelayMetrics, *, interval: float) -> None:
        if interval <= 0:
            raise OutboxUsageError("the metrics sample interval must be positive")
        self._outbox, self._metrics, self._interval = outbox, metrics, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="outbox-metrics-sampler", daemon=True)
        self._failing = False

    def start(self) -> None:
        self._thread.start()

    def sample(self) -> None:
        """Take one sample now (also what the thread does every interval)."""
        try:
            with self._outbox.transaction("sample the outbox backlog") as conn:
                counts, age = sample_backlog(conn, self._outbox.tables)
        except Exception as exc:
            self._metrics.sample_failures.inc()
            if not self._failing:
                log.warning(
                    "cannot sample the outbox backlog for metrics (%s); the gauges keep the last sample",
                    exc,
                    extra={"event": "metrics_sample_failed"},
                )
            self._failing = True
            return
        self._failing = False
        self._metrics.backlog.store(counts, age)

    def _loop(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self._interval):
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


class ConsumerMetrics:
    """The result consumer's metrics, on a registry of their own (or the one given).

    Counters (result events): ``orbit_consumer_events_applied_total``,
    ``orbit_consumer_events_duplicate_total``, ``orbit_consumer_events_parked_total`` (recorded
    FAILED after ``max_deliveries``), ``orbit_consumer_handler_failures_total`` (rolled back, not
    acked), ``orbit_consumer_ack_failures_total``, ``orbit_consumer_deliveries_left_to_lease_total``
    (too little lease left to apply them: they come back), ``orbit_consumer_slow_applies_total``
    (an apply took half the lease or more: alert on its rate); gauge
    ``orbit_consumer_apply_estimate_seconds`` (the recent apply time a delivery after the first of
    a batch needs left); histogram ``orbit_consumer_apply_duration_seconds``. Labels: ``subscription``.

    Args:
        registry: where to register; ``None`` means a new ``CollectorRegistry``.

    Raises:
        OutboxUsageError: prometheus-client is not installed.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        p = _prometheus()
        self.registry: CollectorRegistry = registry if registry is not None else p.CollectorRegistry()
        r = self.registry
        labels = ["subscription"]
        self.applied = p.Counter(
            "orbit_consumer_events_applied", "Result events applied (inbox row + business change).", labels,
            registry=r,
        )  # fmt: skip
        self.duplicates = p.Counter(
            "orbit_consumer_events_duplicate", "Deliveries of events already in the inbox (nothing changed).",
            labels, registry=r,
        )  # fmt: skip
        self.parked = p.Counter(
            "orbit_consumer_events_parked",
            "Events recorded FAILED in the inbox after max_deliveries failed handler runs (acked).",
            labels, registry=r,
        )  # fmt: skip
        self.handler_failures = p.Counter(
            "orbit_consumer_handler_failures", "Handler runs that raised (rolled back, not acked).", labels,
            registry=r,
        )  # fmt: skip
        self.ack_failures = p.Counter(
            "orbit_consumer_ack_failures", "Acks that failed after the commit (the event comes back).", labels,
            registry=r,
        )  # fmt: skip
        self.left_to_lease = p.Counter(
            "orbit_consumer_deliveries_left_to_lease",
            "Leased deliveries not applied because too little of their lease was left (they come back).",
            labels, registry=r,
        )  # fmt: skip
        self.slow_applies = p.Counter(
            "orbit_consumer_slow_applies", "Applies that took half the delivery lease or more.", labels,
            registry=r,
        )  # fmt: skip
        self.apply_estimate = p.Gauge(
            "orbit_consumer_apply_estimate_seconds",
            "Recent apply time (the slowest, halved at every later apply), in seconds.", labels, registry=r,
        )  # fmt: skip
        self.apply_seconds = p.Histogram(
            "orbit_consumer_apply_duration_seconds",
            "Time to apply one result event (its business transaction), in seconds.",
            labels, buckets=_APPLY_BUCKETS, registry=r,
        )  # fmt: skip

    def handled(self, subscription: str, kind: str, seconds: float) -> None:
        """One delivery handled: ``kind`` is applied, duplicate, failed or parked."""
        if kind == "applied":
            self.applied.labels(subscription).inc()
            self.apply_seconds.labels(subscription).observe(seconds)
        elif kind == "duplicate":
            self.duplicates.labels(subscription).inc()
        elif kind == "parked":
            self.parked.labels(subscription).inc()
            self.handler_failures.labels(subscription).inc()
        elif kind == "failed":
            self.handler_failures.labels(subscription).inc()

    def ack_failed(self, subscription: str) -> None:
        self.ack_failures.labels(subscription).inc()
