"""What the relay sends (DESIGN §3, §5): a claimed batch as the batch requests the server takes,
the cached queue check of one-by-one submissions, and how an older server without the batch
route is recognised."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from datetime import datetime

from orbit_client import OrbitAPIError, OrbitClient, OrbitError
from outbox_adapter import _queries as q
from outbox_adapter._outcomes import SendOutcome, Verdict, purged_task_id

__all__ = [
    "FALLBACK_KEY_WINDOW",
    "MAX_BATCH_BYTES",
    "MAX_BATCH_ITEMS",
    "Batch",
    "Done",
    "KeyWindow",
    "QueueCache",
    "requests_of",
    "route_missing",
]


class QueueCache:
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

    def found(self, namespace: str, queue_name: str) -> None:
        """Remember that a queue exists (a batch item was accepted into it): no check needed."""
        with self._lock:
            self._known[(namespace, queue_name)] = (time.monotonic() + self._ttl, None)


@dataclass
class Batch:
    """Rows of one claim and one namespace, sent as one request (or, for an older server, one row)."""

    namespace: str
    claims: list[q.Claim]
    token: str
    lease_expires_at: datetime  # database clock
    claimed_at: datetime  # database clock, read by the claim
    claimed_mono: float  # time.monotonic() just before the claim's transaction began
    single: bool = False  # submit with submit_task (an older server without the batch route)
    flows: bool = False  # flow rows: each started with its own request, one after the other


@dataclass(frozen=True)
class Done:
    batch: Batch
    outcomes: list[SendOutcome | None]  # one per claim; None: released unsent


#: Most items in one batch request (the server's default ``ORBIT_MAX_BATCH_ITEMS``).
MAX_BATCH_ITEMS = 500
#: Largest estimated body of one batch request, in bytes: well under the server's default
#: ``ORBIT_MAX_BODY_BYTES`` (256 KiB), so a batch of large params is split, not refused.
MAX_BATCH_BYTES = 192 * 1024


def requests_of(claims: list[q.Claim]) -> list[list[q.Claim]]:
    """Split the claims of one namespace into batch requests of at most :data:`MAX_BATCH_ITEMS` items
    and about :data:`MAX_BATCH_BYTES` of JSON each (a row alone over the limit is a request alone)."""
    requests: list[list[q.Claim]] = [[]]
    size = 0
    for claim in claims:
        item = 120 + len(claim.idempotency_key) + len(claim.queue) + len(claim.handler)
        item += len(json.dumps(claim.params, separators=(",", ":"), ensure_ascii=False))
        item += len(json.dumps(claim.options, separators=(",", ":"))) if claim.options else 0
        if requests[-1] and (len(requests[-1]) >= MAX_BATCH_ITEMS or size + item > MAX_BATCH_BYTES):
            requests.append([])
            size = 0
        requests[-1].append(claim)
        size += item
    return requests


def route_missing(exc: BaseException) -> bool:
    """Whether a batch request was refused because the server has no batch route (an older server):
    404 ``not_found`` (no such path) or 405 (``POST .../tasks/{id}`` has no POST)."""
    status = getattr(exc, "status_code", None)
    code = getattr(exc, "code", None)
    return status == 405 or (status == 404 and code in (None, "", "not_found"))


#: The key window assumed while the server's cannot be read: the smallest the server allows
#: (``ORBIT_SUBMISSION_KEY_TTL_SECONDS`` >= 3600), so the assumption is never too long.
FALLBACK_KEY_WINDOW = 3600.0


def _margin(window: float) -> float:
    """Safety margin under a key window, in seconds: clock skew between the business database and the
    server's, and the time a key is accepted after its row was enqueued."""
    return min(3600.0, window / 10)


#: Rows younger than this are inside any key window the server may have (README "Retention and the key window").
ALWAYS_FRESH = FALLBACK_KEY_WINDOW - _margin(FALLBACK_KEY_WINDOW)


