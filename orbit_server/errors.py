"""Domain errors. Endpoints raise them; one handler turns each into an RFC 9457
problem body with a stable ``code`` (see :mod:`orbit_server.api.problems`)."""

from __future__ import annotations

__all__ = [
    "AttemptNotFound",
    "ConcurrentUpdate",
    "DeadlinePassed",
    "DeliveryNotFound",
    "FlowInstanceFinished",
    "FlowInstanceNotFound",
    "FlowNotFound",
    "FlowVersionNotFound",
    "Forbidden",
    "IdempotencyConflict",
    "IdempotencyKeyInvalid",
    "IdempotencyKeyMissing",
    "IdempotencyKeyReused",
    "InvalidCursor",
    "InvalidTransition",
    "ItemIdempotencyKeyInvalid",
    "ItemIdempotencyKeyMissing",
    "LeaseLost",
    "NameTaken",
    "NamespaceNotFound",
    "NotRetryable",
    "OrbitServerError",
    "PayloadTooLarge",
    "QueueNotFound",
    "ReportConflict",
    "RequestInProgress",
    "SubmissionNotFound",
    "SubscriptionExists",
    "SubscriptionNotFound",
    "SuccessorExists",
    "TaskNotFound",
    "TaskPurged",
    "Unauthenticated",
]


class OrbitServerError(Exception):
    """Base of every error the API reports on purpose."""

    status: int = 500
    code: str = "internal_error"
    title: str = "Internal server error"
    #: When raised inside :func:`orbit_server.db.transact.transact`, commit what the
    #: transaction wrote before answering with this error (e.g. late-result evidence).
    keep_writes: bool = False

    def __init__(
        self,
        detail: str | None = None,
        *,
        headers: dict[str, str] | None = None,
        extra: dict[str, object] | None = None,
    ) -> None:
        super().__init__(detail or self.title)
        self.detail = detail
        self.headers = headers or {}
        #: Extension members added to the problem body (RFC 9457 §3.2).
        self.extra = extra or {}


class Unauthenticated(OrbitServerError):
    status, code, title = 401, "unauthenticated", "Missing or unknown API key"

    def __init__(self, detail: str | None = None) -> None:
        super().__init__(detail, headers={"WWW-Authenticate": 'Bearer realm="orbit"'})


class Forbidden(OrbitServerError):
    status, code, title = 403, "forbidden", "The API key's role does not allow this"


class NamespaceNotFound(OrbitServerError):
    status, code, title = 404, "namespace_not_found", "Namespace not found"


class QueueNotFound(OrbitServerError):
    status, code, title = 404, "queue_not_found", "Queue not found"


class TaskNotFound(OrbitServerError):
    status, code, title = 404, "task_not_found", "Task not found"


class TaskPurged(OrbitServerError):
    """410: the key is remembered, but the task it created was purged (README "Retention and the key window")."""

    status, code, title = 410, "task_purged", "The task this key created was purged"

    def __init__(self, detail: str, *, task_id: str) -> None:
        super().__init__(detail, extra={"task_id": task_id})


class SubmissionNotFound(OrbitServerError):
    status, code, title = 404, "submission_not_found", "No submission with this idempotency key"


class IdempotencyKeyMissing(OrbitServerError):
    status, code, title = 400, "idempotency_key_missing", "The Idempotency-Key header is required"


class IdempotencyKeyInvalid(OrbitServerError):
    status, code, title = 400, "idempotency_key_invalid", "Malformed Idempotency-Key header"


class ItemIdempotencyKeyMissing(IdempotencyKeyMissing):
    """A batch item without its ``idempotency_key`` field (the same code as the missing header)."""

    title = "The item's idempotency_key is required"


class ItemIdempotencyKeyInvalid(IdempotencyKeyInvalid):
    """A batch item whose ``idempotency_key`` field is malformed (the same code as a malformed header)."""

    title = "Malformed idempotency_key of the item"


class IdempotencyKeyReused(OrbitServerError):
    status, code, title = 422, "idempotency_key_reused", "Idempotency key already used for another request"


class RequestInProgress(OrbitServerError):
    status, code, title = 409, "request_in_progress", "A request with this idempotency key is in progress"

    def __init__(self, detail: str | None = None) -> None:
        super().__init__(detail, headers={"Retry-After": "1"})


class PayloadTooLarge(OrbitServerError):
    status, code, title = 413, "payload_too_large", "Request body too large"


class NameTaken(OrbitServerError):
    status, code, title = 409, "already_exists", "Name already taken"


