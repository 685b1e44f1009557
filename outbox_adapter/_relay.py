"""The relay: claims due outbox rows, submits them to Orbit in batches, records each outcome (DESIGN §5).

One loop per process, ``concurrency`` batch requests in flight on a thread pool::

    claim a batch        short transaction: FOR UPDATE SKIP LOCKED (SQLite: BEGIN IMMEDIATE) and a
                         conditional update whose row count is checked; lease owner/token/expiry
                         from the database clock, attempts + 1
    check the lease      just before sending: at least the request timeout (plus a margin) must be
                         left of the lease, else the rows are released unsent
    send                 POST /v1/namespaces/{ns}/tasks/batch, one request per namespace of the batch,
                         each item with its row's idempotency key, outside any transaction
    record               one short transaction per batch: one conditional UPDATE per outcome class on
                         (id IN (...), lease_token) with a live lease; row counts checked; a lost lease
                         records nothing for that row

A server without the batch route gets one ``POST .../tasks`` per row (with the queue check,
cached), the lease checked before each. A slow request only holds its own slot, never the
recording of others.

This module holds the loop, the claims and the shutdown; the sends are ``_relay_send``
(:class:`Sender`), the records ``_relay_record`` (:class:`Recorder`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import FrameType, TracebackType
from typing import Any, Self

from sqlalchemy.engine import URL, Connection, Engine

from orbit_client import OrbitClient, OrbitError, RetryPolicy
from outbox_adapter import _queries as q
from outbox_adapter._exceptions import OutboxDatabaseError, OutboxUsageError
from outbox_adapter._manager import Outbox
from outbox_adapter._metrics import BacklogSampler, MetricsServer, RelayMetrics
from outbox_adapter._models import DeliveredRow, RelayStats
from outbox_adapter._outcomes import (
    Backoff,
    Outage,
    SendOutcome,
    Verdict,
    classify_error,
)
from outbox_adapter._relay_record import Recorder
from outbox_adapter._relay_send import Sender
from outbox_adapter._sending import Batch, Done, requests_of
from outbox_adapter._settings import OutboxSettings
from outbox_adapter._tables import OutboxTables

__all__ = ["DEFAULT_MAX_ATTEMPTS", "Relay"]

log = logging.getLogger("outbox_adapter.relay")

#: Budget of possibly-accepted sends of a row whose ``max_attempts`` is ``NULL``.
DEFAULT_MAX_ATTEMPTS = 5


def _by_namespace(claims: list[q.Claim]) -> dict[str, list[q.Claim]]:
    by_namespace: dict[str, list[q.Claim]] = {}
    for claim in claims:
        by_namespace.setdefault(claim.namespace, []).append(claim)
    return by_namespace


def _spread(claims: list[q.Claim], slots: int) -> list[list[q.Claim]]:
    """``claims`` dealt into at most ``slots`` non-empty lists, in order within each."""
    dealt: list[list[q.Claim]] = [claims[i::slots] for i in range(min(slots, len(claims)))]
    return dealt


def _key_prefix(client: OrbitClient) -> str:
    """The first characters of the client's API key, as ``orbit-server api-key list`` shows them (never
    the whole key)."""
    headers = getattr(client, "_headers", None)
    bearer = headers.get("Authorization", "") if headers is not None else ""
    key = bearer.removeprefix("Bearer ")
    return f"{key[:12]}…" if key else "(none)"


class _OrbitDown:
    """The Orbit server not answering (connection refused or lost, timeout, 503) as one condition of
    the relay, not of each row: logged once when it begins and once when it ends; meanwhile the relay
    claims nothing and probes the server (``GET`` a queue of the first row it could not send) after
    each wait of ``backoff``; the rows wait due now, without spending their own backoff."""

    def __init__(self, backoff: Backoff, *, probing: bool = True) -> None:
        self.backoff = backoff
        self.probing = probing
        self.active = False
        self.failures = 0
        self.rows = 0
        self._since = 0.0
        self._probe_at = 0.0
        self._target: tuple[str, str] = ("", "")

    def begin(self, claim: q.Claim, outcome: SendOutcome, rows: int) -> None:
        """Count ``rows`` not sent because the server did not answer (``outcome``, for ``claim``)."""
        self.rows += rows
        if self.active:
            return
        self.active, self.failures, self._since = True, 1, time.monotonic()
        self._target = (claim.namespace, claim.queue)
        self._probe_at = self._since + self.backoff.delay(1, outcome.retry_after)
        if not self.probing:  # a --once run: the rows stay due for the next run, which the run's end reports
            log.warning(
                "the Orbit server is unreachable (%s); the rows it does not take stay due for the next run",
                outcome.error,
                extra={"event": "orbit_unavailable", "status_code": outcome.status_code},
            )
            return
        log.warning(
            "the Orbit server is unreachable (%s); the relay sends nothing until it answers: it asks again "
            "every %.1f s at most, and then every waiting row is due at once (no row spends its own backoff "
            "on the outage)",
            outcome.error,
            self.backoff.cap,
            extra={"event": "orbit_unavailable", "status_code": outcome.status_code},
        )

    def wait_left(self) -> float:
        """Seconds until the next probe is due."""
        return max(0.0, self._probe_at - time.monotonic())

    def probe(self, client: OrbitClient) -> SendOutcome | None:
        """Ask the server once (when due): ``None`` while it still does not answer (next probe scheduled)
        or when it answered (the outage ends, logged); a ``misconfigured`` outcome when it refused the key."""
        if self.wait_left() > 0:
            return None
        try:
            client.get_queue(*self._target)
        except OrbitError as exc:
            outcome = classify_error(exc)
            if outcome.misconfigured:
                self._end()
                return outcome
            if outcome.unreachable:
                self.failures += 1
                delay = self.backoff.delay(self.failures, outcome.retry_after)
                self._probe_at = time.monotonic() + delay
                log.debug("the Orbit server still does not answer (%s); asking again in %.1f s", exc, delay)
                return None
        self._end()
        return None

    def _end(self) -> None:
        log.warning(
            "the Orbit server answers again after %.1f s (%d tries); resuming the %d rows that waited",
            time.monotonic() - self._since,
            self.failures,
            self.rows,
            extra={"event": "orbit_recovered", "failures": self.failures, "rows": self.rows},
        )
        self.active, self.failures, self.rows = False, 0, 0


class Relay:
    """Delivers outbox rows to Orbit: every committed row becomes exactly one task (README "Outbox").

    Any number of relays may run on one table: claims are disjoint (``SKIP LOCKED``, or
    SQLite's single writer, and in any case a conditional update whose row count is
    checked) and every recorded outcome is fenced by the row's lease token.

    **Batches.** Each claim leases up to ``batch_size`` due rows and sends them at once,
    one ``POST /v1/namespaces/{ns}/tasks/batch`` per namespace (README "Batch acceptance"), each row with
    its own idempotency key; the outcomes of a request are recorded in one transaction
    (one conditional update per outcome class). A server without the batch route (404 /
    405) is remembered and rows are then submitted one by one.

    **Leases.** A send starts only while its lease has time left, as this process sees it:
    just before a request, the lease's end (database clock) is compared with the database
    time of the claim plus the time elapsed since; unless at least the request timeout plus
    a margin (``min(5, max(0.1, lease_seconds / 10))`` s) is left, or half the lease when the
    lease is shorter than that, the rows are released unsent (attempt given back, due now)
    and claimed again. The server does not check relay leases: a process paused between
    that check and the send (SIGSTOP, a long pause) sends late, perhaps after a peer
    re-claimed and sent the rows; the keys make that a replay (one task per row) and this
    relay's record is refused, but an operator's abandon cannot stop such a send (README
    "Outbox", "Leases").

    **Outcomes** (README "Outbox", per row, also per item of a batch; the table is in
    ``_outcomes``): accepted (201/200) → ``DELIVERED`` with the task id; definitely not
    accepted (429, 409 ``request_in_progress``) → ``PENDING`` after a backoff, ``Retry-After`` honoured;
    outcome unknown (read timeout, connection reset, 5xx; for a whole batch request, every
    row in it) → ``PENDING`` after a backoff with the **same key**, and once the budget is
    spent ``NEEDS_RECONCILE``, never ``DEAD``; permanently refused (400, 404 including an
    unknown namespace or queue, 413, 422) → ``DEAD``, or ``NEEDS_RECONCILE`` when an
    earlier send of the row had an unknown outcome (the task may exist); 422
    ``idempotency_key_reused`` → ``NEEDS_RECONCILE``.

    **The server down is one condition, not one per row.** A send that got no answer (connection
    refused or lost, timeout) or a 503 leaves its rows ``PENDING`` and due at once (the attempt
    given back when nothing was sent); the relay logs one warning, claims nothing more and asks the
    server (``GET`` a queue of those rows) after each wait of ``orbit_backoff``; as soon as it
    answers, one line says so and every waiting row goes out: no row spends its own backoff on the
    outage (a 503's ``Retry-After`` still holds). **A refused key stops the relay:** a 401/403 is a configuration error, not an outage:
    the relay claims nothing more, leaves the rows ``PENDING`` and due with their attempts given
    back, logs which key (its first characters) and what to do, and :meth:`run` raises the error.

    **How attempts count.** ``attempts`` is the number of sends that may have been
    accepted: each claim adds 1 *before* sending (so a relay that dies mid-send has
    counted its send), and an answer proving the server did nothing (connection refused,
    429, 503, 409, 401/403, or a failed queue check) gives it back, as does a release. A
    row whose ``attempts`` reaches its budget (``max_attempts``, else this relay's
    ``max_attempts``) after an unknown outcome, or whose expired lease is found with the
    budget spent, goes to ``NEEDS_RECONCILE``. ``send_count`` counts every claim and
    sets the backoff exponent. A row that keeps being refused before sending is retried
    for ever, with the backoff capped.

    Args:
        client: the Orbit client; build it with ``RetryPolicy(max_attempts=1)`` (the
            relay does its own, persisted backoff) and a ``timeout`` well under
            ``lease_seconds``. Not closed by the relay.
        engine: the business database engine the application built (never disposed of).
        database_url: or a URL to build the relay's own engine from (disposed in :meth:`close`).
        tables: the outbox tables; ``None`` means ``OutboxTables()``.
        batch_size: most rows claimed, and sent, at once. Default ``50``. One request carries
            at most 500 items (the server's default ``ORBIT_MAX_BATCH_ITEMS``) and about
            192 KiB of JSON; a larger batch goes as several requests.
        concurrency: batch requests in flight at once. Default ``4``. A new batch is
            claimed when fewer than ``concurrency`` requests are in flight, so at most
            ``concurrency`` claimed batches are unfinished.
        lease_seconds: how long a claim is valid, in seconds (database clock). It must
            cover the request (``request_timeout``) and recording. Default ``60.0``.
        request_timeout: the longest one submission request may take, in seconds; ``None``
            means the client's timeout. Used by the lease rule above.
        poll_interval: seconds to wait when nothing is due. Default ``1.0``.
        shutdown_timeout: seconds :meth:`run` waits for in-flight sends after :meth:`stop`
            (SIGTERM). Sends still running then keep their leases, which expire; another
            relay resends them with the same keys. Default ``30.0``.
        max_attempts: budget of possibly-accepted sends for rows whose ``max_attempts``
            is ``NULL``. Default ``5``.
        backoff: waits between a row's tries (persisted in ``available_at``); ``None``
            means ``Backoff()`` (1 s base, 300 s cap, full jitter). ``Backoff.no_wait()``
            is the test switch.
        db_backoff: waits while the business database is unreachable; ``None`` means
            ``Backoff(base=0.5, cap=30)``.
        orbit_backoff: waits between two probes while the Orbit server does not answer (a
            ``Retry-After`` of a 503 is honoured); ``None`` means ``Backoff(base=0.5, cap=5)``, so
            rows go out at most about 5 s after the server is back.
        queue_cache_ttl: seconds a found queue is remembered (a missing one: at most 5 s),
            for one-by-one submissions; a batch needs no separate check (an item for a
            missing queue is answered 404 ``queue_not_found`` and creates nothing).
            Default ``60.0``.
        owner: the lease owner written on claimed rows; ``None`` means
            ``"<host>:<pid>:<random>"``.
        on_delivered: called inside the transaction that records a ``DELIVERED`` row, once
            per row, before the row is marked (reliability model §6.1: store the acceptance
            and the link to the business record together), e.g. to write the task id on the
            order. Each call runs under a savepoint: if it raises (a database error such as
            ``IntegrityError`` included, or it leaves the transaction unusable), its writes are
            rolled back and only that row is not recorded (the others of its batch are): its
            lease expires and it is resent (the server replays).
        install_signal_handlers: make SIGTERM and SIGINT call :meth:`stop` while
            :meth:`run` runs (main thread only). Default ``False``.
        metrics: count into these :class:`RelayMetrics` (e.g. built on the application's own
            registry); ``None`` means new ones when ``metrics_port`` is set, else no metrics.
        metrics_port: serve Prometheus metrics on this TCP port while :meth:`run` runs (``0``: a
            free port, logged); ``None`` (the default) serves none. README "Operations".
        metrics_host: address the metrics server listens on. Default ``"127.0.0.1"``.
        metrics_sample_interval: seconds between two samples of the outbox backlog (rows per
            state, oldest pending age) while :meth:`run` runs with metrics. Default ``15.0``.

    Raises:
        OutboxUsageError: invalid settings, or both/neither of ``engine``/``database_url``.
    """

    def __init__(
        self,
        *,
        client: OrbitClient,
        engine: Engine | None = None,
        database_url: str | URL | None = None,
        tables: OutboxTables | None = None,
        batch_size: int = 50,
        concurrency: int = 4,
        lease_seconds: float = 60.0,
        request_timeout: float | None = None,
        poll_interval: float = 1.0,
        shutdown_timeout: float = 30.0,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        backoff: Backoff | None = None,
        db_backoff: Backoff | None = None,
        orbit_backoff: Backoff | None = None,
        queue_cache_ttl: float = 60.0,
        owner: str | None = None,
        on_delivered: Callable[[Connection, DeliveredRow], None] | None = None,
        install_signal_handlers: bool = False,
        metrics: RelayMetrics | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        metrics_sample_interval: float = 15.0,
    ) -> None:
        if request_timeout is None:
            timeout = getattr(client, "_timeout", None)
            read = getattr(timeout, "read", None)
            request_timeout = float(read) if isinstance(read, int | float) else 10.0
        checks = (
            (batch_size >= 1, "batch_size must be at least 1"),
            (concurrency >= 1, "concurrency must be at least 1"),
            (lease_seconds > 0, "lease_seconds must be positive"),
            (request_timeout > 0, "request_timeout must be positive"),
            (poll_interval > 0, "poll_interval must be positive"),
            (shutdown_timeout >= 0, "shutdown_timeout cannot be negative"),
            (1 <= max_attempts <= 1000, "max_attempts must be 1-1000"),
            (queue_cache_ttl >= 0, "queue_cache_ttl cannot be negative"),
            (metrics_port is None or 0 <= metrics_port <= 65535, "metrics_port must be 0-65535"),
            (metrics_sample_interval > 0, "metrics_sample_interval must be positive"),
        )
        for ok, message in checks:
            if not ok:
                raise OutboxUsageError(message)
        self.outbox = Outbox(engine, database_url=database_url, tables=tables, pool_size=concurrency + 2)
        self.client = client
        self.batch_size = batch_size
        self.concurrency = concurrency
        self.lease_seconds = lease_seconds
        self.request_timeout = request_timeout
        self.poll_interval = poll_interval
        self.shutdown_timeout = shutdown_timeout
        self.max_attempts = max_attempts
        self.backoff = backoff or Backoff()
        self.db_backoff = db_backoff or Backoff(base=0.5, cap=30.0)
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.on_delivered = on_delivered
        self.install_signal_handlers = install_signal_handlers
        #: The relay's metrics (``None``: none are counted).
        self.metrics = metrics if metrics is not None or metrics_port is None else RelayMetrics()
        self.metrics_port, self.metrics_host = metrics_port, metrics_host
        self.metrics_sample_interval = metrics_sample_interval
        #: The metrics server while :meth:`run` runs with ``metrics_port`` (its ``port``, ``url``).
        self.metrics_server: MetricsServer | None = None
        margin = min(5.0, max(0.1, lease_seconds / 10))
        #: Seconds of lease a send needs left to start (the lease rule in the class docstring).
        self.send_window = min(request_timeout + margin, lease_seconds / 2)
        if request_timeout + margin > lease_seconds / 2:
            log.warning(
                "lease_seconds (%.1f s) is short for the request timeout (%.1f s): a send starts only with %.1f s "
                "of lease left, so a slower answer can outlive the lease (its outcome is then not recorded and "
                "the row is sent again with the same key); make lease_seconds at least twice the timeout",
                lease_seconds,
                request_timeout,
                self.send_window,
                extra={"event": "lease_short"},
            )
        self._sender = Sender(client, send_window=self.send_window, queue_cache_ttl=queue_cache_ttl)
        self._recorder = Recorder(
            self.outbox,
            owner=self.owner,
            backoff=self.backoff,
            on_delivered=on_delivered,
            metrics=self.metrics,
        )
        self._events: queue.SimpleQueue[Done | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._database = Outage("database", "business database", self.db_backoff, log)
        self._orbit = _OrbitDown(orbit_backoff or Backoff(base=0.5, cap=5.0))
        #: The refusal of the relay's key (401/403) that stops :meth:`run`, if one came.
        self._refused: SendOutcome | None = None
        self._owned_client: OrbitClient | None = None

    @classmethod
    def from_settings(
        cls, settings: OutboxSettings, *, engine: Engine | None = None, **overrides: Any
    ) -> Relay:
        """Build a relay and its own client from :class:`OutboxSettings` (``OutboxSettings()`` reads the env).

        The client gets ``RetryPolicy(max_attempts=1)`` and ``settings.request_timeout``;
        :meth:`close` closes it. ``engine`` replaces ``settings.database_url``; ``overrides``
        are passed to the constructor (e.g. ``on_delivered=``).

        Raises:
            OutboxUsageError: ``orbit_url`` or ``api_key`` is missing, or a setting is invalid.
        """
        if not settings.orbit_url or settings.api_key is None:
            raise OutboxUsageError("the relay needs orbit_url and api_key (ORBIT_URL, ORBIT_API_KEY)")
        try:
            client = OrbitClient(
                settings.orbit_url,
                api_key=settings.api_key.get_secret_value(),
                timeout=settings.request_timeout,
                retry=RetryPolicy(max_attempts=1),
            )
        except OrbitError as exc:
            raise OutboxUsageError(f"cannot build the Orbit client: {exc}") from None
        options: dict[str, Any] = {
            "tables": OutboxTables(name=settings.table),
            "batch_size": settings.batch_size,
            "concurrency": settings.concurrency,
            "lease_seconds": settings.lease_seconds,
            "request_timeout": settings.request_timeout,
            "poll_interval": settings.poll_interval,
            "shutdown_timeout": settings.shutdown_timeout,
            "max_attempts": settings.max_attempts,
            "backoff": Backoff(base=settings.backoff_base, cap=settings.backoff_cap),
            "metrics_port": settings.metrics_port,
            "metrics_host": settings.metrics_host,
            "metrics_sample_interval": settings.metrics_sample_interval,
            **overrides,
        }
        try:
            if engine is not None:
                relay = cls(client=client, engine=engine, **options)
            else:
                relay = cls(client=client, database_url=settings.database_url, **options)
        except BaseException:
            client.close()
            raise
        relay._owned_client = client
        return relay

    def __repr__(self) -> str:
        return (
            f"Relay(owner={self.owner!r}, outbox={self.outbox!r}, batch_size={self.batch_size}, "
            f"concurrency={self.concurrency}, lease_seconds={self.lease_seconds})"
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Dispose of the relay's own engine (built from ``database_url``) and close a client built by
        :meth:`from_settings`; an application's engine or client is left alone."""
        self.outbox.close()
        if self._owned_client is not None:
            self._owned_client.close()

    def stop(self) -> None:
        """Ask :meth:`run` to finish: claim nothing more, release unsent claims, finish and record
        in-flight sends (up to ``shutdown_timeout``). Safe from any thread or a signal handler."""
        self._stopping.set()
        self._events.put(None)

    def run_once(self) -> RelayStats:
        """Deliver what is due now, then return (``run(once=True)``)."""
        return self.run(once=True)

    def run(self, *, once: bool = False) -> RelayStats:
        """Relay until :meth:`stop` (or SIGTERM with ``install_signal_handlers``), or, with
        ``once``, until nothing is due.

        With ``once``, a row refused before sending (e.g. connection refused) is not claimed
        a second time in the same run, so the run ends even with a zero backoff.

        Returns:
            What this run did, counted in rows (``requests``: submission requests).

        Raises:
            OutboxDatabaseError: with ``once``, the business database is unreachable; without
                it, only a non-transient database failure (e.g. missing tables:
                :class:`OutboxSchemaError`). Transient failures are waited out, logged once
                per backoff.
            OrbitAPIError: the server refused the relay's API key (``AuthenticationError`` 401,
                ``PermissionDeniedError`` 403): raised once in-flight sends are recorded; the rows
                stay ``PENDING`` with their attempts given back.
        """
        self._stopping.clear()
        self._refused = None
        self._orbit = _OrbitDown(self._orbit.backoff, probing=not once)
        self._recorder.unavailable.clear()
        stats = RelayStats()
        observing = self._start_metrics()
        previous = self._install_signal_handlers() if self.install_signal_handlers else None
        executor = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="outbox-send")
        outstanding: dict[int, tuple[Batch, Future[None]]] = {}
        finished: list[Done] = []
        refused_once: set[int] = set()
        log.info(
            "relay %s started (batch size %d, concurrency %d, lease %.1f s%s)",
            self.owner,
            self.batch_size,
            self.concurrency,
            self.lease_seconds,
            ", once" if once else "",
            extra={"event": "relay_started", "owner": self.owner},
        )
        pin = self.outbox.pinned()  # claims and records all run on this thread: one connection for them
        pin.__enter__()
        try:
            while not self._stopping.is_set():
                self._collect(outstanding, finished, timeout=None)
                if finished:
                    refused_once.update(
                        claim.id
                        for done in finished
                        for claim, outcome in zip(done.batch.claims, done.outcomes, strict=True)
                        if outcome is not None and outcome.verdict is Verdict.NOT_SENT
                    )
                    if not self._record_all(finished, stats, once=once):
                        continue
                if self._refused is not None:
                    break  # a configuration error: claim nothing more (the in-flight sends finish below)
                if self._orbit.active and not once:
                    self._refused = self._orbit.probe(self.client)
                    if self._refused is None and self._orbit.active:
                        self._collect(
                            outstanding, finished, timeout=self._orbit.wait_left(), at_least_one=True
                        )
                    continue
                claimed = 0
                limit = self.batch_size if self._sender.batch_route else self.concurrency - len(outstanding)
                if len(outstanding) < self.concurrency:
                    # Never claim a row this relay still has in flight (its lease may have expired),
                    # nor, in a --once run, a row already refused in this run.
                    in_flight = {c.id for batch, _ in outstanding.values() for c in batch.claims}
                    batches = self._claim(
                        stats, once=once, limit=limit, exclude=in_flight | (refused_once if once else set())
                    )
                    if batches is None:  # database unavailable; waited
                        continue
                    for batch in batches:
                        claimed += len(batch.claims)
                        outstanding[id(batch)] = (batch, executor.submit(self._send_and_report, batch))
                    stats.claimed += claimed
                    if self.metrics is not None:
                        self.metrics.claimed(claimed)
                if not outstanding:
                    if once:
                        break
                    self._collect(outstanding, finished, timeout=self.poll_interval)
                elif claimed < limit or len(outstanding) >= self.concurrency:
                    self._collect(outstanding, finished, timeout=self.poll_interval, at_least_one=True)
        finally:
            try:
                self._shut_down(executor, outstanding, finished, stats)
            finally:
                pin.__exit__(None, None, None)
                self._stop_metrics(observing)
                if previous is not None:
                    for signum, handler in previous.items():
                        signal.signal(signum, handler)
        stats.orbit_unavailable = len(self._recorder.unavailable)
        log.info(
            "relay %s stopped: %s",
            self.owner,
            stats.to_dict(),
            extra={"event": "relay_stopped", **stats.to_dict()},
        )
        if self._refused is not None:
            refused = self._refused
            log.error(
                "the Orbit server refused the relay's API key %s (%s): a configuration error, so the relay "
                "stopped; the rows stay PENDING with their attempts intact; set ORBIT_API_KEY to a submit "
                "(or admin) key of the rows' namespace (`orbit-server api-key create NAMESPACE --role submit`) "
                'and start the relay again (README "Outbox")',
                _key_prefix(self.client),
                refused.error,
                extra={"event": "api_key_refused", "status_code": refused.status_code},
            )
            assert refused.cause is not None
            raise refused.cause
        return stats

    # --- metrics -------------------------------------------------------------------------------------

    def _start_metrics(self) -> tuple[MetricsServer | None, BacklogSampler | None]:
        """With metrics: start the backlog sampler and, with ``metrics_port``, the metrics server."""
        if self.metrics is None:
            return None, None
        sampler = BacklogSampler(self.outbox, self.metrics, interval=self.metrics_sample_interval)
        sampler.start()
        server = None
        if self.metrics_port is not None:
            try:
                server = MetricsServer(self.metrics.registry, port=self.metrics_port, host=self.metrics_host)
            except BaseException:
                sampler.close()
                raise
            log.info(
                "relay metrics at %s", server.url, extra={"event": "metrics_serving", "port": server.port}
            )
        self.metrics_server = server
        return server, sampler

    def _stop_metrics(self, observing: tuple[MetricsServer | None, BacklogSampler | None]) -> None:
        server, sampler = observing
        if sampler is not None:
            sampler.close()
        if server is not None:
            server.close()
        self.metrics_server = None

    # --- claiming ------------------------------------------------------------------------------------

    def _claim(self, stats: RelayStats, *, once: bool, limit: int, exclude: set[int]) -> list[Batch] | None:
        """Claim up to ``limit`` rows, as one batch per namespace (one per row for an older server);
        ``None`` when the database is unreachable (after waiting a backoff)."""
        started = time.monotonic()
        try:
            with self.outbox.transaction("claim a batch of outbox rows") as conn:
                claims, spent = q.claim_batch(
                    conn,
                    self.outbox.tables,
                    owner=self.owner,
                    lease_seconds=self.lease_seconds,
                    limit=max(1, limit),
                    default_max_attempts=self.max_attempts,
                    actor=f"relay:{self.owner}",
                    exclude_ids=exclude,
                )
        except OutboxDatabaseError as exc:
            if once or not exc.retryable:
                raise
            self._database.down(exc, self._stopping)
            return None
        self._database.up()
        stats.needs_reconcile += len(spent)
        if self.metrics is not None:
            self.metrics.spent_on_claim(len(spent))
        for row_id in spent:
            log.warning(
                "row %d: lease expired without a recorded outcome and its budget is spent; NEEDS_RECONCILE",
                row_id,
                extra={"event": "needs_reconcile", "row_id": row_id},
            )
        if not claims:
            return []
        first = claims[0]
        assert first.claimed_at is not None

        def batch(members: list[q.Claim], single: bool) -> Batch:
            assert first.claimed_at is not None
            return Batch(members[0].namespace, members, first.token, first.lease_expires_at, first.claimed_at,
                          started, single)  # fmt: skip

        flows = [claim for claim in claims if claim.is_flow]
        if flows:  # one request per flow row: spread over the send slots, each slot sending in turn
            claims = [claim for claim in claims if not claim.is_flow]
        batches = [
            dataclasses.replace(batch(chunk, False), flows=True)
            for members in _by_namespace(flows).values()
            for chunk in _spread(members, self.concurrency)
        ]
        if not self._sender.batch_route:
            return batches + [batch([claim], True) for claim in claims]
        return batches + [
            batch(chunk, False)
            for members in _by_namespace(claims).values()
            for chunk in requests_of(members)
        ]

    def _send_and_report(self, batch: Batch) -> None:
        started = time.monotonic()
        try:
            outcomes = self._sender.send(batch)
        except BaseException as exc:  # never lose a claim: anything unexpected may have been sent
            outcomes = [classify_error(exc)] * len(batch.claims)
        if self.metrics is not None and outcomes and outcomes[-1] is not None:  # sent, not released
            self.metrics.sent(len(batch.claims), time.monotonic() - started)
        self._events.put(Done(batch, outcomes))

    def _collect(
        self,
        outstanding: dict[int, tuple[Batch, Future[None]]],
        finished: list[Done],
        *,
        timeout: float | None,
        at_least_one: bool = False,
    ) -> None:
        """Move finished sends to ``finished``; wait up to ``timeout`` seconds for the first one
        (``None``: do not wait). Returns early on :meth:`stop`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                if deadline is None or (finished and not at_least_one):
                    item = self._events.get_nowait()
                else:
                    item = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            if item is None:  # stop() or a spurious wake-up
                if self._stopping.is_set():
                    return
                continue
            outstanding.pop(id(item.batch), None)
            finished.append(item)
            self._notice(item)
            at_least_one = False
            deadline = None

    def _notice(self, done: Done) -> None:
        """Take note of a refused key or of a server that did not answer, once per finished send."""
        for claim, outcome in zip(done.batch.claims, done.outcomes, strict=True):
            if outcome is None:
                continue
            if outcome.misconfigured and outcome.cause is not None:
                if self._refused is None:
                    self._refused = outcome
                return
            if outcome.unreachable and outcome.verdict in (Verdict.NOT_SENT, Verdict.UNKNOWN):
                self._orbit.begin(claim, outcome, sum(o is not None for o in done.outcomes))
                return

    # --- recording -----------------------------------------------------------------------------------

    def _record_all(self, finished: list[Done], stats: RelayStats, *, once: bool) -> bool:
        """Record each finished batch (one transaction each) and take it off ``finished``.

        Returns ``False`` when the database is unreachable: what is left unrecorded stays in
        ``finished`` and one backoff has been waited.
        """
        while finished:
            try:
                self._recorder.record_batch(finished[0], stats)
            except OutboxDatabaseError as exc:
                if once or not exc.retryable:
                    raise
                self._database.down(exc, self._stopping)
                return False
            finished.pop(0)
            self._database.up()
        return True

    # --- shutdown ----------------------------------------------------------------------------------------

    def _shut_down(
        self,
        executor: ThreadPoolExecutor,
        outstanding: dict[int, tuple[Batch, Future[None]]],
        finished: list[Done],
        stats: RelayStats,
    ) -> None:
        """Release unsent claims, wait for in-flight sends (``shutdown_timeout``), record everything."""
        for key, (batch, future) in list(outstanding.items()):
            if future.cancel():
                outstanding.pop(key)
                finished.append(Done(batch, [None] * len(batch.claims)))
        deadline = time.monotonic() + self.shutdown_timeout
        if outstanding:
            log.info(
                "waiting up to %.1f s for %d in-flight sends",
                self.shutdown_timeout,
                len(outstanding),
                extra={"event": "draining", "in_flight": len(outstanding)},
            )
        while outstanding and time.monotonic() < deadline:
            self._collect(outstanding, finished, timeout=deadline - time.monotonic(), at_least_one=True)
        while finished:
            try:
                self._recorder.record_batch(finished[0], stats)
            except OutboxDatabaseError as exc:
                if not exc.retryable or time.monotonic() >= deadline:
                    rows = sum(len(done.batch.claims) for done in finished)
                    log.error(
                        "could not record %d outcomes at shutdown (%s); their leases will expire and the rows will "
                        "be resent with the same keys",
                        rows,
                        exc,
                        extra={"event": "shutdown_unrecorded", "rows": rows},
                    )
                    break
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                continue
            finished.pop(0)
        finished.clear()
        if outstanding:
            log.warning(
                "%d sends still in flight after %.1f s; their leases will expire and another relay will resend "
                "them with the same keys",
                len(outstanding),
                self.shutdown_timeout,
                extra={"event": "shutdown_timeout", "in_flight": len(outstanding)},
            )
        executor.shutdown(wait=False, cancel_futures=True)

    def _install_signal_handlers(self) -> dict[int, Any] | None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("signal handlers can only be installed from the main thread; not installed")
            return None

        def handle(signum: int, _frame: FrameType | None) -> None:
            log.warning(
                "received %s: finishing in-flight sends (up to %.1f s), releasing the rest",
                signal.Signals(signum).name,
                self.shutdown_timeout,
                extra={"event": "stopping", "signal": signal.Signals(signum).name},
            )
            self.stop()

        previous: dict[int, Any] = {}
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, handle)
        return previous
