"""The result consumer: brings Orbit's result events into the business database, once each
(DESIGN §4 "Result events", §5 "Inbox"; §6.2 of the reliability model).

One loop per process; the deliveries of a leased batch are handled one at a time, in order::

    lease      POST .../subscriptions/{name}/deliveries/lease, outside any transaction
    apply      ONE business transaction: is the event in the inbox? if not, insert its inbox
               row and call handler(conn, event) on that same connection (it updates the
               business tables and may enqueue() follow-up outbox rows); commit
    ack        POST .../deliveries/{id}/ack, after the commit, outside any transaction

A crash (or a lost ack) between commit and ack makes the server deliver the event again
after its lease; the inbox row, committed with the business change, turns that delivery
into a duplicate, which changes nothing and is acked. The inbox is what makes the
business effect happen once, whatever the server and the network do.
"""

from __future__ import annotations

import logging
import re
import signal
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType, TracebackType
from typing import Any, Protocol, Self

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine

from orbit_client import NAME_PATTERN, Delivery, OrbitError, ResultEvent, _tracing
from outbox_adapter import _inbox_queries as iq
from outbox_adapter import _tracing as outbox_tracing
from outbox_adapter._db import again_on_conflict, short_transaction, translate_db_error
from outbox_adapter._exceptions import OutboxDatabaseError, OutboxUsageError
from outbox_adapter._faults import Faults
from outbox_adapter._manager import Outbox
from outbox_adapter._metrics import ConsumerMetrics, MetricsServer
from outbox_adapter._models import ConsumerStats
from outbox_adapter._outcomes import Backoff, Outage
from outbox_adapter._tables import InboxOutcome, OutboxTables

__all__ = ["DEFAULT_MAX_DELIVERIES", "DeliveryClient", "ResultConsumer", "ResultHandler", "lease_hint"]

log = logging.getLogger("outbox_adapter.inbox")

#: Deliveries of one event after which a handler that still fails gets the event parked as ``FAILED``.
DEFAULT_MAX_DELIVERIES = 10


class DeliveryClient(Protocol):
    """The two calls the consumer makes: :class:`orbit_client.OrbitClient` has them (work role)."""

    def lease_deliveries(
        self, namespace: str, subscription: str, *, max: int = ..., lease_seconds: float = ...
    ) -> Sequence[Delivery]: ...

    def ack_delivery(self, namespace: str, subscription: str, delivery_id: str) -> None: ...


#: ``handler(conn, event)``: applies one result event on the business connection, inside the
#: transaction that records it in the inbox. Its return value is ignored.
ResultHandler = Callable[[Connection, ResultEvent], object]


class _Duplicate(Exception):
    """The event is already in the inbox: roll back, change nothing."""


