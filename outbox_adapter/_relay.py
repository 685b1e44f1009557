"""The relay: claims due outbox rows, submits them to Orbit, records each outcome (DESIGN §5).

One loop per process, ``concurrency`` sends in flight on a thread pool::

    claim a batch        short transaction: FOR UPDATE SKIP LOCKED (SQLite: BEGIN IMMEDIATE),
                         lease owner/token/expiry from the database clock, attempts + 1
    check the queue      GET /v1/namespaces/{ns}/queues/{queue}, cached; 404 → DEAD
    send                 POST .../tasks with Idempotency-Key = the row's key, outside any transaction
    record               short transaction: one conditional UPDATE per outcome on (id, lease_token)
                         with a live lease; row count checked; a lost lease records nothing

Sends that finish together are recorded in one transaction; a slow send only holds its
own slot, never the recording of others.
"""

from __future__ import annotations

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
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import FrameType, TracebackType
from typing import Any, Self

from sqlalchemy.engine import URL, Connection, Engine

from orbit_client import OrbitClient, OrbitError, RetryPolicy
from outbox_adapter import _queries as q
from outbox_adapter._db import db_now
from outbox_adapter._exceptions import OutboxDatabaseError, OutboxUsageError
from outbox_adapter._faults import Faults
from outbox_adapter._manager import Outbox
from outbox_adapter._models import DeliveredRow, RelayStats
from outbox_adapter._outcomes import Backoff, Outage, SendOutcome, Verdict, accepted, classify_error
from outbox_adapter._settings import OutboxSettings
from outbox_adapter._tables import OutboxTables

__all__ = ["DEFAULT_MAX_ATTEMPTS", "Relay"]

log = logging.getLogger("outbox_adapter.relay")

#: Budget of possibly-accepted sends of a row whose ``max_attempts`` is ``NULL``.
DEFAULT_MAX_ATTEMPTS = 5


class _QueueCache:
    """Remembers which (namespace, queue) exist, so most sends skip the check (DESIGN §5 "cached")."""

    def __init__(self, client: OrbitClient, ttl: float) -> None:
        self._client = client
        self._ttl = ttl
        self._negative_ttl = min(ttl, 5.0)
        self._lock = threading.Lock()
        self._known: dict[tuple[str, str], tuple[float, OrbitError | None]] = {}

    def check(self, namespace: str, queue_name: str) -> None:
        """Return if the queue exists; raise the ``OrbitError`` of the lookup otherwise.

        A found queue is remembered ``ttl`` seconds, a missing one (404) ``min(ttl, 5)``
        seconds; other failures are not remembered.
        """
        key = (namespace, queue_name)
        now = time.monotonic()
        with self._lock:
            cached = self._known.get(key)
        if cached is not None and cached[0] > now:
            if cached[1] is not None:
                raise cached[1]
            return
        try:
            self._client.get_queue(namespace, queue_name)
        except OrbitError as exc:
            if getattr(exc, "status_code", None) == 404:
                with self._lock:
                    self._known[key] = (now + self._negative_ttl, exc)
            raise
        with self._lock:
            self._known[key] = (now + self._ttl, None)


@dataclass(frozen=True)
class _Done:
    claim: q.Claim
    outcome: SendOutcome | None  # None: released unsent


