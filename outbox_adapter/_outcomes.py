"""What a send's result means for the row (DESIGN §5), and how long the row waits before the next try.

Pure decision logic with no I/O, so it is unit-tested exhaustively. The decision reads
only the attributes every ``orbit_client`` error carries (``outcome_known``,
``retryable``, ``status_code``, ``code``, ``retry_after``):

=================================================  ==================  ===============================
what came back                                     verdict             the row
=================================================  ==================  ===============================
201 / 200 (replay)                                 ``DELIVERED``       ``DELIVERED`` with the task id
410 ``task_purged`` with its ``task_id``            ``DELIVERED``       ``DELIVERED`` with that task id
(the key's task ran and was purged since)
422 ``idempotency_key_reused``                     ``RECONCILE``       ``NEEDS_RECONCILE``
``outcome_known=False`` (read timeout, reset, 5xx)  ``UNKNOWN``         ``PENDING`` + backoff, counted;
                                                                       budget spent → ``NEEDS_RECONCILE``
``retryable`` and known (refused, 429, 503, 409     ``NOT_SENT``        ``PENDING`` + backoff (Retry-After
in progress)                                                           honoured), attempt given back
401 / 403 (the relay's API key is wrong)            ``NOT_SENT``        ``PENDING``, due now, attempt given
                                                                       back; the relay stops (exits non-zero)
any other 4xx (400, 404 incl. unknown queue, 413,  ``DEAD``            ``DEAD`` with the error
422 validation), or a misuse caught by the client
anything unexpected                                ``UNKNOWN``         as for a timeout: it may have been sent
=================================================  ==================  ===============================

When the server gave no answer (connection refused or lost, a timeout) or a 503 (``unreachable``), the
row spends no backoff of its own: it is due at once (a 503's ``Retry-After`` still holds), counted or
given back as the table says, and the relay waits the outage out as one condition (``_relay``).
"""

from __future__ import annotations

import enum
import logging
import random as _random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from orbit_client import (
    BatchItemResult,
    IdempotencyKeyReusedError,
    OrbitAPIError,
    OrbitError,
    OrbitTransportError,
    OrbitUsageError,
    Problem,
    ServiceUnavailableError,
    SubmitResult,
)
from outbox_adapter._exceptions import OutboxUsageError

__all__ = [
    "Backoff",
    "Outage",
    "SendOutcome",
    "Verdict",
    "accepted",
    "classify_error",
    "dead_queue_hint",
    "item_outcome",
    "purged_task_id",
]


class Verdict(enum.Enum):
    """The outcome classes of DESIGN §5."""

    DELIVERED = "delivered"
    NOT_SENT = "not_sent"
    UNKNOWN = "unknown"
    DEAD = "dead"
    RECONCILE = "reconcile"


@dataclass(frozen=True, kw_only=True)
class SendOutcome:
    """The result of one send, classified.

    Attributes:
        verdict: the outcome class.
        task_id: the Orbit task id when delivered, else ``None``.
        replayed: ``True`` when the server answered with the original task of an earlier send.
        status_code: the HTTP status, or ``None`` when no response came.
        error: the error message for ``last_error`` (never contains params), or ``None``.
        retry_after: seconds the server asked us to wait (``Retry-After``), or ``None``.
        misconfigured: ``True`` when the relay's own configuration is at fault (401/403).
        unreachable: ``True`` when no answer came from the server (connection refused or
            lost, timeout) or it answered 503: the server, not the row, is the problem.
        cause: the error a ``misconfigured`` outcome came from (the relay raises it), else ``None``.
    """

    verdict: Verdict
    task_id: str | None = None
    replayed: bool = False
    status_code: int | None = None
    error: str | None = None
    retry_after: float | None = None
    misconfigured: bool = False
    unreachable: bool = False
    cause: OrbitError | None = field(default=None, compare=False, repr=False)

    @property
    def orbit_unavailable(self) -> bool:
        """Not delivered because the Orbit server was unreachable or refused the relay's API key."""
        return self.verdict in (Verdict.NOT_SENT, Verdict.UNKNOWN) and (
            self.unreachable or self.misconfigured
        )


def purged_task_id(status: int | None, problem: Problem | None) -> str | None:
    """The ``task_id`` of a ``410 task_purged`` answer (the key is remembered, its task ran and was
    purged: the submission was delivered), else ``None``."""
    if status != 410 or problem is None or problem.code != "task_purged":
        return None
    task_id = (problem.model_extra or {}).get("task_id")
    return task_id if isinstance(task_id, str) and task_id else None


