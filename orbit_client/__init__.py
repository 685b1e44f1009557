"""Orbit client: submit tasks to an Orbit server over HTTP, at most once per idempotency key.

Everything public is re-exported here; the ``_modules`` behind it are private.
Importing this package never imports SQLAlchemy or a database driver (DESIGN §1).
"""

from orbit_client._client import AsyncOrbitClient, OrbitClient
from orbit_client._exceptions import (
    AuthenticationError,
    BadRequestError,
    ConflictError,
    IdempotencyKeyReusedError,
    NotFoundError,
    OrbitAPIError,
    OrbitConnectError,
    OrbitError,
    OrbitOutcomeUnknownError,
    OrbitTransportError,
    OrbitUsageError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RateLimitedError,
    RequestInProgressError,
    ServerError,
    ServiceUnavailableError,
    UnprocessableEntityError,
)
from orbit_client._models import (
    IDEMPOTENCY_KEY_MAX_LENGTH,
    NAME_PATTERN,
    Problem,
    Queue,
    SubmitOptions,
    SubmitResult,
    Task,
    TaskStatus,
    TaskSubmission,
    UTCDateTime,
    is_valid_idempotency_key,
)
from orbit_client._retry import RetryPolicy
from orbit_client._version import __version__

__all__ = [
    "IDEMPOTENCY_KEY_MAX_LENGTH",
    "NAME_PATTERN",
    "AsyncOrbitClient",
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "IdempotencyKeyReusedError",
    "NotFoundError",
    "OrbitAPIError",
    "OrbitClient",
    "OrbitConnectError",
    "OrbitError",
    "OrbitOutcomeUnknownError",
    "OrbitTransportError",
    "OrbitUsageError",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "Problem",
    "Queue",
    "RateLimitedError",
    "RequestInProgressError",
    "RetryPolicy",
    "ServerError",
    "ServiceUnavailableError",
    "SubmitOptions",
    "SubmitResult",
    "Task",
    "TaskStatus",
    "TaskSubmission",
    "UTCDateTime",
    "UnprocessableEntityError",
    "__version__",
    "is_valid_idempotency_key",
]

# Errors, clients and the policy show as ``orbit_client.X`` in tracebacks and reprs, as in httpx.
# (Not the pydantic models: pydantic resolves their annotations through their real module.)
for _public in (
    AsyncOrbitClient,
    OrbitClient,
    RetryPolicy,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    IdempotencyKeyReusedError,
    NotFoundError,
    OrbitAPIError,
    OrbitConnectError,
    OrbitError,
    OrbitOutcomeUnknownError,
    OrbitTransportError,
    OrbitUsageError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RateLimitedError,
    RequestInProgressError,
    ServerError,
    ServiceUnavailableError,
    UnprocessableEntityError,
):
    _public.__module__ = "orbit_client"
del _public