class AttemptNotFound(OrbitServerError):
    status, code, title = 404, "attempt_not_found", "Attempt not found"


class LeaseLost(OrbitServerError):
    """409: the attempt no longer holds the task's lease (forged, stale, expired or finished).

    Nothing changed, except that a ``complete``/``fail`` body carrying the attempt's
    own token is kept on the attempt as late evidence (``evidence_recorded``).
    """

    status, code, title = 409, "lease_lost", "The attempt no longer holds the task's lease"

    #: Commit before answering: the refusal may have expired the attempt or recorded evidence.
    keep_writes = True

    def __init__(
        self, detail: str | None = None, *, evidence_recorded: bool = False, queue_paused: bool = False
    ) -> None:
        extra: dict[str, object] = {"evidence_recorded": evidence_recorded}
        if queue_paused:  # a start refused by a paused queue, whose lease was given back
            extra["queue_paused"] = True
        super().__init__(detail, extra=extra)


class ReportConflict(OrbitServerError):
    """A second report of an attempt that already reported its outcome, with another result or error
    (a repeat of the same report answers 200): the attempt's outcome never changes; the first such
    report is kept on the attempt as evidence (``evidence_recorded``), as a late one is."""

    status, code, title = 409, "report_conflict", "The attempt already reported another outcome"

    #: Commit before answering: the refusal may have recorded evidence.
    keep_writes = True

    def __init__(self, detail: str | None = None, *, evidence_recorded: bool = False) -> None:
        super().__init__(detail, extra={"evidence_recorded": evidence_recorded})


class InvalidTransition(OrbitServerError):
    """409: the task's state does not allow this (§2 of the reliability model)."""

    status, code, title = 409, "invalid_transition", "The task's state does not allow this transition"


class FlowInstanceFinished(InvalidTransition):
    """409 ``invalid_transition``: the flow instance is finished (README "Flows: running them")."""

    title = "The flow instance is finished"


class DeadlinePassed(OrbitServerError):
    """A manual retry whose new deadline is not in the future: its task could only fail at once."""

    status, code, title = 422, "deadline_passed", "The deadline has already passed"


class SuccessorExists(OrbitServerError):
    """409: the task already has its one direct successor (manual retry)."""

    status, code, title = 409, "successor_exists", "The task was already retried"

    def __init__(self, detail: str | None = None, *, successor_id: str) -> None:
        super().__init__(detail, extra={"successor_id": successor_id})


class NotRetryable(OrbitServerError):
    """409: only a ``FAILED`` or ``CANCELLED`` task that is not a flow step can be retried by hand."""

    status, code, title = 409, "not_retryable", "Only a FAILED or CANCELLED task can be retried"


class ConcurrentUpdate(OrbitServerError):
    """409: a row changed under a conditional update; nothing was written. Retry."""

    status, code, title = 409, "concurrent_update", "The task changed while the request ran; retry"

    def __init__(self, detail: str | None = None) -> None:
        super().__init__(detail, headers={"Retry-After": "1"})


class InvalidCursor(OrbitServerError):
    status, code, title = 400, "invalid_cursor", "Malformed page cursor"


class SubscriptionNotFound(OrbitServerError):
    status, code, title = 404, "subscription_not_found", "Subscription not found"


class SubscriptionExists(OrbitServerError):
    """409: a subscription with this name exists with other queues (same queues answer 200)."""

    status, code, title = 409, "subscription_exists", "A subscription with this name exists with other queues"


class DeliveryNotFound(OrbitServerError):
    status, code, title = 404, "delivery_not_found", "Delivery not found"


# --- flows (README "Flows: running them") ---


class FlowNotFound(OrbitServerError):
    status, code, title = 404, "flow_not_found", "Flow not found"


class FlowVersionNotFound(OrbitServerError):
    status, code, title = 404, "flow_version_not_found", "Flow version not found"


class FlowInstanceNotFound(OrbitServerError):
    status, code, title = 404, "flow_instance_not_found", "Flow instance not found"


class FlowInstancePurged(OrbitServerError):
    """410: the start key is remembered (a tombstone), but the instance it started was purged (README
    "Retention and the key window"): the start happened; it is never started a second time."""

    status, code, title = 410, "flow_instance_purged", "The flow instance this key started was purged"

    def __init__(self, detail: str, *, instance_id: str) -> None:
        super().__init__(detail, extra={"instance_id": instance_id})


class IdempotencyConflict(OrbitServerError):
    """409: a flow start or signal reused an Idempotency-Key with a different request."""

    status, code, title = 409, "idempotency_conflict", "Idempotency key already used for another request"