def _purged(status: int | None, problem: Problem | None) -> SendOutcome | None:
    task_id = purged_task_id(status, problem)
    if task_id is None:
        return None
    return SendOutcome(verdict=Verdict.DELIVERED, task_id=task_id, replayed=True, status_code=410)


def accepted(result: SubmitResult) -> SendOutcome:
    """A 201 (new task) or 200 (replay) answer: ``DELIVERED``."""
    return SendOutcome(
        verdict=Verdict.DELIVERED,
        task_id=result.task.id,
        replayed=result.replayed,
        status_code=200 if result.replayed else 201,
    )


def item_outcome(result: BatchItemResult, *, namespace: str, queue: str, row_id: int) -> SendOutcome:
    """One item's answer in a batch submission, classified exactly as the single answer would be
    (DESIGN §5): 201/200 → ``DELIVERED``; 410 ``task_purged`` with a ``task_id`` → ``DELIVERED``
    (that task); 422 ``idempotency_key_reused`` → ``RECONCILE``; 409
    ``request_in_progress`` (and 429/503) → ``NOT_SENT``; 404 (``queue_not_found``) and any
    other 4xx → ``DEAD``; anything else (a 5xx, a status the contract does not name, a 2xx
    without its task) → ``UNKNOWN``: it may have been accepted."""
    status, problem = result.status, result.error
    code = problem.code if problem is not None else None
    request_id = problem.request_id if problem is not None else None
    if problem is not None:
        message = f"{status} {code}: {problem.detail or problem.title} (request id {request_id or '-'})"
    else:
        message = f"{status} without a problem body"
    if status in (200, 201) and result.task is not None:
        return SendOutcome(
            verdict=Verdict.DELIVERED, task_id=result.task.id, replayed=status == 200, status_code=status
        )
    purged = _purged(status, problem)
    if purged is not None:
        return purged
    if status == 422 and code == "idempotency_key_reused":
        return SendOutcome(verdict=Verdict.RECONCILE, status_code=status, error=message)
    if status in (409, 429, 503):
        return SendOutcome(verdict=Verdict.NOT_SENT, status_code=status, error=message)
    if status == 404:
        return SendOutcome(
            verdict=Verdict.DEAD,
            status_code=status,
            error=(
                f"queue {queue!r} of namespace {namespace!r} does not exist for the relay's API key ({message}); "
                + dead_queue_hint(namespace, queue, row_id)
            ),
        )
    if 400 <= status < 500:
        return SendOutcome(verdict=Verdict.DEAD, status_code=status, error=message)
    return SendOutcome(
        verdict=Verdict.UNKNOWN,
        status_code=status,
        error=f"unexpected item answer {message}; the task may have been accepted",
    )


def classify_error(error: BaseException) -> SendOutcome:
    """Classify a failed send by the error's attributes (DESIGN §5; table in this module's docstring)."""
    if not isinstance(error, OrbitError):
        return SendOutcome(
            verdict=Verdict.UNKNOWN,
            error=f"unexpected {type(error).__name__} while sending: {error}; the request may have been sent",
        )
    status = error.status_code if isinstance(error, OrbitAPIError) else None
    retry_after = error.retry_after if isinstance(error, OrbitAPIError) else None
    purged = _purged(status, error.problem) if isinstance(error, OrbitAPIError) else None
    if purged is not None:
        return purged
    message = str(error)
    unreachable = isinstance(error, OrbitTransportError | ServiceUnavailableError)
    if isinstance(error, IdempotencyKeyReusedError) or (
        isinstance(error, OrbitAPIError) and error.code == "idempotency_key_reused"
    ):
        return SendOutcome(verdict=Verdict.RECONCILE, status_code=status, error=message)
    if not error.outcome_known:
        return SendOutcome(
            verdict=Verdict.UNKNOWN,
            status_code=status,
            error=message,
            retry_after=retry_after,
            unreachable=unreachable,
        )
    if error.retryable:
        return SendOutcome(
            verdict=Verdict.NOT_SENT,
            status_code=status,
            error=message,
            retry_after=retry_after,
            unreachable=unreachable,
        )
    if status in (401, 403):
        return SendOutcome(
            verdict=Verdict.NOT_SENT,
            status_code=status,
            error=f"{message} (the relay's API key is at fault, not the row)",
            misconfigured=True,
            cause=error,
        )
    if isinstance(error, OrbitAPIError | OrbitUsageError):
        return SendOutcome(verdict=Verdict.DEAD, status_code=status, error=message)
    return SendOutcome(verdict=Verdict.UNKNOWN, status_code=status, error=message)


