"""The outcome classes of DESIGN §5, from the client's error attributes, and the backoff rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from orbit_client import (
    AuthenticationError,
    BadRequestError,
    BatchItemResult,
    IdempotencyKeyReusedError,
    NotFoundError,
    OrbitAPIError,
    OrbitConnectError,
    OrbitOutcomeUnknownError,
    OrbitUsageError,
    PayloadTooLargeError,
    Problem,
    RateLimitedError,
    RequestInProgressError,
    ServerError,
    ServiceUnavailableError,
    UnprocessableEntityError,
)
from outbox_adapter import Backoff, OutboxUsageError
from outbox_adapter._faults import Faults
from outbox_adapter._outcomes import Verdict, classify_error, item_outcome
from outbox_adapter.cli import parse_duration


def _api(cls: type, status: int, code: str = "x", retry_after: float | None = None) -> Exception:
    return cls("m", status_code=status, code=code, retry_after=retry_after)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("error", "verdict"),
    [
        (OrbitConnectError("refused", method="POST", url="u"), Verdict.NOT_SENT),
        (OrbitOutcomeUnknownError("timeout", method="POST", url="u"), Verdict.UNKNOWN),
        (_api(ServerError, 500), Verdict.UNKNOWN),
        (_api(ServerError, 502), Verdict.UNKNOWN),
        (_api(ServiceUnavailableError, 503), Verdict.NOT_SENT),
        (_api(RateLimitedError, 429), Verdict.NOT_SENT),
        (_api(RequestInProgressError, 409, "request_in_progress"), Verdict.NOT_SENT),
        (_api(AuthenticationError, 401), Verdict.NOT_SENT),
        (_api(BadRequestError, 400), Verdict.DEAD),
        (_api(NotFoundError, 404, "queue_not_found"), Verdict.DEAD),
        (_api(PayloadTooLargeError, 413), Verdict.DEAD),
        (_api(UnprocessableEntityError, 422, "validation_error"), Verdict.DEAD),
        (_api(IdempotencyKeyReusedError, 422, "idempotency_key_reused"), Verdict.RECONCILE),
        (OrbitUsageError("bad key"), Verdict.DEAD),
        (RuntimeError("bug"), Verdict.UNKNOWN),
    ],
)
def test_classification(error: Exception, verdict: Verdict) -> None:
    assert classify_error(error).verdict is verdict


def test_an_outcome_made_unknown_by_an_earlier_attempt_stays_unknown() -> None:
    # The client sets outcome_known=False on a 503 that follows an unknown attempt: never NOT_SENT then.
    error = _api(ServiceUnavailableError, 503)
    error.outcome_known = False  # type: ignore[attr-defined]
    assert classify_error(error).verdict is Verdict.UNKNOWN


def test_401_blames_the_relay_and_retry_after_is_carried() -> None:
    assert classify_error(_api(AuthenticationError, 401)).misconfigured
    assert classify_error(_api(ServiceUnavailableError, 503, retry_after=7.0)).retry_after == 7.0


def test_backoff_is_exponential_full_jitter_capped_and_honours_retry_after() -> None:
    top = Backoff(base=1.0, cap=10.0, random=lambda: 1.0)
    assert [top.delay(n) for n in (1, 2, 3, 4, 5, 6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert Backoff(base=1.0, cap=10.0, random=lambda: 0.25).delay(3) == 1.0
    assert top.delay(10_000) == 10.0  # no overflow
    assert top.delay(1, retry_after=42.0) == 42.0
    assert Backoff(max_retry_after=60.0).delay(1, retry_after=86400.0) == 60.0
    assert Backoff.no_wait().delay(9) == 0.0 and Backoff.no_wait().delay(1, retry_after=3) == 3.0
    with pytest.raises(OutboxUsageError):
        Backoff(base=-1)


def test_durations() -> None:
    assert parse_duration("7d") == 7 * 86400 and parse_duration("90") == 90 and parse_duration("1.5h") == 5400
    with pytest.raises(OutboxUsageError, match="7d"):
        parse_duration("a week")


def test_fault_hooks_are_off_unless_named() -> None:
    assert Faults.from_env({}) is None
    assert Faults.from_env({"ORBIT_OUTBOX_FAULT": "pause-after-send"}) == Faults(pause_after_send=True)
    assert Faults.from_env({"ORBIT_OUTBOX_FAULT": "delay-before-send=0.5"}) == Faults(delay_before_send=0.5)
    with pytest.raises(ValueError, match="not a known fault hook"):
        Faults.from_env({"ORBIT_OUTBOX_FAULT": "pause"})


def test_a_gated_fault_hook_pauses_once_per_arming(tmp_path: Path) -> None:
    """``HOOK@FILE`` (bench.chaos): nothing happens until FILE exists; the next pass takes the arming."""
    gate = tmp_path / "arm"
    faults = Faults.from_env({"ORBIT_OUTBOX_FAULT": f"pause-after-commit@{gate}"})
    assert faults == Faults(pause_after_commit=True, gate=str(gate))
    assert not faults._armed()
    gate.touch()
    assert faults._armed() and not gate.exists()  # taken: the next pass runs normally again
    assert not faults._armed()


def test_outage_logs_once_per_wait_and_once_on_recovery(caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import threading

    from outbox_adapter._outcomes import Outage

    stopping = threading.Event()
    stopping.set()  # the waits return at once
    outage = Outage("database", "business database", Backoff.no_wait(), logging.getLogger("outbox_adapter.t"))
    with caplog.at_level(logging.WARNING, logger="outbox_adapter.t"):
        outage.up()  # no streak: nothing to say
        outage.down(RuntimeError("refused"), stopping)
        outage.down(RuntimeError("refused"), stopping)
        outage.up()
        outage.up()
    events = [getattr(r, "event", None) for r in caplog.records]
    assert events == ["database_unavailable", "database_unavailable", "database_recovered"]
    assert outage.failures == 0


_TASK = {
    "id": "t-1", "namespace": "shop", "queue": "default", "handler": "h", "status": "WAITING", "state_version": 1,
    "attempt_count": 0, "max_attempts": 3, "available_at": "2030-01-01T00:00:00Z",
    "created_at": "2030-01-01T00:00:00Z", "updated_at": "2030-01-01T00:00:00Z",
}  # fmt: skip


@pytest.mark.parametrize(
    ("status", "code", "verdict"),
    [
        (201, None, Verdict.DELIVERED),
        (200, None, Verdict.DELIVERED),
        (404, "queue_not_found", Verdict.DEAD),
        (409, "request_in_progress", Verdict.NOT_SENT),
        (422, "idempotency_key_reused", Verdict.RECONCILE),
        (422, "validation_error", Verdict.DEAD),
        (400, "idempotency_key_invalid", Verdict.DEAD),
        (429, "rate_limited", Verdict.NOT_SENT),
        (500, "internal_error", Verdict.UNKNOWN),  # not an item status the contract names: it may exist
        (207, None, Verdict.UNKNOWN),
    ],
)
def test_each_batch_item_is_classified_as_its_single_answer_would_be(
    status: int, code: str | None, verdict: Verdict
) -> None:
    body: dict[str, object] = {"status": status, "replayed": status == 200}
    if status in (200, 201):
        body["task"] = _TASK
    if code is not None:
        body["error"] = {"title": code, "status": status, "code": code, "request_id": "r-1"}
    outcome = item_outcome(BatchItemResult.model_validate(body), namespace="shop", queue="default", row_id=7)
    assert outcome.verdict is verdict and outcome.status_code == status
    if verdict is Verdict.DELIVERED:
        assert (outcome.task_id, outcome.replayed) == ("t-1", status == 200)
    else:
        assert outcome.task_id is None and ("r-1" in (outcome.error or "")) == (code is not None)
    if status == 404:
        assert "queue 'default'" in (outcome.error or "") and "orbit-outbox retry 7" in (outcome.error or "")


def _purged_problem(task_id: str | None) -> dict[str, object]:
    problem: dict[str, object] = {
        "title": "purged",
        "status": 410,
        "code": "task_purged",
        "request_id": "r-1",
    }
    if task_id is not None:
        problem["task_id"] = task_id
    return problem


def test_410_task_purged_with_a_task_id_is_delivered_as_a_batch_item_and_a_single_answer() -> None:
    """Regression (issue 20 #7): a resend whose key's task was purged got 410 task_purged; the item was
    judged a refusal (and after an earlier unknown send, NEEDS_RECONCILE for ever). The key's task ran:
    the row is delivered, with that task id."""
    item = BatchItemResult.model_validate({"status": 410, "replayed": False, "error": _purged_problem("t-9")})
    outcome = item_outcome(item, namespace="shop", queue="default", row_id=7)
    assert (outcome.verdict, outcome.task_id, outcome.replayed, outcome.status_code) == (
        Verdict.DELIVERED, "t-9", True, 410,
    )  # fmt: skip
    single = OrbitAPIError(
        "purged", status_code=410, code="task_purged", problem=Problem.model_validate(_purged_problem("t-9"))
    )
    assert (classify_error(single).verdict, classify_error(single).task_id) == (Verdict.DELIVERED, "t-9")
    # Without the task id it names nothing to deliver to: a refusal, as any other 4xx.
    bare = BatchItemResult.model_validate({"status": 410, "replayed": False, "error": _purged_problem(None)})
    assert item_outcome(bare, namespace="shop", queue="default", row_id=7).verdict is Verdict.DEAD
