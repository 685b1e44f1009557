"""RetryPolicy: pure decisions, no I/O."""

from __future__ import annotations

from dataclasses import FrozenInstanceError

import pytest

from orbit_client import (
    BadRequestError,
    OrbitConnectError,
    OrbitOutcomeUnknownError,
    OrbitUsageError,
    RateLimitedError,
    RetryPolicy,
    ServerError,
)
from orbit_client._retry import _CallRetries


def connect_error() -> OrbitConnectError:
    return OrbitConnectError("refused", method="POST", url="https://orbit.test/x")


def unknown_error() -> OrbitOutcomeUnknownError:
    return OrbitOutcomeUnknownError("read timeout", method="POST", url="https://orbit.test/x")


def rate_limited(retry_after: float | None) -> RateLimitedError:
    return RateLimitedError("slow down", status_code=429, code="rate_limited", retry_after=retry_after)


def test_defaults() -> None:
    policy = RetryPolicy()
    assert (policy.max_attempts, policy.backoff_base, policy.backoff_cap, policy.max_retry_after) == (
        4,
        0.2,
        5.0,
        30.0,
    )
    assert "sleep" not in repr(policy)
    with pytest.raises(FrozenInstanceError):
        policy.max_attempts = 2  # type: ignore[misc]


def test_keyword_only() -> None:
    with pytest.raises(TypeError):
        RetryPolicy(3)  # type: ignore[call-arg]


def test_full_jitter_doubles_up_to_the_cap() -> None:
    policy = RetryPolicy(max_attempts=10, random=lambda: 1.0)
    assert [policy.delay_for(connect_error(), n) for n in range(1, 10)] == pytest.approx(
        [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0, 5.0]
    )
    assert RetryPolicy(random=lambda: 0.0).delay_for(connect_error(), 1) == 0.0


def test_attempts_are_bounded() -> None:
    policy = RetryPolicy(max_attempts=3)
    assert policy.delay_for(unknown_error(), 2) is not None
    assert policy.delay_for(unknown_error(), 3) is None
    assert RetryPolicy(max_attempts=1).delay_for(unknown_error(), 1) is None


def test_only_retryable_errors_are_retried() -> None:
    policy = RetryPolicy()
    assert policy.delay_for(BadRequestError("bad", status_code=400, code="x"), 1) is None
    assert policy.delay_for(ServerError("boom", status_code=500, code="internal_error"), 1) is not None


def test_retry_after_is_waited_exactly_within_bounds() -> None:
    policy = RetryPolicy(max_retry_after=30.0)
    assert policy.delay_for(rate_limited(12.0), 1) == 12.0
    assert policy.delay_for(rate_limited(30.0), 1) == 30.0
    assert policy.delay_for(rate_limited(30.5), 1) is None
    assert policy.delay_for(rate_limited(0.0), 1) == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [{"max_attempts": 0}, {"backoff_base": -1.0}, {"backoff_cap": -0.1}, {"max_retry_after": -5.0}],
)
def test_invalid_policy(kwargs: dict[str, float]) -> None:
    with pytest.raises(OrbitUsageError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_no_wait() -> None:
    policy = RetryPolicy.no_wait(max_attempts=2)
    assert policy.max_attempts == 2
    assert policy.sleep is not None
    assert policy.sleep(3.0) is None


def test_outcome_unknown_is_sticky() -> None:
    """An unknown outcome on an earlier attempt makes the final error outcome-unknown."""
    retries = _CallRetries(RetryPolicy(max_attempts=3), enabled=True)
    assert retries.next_delay(connect_error()) is not None
    assert retries.next_delay(unknown_error()) is not None
    final = connect_error()

    assert retries.next_delay(final) is None

    assert final.outcome_known is False
    assert "attempt 2 of 3" in str(final)
    assert any("outcome_known is False" in note for note in final.__notes__)


def test_known_outcomes_stay_known() -> None:
    retries = _CallRetries(RetryPolicy(max_attempts=2), enabled=True)
    retries.next_delay(connect_error())
    final = connect_error()

    assert retries.next_delay(final) is None

    assert final.outcome_known is True
    assert final.__notes__ == ["gave up after 2 attempts (RetryPolicy.max_attempts)"]


def test_disabled_retries_raise_the_first_error_untouched() -> None:
    retries = _CallRetries(RetryPolicy(), enabled=False)
    error = unknown_error()

    assert retries.next_delay(error) is None
    assert not hasattr(error, "__notes__")