class _Conflict(Exception):
    """The inbox insert hit a unique key: most likely a concurrent duplicate, checked after the rollback."""

    def __init__(self, cause: sa.exc.IntegrityError) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _HandlerFailed(Exception):
    """The handler raised ``cause``: roll back."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class ResultConsumer:
    """Applies the result events of one subscription to the business database, once each (README "Consuming results (inbox)").

    For each leased delivery, in **one business transaction**: if the event is already in
    the inbox (same subscription and event id), nothing happens; otherwise its inbox row is
    inserted and ``handler(conn, event)`` runs on that connection, and may update business
    tables and :func:`~outbox_adapter.enqueue` follow-up outbox rows in the same
    transaction. After the commit, and only then, the delivery is acked over HTTP. No
    transaction is ever open across an HTTP call.

    - **Duplicate delivery** (an ack lost, a consumer killed between commit and ack, two
      consumers racing after a lease expired): nothing changes; acked. Two transactions
      inserting the same event serialise on the inbox's unique key: the second waits for
      the first and becomes a duplicate.
    - **Handler raises**: the transaction rolls back (no inbox row, no follow-ups), the
      delivery is not acked, the error is logged with the event id. The server delivers it
      again after ``lease_seconds``, so the lease is the retry delay.
    - **Poison events**: when the handler raises on a delivery whose ``delivery_count`` is
      ``max_deliveries`` or more, the event is recorded in the inbox as ``FAILED`` with the
      error and the whole event (JSON), without its business change, and acked; the log
      says so at error level. Find them with ``Outbox.inbox_rows(outcome="FAILED")``.
      ``max_deliveries=None`` never gives up (the event comes back every lease, for ever).
      ``delivery_count`` is the server's count, so redeliveries caused by a business
      database outage count too; the decision is only ever taken on a handler failure.
    - **Business database unreachable** (or a transient failure: deadlock, lock wait timeout,
      connection lost, including inside the handler): nothing is acked, the rest of the batch
      is left to its lease, and the consumer waits ``db_backoff`` and carries on, logging
      once per wait, as the relay does.
    - **Orbit unreachable** while leasing (connection refused, timeout, 429, 5xx): the
      consumer waits ``orbit_backoff`` and tries again. A refusal that will not heal by
      itself (401/403: the key; 404: no such subscription or namespace) is raised.
      A failed ack is logged and counted; that delivery comes back after its lease as a
      duplicate and is acked then.

    Args:
        engine_or_url: the business database: an ``Engine`` the application built (used
            as is, never disposed of; the handler's transaction keeps its isolation level),
            or a SQLAlchemy URL to build the consumer's own engine (disposed in :meth:`close`).
            On SQLite every transaction begins with ``BEGIN IMMEDIATE``.
        client: an :class:`orbit_client.OrbitClient` (or anything with its
            ``lease_deliveries`` and ``ack_delivery``) with a ``work`` (or ``admin``) key of
            ``namespace``. Not closed by the consumer.
        namespace: the Orbit namespace of the subscription.
        subscription: the subscription's name (create it first:
            ``OrbitClient.create_subscription``, admin role).
        handler: ``handler(conn, event)`` with the business ``Connection`` and an
            ``orbit_client.ResultEvent``; must not commit, roll back or call Orbit.
        tables: the inbox (and outbox) tables; ``None`` means ``OutboxTables()``
            (``orbit_inbox``).
        batch_size: most deliveries leased at once. Default ``10``.
        lease_seconds: how long the server waits for an ack before delivering again, in
            seconds. It should cover handling a whole batch: deliveries are handled one after
            another, and one is applied only while at least ``min(5, max(0.1, lease_seconds /
            10))`` seconds of its lease are left, counted from before the lease request (after
            the first delivery of a batch, also at least the recent apply time: the slowest
            apply, halved at every later apply, so one slow apply is forgotten after a few fast
            ones); the rest is left to its lease and comes back. The first delivery of every
            batch is always applied while the margin is left, so a slow apply never stops the
            consumer. A delivery whose lease ran out while it was applied is not acked (it comes
            back and is acked as a duplicate). Default ``30.0``.
        poll_interval: seconds to wait after a lease returned less than a full batch. Default ``1.0``.
        max_deliveries: deliveries after which an event whose handler still fails is
            parked as ``FAILED`` and acked; ``None`` means never. Default ``10``.
        orbit_backoff: waits while Orbit is unreachable; ``None`` means ``Backoff(base=1, cap=30)``.
        db_backoff: waits while the business database is unreachable; ``None`` means
            ``Backoff(base=0.5, cap=30)``. ``Backoff.no_wait()`` is the test switch.
        install_signal_handlers: make SIGTERM and SIGINT call :meth:`stop` while :meth:`run`
            runs (main thread only). Default ``False``.
        metrics: count into these :class:`ConsumerMetrics` (e.g. on the application's own
            registry); ``None`` means new ones when ``metrics_port`` is set, else no metrics.
        metrics_port: serve Prometheus metrics on this TCP port while :meth:`run` runs (``0``: a
            free port, logged); ``None`` (the default) serves none. README "Operations".
        metrics_host: address the metrics server listens on. Default ``"127.0.0.1"``.

    Raises:
        OutboxUsageError: an invalid name or setting, a handler that is not callable, or an
            unusable database URL.
    """

    def __init__(
        self,
        engine_or_url: Engine | str | URL,
        client: DeliveryClient,
        namespace: str,
        subscription: str,
        handler: ResultHandler,
        *,
        tables: OutboxTables | None = None,
        batch_size: int = 10,
        lease_seconds: float = 30.0,
        poll_interval: float = 1.0,
        max_deliveries: int | None = DEFAULT_MAX_DELIVERIES,
        orbit_backoff: Backoff | None = None,
        db_backoff: Backoff | None = None,
        install_signal_handlers: bool = False,
        metrics: ConsumerMetrics | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
    ) -> None:
        name = re.compile(NAME_PATTERN)
        checks = (
            (isinstance(namespace, str) and name.match(namespace) is not None, f"namespace {namespace!r} is not a valid name"),
            (isinstance(subscription, str) and name.match(subscription) is not None, f"subscription {subscription!r} is not a valid name"),
            (callable(handler), f"handler must be callable as handler(conn, event), not {handler!r}"),
            (1 <= batch_size <= 1000, "batch_size must be 1-1000"),
            (lease_seconds > 0, "lease_seconds must be positive"),
            (poll_interval > 0, "poll_interval must be positive"),
            (max_deliveries is None or max_deliveries >= 1, "max_deliveries must be at least 1, or None"),
            (metrics_port is None or 0 <= metrics_port <= 65535, "metrics_port must be 0-65535"),
        )  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise OutboxUsageError(message)
        if isinstance(engine_or_url, Engine):
            self.outbox = Outbox(engine_or_url, tables=tables)
        else:
            self.outbox = Outbox(database_url=engine_or_url, tables=tables, pool_size=2)
        self.client = client
        self.namespace = namespace
        self.subscription = subscription
        self.handler = handler
        self.batch_size = batch_size
        self.lease_seconds = lease_seconds
        self.poll_interval = poll_interval
        self.max_deliveries = max_deliveries
        self.orbit_backoff = orbit_backoff or Backoff(base=1.0, cap=30.0)
        self.db_backoff = db_backoff or Backoff(base=0.5, cap=30.0)
        self.install_signal_handlers = install_signal_handlers
        #: The consumer's metrics (``None``: none are counted).
        self.metrics = metrics if metrics is not None or metrics_port is None else ConsumerMetrics()
        self.metrics_port, self.metrics_host = metrics_port, metrics_host
        #: The metrics server while :meth:`run` runs with ``metrics_port`` (its ``port``, ``url``).
        self.metrics_server: MetricsServer | None = None
        #: Seconds of lease a delivery needs left for the consumer to start applying it.
        self.lease_margin = min(5.0, max(0.1, lease_seconds / 10))
        #: Seconds a recent apply took: the slowest, halved at every later apply (a decaying maximum).
        self.apply_estimate = 0.0
        self._faults = Faults.from_env()
        self._stopping = threading.Event()
        self._outages = {
            "database": Outage("database", "business database", self.db_backoff, log),
            "orbit": Outage("orbit", "Orbit server", self.orbit_backoff, log),
        }

    def __repr__(self) -> str:
        return (
            f"ResultConsumer(namespace={self.namespace!r}, subscription={self.subscription!r}, "
            f"outbox={self.outbox!r}, batch_size={self.batch_size}, lease_seconds={self.lease_seconds})"
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Dispose of the consumer's own engine (built from a URL); an application's engine and the
        client are left alone."""
        self.outbox.close()

    def stop(self) -> None:
        """Ask :meth:`run` to finish: the delivery being handled is finished (committed and acked),
        the rest of the batch is left to its lease. Safe from any thread or a signal handler."""
        self._stopping.set()

    def run_once(self) -> ConsumerStats:
        """Handle what is due now, then return (``run(once=True)``)."""
        return self.run(once=True)

    def run(self, *, once: bool = False) -> ConsumerStats:
        """Consume until :meth:`stop` (or SIGTERM with ``install_signal_handlers``), or, with
        ``once``, until a lease comes back empty.

        With ``once``, an event whose handler failed in this run is not handed to the handler
        again in the same run (it stays unacked), so the run ends.

        Returns:
            What this run did, counted in deliveries.

        Raises:
            OutboxDatabaseError: a non-transient failure of the business database, e.g. the
                inbox table is missing (:class:`OutboxSchemaError`: run ``orbit-outbox
                migrate``); with ``once``, any failure. Transient failures are waited out.
            OrbitError: leasing was refused for good (401/403: the API key; 404: no such
                subscription or namespace); with ``once``, any failure to lease.
        """
        self._stopping.clear()
        stats = ConsumerStats()
        if self.metrics is not None and self.metrics_port is not None:
            self.metrics_server = MetricsServer(
                self.metrics.registry, port=self.metrics_port, host=self.metrics_host
            )
            log.info(
                "consumer metrics at %s",
                self.metrics_server.url,
                extra={"event": "metrics_serving", "port": self.metrics_server.port},
            )
        previous = self._install_signal_handlers() if self.install_signal_handlers else None
        failed_in_run: set[str] = set()
        log.info(
            "consumer of %s/%s started (batch size %d, lease %.1f s%s)",
            self.namespace,
            self.subscription,
            self.batch_size,
            self.lease_seconds,
            ", once" if once else "",
            extra={
                "event": "consumer_started",
                "namespace": self.namespace,
                "subscription": self.subscription,
            },
        )
        try:
            while not self._stopping.is_set():
                leased_at = (
                    time.monotonic()
                )  # before the request: the lease ends no earlier than this + lease_seconds
                deliveries = self._lease(once=once)
                if deliveries is None:  # Orbit unavailable; waited
                    continue
                stats.leased += len(deliveries)
                if once and all(d.event.id in failed_in_run for d in deliveries):
                    stats.unprocessed += len(deliveries)
                    break
                deadline = leased_at + self.lease_seconds
                self._handle_batch(
                    deliveries, stats, once=once, failed_in_run=failed_in_run, deadline=deadline
                )
                if len(deliveries) < self.batch_size and not once:
                    self._stopping.wait(self.poll_interval)
        finally:
            if previous is not None:
                for signum, handler in previous.items():
                    signal.signal(signum, handler)
            if self.metrics_server is not None:
                self.metrics_server.close()
                self.metrics_server = None
        log.info(
            "consumer of %s/%s stopped: %s",
            self.namespace,
            self.subscription,
            stats.to_dict(),
            extra={"event": "consumer_stopped", **stats.to_dict()},
        )
        return stats

    # --- leasing -------------------------------------------------------------------------------------

    def _lease(self, *, once: bool) -> Sequence[Delivery] | None:
        """Lease a batch; ``None`` when Orbit is unreachable (after waiting a backoff)."""
        try:
            deliveries = self.client.lease_deliveries(
                self.namespace, self.subscription, max=self.batch_size, lease_seconds=self.lease_seconds
            )
        except OrbitError as exc:
            if once or not exc.retryable:
                log.error(
                    "cannot lease deliveries of %s/%s: %s%s",
                    self.namespace,
                    self.subscription,
                    exc,
                    lease_hint(exc),
                    extra={"event": "lease_failed", "subscription": self.subscription},
                )
                raise
            self._outages["orbit"].down(exc, self._stopping)
            return None
        self._outages["orbit"].up()
        return deliveries

    # --- one batch -----------------------------------------------------------------------------------

    def _handle_batch(
        self,
        deliveries: Sequence[Delivery],
        stats: ConsumerStats,
        *,
        once: bool,
        failed_in_run: set[str],
        deadline: float,
    ) -> None:
        """Handle ``deliveries`` in order while their lease (ending at monotonic ``deadline``) allows:
        a delivery is applied only with at least :attr:`lease_margin` seconds of lease left (and,
        after the first of the batch, :attr:`apply_estimate`); the rest is left to its lease and
        comes back. The first is judged by the margin alone, so a slow apply in the past (a lock
        wait, a frozen database) never makes the consumer refuse every delivery."""
        for index, delivery in enumerate(deliveries):
            left = len(deliveries) - index
            remaining = deadline - time.monotonic()
            needed = self.lease_margin if index == 0 else max(self.lease_margin, self.apply_estimate)
            if remaining < needed:
                stats.unprocessed += left
                if self.metrics is not None:
                    self.metrics.left_to_lease.labels(self.subscription).inc(left)
                log.warning(
                    "%.2f s of lease left for %d deliveries, too little to apply the next (%.2f s needed); left "
                    "to their lease (they come back): lease fewer (batch_size) or for longer (lease_seconds)",
                    max(remaining, 0.0),
                    left,
                    needed,
                    extra={"event": "lease_running_out", "left": left},
                )
                return
            if self._stopping.is_set():
                stats.unprocessed += left
                log.info(
                    "stopping: %d leased deliveries left to their lease",
                    left,
                    extra={"event": "left_to_lease"},
                )
                return
            if once and delivery.event.id in failed_in_run:
                stats.unprocessed += 1
                continue
            try:
                if _tracing.AVAILABLE:
                    with _tracing.use_span(outbox_tracing.apply_span(delivery, self.subscription)) as span:
                        kind = self._handle(delivery, stats, deadline=deadline)
                        outbox_tracing.applied(span, kind)
                else:
                    kind = self._handle(delivery, stats, deadline=deadline)
            except OutboxDatabaseError as exc:
                if once or not exc.retryable:
                    raise
                stats.unprocessed += left
                self._outages["database"].down(exc, self._stopping)
                return
            self._outages["database"].up()
            if kind == "failed":
                failed_in_run.add(delivery.event.id)

    def _handle(self, delivery: Delivery, stats: ConsumerStats, *, deadline: float | None = None) -> str:
        """Apply one delivery and ack it when its outcome is committed. Returns what happened:
        ``"applied"``, ``"duplicate"``, ``"failed"`` (not acked) or ``"parked"``.

        Raises:
            OutboxDatabaseError: the business database failed; nothing acked.
        """
        event = delivery.event
        extra = {
            "event_id": event.id,
            "delivery_id": delivery.id,
            "task_id": event.task_id,
            "delivery_count": delivery.delivery_count,
            "subscription": self.subscription,
        }
        started = time.monotonic()
        try:
            # A lock conflict (on Galera: another node's write, met at COMMIT) is applied again at once.
            kind = again_on_conflict(lambda: self._apply(delivery))
        except _HandlerFailed as failed:
            stats.failed += 1
            cause = failed.cause
            if self.max_deliveries is None or delivery.delivery_count < self.max_deliveries:
                log.error(
                    "event %s (task %s, delivery %d): handler failed: %s; rolled back, not acked: it comes back "
                    "after its lease (%.1f s)",
                    event.id,
                    event.task_id,
                    delivery.delivery_count,
                    _describe(cause),
                    self.lease_seconds,
                    exc_info=cause,
                    extra={**extra, "event": "handler_failed"},
                )
                if self.metrics is not None:
                    self.metrics.handled(self.subscription, "failed", time.monotonic() - started)
                return "failed"
            kind = self._park(delivery, cause)
            if kind == "parked":
                stats.parked += 1
                log.error(
                    "event %s (task %s): handler failed on delivery %d of at most %d: %s; recorded in the inbox "
                    "as FAILED without its business change, and acked",
                    event.id,
                    event.task_id,
                    delivery.delivery_count,
                    self.max_deliveries,
                    _describe(cause),
                    exc_info=cause,
                    extra={**extra, "event": "parked"},
                )
        if kind == "applied":
            stats.applied += 1
            log.info(
                "event %s (task %s, %s) applied",
                event.id,
                event.task_id,
                event.status,
                extra={**extra, "event": "applied"},
            )
        elif kind == "duplicate":
            stats.duplicates += 1
            log.info(
                "event %s (task %s) is already in the inbox: duplicate delivery, nothing changed",
                event.id,
                event.task_id,
                extra={**extra, "event": "duplicate"},
            )
        took = time.monotonic() - started
        if self.metrics is not None:
            self.metrics.handled(self.subscription, kind, took)
        self._estimate(took, extra)
        if self._faults is not None:
            self._faults.after_commit(event.id)
        if deadline is not None and time.monotonic() >= deadline:
            stats.ack_skipped += 1
            log.warning(
                "event %s: committed, but its lease ran out meanwhile; not acked: it comes back after its lease "
                "and is acked then as a duplicate",
                event.id,
                extra={**extra, "event": "ack_skipped"},
            )
            return kind
        self._ack(delivery, stats, extra)
        return kind

    def _estimate(self, took: float, extra: dict[str, Any]) -> None:
        """Fold one apply's ``took`` seconds into :attr:`apply_estimate` (a decaying maximum: the
        slowest, halved at every later apply), and warn about an apply that took half the lease."""
        self.apply_estimate = max(took, self.apply_estimate / 2)
        if self.metrics is not None:
            self.metrics.apply_estimate.labels(self.subscription).set(self.apply_estimate)
        if took >= self.lease_seconds / 2:
            if self.metrics is not None:
                self.metrics.slow_applies.labels(self.subscription).inc()
            log.warning(
                "event %s took %.2f s to apply, %.0f%% of the %.1f s lease (a lock wait, a slow or frozen "
                "business database?): later deliveries of its batch may be left to their lease",
                extra["event_id"],
                took,
                100 * took / self.lease_seconds,
                self.lease_seconds,
                extra={**extra, "event": "slow_apply", "seconds": took},
            )

    def _apply(self, delivery: Delivery) -> str:
        """The business transaction: inbox row + handler, or nothing for a duplicate.

        Raises:
            _HandlerFailed: the handler raised (rolled back).
            OutboxDatabaseError: the business database failed, here or (transiently) in the handler.
        """
        event = delivery.event
        what = f"apply result event {event.id}"
        try:
            with short_transaction(self.outbox.engine, read_committed=False) as conn:
                row_id = self._insert(conn, delivery, InboxOutcome.APPLIED)
                try:
                    self.handler(conn, event)
                except Exception as exc:
                    raise _HandlerFailed(exc) from exc
                iq.mark_inbox_processed(conn, self.outbox.tables, row_id)
        except _Duplicate:
            return "duplicate"
        except _Conflict as conflict:
            return self._after_conflict(conflict, event.id, what)
        except _HandlerFailed as failed:
            transient = _transient_db_error(failed.cause, what)
            if transient is not None:
                raise transient from failed.cause
            raise
        except sa.exc.SQLAlchemyError as exc:
            raise translate_db_error(exc, what) from exc
        return "applied"

    def _park(self, delivery: Delivery, cause: Exception) -> str:
        """Record the event as ``FAILED`` (its own transaction, no handler). ``"parked"`` or ``"duplicate"``.

        Raises:
            OutboxDatabaseError: the business database failed; nothing acked.
        """
        error = f"handler failed on delivery {delivery.delivery_count}: {_describe(cause)}"
        try:
            with short_transaction(self.outbox.engine, read_committed=False) as conn:
                self._insert(conn, delivery, InboxOutcome.FAILED, error=error)
        except _Duplicate:
            return "duplicate"
        except _Conflict as conflict:
            return self._after_conflict(
                conflict, delivery.event.id, f"record result event {delivery.event.id}"
            )
        except sa.exc.SQLAlchemyError as exc:
            raise translate_db_error(exc, f"record result event {delivery.event.id} as FAILED") from exc
        return "parked"

    def _insert(
        self, conn: Connection, delivery: Delivery, outcome: InboxOutcome, *, error: str | None = None
    ) -> int:
        """Insert the event's inbox row; :class:`_Duplicate` if the event is already there,
        :class:`_Conflict` if the insert hit a unique key (the caller rolls back, then checks)."""
        t = self.outbox.tables
        event = delivery.event
        if iq.inbox_contains(conn, t, subscription=self.subscription, event_id=event.id):
            raise _Duplicate
        try:
            return iq.insert_inbox_row(
                conn,
                t,
                event_id=event.id,
                subscription=self.subscription,
                namespace=event.namespace,
                task_id=event.task_id,
                status=event.status.value,
                outcome=outcome,
                delivery_count=delivery.delivery_count,
                error=error,
                event=event.model_dump(mode="json") if outcome is InboxOutcome.FAILED else None,
                processed=outcome is InboxOutcome.FAILED,
            )
        except sa.exc.IntegrityError as exc:
            raise _Conflict(exc) from exc

    def _after_conflict(self, conflict: _Conflict, event_id: str, what: str) -> str:
        """After the rollback: a concurrent transaction inserted the event first and committed
        (``"duplicate"``), or the error meant something else (raised)."""
        try:
            with short_transaction(self.outbox.engine, read_committed=False) as conn:
                found = iq.inbox_contains(
                    conn, self.outbox.tables, subscription=self.subscription, event_id=event_id
                )
        except sa.exc.SQLAlchemyError as exc:
            raise translate_db_error(exc, what) from exc
        if found:
            return "duplicate"
        raise translate_db_error(conflict.cause, what) from conflict.cause

    def _ack(self, delivery: Delivery, stats: ConsumerStats, extra: dict[str, Any]) -> None:
        """Ack after the commit, outside any transaction; a failure only costs a duplicate delivery later."""
        try:
            self.client.ack_delivery(self.namespace, self.subscription, delivery.id)
        except OrbitError as exc:
            stats.ack_failures += 1
            if self.metrics is not None:
                self.metrics.ack_failed(self.subscription)
            log.warning(
                "event %s: committed, but the ack of delivery %s failed (%s); it will be delivered again after "
                "its lease and acked as a duplicate",
                delivery.event.id,
                delivery.id,
                exc,
                extra={**extra, "event": "ack_failed"},
            )
            return
        stats.acked += 1

    def _install_signal_handlers(self) -> dict[int, Any] | None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("signal handlers can only be installed from the main thread; not installed")
            return None

        def handle(signum: int, _frame: FrameType | None) -> None:
            log.warning(
                "received %s: finishing the delivery in hand, leaving the rest to its lease",
                signal.Signals(signum).name,
                extra={"event": "stopping", "signal": signal.Signals(signum).name},
            )
            self.stop()

        previous: dict[int, Any] = {}
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, handle)
        return previous


def _transient_db_error(cause: Exception, what: str) -> OutboxDatabaseError | None:
    """The handler's error as a retryable database error (an outage, a deadlock), else ``None``.

    A handler error that is not a transient database failure is the handler's: it counts
    towards ``max_deliveries``.
    """
    if isinstance(cause, OutboxDatabaseError):
        return cause if cause.retryable else None
    if isinstance(cause, sa.exc.SQLAlchemyError):
        translated = translate_db_error(cause, what)
        return translated if translated.retryable else None
    return None


def lease_hint(exc: OrbitError) -> str:
    """What to do about a lease the server refused for good, as ``"; ..."`` (empty when nothing to add)."""
    status = getattr(exc, "status_code", None)
    if status == 404:
        return (
            "; create the subscription first (OrbitClient.create_subscription with an admin key) and check "
            "the namespace"
        )
    if status in (401, 403):
        return "; the API key must be a work (or admin) key of this namespace"
    return ""