@dataclass(frozen=True, kw_only=True)
class Backoff:
    """How long a row waits before its next try: exponential, full jitter, capped (as hynek/stamina).

    The wait after the row's *n*-th try (``send_count``, 1-based) is
    ``random() * min(cap, base * 2**(n - 1))`` seconds. When the server sent
    ``Retry-After``, the wait is exactly that many seconds instead (at most
    ``max_retry_after``). The wait is added to the **database** clock's now and stored
    in ``available_at``, so it survives restarts and any relay honours it.

    Args:
        base: upper bound of the first wait, in seconds. Default ``1.0``.
        cap: ceiling of the upper bound, in seconds. Default ``300.0``.
        max_retry_after: longest ``Retry-After`` honoured, in seconds; a longer one is cut
            to this. Default ``3600.0``.
        random: returns a float in ``[0, 1)`` scaling the jitter; default :func:`random.random`.
            Tests pass ``lambda: 1.0`` (the bound itself) or ``lambda: 0.0``.

    Raises:
        OutboxUsageError: a duration is negative.

    ``Backoff.no_wait()`` makes every wait zero except an honoured ``Retry-After`` (the
    test switch: rows are due again at once).
    """

    base: float = 1.0
    cap: float = 300.0
    max_retry_after: float = 3600.0
    random: Callable[[], float] = field(default=_random.random, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("base", "cap", "max_retry_after"):
            if getattr(self, name) < 0:
                raise OutboxUsageError(f"Backoff.{name} is a duration in seconds and cannot be negative")

    @classmethod
    def no_wait(cls) -> Backoff:
        """A backoff of zero seconds (``Retry-After`` is still honoured)."""
        return cls(base=0.0, cap=0.0)

    def delay(self, tries: int, retry_after: float | None = None) -> float:
        """Seconds to wait after the row's ``tries``-th try (1-based), given the server's ``Retry-After``."""
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.max_retry_after)
        bound = min(self.cap, self.base * 2.0 ** min(max(tries - 1, 0), 60))
        return self.random() * bound


class Outage:
    """A streak of failures to reach one dependency (the business database, the Orbit server).

    :meth:`down` counts a failure, logs one line (event ``<name>_unavailable``) and waits one
    backoff, cut short by ``stopping``; :meth:`up` ends the streak with one line (event
    ``<name>_recovered``, with the failures and the seconds it lasted). So a loop logs once
    per wait, not once per attempt, and recovers by itself.
    """

    def __init__(self, name: str, label: str, backoff: Backoff, logger: logging.Logger) -> None:
        self.name, self.label, self.backoff, self._log = name, label, backoff, logger
        self.failures = 0
        self._since = 0.0

    def down(self, exc: BaseException, stopping: threading.Event) -> None:
        """Count a failure, log it, and wait one backoff (returns early once ``stopping`` is set)."""
        if self.failures == 0:
            self._since = time.monotonic()
        self.failures += 1
        delay = self.backoff.delay(self.failures)
        self._log.warning(
            "%s unavailable (failure %d): %s; retrying in %.1f s",
            self.label,
            self.failures,
            exc,
            delay,
            extra={"event": f"{self.name}_unavailable", "failures": self.failures, "retry_in": delay},
        )
        stopping.wait(delay)

    def up(self) -> None:
        """End a streak of failures, if there was one (logs how long it lasted)."""
        if self.failures:
            self._log.warning(
                "%s reachable again after %d failures (%.1f s)",
                self.label,
                self.failures,
                time.monotonic() - self._since,
                extra={"event": f"{self.name}_recovered", "failures": self.failures},
            )
            self.failures = 0


def dead_queue_hint(namespace: str, queue: str, row_id: int) -> str:
    """Both ways out of a row that went ``DEAD`` for an unknown queue: the queue is right
    (create it, retry the row) or mistyped (delete the row, audited)."""
    return (
        f"if the queue name is right, create it (`orbit-server queue create {namespace} {queue}`) and run "
        f"`orbit-outbox retry {row_id}`; if it is wrong, delete the row: `orbit-outbox purge --dead-older-than 0s "
        f"--row {row_id} --reason TEXT` (audited) and enqueue the work again with the right queue"
    )
