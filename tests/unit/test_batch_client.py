"""OrbitClient.submit_tasks and AsyncOrbitClient.submit_tasks against respx mocks (both clients)."""

from __future__ import annotations

import inspect
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
import respx

from orbit_client import (
    AsyncOrbitClient,
    BatchItem,
    BatchItemResult,
    BatchSubmission,
    OrbitAPIError,
    OrbitClient,
    OrbitConnectError,
    OrbitOutcomeUnknownError,
    OrbitUsageError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RetryPolicy,
    ServerError,
    SubmitOptions,
    Task,
    TaskSubmission,
    UnprocessableEntityError,
)

BASE = "https://orbit.test"
API_KEY = "sk-test-secret-0123456789"
BATCH = "/v1/namespaces/acme/tasks/batch"
JITTER = 0.5


def task_json(task_id: str = "7d4c0a52-0f0e-4d2b-9a43-3c1f3e4f5a6b", **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": task_id,
        "namespace": "acme",
        "queue": "orders",
        "handler": "orders.fulfil",
        "params": {"order_id": 42},
        "status": "WAITING",
        "state_version": 1,
        "attempt_count": 0,
        "max_attempts": 3,
        "available_at": "2026-01-01T00:00:00.000000Z",
        "created_at": "2026-01-01T00:00:00.000000Z",
        "updated_at": "2026-01-01T00:00:00.000000Z",
    }
    body.update(overrides)
    return body


def item_problem(status: int, code: str) -> dict[str, Any]:
    return {"type": "about:blank", "title": f"title of {code}", "status": status, "code": code,
            "detail": f"detail of {code}", "request_id": "req-1"}  # fmt: skip


def problem(status: int, code: str, **headers: str) -> httpx.Response:
    body = {"type": "about:blank", "title": f"title of {code}", "status": status, "code": code}
    return httpx.Response(
        status,
        content=json.dumps(body).encode(),
        headers={"Content-Type": "application/problem+json", "X-Request-Id": "req-1", **headers},
    )


def answer(*results: dict[str, Any]) -> httpx.Response:
    return httpx.Response(200, json={"items": list(results)}, headers={"X-Request-Id": "req-ok"})


def item(key: str = "order-42", **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "idempotency_key": key,
        "queue": "orders",
        "handler": "orders.fulfil",
        "params": {"order_id": 42},
    }
    body.update(overrides)
    return body


class Calls:
    """Runs the sync or the async client behind one awaitable interface."""

    def __init__(self, client: OrbitClient | AsyncOrbitClient) -> None:
        self.client = client

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.client, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            return await result if inspect.isawaitable(result) else result

        return call


@pytest.fixture
def sleeps() -> list[float]:
    return []


@pytest.fixture
def mock() -> Iterator[respx.MockRouter]:
    with respx.mock(base_url=BASE, assert_all_called=False) as router:
        yield router


@pytest.fixture(params=["sync", "async"])
async def client(
    request: pytest.FixtureRequest, sleeps: list[float], mock: respx.MockRouter
) -> AsyncIterator[Calls]:
    policy = RetryPolicy(sleep=sleeps.append, random=lambda: JITTER)
    transport: Any = httpx.MockTransport(mock.handler)
    if request.param == "sync":
        sync = OrbitClient(BASE, api_key=API_KEY, retry=policy, transport=transport)
        yield Calls(sync)
        sync.close()
    else:
        async_client = AsyncOrbitClient(BASE, api_key=API_KEY, retry=policy, transport=transport)
        yield Calls(async_client)
        await async_client.aclose()


# --- success ----------------------------------------------------------------------------------------