class KeyWindow:
    """The server's key window (``GET /v1/settings``), read only once a row is old enough to need
    it and then kept ``refresh`` seconds (README "Retention and the key window").

    A row older than the window minus a margin may have a key the server has forgotten; the relay
    settles such a row by its key before sending it (:meth:`settle`).
    """

    def __init__(self, client: OrbitClient, refresh: float = 300.0) -> None:
        self._client = client
        self._refresh = refresh
        self._lock = threading.Lock()
        self._limit: tuple[float, float | None] | None = None  # (valid until, limit)

    def limit(self) -> float | None:
        """Seconds a row may age before it is settled by key first; ``None`` for a server without
        ``/v1/settings`` (an older server, which never purges keys)."""
        now = time.monotonic()
        with self._lock:
            if self._limit is not None and self._limit[0] > now:
                return self._limit[1]
        keep = self._refresh
        limit: float | None
        try:
            window = float(self._client.get_settings().submission_key_ttl_seconds)
            limit = window - _margin(window)
        except OrbitError as exc:
            if getattr(exc, "status_code", None) == 404 and getattr(exc, "code", None) in (
                None,
                "",
                "not_found",
            ):
                limit = None
            else:  # unreadable for now: assume the shortest window, ask again soon
                limit, keep = ALWAYS_FRESH, min(keep, 30.0)
        with self._lock:
            self._limit = (now + keep, limit)
        return limit

    def aged(self, batch: Batch) -> set[int]:
        """Ids of the claims of ``batch`` older than the key window minus its margin (by the database
        clock of the claim: both times are the business database's)."""
        ages = {
            c.id: (batch.claimed_at - c.created_at).total_seconds()
            for c in batch.claims
            if c.created_at is not None and not c.is_flow  # a flow start's key lives as long as its instance
        }
        if not any(age > ALWAYS_FRESH for age in ages.values()):
            return set()  # the common case: no settings request at all
        limit = self.limit()
        return set() if limit is None else {row_id for row_id, age in ages.items() if age > limit}

    def settle(self, claim: q.Claim, limit: float | None) -> SendOutcome | None:
        """Settle an aged claim by its key: the outcome to record, or ``None`` to send it after all
        (the server has no task for the key and the row was never claimed before, so never sent).

        Found with this row's queue, handler and params (or purged after it ran) → ``DELIVERED``;
        not found after an earlier claim → ``NEEDS_RECONCILE`` (the server may have forgotten the
        key: a resend could create a second task); a failed lookup → retried later, nothing sent.
        """
        try:
            task = self._client.find_submission(claim.namespace, claim.idempotency_key)
        except OrbitAPIError as exc:
            purged = purged_task_id(exc.status_code, exc.problem)
            if purged is not None:
                return SendOutcome(verdict=Verdict.DELIVERED, task_id=purged, replayed=True, status_code=410)
            return self._not_settled(exc)
        except OrbitError as exc:
            return self._not_settled(exc)
        if task is not None:
            if (task.queue, task.handler, task.params) == (claim.queue, claim.handler, claim.params):
                return SendOutcome(verdict=Verdict.DELIVERED, task_id=task.id, replayed=True, status_code=200)
            return SendOutcome(
                verdict=Verdict.RECONCILE,
                status_code=200,
                error=f"the key names task {task.id}, which is another submission; settle the row with "
                '`orbit-outbox resolve` (README "Outbox")',
            )
        if claim.send_count <= 1:
            return None
        days = f"{limit / 86400:.1f} days" if limit is not None else "the key window"
        return SendOutcome(
            verdict=Verdict.RECONCILE,
            status_code=404,
            error=(
                f"the row is older than the server's key window less a margin ({days}) and the server knows "
                "no task for its key: the key may have been purged after the task was created, so a resend "
                "could create a second task; find out what happened and settle it with `orbit-outbox resolve` "
                '(README "Retention and the key window")'
            ),
        )

    @staticmethod
    def _not_settled(exc: OrbitError) -> SendOutcome:
        return SendOutcome(
            verdict=Verdict.NOT_SENT,
            status_code=getattr(exc, "status_code", None),
            error=f"the row is older than the key window; settling it by its key failed, nothing was sent: {exc}",
            retry_after=getattr(exc, "retry_after", None),
        )
