"""The execution calls of OrbitClient / AsyncOrbitClient and the worker's non-I/O parts, against respx mocks."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import respx

from orbit_client import (
    TRACEBACK_MAX_LENGTH,
    AsyncOrbitClient,
    AttemptError,
    InvalidTransitionError,
    LeaseGrant,
    LeaseLostError,
    OrbitClient,
    OrbitUsageError,
    RetryableError,
    RetryPolicy,
    ServiceUnavailableError,
    SuccessorExistsError,
    TaskCancelled,
)
from orbit_client._worker import _error_for, _unknown_handler

BASE = "https://orbit.test"
ATTEMPT = "/v1/namespaces/acme/attempts/a-1"


def task_json() -> dict[str, Any]:
    return {
        "id": "t-1",
        "namespace": "acme",
        "queue": "orders",
        "handler": "orders.fulfil",
        "params": {"order_id": 42},
        "status": "LEASED",
        "state_version": 2,
        "attempt_count": 1,
        "max_attempts": 3,
        "available_at": "2026-01-01T00:00:00.000000Z",
        "created_at": "2026-01-01T00:00:00.000000Z",
        "updated_at": "2026-01-01T00:00:00.000000Z",
    }


def state_json(**changes: Any) -> dict[str, Any]:
    return {
        "attempt_id": "a-1",
        "task_id": "t-1",
        "generation": 1,
        "status": "RUNNING",
        "task_status": "RUNNING",
        "lease_expires_at": "2026-01-01T00:00:30.000000Z",
        "cancel_requested": False,
        **changes,
    }


def problem(status: int, code: str, **extra: Any) -> httpx.Response:
    body = {"title": code, "status": status, "code": code, **extra}
    return httpx.Response(status, json=body, headers={"content-type": "application/problem+json"})


def client(**kwargs: Any) -> OrbitClient:
    return OrbitClient(BASE, api_key="k", retry=RetryPolicy.no_wait(), **kwargs)


@respx.mock
def test_lease_sends_the_request_and_waits_longer_than_the_long_poll() -> None:
    grant = {
        "task": task_json(),
        "attempt": {
            "id": "a-1",
            "generation": 1,
            "lease_token": "tok",
            "lease_expires_at": "2026-01-01T00:00:30Z",
        },
    }
    route = respx.post(f"{BASE}/v1/namespaces/acme/queues/orders/leases").respond(json=[grant])
    with client(timeout=3) as orbit:
        grants = orbit.lease_tasks(
            "acme", "orders", worker_id="w-1", max_tasks=5, lease_seconds=10, wait_seconds=7
        )
    assert grants == [LeaseGrant.model_validate(grant)]
    request = route.calls.last.request
    assert json.loads(request.content) == {
        "worker_id": "w-1",
        "max_tasks": 5,
        "lease_seconds": 10,
        "wait_seconds": 7,
    }
    assert request.extensions["timeout"]["read"] == 10  # 3 s of its own plus the 7 s long poll


@respx.mock
def test_lease_is_not_retried_but_attempt_calls_are() -> None:
    lease = respx.post(f"{BASE}/v1/namespaces/acme/queues/orders/leases").mock(
        side_effect=[problem(503, "unavailable"), httpx.Response(200, json=[])]
    )
    start = respx.post(f"{BASE}{ATTEMPT}/start").mock(
        side_effect=[problem(503, "unavailable"), httpx.Response(200, json=state_json())]
    )
    with client() as orbit:
        with pytest.raises(ServiceUnavailableError):
            orbit.lease_tasks("acme", "orders", worker_id="w")
        assert orbit.start_attempt("acme", "a-1", "tok").status == "RUNNING"
    assert lease.call_count == 1 and start.call_count == 2


@respx.mock
def test_attempt_bodies() -> None:
    routes = {
        action: respx.post(f"{BASE}{ATTEMPT}/{action}").respond(json=state_json())
        for action in ("heartbeat", "complete", "fail")
    }
    with client() as orbit:
        orbit.heartbeat("acme", "a-1", "tok")
        orbit.heartbeat("acme", "a-1", "tok", lease_seconds=60)
        orbit.complete_attempt("acme", "a-1", "tok", {"receipt": "R-1"})
        orbit.fail_attempt("acme", "a-1", "tok", {"type": "E", "message": "m", "retryable": True})
    beats = [json.loads(c.request.content) for c in routes["heartbeat"].calls]
    assert beats == [
        {"lease_token": "tok", "lease_seconds": None},
        {"lease_token": "tok", "lease_seconds": 60},
    ]
    assert json.loads(routes["complete"].calls.last.request.content) == {
        "lease_token": "tok",
        "result": {"receipt": "R-1"},
    }
    assert json.loads(routes["fail"].calls.last.request.content)["error"] == {
        "type": "E",
        "message": "m",
        "retryable": True,
    }


@respx.mock
def test_conflicts_map_to_their_classes() -> None:
    respx.post(f"{BASE}{ATTEMPT}/complete").mock(
        return_value=problem(409, "lease_lost", evidence_recorded=True)
    )
    respx.post(f"{BASE}{ATTEMPT}/start").mock(
        return_value=problem(409, "lease_lost", evidence_recorded=False)
    )
    respx.post(f"{BASE}/v1/namespaces/acme/tasks/t-1/review").mock(
        return_value=problem(409, "invalid_transition")
    )
    respx.post(f"{BASE}/v1/namespaces/acme/tasks/t-1/retry").mock(
        return_value=problem(409, "successor_exists", successor_id="t-2")
    )
    with client() as orbit:
        with pytest.raises(LeaseLostError) as lost:
            orbit.complete_attempt("acme", "a-1", "tok", 1)
        assert lost.value.evidence_recorded is True and not lost.value.retryable
        with pytest.raises(LeaseLostError) as refused:
            orbit.start_attempt("acme", "a-1", "tok")
        assert refused.value.evidence_recorded is False
        with pytest.raises(InvalidTransitionError):
            orbit.review_task("acme", "t-1", outcome="succeeded", reason="r", evidence_ref="e")
        with pytest.raises(SuccessorExistsError) as exists:
            orbit.retry_task("acme", "t-1", reason="r")
        assert exists.value.successor_id == "t-2"


def test_invalid_arguments_send_nothing() -> None:
    with client() as orbit:
        with pytest.raises(OrbitUsageError, match="max_tasks"):
            orbit.lease_tasks("acme", "orders", worker_id="w", max_tasks=0)
        with pytest.raises(OrbitUsageError, match="result"):
            orbit.complete_attempt("acme", "a-1", "tok", {1, 2})  # type: ignore[arg-type]
        with pytest.raises(OrbitUsageError, match="outcome"):
            orbit.review_task("acme", "t-1", outcome="maybe", reason="r", evidence_ref="e")
        with pytest.raises(OrbitUsageError, match="limit"):
            orbit.list_tasks("acme", limit=0)


@respx.mock
async def test_async_twin() -> None:
    respx.post(f"{BASE}{ATTEMPT}/start").respond(json=state_json())
    route = respx.get(f"{BASE}/v1/namespaces/acme/tasks").respond(
        json={"items": [task_json()], "next_cursor": "c"}
    )
    async with AsyncOrbitClient(BASE, api_key="k", retry=RetryPolicy.no_wait()) as orbit:
        assert (await orbit.start_attempt("acme", "a-1", "tok")).generation == 1
        page = await orbit.list_tasks("acme", status="WAITING", queue="orders", limit=5, cursor="x")
    assert page.next_cursor == "c" and page.items[0].id == "t-1"
    assert dict(route.calls.last.request.url.params) == {
        "limit": "5",
        "status": "WAITING",
        "queue": "orders",
        "cursor": "x",
    }


class _Declared(Exception):
    retryable = True


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (RetryableError("slow"), AttemptError(type="RetryableError", message="slow", retryable=True)),
        (_Declared("x"), AttemptError(type="_Declared", message="x", retryable=True)),
        (ValueError("bad"), AttemptError(type="ValueError", message="bad", retryable=False)),
        (TaskCancelled("stop"), AttemptError(type="cancelled", message="stop", retryable=False)),
    ],
)
def test_handler_exceptions_are_classified(exc: BaseException, expected: AttemptError) -> None:
    error = _error_for(exc)
    assert error.model_copy(update={"traceback": None}) == expected
    if expected.type == "cancelled":  # a stop on request is no failure: no traceback
        assert error.traceback is None
    else:
        assert error.traceback is not None and error.traceback.endswith(f"{type(exc).__name__}: {exc}\n")


def test_an_error_without_a_traceback_serialises_as_before() -> None:
    error = AttemptError(type="ValueError", message="bad")
    assert error.model_dump(mode="json") == {"type": "ValueError", "message": "bad", "retryable": False}
    assert AttemptError(type="E", traceback="tb").model_dump()["traceback"] == "tb"


def test_a_long_traceback_keeps_its_end_and_marks_the_cut() -> None:
    lines = [f"  line {i}\n" for i in range(5000)]
    text = "".join(lines) + "KeyError: 'order_id'\n"
    bounded = AttemptError.bounded_traceback(text)
    assert len(bounded) <= TRACEBACK_MAX_LENGTH and bounded.endswith("KeyError: 'order_id'\n")
    marker, first, *_ = bounded.split("\n")
    cut = int(marker.removeprefix("... [").removesuffix(" characters cut]"))
    assert first in {line.rstrip("\n") for line in lines}  # whole lines only
    assert cut + len(bounded) - len(marker) - 1 == len(text)  # the marker counts what is gone
    assert AttemptError.bounded_traceback("short") == "short"
    frames = "".join(
        f'  File "/some/path{i % 7 * "x"}.py", line {i}\n    call()\n         ^^^^\n' for i in range(900)
    )
    kept = AttemptError.bounded_traceback(frames + "KeyError: 'k'\n")
    assert kept.split("\n")[1].startswith("  File ")  # a cut starts at a whole frame, not inside one
    with pytest.raises(ValueError, match="at most 16384 characters"):
        AttemptError(type="E", traceback="x" * (TRACEBACK_MAX_LENGTH + 1))


def test_an_unknown_handler_names_the_handlers_the_worker_has() -> None:
    error = _unknown_handler("w-1", "chrage", {"refund": print, "charge": print})
    assert error.message == "worker w-1 has no handler 'chrage'; its handlers: 'charge', 'refund'"
    assert error.type == "unknown_handler" and error.retryable is False and error.traceback is None


def test_long_messages_are_cut() -> None:
    assert len(_error_for(ValueError("x" * 20_000)).message) == 10_000
