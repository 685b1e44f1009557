"""The exception tree, status mapping and Retry-After parsing."""

from __future__ import annotations

import pickle
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from orbit_client import (
    BadRequestError,
    ConcurrentUpdateError,
    ConflictError,
    IdempotencyKeyReusedError,
    InvalidTransitionError,
    LeaseLostError,
    NotFoundError,
    OrbitAPIError,
    OrbitConnectError,
    OrbitError,
    OrbitOutcomeUnknownError,
    OrbitTransportError,
    OrbitUsageError,
    RateLimitedError,
    RequestInProgressError,
    ServerError,
    ServiceUnavailableError,
    SuccessorExistsError,
    UnprocessableEntityError,
)
from orbit_client._calls import _parse_retry_after
from orbit_client._exceptions import _api_error_class

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        (400, "idempotency_key_missing", BadRequestError),
        (404, "submission_not_found", NotFoundError),
        (409, "request_in_progress", RequestInProgressError),
        (409, "lease_lost", LeaseLostError),
        (409, "invalid_transition", InvalidTransitionError),
        (409, "successor_exists", SuccessorExistsError),
        (409, "concurrent_update", ConcurrentUpdateError),
        (409, "some_other_conflict", ConflictError),
        (422, "idempotency_key_reused", IdempotencyKeyReusedError),
        (422, "validation_error", UnprocessableEntityError),
        (429, "rate_limited", RateLimitedError),
        (500, "internal_error", ServerError),
        (502, "http_502", ServerError),
        (503, "unavailable", ServiceUnavailableError),
        (504, "http_504", ServerError),
        (405, "http_405", OrbitAPIError),
    ],
)
def test_status_mapping(status: int, code: str, expected: type[OrbitAPIError]) -> None:
    assert _api_error_class(status, code) is expected


@pytest.mark.parametrize(
    ("error_class", "retryable", "outcome_known"),
    [
        (OrbitConnectError, True, True),
        (OrbitOutcomeUnknownError, True, False),
        (OrbitAPIError, False, True),
        (RequestInProgressError, True, True),
        (IdempotencyKeyReusedError, False, True),
        (RateLimitedError, True, True),
        (ServerError, True, False),
        (ServiceUnavailableError, True, True),
        (OrbitUsageError, False, True),
    ],
)
def test_defaults(error_class: type[OrbitError], retryable: bool, outcome_known: bool) -> None:
    assert (error_class.retryable, error_class.outcome_known) == (retryable, outcome_known)


def test_families() -> None:
    assert issubclass(OrbitConnectError, OrbitTransportError)
    assert issubclass(OrbitOutcomeUnknownError, OrbitTransportError)
    assert issubclass(ServiceUnavailableError, ServerError)
    assert issubclass(OrbitUsageError, ValueError)
    assert not issubclass(OrbitAPIError, OrbitTransportError)


def test_instance_override_leaves_the_class_alone() -> None:
    error = ServerError("boom", status_code=500, code="internal_error", outcome_known=True)
    assert error.outcome_known is True
    assert ServerError.outcome_known is False
    assert str(error) == "boom"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("120", 120.0),
        (" 7 ", 7.0),
        ("1.5", 1.5),
        ("0", 0.0),
        (format_datetime(NOW + timedelta(seconds=30), usegmt=True), 30.0),
        (format_datetime(NOW - timedelta(seconds=30), usegmt=True), 0.0),
        ("Thu, 01 Jan 2026 12:00:10 -0000", 10.0),
        ("-5", None),
        ("soon", None),
        ("", None),
        ("inf", None),
    ],
)
def test_parse_retry_after(value: str | None, expected: float | None) -> None:
    assert _parse_retry_after(value, now=NOW) == expected


def test_errors_pickle_with_their_attributes() -> None:
    error = RateLimitedError("slow down", status_code=429, code="rate_limited", retry_after=3.0)
    error.outcome_known = False
    error.add_note("a note")

    copy = pickle.loads(pickle.dumps(error))

    assert type(copy) is RateLimitedError
    assert (str(copy), copy.status_code, copy.retry_after, copy.outcome_known) == (
        "slow down",
        429,
        3.0,
        False,
    )
    assert copy.__notes__ == ["a note"]
    unknown = pickle.loads(pickle.dumps(OrbitOutcomeUnknownError("lost", method="POST", url="https://o/x")))
    assert (unknown.method, unknown.outcome_known) == ("POST", False)
