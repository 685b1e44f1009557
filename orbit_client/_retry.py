"""When the client retries a failed attempt, and how long it waits first.

Pure decision logic with no I/O: the clients ask :class:`RetryPolicy` for a delay
and do the sleeping themselves. Backoff is exponential with full jitter (as in
hynek/stamina); a server's ``Retry-After`` replaces the jitter (DESIGN §5).
"""

from __future__ import annotations

import random as _random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orbit_client._exceptions import OrbitAPIError, OrbitError, OrbitUsageError

__all__ = ["RetryPolicy"]


def _no_sleep(seconds: float) -> None:
    """Stand-in for sleeping used by :meth:`RetryPolicy.no_wait`."""


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How a client call is retried after an attempt fails with a retryable error.

    Only errors with ``retryable=True`` are retried (connection failures, outcome-unknown
    transport failures, 409 ``request_in_progress``, 429 and 5xx); everything else is
    raised at once. Retrying a submission is safe because its idempotency key does not
    change between attempts (IETF Idempotency-Key draft; README "Using the client").

    Args:
        max_attempts: total number of tries, the first one included; ``1`` disables
            retries. Default ``4``.
        backoff_base: upper bound, in seconds, of the random delay before the first
            retry; it doubles for each later retry. Default ``0.2``.
        backoff_cap: ceiling, in seconds, of that upper bound. Default ``5.0``. The delay
            before retry *n* (0-based) is ``uniform(0, min(backoff_cap, backoff_base * 2**n))``
            ("full jitter").
        max_retry_after: longest ``Retry-After``, in seconds, the client waits for. A server
            asking for longer ends the call with its error at once, whose ``retry_after``
            tells the caller when to come back. Default ``30.0``.
        sleep: called with the delay in seconds *instead of* ``time.sleep`` /
            ``asyncio.sleep``; ``None`` (the default) sleeps for real. Meant for tests:
            ``RetryPolicy(sleep=delays.append)`` records the delays without waiting.
            The async client calls it without awaiting, so it must not block.
        random: returns a float in ``[0, 1)`` that scales the jitter; default
            :func:`random.random`.

    Raises:
        OrbitUsageError: if ``max_attempts < 1`` or a duration is negative.

    Rule: if any earlier attempt of a call ended with its outcome unknown, the error
    finally raised has ``outcome_known=False`` even if its own attempt was refused
    cleanly, because the server may have performed that earlier attempt.
    """

    max_attempts: int = 4
    backoff_base: float = 0.2
    backoff_cap: float = 5.0
    max_retry_after: float = 30.0
    sleep: Callable[[float], object] | None = field(default=None, repr=False, compare=False)
    random: Callable[[], float] = field(default=_random.random, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise OrbitUsageError(
                f"max_attempts must be at least 1 (1 disables retries), not {self.max_attempts}"
            )
        for name in ("backoff_base", "backoff_cap", "max_retry_after"):
            if getattr(self, name) < 0:
                raise OrbitUsageError(f"{name} is a duration in seconds and cannot be negative")

    @classmethod
    def no_wait(cls, **changes: Any) -> RetryPolicy:
        """A policy that never really sleeps (for tests); ``changes`` override the other fields.

        Example: ``RetryPolicy.no_wait(max_attempts=2)``.
        """
        return cls(sleep=_no_sleep, **changes)

    def backoff(self, attempt: int) -> float:
        """Jittered delay, in seconds, after failed attempt number ``attempt`` (1 = the first try).

        Returns ``uniform(0, min(backoff_cap, backoff_base * 2**(attempt - 1)))``.
        """
        bound = min(self.backoff_cap, self.backoff_base * 2.0 ** (attempt - 1))
        return self.random() * bound

    def delay_for(self, error: OrbitError, attempt: int) -> float | None:
        """Decide what to do after attempt number ``attempt`` (1 = the first try) failed with ``error``.

        Returns:
            The delay in seconds before the next attempt, or ``None`` to stop and raise
            ``error``: it is not retryable, the attempts are spent, or its ``Retry-After``
            exceeds ``max_retry_after``. A ``Retry-After`` within bounds is waited for
            exactly, instead of the jittered backoff.
        """
        if not error.retryable or attempt >= self.max_attempts:
            return None
        if isinstance(error, OrbitAPIError) and error.retry_after is not None:
            return error.retry_after if error.retry_after <= self.max_retry_after else None
        return self.backoff(attempt)


class _CallRetries:
    """The attempts of one client call: asks the policy for delays and finishes the last error."""

    def __init__(self, policy: RetryPolicy, *, enabled: bool) -> None:
        self._policy = policy
        self._enabled = enabled
        self.attempt = 0
        self._unknown: tuple[int, OrbitError] | None = None

    def next_delay(self, error: OrbitError) -> float | None:
        """Record that an attempt failed with ``error``; return the delay before the next one.

        ``None`` means stop: ``error`` is then ready to raise (outcome rule applied,
        notes added).
        """
        self.attempt += 1
        delay = self._policy.delay_for(error, self.attempt) if self._enabled else None
        if delay is None:
            self._finish(error)
        elif not error.outcome_known and self._unknown is None:
            self._unknown = (self.attempt, error)
        return delay

    def _finish(self, error: OrbitError) -> None:
        policy = self._policy
        if self._enabled and error.retryable:
            if self.attempt >= policy.max_attempts:
                if self.attempt > 1:
                    error.add_note(f"gave up after {self.attempt} attempts (RetryPolicy.max_attempts)")
            elif isinstance(error, OrbitAPIError) and error.retry_after is not None:
                error.add_note(
                    f"not retried: Retry-After of {error.retry_after:g} s exceeds "
                    f"RetryPolicy.max_retry_after ({policy.max_retry_after:g} s)"
                )
        if self._unknown is not None and error.outcome_known:
            attempt, earlier = self._unknown
            error.outcome_known = False
            error.message += (
                f"; but attempt {attempt} of {self.attempt} of this call ended with its outcome unknown "
                f"({type(earlier).__name__}), so the server may have accepted the request: retry with "
                "the same idempotency key or look it up with find_submission()"
            )
            error.args = (error.message,)
            error.add_note(
                f"outcome_known is False because attempt {attempt} of {self.attempt} ended with its "
                f"outcome unknown: {earlier}"
            )
