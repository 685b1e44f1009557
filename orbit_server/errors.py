"""Domain errors. Endpoints raise them; one handler turns each into an RFC 9457
problem body with a stable ``code`` (see ``app.py``)."""

from __future__ import annotations

__all__ = [
    "Forbidden",
    "IdempotencyKeyInvalid",
    "IdempotencyKeyMissing",
    "IdempotencyKeyReused",
    "NameTaken",
    "NamespaceNotFound",
    "OrbitServerError",
    "PayloadTooLarge",
    "QueueNotFound",
    "RequestInProgress",
    "SubmissionNotFound",
    "TaskNotFound",
    "Unauthenticated",
]


class OrbitServerError(Exception):
    """Base of every error the API reports on purpose."""

    status: int = 500
    code: str = "internal_error"
    title: str = "Internal server error"

    def __init__(self, detail: str | None = None, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail or self.title)
        self.detail = detail
        self.headers = headers or {}


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


class SubmissionNotFound(OrbitServerError):
    status, code, title = 404, "submission_not_found", "No submission with this idempotency key"


class IdempotencyKeyMissing(OrbitServerError):
    status, code, title = 400, "idempotency_key_missing", "The Idempotency-Key header is required"


class IdempotencyKeyInvalid(OrbitServerError):
    status, code, title = 400, "idempotency_key_invalid", "Malformed Idempotency-Key header"


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