async def test_results_in_request_order(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.post(BATCH).mock(
        return_value=answer(
            {"status": 201, "task": task_json("t-1"), "replayed": False},
            {"status": 200, "task": task_json("t-0"), "replayed": True},
            {"status": 404, "error": item_problem(404, "queue_not_found")},
            {"status": 422, "error": item_problem(422, "idempotency_key_reused")},
        )
    )

    results = await client.submit_tasks(
        "acme",
        [
            item("k-1"),
            BatchItem(
                idempotency_key="k-0", queue="orders", handler="orders.fulfil", params={"order_id": 42}
            ),
            item("k-2", queue="nope"),
            item("k-0", params={"order_id": 43}),
        ],
    )

    assert [r.status for r in results] == [201, 200, 404, 422]
    assert all(isinstance(r, BatchItemResult) for r in results)
    assert [r.replayed for r in results] == [False, True, False, False]
    assert [r.ok for r in results] == [True, True, False, False]
    assert isinstance(results[0].task, Task) and results[0].task.id == "t-1"
    assert results[1].task is not None and results[1].task.id == "t-0"
    assert results[2].task is None
    assert results[2].error is not None and results[2].error.code == "queue_not_found"
    assert results[3].error is not None and results[3].error.code == "idempotency_key_reused"
    request = route.calls.last.request
    assert request.headers["Authorization"] == f"Bearer {API_KEY}"
    assert "Idempotency-Key" not in request.headers
    assert json.loads(request.content) == {
        "items": [
            item("k-1"),
            item("k-0"),
            item("k-2", queue="nope"),
            item("k-0", params={"order_id": 43}),
        ]
    }


async def test_items_as_models_or_mappings_send_the_same_body(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.post(BATCH).mock(return_value=answer({"status": 201, "task": task_json()}))
    options = {"max_attempts": 5, "retry_safe": True}

    await client.submit_tasks("acme", [item("k", options=options)])
    await client.submit_tasks("acme", [BatchItem.model_validate(item("k", options=SubmitOptions(**options)))])

    first, second = (call.request.content for call in route.calls)
    assert first == second
    assert json.loads(first)["items"][0]["options"] == options


async def test_params_and_options_can_be_left_out(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.post(BATCH).mock(return_value=answer({"status": 201, "task": task_json(params=None)}))

    await client.submit_tasks("acme", [{"idempotency_key": "k", "queue": "orders", "handler": "h"}])

    assert json.loads(route.calls.last.request.content) == {
        "items": [{"idempotency_key": "k", "queue": "orders", "handler": "h"}]
    }


def test_batch_item_digests_like_the_single_submission() -> None:
    batch_item = BatchItem.model_validate(item("k", options={"max_attempts": 2}))
    single = TaskSubmission.model_validate(
        {
            "queue": "orders",
            "handler": "orders.fulfil",
            "params": {"order_id": 42},
            "options": {"max_attempts": 2},
        }
    )
    assert batch_item.submission() == single
    assert batch_item.submission().canonical_meaning() == single.canonical_meaning()


def test_batch_submission_needs_an_item() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        BatchSubmission(items=[])


# --- whole-request failures keep submit_task's rules -------------------------------------------------


async def test_retried_with_the_same_body_after_outcome_unknown(
    client: Calls, mock: respx.MockRouter, sleeps: list[float]
) -> None:
    route = mock.post(BATCH).mock(
        side_effect=[
            problem(500, "internal_error"),
            httpx.ReadTimeout,
            problem(409, "request_in_progress", **{"Retry-After": "1"}),
            answer({"status": 200, "task": task_json(), "replayed": True}),
        ]
    )

    results = await client.submit_tasks("acme", [item("k")])

    assert results[0].replayed is True
    assert route.call_count == 4
    assert len({call.request.content for call in route.calls}) == 1
    assert sleeps == [pytest.approx(0.2 * JITTER), pytest.approx(0.4 * JITTER), 1.0]


async def test_500_ends_outcome_unknown(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.post(BATCH).mock(return_value=problem(500, "internal_error"))

    with pytest.raises(ServerError) as info:
        await client.submit_tasks("acme", [item("k")])

    assert (info.value.retryable, info.value.outcome_known) == (True, False)
    assert route.call_count == 4


async def test_timeout_ends_outcome_unknown(client: Calls, mock: respx.MockRouter) -> None:
    mock.post(BATCH).mock(side_effect=httpx.ReadTimeout)

    with pytest.raises(OrbitOutcomeUnknownError) as info:
        await client.submit_tasks("acme", [item("k")])

    assert info.value.outcome_known is False


async def test_connect_error_is_outcome_known(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.post(BATCH).mock(side_effect=httpx.ConnectError)

    with pytest.raises(OrbitConnectError) as info:
        await client.submit_tasks("acme", [item("k")])

    assert info.value.outcome_known is True
    assert route.call_count == 4


@pytest.mark.parametrize(
    ("status", "code", "error_class"),
    [
        (403, "forbidden", PermissionDeniedError),
        (413, "payload_too_large", PayloadTooLargeError),
        (422, "validation_error", UnprocessableEntityError),
    ],
)
async def test_whole_request_refusals_are_raised_not_retried(
    client: Calls, mock: respx.MockRouter, status: int, code: str, error_class: type[OrbitAPIError]
) -> None:
    route = mock.post(BATCH).mock(return_value=problem(status, code))

    with pytest.raises(error_class) as info:
        await client.submit_tasks("acme", [item("k")])

    assert info.value.outcome_known is True
    assert info.value.code == code
    assert route.call_count == 1


async def test_per_item_errors_are_results_not_exceptions(client: Calls, mock: respx.MockRouter) -> None:
    mock.post(BATCH).mock(
        return_value=answer({"status": 422, "error": item_problem(422, "idempotency_key_reused")})
    )

    results = await client.submit_tasks("acme", [item("k")])

    assert results[0].error is not None
    assert results[0].error.code == "idempotency_key_reused"


@pytest.mark.parametrize(
    "body",
    [
        {"items": [{"status": 201, "task": task_json()}, {"status": 201, "task": task_json()}]},
        {"items": []},
        {"results": []},
        [],
    ],
)
async def test_an_answer_that_does_not_fit_is_outcome_unknown(
    client: Calls, mock: respx.MockRouter, body: Any
) -> None:
    mock.post(BATCH).mock(return_value=httpx.Response(200, json=body))

    with pytest.raises(OrbitAPIError) as info:
        await client.submit_tasks("acme", [item("k")])

    assert info.value.code == "invalid_response"
    assert info.value.outcome_known is False


# --- misuse: nothing is sent ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("items", "match"),
    [
        ([], "empty"),
        ((), "empty"),
        ("k", "list of BatchItem"),
        (item("k"), "list of BatchItem"),
        ([item("k"), 7], r"items\[1\] is a int"),
        ([item("k"), item("")], r"items\[1\]\.idempotency_key"),
        ([item("k" * 256)], r"items\[0\]\.idempotency_key"),
        ([item(" leading")], r"items\[0\]\.idempotency_key"),
        ([item("cl\u00e9")], r"items\[0\]\.idempotency_key"),
        ([item("k", queue="bad name")], r"items\[0\]\.queue"),
        ([item("k", params={"card": "4111-secret", "x": float("nan")})], r"items\[0\]\.params"),
        ([item("k", params={"card": "4111-secret"}, options={"max_attempts": 0})], r"items\[0\]\.options"),
        ([item("k", params={"card": "4111-secret"}, surprise=1)], r"items\[0\]\.surprise"),
        ([{"queue": "orders", "handler": "h"}], r"items\[0\]\.idempotency_key"),
    ],
)
async def test_malformed_batch_sends_nothing(
    client: Calls, mock: respx.MockRouter, items: Any, match: str
) -> None:
    with pytest.raises(OrbitUsageError, match=match) as info:
        await client.submit_tasks("acme", items)

    assert "secret" not in str(info.value)
    assert "nothing was sent" in str(info.value)
    assert mock.calls.call_count == 0


async def test_bad_namespace_sends_nothing(client: Calls, mock: respx.MockRouter) -> None:
    with pytest.raises(OrbitUsageError):
        await client.submit_tasks("", [item("k")])
    assert mock.calls.call_count == 0


async def test_namespace_is_quoted(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.post("/v1/namespaces/a%2Fb/tasks/batch").mock(
        return_value=answer({"status": 201, "task": task_json()})
    )

    await client.submit_tasks("a/b", [item("k")])

    assert route.call_count == 1


def test_params_left_out_are_an_empty_object_and_mean_the_same() -> None:
    """Regression (issue 10, first hour): a body without ``params`` meant ``null``."""
    bare = TaskSubmission.model_validate({"queue": "orders", "handler": "h"})
    assert bare.params == {}
    assert (
        bare.canonical_meaning() == TaskSubmission(queue="orders", handler="h", params={}).canonical_meaning()
    )
    assert (
        bare.canonical_meaning()
        != TaskSubmission(queue="orders", handler="h", params=None).canonical_meaning()
    )
    assert BatchItem.model_validate({"idempotency_key": "k", "queue": "orders", "handler": "h"}).params == {}
