"""What the relay sends (DESIGN §3, §5): a claimed batch as the batch requests the server takes,
the cached queue check of one-by-one submissions, and how an older server without the batch
route is recognised."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from datetime import datetime

from orbit_client import OrbitClient, OrbitError
from outbox_adapter import _queries as q
from outbox_adapter._outcomes import SendOutcome

__all__ = [
    "MAX_BATCH_BYTES",
    "MAX_BATCH_ITEMS",
    "Batch",
    "Done",
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
