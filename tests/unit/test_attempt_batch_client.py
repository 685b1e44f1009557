"""The batched attempt calls of OrbitClient / AsyncOrbitClient, against respx mocks."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import respx

from orbit_client import (
    MAX_ATTEMPT_BATCH_ITEMS,
    AsyncOrbitClient,
    AttemptError,
    AttemptItemResult,
    CompleteItem,
    ConcurrentUpdateError,
    InvalidTransitionError,
    LeaseLostError,
    NotFoundError,
    OrbitAPIError,
    OrbitClient,
    OrbitOutcomeUnknownError,
    OrbitUsageError,
    RetryPolicy,
    StartItem,
)
from orbit_client._reports import _sized_chunks
from tests.unit.test_execution_client import problem, state_json

BASE = "https://orbit.test"
BATCH = "/v1/namespaces/acme/attempts"


def client(**kwargs: Any) -> OrbitClient:
    return OrbitClient(BASE, api_key="k", retry=RetryPolicy.no_wait(), **kwargs)


def error_item(status: int, code: str, **extra: Any) -> dict[str, Any]:
    return {
        "status": status,
        "error": {"title": code, "status": status, "code": code, "request_id": "r-1", **extra},
    }


def answer(*items: dict[str, Any]) -> httpx.Response:
    return httpx.Response(200, json={"items": list(items)})


@respx.mock
def test_start_attempts_sends_the_items_and_answers_one_result_per_item() -> None:
    route = respx.post(f"{BASE}{BATCH}/start").mock(
        return_value=answer(
            {"status": 200, "attempt": state_json()},
            error_item(409, "lease_lost", evidence_recorded=False),
            error_item(404, "attempt_not_found"),
        )
    )
    with client() as c:
        results = c.start_attempts(
            "acme",
            [
                StartItem(attempt_id="a-1", lease_token="t1"),
                {"attempt_id": "a-2", "lease_token": "t2"},
                {"attempt_id": "a-3", "lease_token": "t3"},
            ],
        )
    assert json.loads(route.calls.last.request.content) == {
        "items": [
            {"attempt_id": "a-1", "lease_token": "t1"},
            {"attempt_id": "a-2", "lease_token": "t2"},
            {"attempt_id": "a-3", "lease_token": "t3"},
        ]
    }
    assert [r.status for r in results] == [200, 409, 404]
    assert results[0].raise_for_status().status == "RUNNING"
    # An error item raises exactly what the single call raises.
    with pytest.raises(LeaseLostError) as lost:
        results[1].raise_for_status()
    assert lost.value.code == "lease_lost" and lost.value.evidence_recorded is False
    assert lost.value.request_id == "r-1" and not lost.value.retryable
    with pytest.raises(NotFoundError):
        results[2].raise_for_status()


@pytest.mark.parametrize(
    ("status", "code", "error_class", "retryable"),
    [
        (409, "lease_lost", LeaseLostError, False),
        (409, "invalid_transition", InvalidTransitionError, False),
        (409, "concurrent_update", ConcurrentUpdateError, True),
        (404, "attempt_not_found", NotFoundError, False),
    ],
)
def test_an_error_item_raises_the_single_call_s_error(
    status: int, code: str, error_class: type[OrbitAPIError], retryable: bool
) -> None:
    result = AttemptItemResult.model_validate(error_item(status, code))
    with pytest.raises(error_class) as raised:
        result.raise_for_status()
    assert raised.value.status_code == status and raised.value.retryable is retryable


@respx.mock
def test_heartbeat_complete_and_fail_batches_send_their_fields() -> None:
    routes = {
        action: respx.post(f"{BASE}{BATCH}/{action}").mock(
            return_value=answer({"status": 200, "attempt": state_json()})
        )
        for action in ("heartbeat", "complete", "fail")
    }
    with client() as c:
        c.heartbeats("acme", [{"attempt_id": "a-1", "lease_token": "t", "lease_seconds": 60}])
        c.complete_attempts("acme", [CompleteItem(attempt_id="a-1", lease_token="t", result={"ok": 1})])
        c.fail_attempts(
            "acme",
            [{"attempt_id": "a-1", "lease_token": "t", "error": AttemptError(type="E", retryable=True)}],
        )
    bodies = {action: json.loads(route.calls.last.request.content) for action, route in routes.items()}
    assert bodies["heartbeat"] == {"items": [{"attempt_id": "a-1", "lease_token": "t", "lease_seconds": 60}]}
    assert bodies["complete"] == {"items": [{"attempt_id": "a-1", "lease_token": "t", "result": {"ok": 1}}]}
    assert bodies["fail"] == {
        "items": [
            {
                "attempt_id": "a-1",
                "lease_token": "t",
                "error": {"type": "E", "message": "", "retryable": True},
            }
        ]
    }


@respx.mock
def test_bad_batches_are_refused_before_sending() -> None:
    route = respx.post(f"{BASE}{BATCH}/start").mock(return_value=answer())
    with client() as c:
        with pytest.raises(OrbitUsageError, match="1 to 500"):
            c.start_attempts("acme", [])
        with pytest.raises(OrbitUsageError, match="1 to 500"):
            c.start_attempts(
                "acme", [{"attempt_id": "a", "lease_token": "t"}] * (MAX_ATTEMPT_BATCH_ITEMS + 1)
            )
        with pytest.raises(OrbitUsageError, match=r"items\.1\.lease_token") as bad:
            c.start_attempts("acme", [{"attempt_id": "a", "lease_token": "secret"}, {"attempt_id": "b"}])
        with pytest.raises(OrbitUsageError, match="sequence"):
            c.start_attempts("acme", {"attempt_id": "a", "lease_token": "t"})  # type: ignore[arg-type]
        with pytest.raises(OrbitUsageError):
            c.complete_attempts("acme", [{"attempt_id": "a", "lease_token": "t", "result": float("nan")}])
    assert "secret" not in str(bad.value)  # names the field, never a value
    assert not route.called


@respx.mock
def test_a_whole_request_failure_is_retried_like_a_single_call_then_raised() -> None:
    route = respx.post(f"{BASE}{BATCH}/complete").mock(
        side_effect=[
            httpx.ReadTimeout("slow"),
            problem(503, "unavailable"),
            answer({"status": 200, "attempt": state_json(status="SUCCEEDED", task_status="SUCCEEDED")}),
        ]
    )
    with client() as c:
        (result,) = c.complete_attempts("acme", [{"attempt_id": "a-1", "lease_token": "t", "result": 1}])
    assert route.call_count == 3 and result.status == 200
    route = respx.post(f"{BASE}{BATCH}/start").mock(side_effect=httpx.ReadTimeout("slow"))
    with client() as c, pytest.raises(OrbitOutcomeUnknownError):
        c.start_attempts("acme", [{"attempt_id": "a-1", "lease_token": "t"}])
    assert route.call_count == 4


@respx.mock
def test_an_old_server_s_404_and_a_short_answer() -> None:
    respx.post(f"{BASE}{BATCH}/start").mock(return_value=problem(404, "not_found"))
    respx.post(f"{BASE}{BATCH}/heartbeat").mock(return_value=answer())
    with client() as c:
        with pytest.raises(NotFoundError) as old:
            c.start_attempts("acme", [{"attempt_id": "a-1", "lease_token": "t"}])
        assert old.value.code == "not_found"
        with pytest.raises(OrbitAPIError) as short:
            c.heartbeats("acme", [{"attempt_id": "a-1", "lease_token": "t"}])
    assert short.value.code == "invalid_response" and short.value.outcome_known is False


@respx.mock
async def test_async_batches() -> None:
    route = respx.post(f"{BASE}{BATCH}/fail").mock(
        return_value=answer({"status": 200, "attempt": state_json()}, error_item(409, "lease_lost"))
    )
    for action in ("start", "heartbeat", "complete"):
        respx.post(f"{BASE}{BATCH}/{action}").mock(
            return_value=answer({"status": 200, "attempt": state_json()})
        )
    async with AsyncOrbitClient(BASE, api_key="k", retry=RetryPolicy.no_wait()) as c:
        error = {"type": "E", "message": "m", "retryable": False}
        results = await c.fail_attempts(
            "acme",
            [
                {"attempt_id": "a-1", "lease_token": "t", "error": error},
                {"attempt_id": "a-2", "lease_token": "t", "error": error},
            ],
        )
        one = [{"attempt_id": "a-1", "lease_token": "t"}]
        assert [r.status for r in await c.start_attempts("acme", one)] == [200]
        assert [r.status for r in await c.heartbeats("acme", one)] == [200]
        assert [r.status for r in await c.complete_attempts("acme", [{**one[0], "result": None}])] == [200]
    assert [r.status for r in results] == [200, 409]
    assert json.loads(route.calls.last.request.content)["items"][1]["attempt_id"] == "a-2"
    with pytest.raises(LeaseLostError):
        results[1].raise_for_status()


LEASE = {"queue": "q", "worker_id": "w", "max_tasks": 3, "start": True}
GRANTED = {"items": [{"status": 200, "attempt": state_json(status="SUCCEEDED", task_status="SUCCEEDED")}]}


@respx.mock
def test_a_retried_report_and_lease_carries_the_reports_alone() -> None:
    # Regression (issue 30, item 2): a retry of a report batch that carried a lease carried it again, so
    # an answer lost after the server committed it granted up to max_tasks tasks once more per retry,
    # each earlier set lapsing unused and spending an attempt of each of its tasks.
    route = respx.post(f"{BASE}{BATCH}/complete").mock(
        side_effect=[httpx.ReadTimeout("lost"), answer(*GRANTED["items"])]
    )
    item = {"attempt_id": "a-1", "lease_token": "t", "result": 1}
    with client() as c:
        done = c.complete_attempts_and_lease("acme", [item], lease=LEASE)
    first, retry = (json.loads(call.request.content) for call in route.calls)
    assert first == {"items": [item], "lease": {**LEASE, "lease_seconds": 30.0}}
    assert retry == {"items": [item]}
    assert [r.status for r in done.items] == [200] and done.grants == [] and done.lease_error is None
    # A first try refused outright is not retried, lease or not.
    route = respx.post(f"{BASE}{BATCH}/fail").mock(return_value=problem(400, "invalid_request"))
    error = {"type": "E", "message": "m", "retryable": False}
    with client() as c, pytest.raises(OrbitAPIError):
        c.fail_attempts_and_lease(
            "acme", [{"attempt_id": "a-1", "lease_token": "t", "error": error}], lease=LEASE
        )
    assert route.call_count == 1


@respx.mock
async def test_a_retried_report_and_lease_carries_the_reports_alone_async() -> None:
    route = respx.post(f"{BASE}{BATCH}/complete").mock(
        side_effect=[problem(503, "unavailable"), answer(*GRANTED["items"])]
    )
    item = {"attempt_id": "a-1", "lease_token": "t", "result": 1}
    async with AsyncOrbitClient(BASE, api_key="k", retry=RetryPolicy.no_wait()) as c:
        done = await c.complete_attempts_and_lease("acme", [item], lease=LEASE)
    assert ["lease" in json.loads(call.request.content) for call in route.calls] == [True, False]
    assert done.grants == []


@respx.mock
def test_a_batch_sends_the_bytes_its_size_split_measured() -> None:
    # Regression (issue 30, item 4): the split measured each item with pydantic, the request was encoded
    # again by httpx (`json=`), which writes 1e-07 for pydantic's 1e-7 and, before httpx 0.28, escapes
    # every non-ASCII character as \uXXXX with spaces: a batch measured under the limit went over it.
    limit = 16 * 1024
    result = {"text": "Grüße aus Köln, 東京からこんにちは", "weights": [1e-7] * 180}
    items = [CompleteItem(attempt_id=f"a-{n}", lease_token="t", result=result) for n in range(40)]
    chunks = _sized_chunks([(item, None) for item in items], limit)
    assert len(chunks) > 1
    route = respx.post(f"{BASE}{BATCH}/complete").mock(
        side_effect=lambda request: answer(
            *[{"status": 200, "attempt": state_json()}] * len(json.loads(request.content)["items"])
        )
    )
    with client() as c:
        for chunk in chunks:
            c.complete_attempts("acme", [item for item, _ in chunk])
            c.complete_attempts_and_lease("acme", [item for item, _ in chunk], lease=LEASE)
    sizes = [len(call.request.content) for call in route.calls]
    assert max(sizes) <= limit, sizes
    assert max(sizes) > limit * 3 // 4  # the chunks were near the limit
    sent = [item for call in route.calls[::2] for item in json.loads(call.request.content)["items"]]
    assert sent == [item.model_dump(mode="json") for item in items]
    assert {call.request.headers["content-type"] for call in route.calls} == {"application/json"}


@respx.mock
def test_an_item_names_its_task_only_when_given_one() -> None:
    """``task_id`` is left out of the body when ``None``: a server that predates it (and refuses unknown
    fields) accepts the item."""
    route = respx.post(f"{BASE}{BATCH}/start").mock(
        return_value=httpx.Response(200, json={"items": [{"status": 200, "attempt": state_json()}] * 2})
    )
    with client() as c:
        c.start_attempts(
            "acme",
            [
                StartItem(attempt_id="a-1", lease_token="t-1"),
                {"attempt_id": "a-2", "lease_token": "t-2", "task_id": "k"},
            ],
        )
    sent = json.loads(route.calls.last.request.content)["items"]
    assert sent == [
        {"attempt_id": "a-1", "lease_token": "t-1"},
        {"attempt_id": "a-2", "lease_token": "t-2", "task_id": "k"},
    ]
    done = CompleteItem(attempt_id="a-1", lease_token="t-1", result=None)
    assert json.loads(done.model_dump_json()) == {"attempt_id": "a-1", "lease_token": "t-1", "result": None}