class Relay:
    """Delivers outbox rows to Orbit: every committed row becomes exactly one task (DESIGN §5).

    Any number of relays may run on one table: claims are disjoint (``SKIP LOCKED``, or
    SQLite's single writer) and every recorded outcome is fenced by the row's lease token.

    **Outcomes** (DESIGN §5; the table is in ``_outcomes``): accepted (201/200) →
    ``DELIVERED`` with the task id; definitely not accepted (connection refused, 429, 503,
    409 ``request_in_progress``, and 401/403, which blame the relay's key) → ``PENDING``
    after a backoff, ``Retry-After`` honoured; outcome unknown (read timeout, connection
    reset, 5xx) → ``PENDING`` after a backoff with the **same key**, and once the budget is
    spent ``NEEDS_RECONCILE``, never ``DEAD``; permanently refused (400, 404 including an
    unknown namespace or queue, 413, 422) → ``DEAD``; 422 ``idempotency_key_reused`` →
    ``NEEDS_RECONCILE``.

    **How attempts count.** ``attempts`` is the number of sends that may have been
    accepted: each claim adds 1 *before* sending (so a relay that dies mid-send has
    counted its send), and an answer proving the server did nothing (connection refused,
    429, 503, 409, 401/403, or a failed queue check) gives it back. A row whose
    ``attempts`` reaches its budget (``max_attempts``, else this relay's
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
        batch_size: most rows claimed by one claim transaction. Default ``50``.
        concurrency: sends in flight at once. Default ``4``. A new batch is claimed when
            fewer than ``concurrency`` claimed rows are unfinished, so at most
            ``batch_size + concurrency - 1`` leases are held.
        lease_seconds: how long a claim is valid, in seconds (database clock). It must
            cover the wait in the pipeline plus the send. Default ``60.0``.
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
        queue_cache_ttl: seconds a found queue is remembered (a missing one: at most 5 s).
            Default ``60.0``.
        owner: the lease owner written on claimed rows; ``None`` means
            ``"<host>:<pid>:<random>"``.
        on_delivered: called inside the transaction that records a ``DELIVERED`` row
            (reliability model §6.1: store the acceptance and the link to the business
            record together), e.g. to write the task id on the order. If it raises, that
            row is not recorded: its lease expires and it is resent (the server replays).
        install_signal_handlers: make SIGTERM and SIGINT call :meth:`stop` while
            :meth:`run` runs (main thread only). Default ``False``.

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
        poll_interval: float = 1.0,
        shutdown_timeout: float = 30.0,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        backoff: Backoff | None = None,
        db_backoff: Backoff | None = None,
        queue_cache_ttl: float = 60.0,
        owner: str | None = None,
        on_delivered: Callable[[Connection, DeliveredRow], None] | None = None,
        install_signal_handlers: bool = False,
    ) -> None:
        checks = (
            (batch_size >= 1, "batch_size must be at least 1"),
            (concurrency >= 1, "concurrency must be at least 1"),
            (lease_seconds > 0, "lease_seconds must be positive"),
            (poll_interval > 0, "poll_interval must be positive"),
            (shutdown_timeout >= 0, "shutdown_timeout cannot be negative"),
            (1 <= max_attempts <= 1000, "max_attempts must be 1-1000"),
            (queue_cache_ttl >= 0, "queue_cache_ttl cannot be negative"),
        )
        for ok, message in checks:
            if not ok:
                raise OutboxUsageError(message)
        self.outbox = Outbox(engine, database_url=database_url, tables=tables, pool_size=concurrency + 2)
        self.client = client
        self.batch_size = batch_size
        self.concurrency = concurrency
        self.lease_seconds = lease_seconds
        self.poll_interval = poll_interval
        self.shutdown_timeout = shutdown_timeout
        self.max_attempts = max_attempts
        self.backoff = backoff or Backoff()
        self.db_backoff = db_backoff or Backoff(base=0.5, cap=30.0)
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.on_delivered = on_delivered
        self.install_signal_handlers = install_signal_handlers
        self._queues = _QueueCache(client, queue_cache_ttl)
        self._faults = Faults.from_env()
        self._events: queue.SimpleQueue[_Done | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._database = Outage("database", "business database", self.db_backoff, log)
        self._owned_client: OrbitClient | None = None
        #: Rows whose last recorded outcome in this run was "Orbit unreachable or refusing our key".
        self._unavailable: set[int] = set()

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
            "poll_interval": settings.poll_interval,
            "shutdown_timeout": settings.shutdown_timeout,
            "max_attempts": settings.max_attempts,
            "backoff": Backoff(base=settings.backoff_base, cap=settings.backoff_cap),
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
            What this run did, counted in rows.

        Raises:
            OutboxDatabaseError: with ``once``, the business database is unreachable; without
                it, only a non-transient database failure (e.g. missing tables:
                :class:`OutboxSchemaError`). Transient failures are waited out, logged once
                per backoff.
        """
        self._stopping.clear()
        self._unavailable.clear()
        stats = RelayStats()
        previous = self._install_signal_handlers() if self.install_signal_handlers else None
        executor = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="outbox-send")
        outstanding: dict[int, tuple[q.Claim, Future[None]]] = {}
        finished: list[_Done] = []
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
        try:
            while not self._stopping.is_set():
                self._collect(outstanding, finished, timeout=None)
                if finished:
                    refused_once.update(
                        d.claim.id
                        for d in finished
                        if d.outcome is not None and d.outcome.verdict is Verdict.NOT_SENT
                    )
                    if not self._record(finished, stats, once=once):
                        continue
                claimed = 0
                if len(outstanding) < self.concurrency:
                    # Never claim a row this relay still has in flight (its lease may have expired),
                    # nor, in a --once run, a row already refused in this run.
                    claims = self._claim(
                        stats, once=once, exclude=set(outstanding) | (refused_once if once else set())
                    )
                    if claims is None:  # database unavailable; waited
                        continue
                    stats.claimed += len(claims)
                    claimed = len(claims)
                    for claim in claims:
                        outstanding[claim.id] = (claim, executor.submit(self._send_and_report, claim))
                if not outstanding:
                    if once:
                        break
                    self._collect(outstanding, finished, timeout=self.poll_interval)
                elif claimed < self.batch_size or len(outstanding) >= self.concurrency:
                    self._collect(outstanding, finished, timeout=self.poll_interval, at_least_one=True)
        finally:
            self._shut_down(executor, outstanding, finished, stats)
            if previous is not None:
                for signum, handler in previous.items():
                    signal.signal(signum, handler)
        stats.orbit_unavailable = len(self._unavailable)
        log.info(
            "relay %s stopped: %s",
            self.owner,
            stats.to_dict(),
            extra={"event": "relay_stopped", **stats.to_dict()},
        )
        return stats

    # --- claiming ------------------------------------------------------------------------------------

    def _claim(self, stats: RelayStats, *, once: bool, exclude: set[int]) -> list[q.Claim] | None:
        """Claim a batch; ``None`` when the database is unreachable (after waiting a backoff)."""
        try:
            with self.outbox.transaction("claim a batch of outbox rows") as conn:
                claims, spent = q.claim_batch(
                    conn,
                    self.outbox.tables,
                    owner=self.owner,
                    lease_seconds=self.lease_seconds,
                    limit=self.batch_size,
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
        for row_id in spent:
            log.warning(
                "row %d: lease expired without a recorded outcome and its budget is spent; NEEDS_RECONCILE",
                row_id,
                extra={"event": "needs_reconcile", "row_id": row_id},
            )
        return claims

    # --- sending (thread pool) -----------------------------------------------------------------------

    def _send_and_report(self, claim: q.Claim) -> None:
        try:
            outcome = self._send(claim)
        except BaseException as exc:  # never lose a claim: anything unexpected may have been sent
            outcome = classify_error(exc)
        self._events.put(_Done(claim, outcome))

    def _send(self, claim: q.Claim) -> SendOutcome:
        """Check the queue, then submit with the row's key. Runs outside any transaction."""
        try:
            self._queues.check(claim.namespace, claim.queue)
        except OrbitError as exc:
            checked = classify_error(exc)
            if checked.verdict is Verdict.DEAD:
                return SendOutcome(
                    verdict=Verdict.DEAD,
                    status_code=checked.status_code,
                    error=(
                        f"queue {claim.queue!r} of namespace {claim.namespace!r} does not exist for the relay's "
                        f"API key ({checked.status_code} {getattr(exc, 'code', '')}, request id "
                        f"{getattr(exc, 'request_id', None) or '-'}); create it (orbit-server queue create), then "
                        f"`orbit-outbox retry {claim.id}`"
                    ),
                )
            # The submission itself was not sent: whatever went wrong, the server did nothing.
            return SendOutcome(
                verdict=Verdict.NOT_SENT,
                status_code=checked.status_code,
                error=f"queue check failed, nothing was submitted: {checked.error}",
                retry_after=checked.retry_after,
                misconfigured=checked.misconfigured,
                unreachable=checked.unreachable,
            )
        if self._faults is not None:
            self._faults.before_send(claim.id)
        try:
            result = self.client.submit_task(
                claim.namespace,
                claim.queue,
                claim.handler,
                claim.params,
                idempotency_key=claim.idempotency_key,
                options=claim.options,
            )
        except Exception as exc:
            outcome = classify_error(exc)
        else:
            outcome = accepted(result)
        if self._faults is not None:
            self._faults.after_send(claim.id)
        return outcome

    def _collect(
        self,
        outstanding: dict[int, tuple[q.Claim, Future[None]]],
        finished: list[_Done],
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
            outstanding.pop(item.claim.id, None)
            finished.append(item)
            at_least_one = False
            deadline = None

    # --- recording -----------------------------------------------------------------------------------

    def _record(self, finished: list[_Done], stats: RelayStats, *, once: bool) -> bool:
        """Record ``finished`` (one transaction) and empty it.

        Returns ``False`` when the database is unreachable: what is left unrecorded stays in
        ``finished`` and one backoff has been waited. If the ``on_delivered`` hook raises,
        the rows are recorded one by one and the failing row is left to its lease.
        """
        try:
            self._record_batch(finished, stats)
        except OutboxDatabaseError as exc:
            if once or not exc.retryable:
                raise
            self._database.down(exc, self._stopping)
            return False
        except Exception as exc:
            if len(finished) > 1:
                remaining = list(finished)
                finished.clear()
                for index, done in enumerate(remaining):
                    single = [done]
                    if not self._record(single, stats, once=once):
                        finished.extend(remaining[index:])
                        return False
                return True
            done = finished.pop()
            log.error(
                "row %d: on_delivered failed (%s: %s); nothing recorded; the lease will expire and the row "
                "will be resent with the same key (the server replays)",
                done.claim.id,
                type(exc).__name__,
                exc,
                extra={
                    "event": "hook_failed",
                    "row_id": done.claim.id,
                    "idempotency_key": done.claim.idempotency_key,
                },
            )
            return True
        finished.clear()
        self._database.up()
        return True

    def _record_batch(self, finished: list[_Done], stats: RelayStats) -> None:
        t = self.outbox.tables
        actor = f"relay:{self.owner}"
        logs: list[tuple[str, q.Claim, SendOutcome | None, str]] = []
        with self.outbox.transaction("record send outcomes") as conn:
            now = db_now(conn)
            events: list[dict[str, Any]] = []
            for done in finished:
                claim, outcome = done.claim, done.outcome
                kind, written, event = self._record_one(conn, claim, outcome, now, actor)
                if not written:
                    logs.append(("lost", claim, outcome, kind))
                    continue
                if event is not None:
                    events.append(event)
                if kind == "delivered" and self.on_delivered is not None:
                    assert outcome is not None and outcome.task_id is not None
                    self.on_delivered(
                        conn,
                        DeliveredRow(
                            row_id=claim.id,
                            idempotency_key=claim.idempotency_key,
                            business_ref=claim.business_ref,
                            orbit_task_id=outcome.task_id,
                            replayed=outcome.replayed,
                        ),
                    )
                logs.append((kind, claim, outcome, kind))
            q.add_events(conn, t, events)
        for kind, claim, outcome, intended in logs:  # after the commit: logs say what is true
            self._log_recorded(kind, claim, outcome, intended, stats)

    def _record_one(
        self, conn: Connection, claim: q.Claim, outcome: SendOutcome | None, now: datetime, actor: str
    ) -> tuple[str, bool, dict[str, Any] | None]:
        """Write one outcome; returns (kind, written, audit event or None)."""
        t = self.outbox.tables
        if outcome is None:
            return "released", q.release_claim(conn, t, claim, now=now), None
        verdict = outcome.verdict
        error = outcome.error or ""
        if verdict is Verdict.DELIVERED:
            assert outcome.task_id is not None and outcome.status_code is not None
            written = q.record_delivered(
                conn, t, claim, now=now, task_id=outcome.task_id, status_code=outcome.status_code
            )
            how = "replayed the original task (200)" if outcome.replayed else "accepted (201)"
            event = q.event_values(
                claim.id,
                q.PENDING,
                q.DELIVERED,
                reason=f"the server {how}",
                actor=actor,
                now=now,
                task_id=outcome.task_id,
            )
            return "delivered", written, event
        if verdict is Verdict.UNKNOWN and claim.attempts >= claim.budget:
            verdict = Verdict.RECONCILE
            error = (
                f"outcome unknown after {claim.attempts} of {claim.budget} attempts; the task may exist: run "
                f"`orbit-outbox reconcile`; last error: {error}"
            )
        if verdict in (Verdict.NOT_SENT, Verdict.UNKNOWN):
            due = now + timedelta(seconds=self.backoff.delay(claim.send_count, outcome.retry_after))
            written = q.record_retry(
                conn,
                t,
                claim,
                now=now,
                available_at=due,
                error=error,
                status_code=outcome.status_code,
                counted=verdict is Verdict.UNKNOWN,
            )
            return "retry", written, None
        if verdict is Verdict.DEAD:
            written = q.record_dead(conn, t, claim, now=now, error=error, status_code=outcome.status_code)
            event = q.event_values(claim.id, q.PENDING, q.DEAD, reason=error, actor=actor, now=now)
            return "dead", written, event
        written = q.record_needs_reconcile(
            conn, t, claim, now=now, error=error, status_code=outcome.status_code
        )
        event = q.event_values(claim.id, q.PENDING, q.NEEDS_RECONCILE, reason=error, actor=actor, now=now)
        return "needs_reconcile", written, event

    def _log_recorded(
        self, kind: str, claim: q.Claim, outcome: SendOutcome | None, intended: str, stats: RelayStats
    ) -> None:
        extra: dict[str, Any] = {
            "event": kind,
            "row_id": claim.id,
            "idempotency_key": claim.idempotency_key,
            "attempts": claim.attempts,
        }
        if outcome is not None:
            extra["status_code"] = outcome.status_code
            if outcome.task_id:
                extra["orbit_task_id"] = outcome.task_id
        if kind == "retry" and outcome is not None and outcome.orbit_unavailable:
            self._unavailable.add(claim.id)
        elif kind != "lost":
            self._unavailable.discard(claim.id)
        if kind == "lost":
            stats.lost_leases += 1
            extra["lost"] = intended
            log.warning(
                "row %d (key %s): lease lost (expired or taken over); outcome %r not recorded; the row's owner "
                "now decides",
                claim.id,
                claim.idempotency_key,
                intended,
                extra=extra,
            )
        elif kind == "delivered":
            assert outcome is not None
            stats.delivered += 1
            stats.replayed += outcome.replayed
            extra["replayed"] = outcome.replayed
            log.info(
                "row %d (key %s) delivered as task %s%s",
                claim.id,
                claim.idempotency_key,
                outcome.task_id,
                " (replayed)" if outcome.replayed else "",
                extra=extra,
            )
        elif kind == "retry":
            assert outcome is not None
            stats.retried += 1
            level = logging.ERROR if outcome.misconfigured else logging.WARNING
            log.log(
                level,
                "row %d (key %s) will be retried (%s): %s",
                claim.id,
                claim.idempotency_key,
                outcome.verdict.value,
                outcome.error,
                extra={**extra, "verdict": outcome.verdict.value},
            )
        elif kind == "dead":
            stats.dead += 1
            log.error(
                "row %d (key %s) is DEAD: %s",
                claim.id,
                claim.idempotency_key,
                outcome.error if outcome else "",
                extra=extra,
            )
        elif kind == "needs_reconcile":
            stats.needs_reconcile += 1
            log.warning(
                "row %d (key %s) needs reconcile: %s",
                claim.id,
                claim.idempotency_key,
                outcome.error if outcome else "",
                extra=extra,
            )
        elif kind == "released":
            stats.released += 1
            log.info("row %d (key %s) released unsent", claim.id, claim.idempotency_key, extra=extra)

    # --- shutdown ----------------------------------------------------------------------------------------

    def _shut_down(
        self,
        executor: ThreadPoolExecutor,
        outstanding: dict[int, tuple[q.Claim, Future[None]]],
        finished: list[_Done],
        stats: RelayStats,
    ) -> None:
        """Release unsent claims, wait for in-flight sends (``shutdown_timeout``), record everything."""
        for claim, future in list(outstanding.values()):
            if future.cancel():
                outstanding.pop(claim.id)
                finished.append(_Done(claim, None))
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
                self._record_batch(finished, stats)
            except OutboxDatabaseError as exc:
                if not exc.retryable or time.monotonic() >= deadline:
                    log.error(
                        "could not record %d outcomes at shutdown (%s); their leases will expire and the rows will "
                        "be resent with the same keys",
                        len(finished),
                        exc,
                        extra={"event": "shutdown_unrecorded", "rows": len(finished)},
                    )
                    break
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                continue
            except Exception as exc:  # hook failure: the rows stay leased and will be resent
                log.error("could not record outcomes at shutdown: %s: %s", type(exc).__name__, exc)
            break
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
