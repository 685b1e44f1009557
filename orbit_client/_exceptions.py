"""Every error the Orbit client raises.

One root, three families kept apart (STYLE habit 2): the request never got an
answer (transport), the server answered with an error status (API), or the
caller used the client wrongly (usage)::

    OrbitError
    ├── OrbitTransportError                 no HTTP response was received
    │   ├── OrbitConnectError               request never sent: outcome known, retryable
    │   └── OrbitOutcomeUnknownError        request may have been sent: outcome unknown, retryable
    ├── OrbitAPIError                       the server answered with a non-2xx status
    │   ├── BadRequestError                 400
    │   ├── AuthenticationError             401
    │   ├── PermissionDeniedError           403
    │   ├── NotFoundError                   404
    │   ├── ConflictError                   409
    │   │   ├── RequestInProgressError      409 request_in_progress: retryable
    │   │   ├── ConcurrentUpdateError       409 concurrent_update: retryable
    │   │   ├── LeaseLostError              409 lease_lost: the attempt no longer holds its lease
    │   │   ├── InvalidTransitionError      409 invalid_transition: the task's (or flow's) state forbids it
    │   │   ├── SuccessorExistsError        409 successor_exists: the task was retried already
    │   │   └── IdempotencyConflictError    409 idempotency_conflict: a flow start/signal key reused
    │   │                                       for another request: never retried
    │   ├── PayloadTooLargeError            413
    │   ├── UnprocessableEntityError        422
    │   │   └── IdempotencyKeyReusedError   422 idempotency_key_reused: never retried
    │   ├── RateLimitedError                429: retryable
    │   └── ServerError                     5xx: retryable, outcome unknown
    │       └── ServiceUnavailableError     503: retryable, outcome known
    └── OrbitUsageError (also ValueError)   misuse caught before anything is sent

Every error carries two attributes a caller (e.g. the outbox relay; README "Using the client")
decides on:

- ``retryable``: sending the same request again may succeed. For a submission this
  is safe because the idempotency key does not change.
- ``outcome_known``: ``True`` means the server definitely did **not** accept or
  perform the request; ``False`` means it may have, so the caller must retry with
  the same idempotency key or look the submission up with ``find_submission()``.

Third-party exceptions never leave the client: a transport error keeps the
``httpx`` exception as ``__cause__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orbit_client._problem import Problem

__all__ = [
    "AuthenticationError",
    "BadRequestError",
    "ConcurrentUpdateError",
    "ConflictError",
    "IdempotencyConflictError",
    "IdempotencyKeyReusedError",
    "InvalidTransitionError",
    "LeaseLostError",
    "NotFoundError",
    "OrbitAPIError",
    "OrbitConnectError",
    "OrbitError",
    "OrbitOutcomeUnknownError",
    "OrbitTransportError",
    "OrbitUsageError",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "RateLimitedError",
    "RequestInProgressError",
    "ServerError",
    "ServiceUnavailableError",
    "SuccessorExistsError",
    "UnprocessableEntityError",
]


class OrbitError(Exception):
    """Root of every error raised by ``orbit_client``.

    Attributes:
        message: what happened and what to do about it (also ``str(error)``).
        retryable: ``True`` if sending the same request again may succeed.
        outcome_known: ``True`` if the server definitely did not accept or perform
            the request; ``False`` if it may have (README "Using the client").
    """

    #: Class defaults; an instance may override them (see the retry loop's rule in ``RetryPolicy``).
    retryable: bool = False
    outcome_known: bool = True

    def __init__(
        self,
        message: str,
        *,
        retryable: bool | None = None,
        outcome_known: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = type(self).retryable if retryable is None else retryable
        self.outcome_known = type(self).outcome_known if outcome_known is None else outcome_known

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only constructors cannot be rebuilt from ``args``: restore the attributes instead.
        return (_rebuild, (type(self), self.message, dict(self.__dict__)))


def _rebuild(cls: type[OrbitError], message: str, state: dict[str, Any]) -> OrbitError:
    """Unpickle an :class:`OrbitError` (see ``OrbitError.__reduce__``)."""
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


# --- transport ---------------------------------------------------------------------------------------


class OrbitTransportError(OrbitError):
    """No HTTP response was received. ``__cause__`` is the underlying ``httpx`` exception.

    Attributes:
        method: the HTTP method of the failed request, e.g. ``"POST"``.
        url: the full URL of the failed request.
    """

    def __init__(
        self,
        message: str,
        *,
        method: str,
        url: str,
        retryable: bool | None = None,
        outcome_known: bool | None = None,
    ) -> None:
        super().__init__(message, retryable=retryable, outcome_known=outcome_known)
        self.method = method
        self.url = url


class OrbitConnectError(OrbitTransportError):
    """The connection could not be made (refused, DNS failure, connect or pool timeout).

    The request was never sent, so the server did nothing: ``outcome_known=True``,
    ``retryable=True``.
    """

    retryable = True
    outcome_known = True


class OrbitOutcomeUnknownError(OrbitTransportError):
    """The request may have reached the server, but no answer came back.

    Raised on read or write timeouts, connection resets and protocol errors after
    the request may have been sent. The server may have performed it:
    ``outcome_known=False``, ``retryable=True``. Retry a submission with the same
    idempotency key, or look it up with ``find_submission()`` (README "Using the client").
    """

    retryable = True
    outcome_known = False


# --- API status --------------------------------------------------------------------------------------


class OrbitAPIError(OrbitError):
    """The server answered with a non-2xx status (modelled on stripe-python's errors).

    Attributes:
        status_code: the HTTP status, e.g. ``422``.
        code: the machine-readable ``code`` member of the RFC 9457 problem body, e.g.
            ``"idempotency_key_reused"``; ``"http_<status>"`` when the body is not a problem.
        title: the problem's short summary (or the HTTP reason phrase); ``None`` if unknown.
        detail: the problem's human-readable explanation; ``None`` if absent.
        request_id: the ``X-Request-Id`` response header (or the body's ``request_id``);
            quote it when reporting a problem. ``None`` if the server sent none.
        retry_after: seconds the server asked us to wait (``Retry-After`` header, given as
            delta-seconds or an HTTP-date); ``None`` if absent or unparsable.
        problem: the parsed problem body, or ``None`` when the body was not one.
    """

    #: What the caller should do; the client appends it to the message.
    hint = "the server refused the request; fix it before sending it again"

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        code: str,
        title: str | None = None,
        detail: str | None = None,
        request_id: str | None = None,
        retry_after: float | None = None,
        problem: Problem | None = None,
        retryable: bool | None = None,
        outcome_known: bool | None = None,
    ) -> None:
        super().__init__(message, retryable=retryable, outcome_known=outcome_known)
        self.status_code = status_code
        self.code = code
        self.title = title
        self.detail = detail
        self.request_id = request_id
        self.retry_after = retry_after
        self.problem = problem


class BadRequestError(OrbitAPIError):
    """400: the request is malformed (e.g. a missing or malformed ``Idempotency-Key``). Not retryable."""

    hint = "the request is malformed; fix it, retrying it unchanged will not help"


class AuthenticationError(OrbitAPIError):
    """401: the API key is missing or unknown (README "HTTP API"). Not retryable."""

    hint = "check the api_key given to the client"


class PermissionDeniedError(OrbitAPIError):
    """403: the API key's role does not allow this operation (README "HTTP API"). Not retryable."""

    hint = "use an API key whose role allows this operation (read, submit, work or admin)"


class NotFoundError(OrbitAPIError):
    """404: the namespace, queue, task or submission does not exist for this API key.

    A key bound to another namespace also gets 404, never 403 (README "HTTP API"). Not retryable.
    """

    hint = "check the namespace, queue or id, and that the API key belongs to that namespace"


class ConflictError(OrbitAPIError):
    """409: the request conflicts with the resource's current state. Not retryable."""

    hint = "the resource's state does not allow this request; reload it before deciding what to do"


class RequestInProgressError(ConflictError):
    """409 ``request_in_progress``: an earlier request with the same idempotency key is still running.

    Nothing was done for this request: ``retryable=True``, ``outcome_known=True``
    (IETF Idempotency-Key draft; README "HTTP API").
    """

    retryable = True
    outcome_known = True
    hint = "another request with this idempotency key is still running; retry later with the same key"


class ConcurrentUpdateError(ConflictError):
    """409 ``concurrent_update``: the task changed under the request, and nothing was written.

    ``retryable=True``, ``outcome_known=True``.
    """

    retryable = True
    outcome_known = True
    hint = "the task changed while the request ran and nothing was done; retry"


class LeaseLostError(ConflictError):
    """409 ``lease_lost``: the attempt's lease token is wrong, or the attempt no longer holds the lease.

    Its lease lapsed, it was cancelled, or it already finished (§3 of the reliability
    model). The task was not changed; stop working on the attempt. When the body of a
    ``complete``/``fail`` carried the attempt's own token, the server kept it on the attempt
    as evidence: ``evidence_recorded`` is then ``True``. Not retryable.
    """

    hint = "stop working on this attempt: another attempt may own the task now"

    @property
    def evidence_recorded(self) -> bool:
        """``True`` when the server kept the late report on the attempt as evidence."""
        extra = (self.problem.model_extra or {}) if self.problem is not None else {}
        return bool(extra.get("evidence_recorded", False))


class InvalidTransitionError(ConflictError):
    """409 ``invalid_transition``: the task's state does not allow this (§2 of the reliability model).

    E.g. reviewing a task that is not ``NEEDS_REVIEW``, cancelling a ``SUCCEEDED`` task, or
    completing an attempt that was never started; for a flow instance, a signal, pause, resume
    or cancel once it finished (README "Flows: client and CLI"). Not retryable.
    """

    hint = (
        "the task's or flow instance's state does not allow this; fetch it (get_task() or "
        "get_flow_instance()) to see where it stands"
    )


class SuccessorExistsError(ConflictError):
    """409 ``successor_exists``: the task was already retried; ``successor_id`` names the new task.

    Not retryable.
    """

    hint = "the task has its one successor already; follow successor_id"

    @property
    def successor_id(self) -> str | None:
        """The id of the task's existing successor, or ``None`` if the server did not say."""
        extra = (self.problem.model_extra or {}) if self.problem is not None else {}
        value = extra.get("successor_id")
        return value if isinstance(value, str) else None


class IdempotencyConflictError(ConflictError):
    """409 ``idempotency_conflict``: the key already names a *different* flow start or signal.

    The flow twin of :class:`IdempotencyKeyReusedError` (tasks answer 422 for the same mistake):
    a flow start (``start_flow``) with another input or version, or a signal (``signal_flow``) with
    another name or payload under a key the instance already recorded. Nothing was done;
    ``outcome_known=True``, never retried (README "Flows: client and CLI").
    """

    hint = (
        "this idempotency key already names a different flow start or signal; do not reuse keys, "
        "and look the original up (find_flow_instance() for a start)"
    )


class PayloadTooLargeError(OrbitAPIError):
    """413: the request body or params exceed the server's size limit (README "HTTP API"). Not retryable."""

    hint = "make the params smaller, e.g. pass a reference to the data instead of the data"


class UnprocessableEntityError(OrbitAPIError):
    """422: the request is well-formed but invalid. Not retryable."""

    hint = "the request failed validation; fix it, retrying it unchanged will not help"


class IdempotencyKeyReusedError(UnprocessableEntityError):
    """422 ``idempotency_key_reused``: the key was already used for a *different* submission.

    Never retried: the same key with a different body is a caller bug (IETF
    Idempotency-Key draft; README "HTTP API"). The outbox relay parks such a row in
    ``NEEDS_RECONCILE`` (README "Outbox").
    """

    hint = (
        "this idempotency key already names a different submission; do not reuse keys, "
        "and look the original up with find_submission()"
    )


class RateLimitedError(OrbitAPIError):
    """429: too many requests. Nothing was done: ``retryable=True``, ``outcome_known=True``.

    ``retry_after`` says how long the server asked us to wait, in seconds.
    """

    retryable = True
    outcome_known = True
    hint = "slow down and retry after retry_after seconds"


class ServerError(OrbitAPIError):
    """5xx: the server failed. It may have done part or all of the work first.

    ``retryable=True``, ``outcome_known=False``: retry a submission with the same
    idempotency key, or look it up with ``find_submission()`` (README "Using the client").
    """

    retryable = True
    outcome_known = False
    hint = (
        "outcome unknown: the server may have performed the request; retry with the same "
        "idempotency key or look it up with find_submission()"
    )


class ServiceUnavailableError(ServerError):
    """503: the server refused the request before doing anything (overloaded, starting, draining).

    ``retryable=True``, ``outcome_known=True``; honour ``retry_after`` (README "Using the client").
    """

    outcome_known = True
    hint = "the server is unavailable and did nothing; retry later"


# --- usage -------------------------------------------------------------------------------------------


class OrbitUsageError(OrbitError, ValueError):
    """The client was used wrongly, e.g. a malformed idempotency key or an invalid argument.

    Raised before anything is sent, so ``outcome_known=True`` and ``retryable=False``.
    Also a :class:`ValueError`.
    """


_BY_STATUS: dict[int, type[OrbitAPIError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    413: PayloadTooLargeError,
    422: UnprocessableEntityError,
    429: RateLimitedError,
    503: ServiceUnavailableError,
}

_BY_STATUS_AND_CODE: dict[tuple[int, str], type[OrbitAPIError]] = {
    (409, "request_in_progress"): RequestInProgressError,
    (409, "concurrent_update"): ConcurrentUpdateError,
    (409, "lease_lost"): LeaseLostError,
    (409, "invalid_transition"): InvalidTransitionError,
    (409, "successor_exists"): SuccessorExistsError,
    (409, "idempotency_conflict"): IdempotencyConflictError,
    (422, "idempotency_key_reused"): IdempotencyKeyReusedError,
}


def _api_error_class(status_code: int, code: str) -> type[OrbitAPIError]:
    """Pick the :class:`OrbitAPIError` subclass for a status and problem ``code``."""
    if cls := _BY_STATUS_AND_CODE.get((status_code, code)):
        return cls
    if cls := _BY_STATUS.get(status_code):
        return cls
    if status_code >= 500:
        return ServerError
    return OrbitAPIError


def _api_error(
    what: str,
    status_code: int,
    code: str,
    *,
    title: str | None = None,
    detail: str | None = None,
    request_id: str | None = None,
    retry_after: float | None = None,
    problem: Problem | None = None,
) -> OrbitAPIError:
    """The :class:`OrbitAPIError` subclass instance for an error answer (not raised).

    ``what`` opens the message (``"POST /v1/... failed"``, ``"batch item failed"``); the status, the
    code, the detail (else the title), the request id and the class's :attr:`~OrbitAPIError.hint` follow.
    """
    error_class = _api_error_class(status_code, code)
    message = f"{what} with {status_code} {code}"
    if detail or title:
        message += f": {detail or title}"
    if request_id:
        message += f" (request id {request_id})"
    return error_class(
        f"{message}; {error_class.hint}",
        status_code=status_code,
        code=code,
        title=title,
        detail=detail,
        request_id=request_id,
        retry_after=retry_after,
        problem=problem,
    )
