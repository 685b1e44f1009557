"""OrbitClient and AsyncOrbitClient against respx mocks: every test runs on both clients."""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
import respx

from orbit_client import (
    AsyncOrbitClient,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    IdempotencyKeyReusedError,
    NotFoundError,
    OrbitAPIError,
    OrbitClient,
    OrbitConnectError,
    OrbitError,
    OrbitOutcomeUnknownError,
    OrbitUsageError,
    PayloadTooLargeError,
    PermissionDeniedError,
    Problem,
    Queue,
    RateLimitedError,
    RequestInProgressError,
    RetryPolicy,
    ServerError,
    ServiceUnavailableError,
    SubmitOptions,
    Task,
    TaskStatus,
    UnprocessableEntityError,
    __version__,
)

BASE = "https://orbit.test"
API_KEY = "sk-test-secret-0123456789"
KEY = "order-42:fulfil"
TASKS = "/v1/namespaces/acme/tasks"
JITTER = 0.5  # the fake random(): every jittered delay is half its bound


def task_json(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": "7d4c0a52-0f0e-4d2b-9a43-3c1f3e4f5a6b",
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


def problem(status: int, code: str, *, detail: str | None = None, **headers: str) -> httpx.Response:
    body = {"type": "about:blank", "title": f"title of {code}", "status": status, "code": code}
    if detail is not None:
        body["detail"] = detail
    return httpx.Response(
        status,
        content=json.dumps(body).encode(),
        headers={"Content-Type": "application/problem+json", "X-Request-Id": "req-1", **headers},
    )


def created(**overrides: Any) -> httpx.Response:
    return httpx.Response(201, json=task_json(**overrides), headers={"X-Request-Id": "req-ok"})


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
def policy(sleeps: list[float]) -> RetryPolicy:
    return RetryPolicy(sleep=sleeps.append, random=lambda: JITTER)


@pytest.fixture
def mock() -> Iterator[respx.MockRouter]:
    with respx.mock(base_url=BASE, assert_all_called=False) as router:
        yield router


@pytest.fixture(params=["sync", "async"])
async def make_client(
    request: pytest.FixtureRequest, policy: RetryPolicy, mock: respx.MockRouter
) -> AsyncIterator[Callable[..., OrbitClient | AsyncOrbitClient]]:
    made: list[OrbitClient | AsyncOrbitClient] = []

    def make(**kwargs: Any) -> OrbitClient | AsyncOrbitClient:
        kwargs.setdefault("api_key", API_KEY)
        kwargs.setdefault("retry", policy)
        # The router as an explicit transport (the `transport=` argument), which also spares
        # building an SSL context per client; respx.mock's patching stays on as a safety net.
        kwargs.setdefault("transport", httpx.MockTransport(mock.handler))
        base_url = kwargs.pop("base_url", BASE)
        cls = OrbitClient if request.param == "sync" else AsyncOrbitClient
        client = cls(base_url, **kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        if isinstance(client, OrbitClient):
            client.close()
        else:
            await client.aclose()


@pytest.fixture
def client(make_client: Callable[..., OrbitClient | AsyncOrbitClient]) -> Calls:
    return Calls(make_client())


async def submit(client: Calls, key: str = KEY, **kwargs: Any) -> Any:
    kwargs.setdefault("params", {"order_id": 42})
    return await client.submit_task("acme", "orders", "orders.fulfil", idempotency_key=key, **kwargs)


# --- success ----------------------------------------------------------------------------------------


async def test_submit_201_is_a_new_task(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.post(TASKS).mock(return_value=created())

    result = await submit(client)

    assert result.replayed is False
    assert isinstance(result.task, Task)
    assert result.task.status is TaskStatus.WAITING
    request = route.calls.last.request
    assert request.headers["Idempotency-Key"] == KEY
    assert request.headers["Authorization"] == f"Bearer {API_KEY}"
    assert request.headers["User-Agent"] == f"orbit-client/{__version__}"
    assert json.loads(request.content) == {
        "queue": "orders",
        "handler": "orders.fulfil",
        "params": {"order_id": 42},
    }


@pytest.mark.parametrize(("header", "replayed"), [("true", True), (None, False), ("false", False)])
async def test_submit_200_replay(
    client: Calls, mock: respx.MockRouter, header: str | None, replayed: bool
) -> None:
    headers = {"Idempotent-Replayed": header} if header else {}
    mock.post(TASKS).mock(return_value=httpx.Response(200, json=task_json(), headers=headers))

    result = await submit(client)

    assert result.replayed is replayed
    assert result.task.id == task_json()["id"]


PARAMS_CASES: list[Any] = [
    {"order_id": 42, "lines": [{"sku": "A-1", "qty": 2}], "note": None, "empty": [], "nested": {"x": {}}},
    {"unicode": "caf\u00e9 \u6771\u4eac \U0001f680", "big": 2**63 - 1, "neg": -(2**63), "float": 0.1},
    ["a", 1, True, None],
    "just a string",
    None,
]


@pytest.mark.parametrize("params", PARAMS_CASES)
async def test_params_round_trip(client: Calls, mock: respx.MockRouter, params: Any) -> None:
    def echo(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        return httpx.Response(201, json=task_json(params=sent.get("params")))

    route = mock.post(TASKS).mock(side_effect=echo)

    result = await submit(client, params=params)

    assert json.loads(route.calls.last.request.content).get("params") == params
    assert result.task.params == params


@pytest.mark.parametrize(
    "options",
    [
        {"max_attempts": 5, "deadline": "2026-02-01T12:00:00+01:00", "retry_safe": True},
        SubmitOptions.model_validate(
            {"max_attempts": 5, "deadline": "2026-02-01T12:00:00+01:00", "retry_safe": True}
        ),
    ],
)
async def test_submit_options_mapping_or_model(client: Calls, mock: respx.MockRouter, options: Any) -> None:
    route = mock.post(TASKS).mock(return_value=created())

    await submit(client, options=options)

    assert json.loads(route.calls.last.request.content)["options"] == {
        "max_attempts": 5,
        "deadline": "2026-02-01T11:00:00.000000Z",
        "retry_safe": True,
    }


async def test_get_task(client: Calls, mock: respx.MockRouter) -> None:
    mock.get("/v1/namespaces/acme/tasks/t-1").mock(return_value=httpx.Response(200, json=task_json(id="t-1")))

    task = await client.get_task("acme", "t-1")

    assert task.id == "t-1"


async def test_get_queue(client: Calls, mock: respx.MockRouter) -> None:
    body = {
        "namespace": "acme",
        "name": "orders",
        "created_at": "2026-01-01T00:00:00Z",
        "counts": {"WAITING": 3},
    }
    mock.get("/v1/namespaces/acme/queues/orders").mock(return_value=httpx.Response(200, json=body))

    queue = await client.get_queue("acme", "orders")

    assert isinstance(queue, Queue)
    assert queue.counts == {TaskStatus.WAITING: 3}


async def test_path_segments_are_quoted(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.route(method="GET").mock(return_value=httpx.Response(200, json=task_json()))

    await client.get_task("acme", "a/b?c#d e%")
    await client.get_task("acme", "..")

    paths = [call.request.url.raw_path for call in route.calls]
    assert paths == [
        b"/v1/namespaces/acme/tasks/a%2Fb%3Fc%23d%20e%25",
        b"/v1/namespaces/acme/tasks/%2E%2E",
    ]


async def test_base_url_path_prefix_is_kept(make_client: Callable[..., Any], mock: respx.MockRouter) -> None:
    route = mock.get("/orbit/v1/namespaces/acme/tasks/t-1").mock(
        return_value=httpx.Response(200, json=task_json())
    )
    client = Calls(make_client(base_url=f"{BASE}/orbit"))

    await client.get_task("acme", "t-1")

    assert route.call_count == 1


async def test_a_path_joined_once_goes_to_the_same_url_every_time(
    make_client: Callable[..., Any], mock: respx.MockRouter
) -> None:
    """The client joins a path to base_url once and reuses the URL (``_BaseClient._url``): the
    requests go where httpx's own join sends them (prefix, quoting and query parameters kept), also
    once more paths were used than the client keeps."""
    from orbit_client._client import _URL_CACHE_SIZE

    route = mock.get(url__regex=r"/orbit/v1/namespaces/acme/tasks/").mock(
        return_value=httpx.Response(200, json=task_json())
    )
    pages = mock.get("/orbit/v1/namespaces/acme/tasks").mock(
        return_value=httpx.Response(200, json={"items": []})
    )
    calls = Calls(make_client(base_url=f"{BASE}/orbit"))
    ids = ["t-1", "t-1", "a/b?c", *(f"t-{n}" for n in range(_URL_CACHE_SIZE + 5)), "t-1"]

    for task_id in ids:
        await calls.get_task("acme", task_id)
    await calls.list_tasks("acme", status="WAITING")
    await calls.list_tasks("acme", status="RUNNING")

    urls = [str(call.request.url) for call in route.calls]
    assert urls[:3] == [f"{BASE}/orbit/v1/namespaces/acme/tasks/t-1"] * 2 + [
        f"{BASE}/orbit/v1/namespaces/acme/tasks/a%2Fb%3Fc"
    ]
    assert urls[-1] == f"{BASE}/orbit/v1/namespaces/acme/tasks/t-1"
    assert [call.request.url.params["status"] for call in pages.calls] == ["WAITING", "RUNNING"]
    assert {call.request.url.path for call in pages.calls} == {"/orbit/v1/namespaces/acme/tasks"}
    assert len(calls.client._urls) <= _URL_CACHE_SIZE


async def test_a_cookie_set_in_front_of_the_server_is_sent_back(
    client: Calls, mock: respx.MockRouter
) -> None:
    """The client reads cookies only from the responses that set one (``orbit_client._http``): a
    load balancer's sticky-session cookie is still kept, sent back, replaced and not dropped by the
    answers that set none, as ``httpx`` would."""
    answers = iter(
        [
            httpx.Response(200, json=task_json(), headers={"Set-Cookie": "LB=node-1; Path=/"}),
            httpx.Response(200, json=task_json()),
            httpx.Response(200, json=task_json(), headers={"Set-Cookie": "LB=node-2; Path=/"}),
            httpx.Response(200, json=task_json()),
        ]
    )
    route = mock.get("/v1/namespaces/acme/tasks/t-1").mock(side_effect=lambda request: next(answers))

    for _ in range(4):
        await client.get_task("acme", "t-1")

    sent = [call.request.headers.get("Cookie") for call in route.calls]
    assert sent == [None, "LB=node-1", "LB=node-1", "LB=node-2"]


async def test_extra_headers_cannot_replace_authorization(
    make_client: Callable[..., Any], mock: respx.MockRouter
) -> None:
    route = mock.post(TASKS).mock(return_value=created())
    client = Calls(make_client(headers={"X-Tenant": "t1", "authorization": "Bearer other"}))

    await submit(client)

    headers = route.calls.last.request.headers
    assert headers["X-Tenant"] == "t1"
    assert headers.get_list("Authorization") == [f"Bearer {API_KEY}"]


# --- find_submission --------------------------------------------------------------------------------


async def test_find_submission_found(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.get(url__regex=r"/submissions/").mock(return_value=httpx.Response(200, json=task_json()))

    task = await client.find_submission("acme", "order/42 ?#%")

    assert task is not None
    assert task.id == task_json()["id"]
    assert route.calls.last.request.url.raw_path == b"/v1/namespaces/acme/submissions/order%2F42%20%3F%23%25"


async def test_find_submission_not_found_is_none(client: Calls, mock: respx.MockRouter) -> None:
    mock.get(f"/v1/namespaces/acme/submissions/{KEY}").mock(return_value=problem(404, "submission_not_found"))

    assert await client.find_submission("acme", KEY) is None


async def test_find_submission_other_404_raises(client: Calls, mock: respx.MockRouter) -> None:
    mock.get(f"/v1/namespaces/acme/submissions/{KEY}").mock(return_value=problem(404, "namespace_not_found"))

    with pytest.raises(NotFoundError) as info:
        await client.find_submission("acme", KEY)

    assert info.value.code == "namespace_not_found"


# --- API status errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "code", "error_class"),
    [
        (400, "idempotency_key_invalid", BadRequestError),
        (401, "unauthenticated", AuthenticationError),
        (403, "forbidden", PermissionDeniedError),
        (404, "queue_not_found", NotFoundError),
        (409, "already_exists", ConflictError),
        (413, "payload_too_large", PayloadTooLargeError),
        (422, "validation_error", UnprocessableEntityError),
        (422, "idempotency_key_reused", IdempotencyKeyReusedError),
        (418, "teapot", OrbitAPIError),
    ],
)
async def test_client_errors_are_mapped_and_not_retried(
    client: Calls,
    mock: respx.MockRouter,
    sleeps: list[float],
    status: int,
    code: str,
    error_class: type[OrbitAPIError],
) -> None:
    route = mock.post(TASKS).mock(return_value=problem(status, code, detail="what went wrong"))

    with pytest.raises(OrbitAPIError) as info:
        await submit(client)

    error = info.value
    assert type(error) is error_class
    assert (error.status_code, error.code) == (status, code)
    assert (error.title, error.detail, error.request_id) == (f"title of {code}", "what went wrong", "req-1")
    assert isinstance(error.problem, Problem)
    assert error.retryable is False
    assert error.outcome_known is True
    assert "what went wrong" in str(error) and "req-1" in str(error)
    assert route.call_count == 1
    assert sleeps == []


async def test_idempotency_key_reused_is_not_retried(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.post(TASKS).mock(return_value=problem(422, "idempotency_key_reused"))

    with pytest.raises(IdempotencyKeyReusedError) as info:
        await submit(client)

    assert isinstance(info.value, UnprocessableEntityError)
    assert "find_submission()" in str(info.value)
    assert route.call_count == 1


async def test_request_in_progress_is_retried_then_succeeds(
    client: Calls, mock: respx.MockRouter, sleeps: list[float]
) -> None:
    route = mock.post(TASKS).mock(
        side_effect=[problem(409, "request_in_progress", **{"Retry-After": "1"}), created()]
    )

    result = await submit(client)

    assert result.replayed is False
    assert route.call_count == 2
    assert sleeps == [1.0]


async def test_request_in_progress_error_attributes(client: Calls, mock: respx.MockRouter) -> None:
    mock.post(TASKS).mock(return_value=problem(409, "request_in_progress"))

    with pytest.raises(RequestInProgressError) as info:
        await submit(client)

    assert isinstance(info.value, ConflictError)
    assert (info.value.retryable, info.value.outcome_known) == (True, True)


async def test_429_retry_after_is_honoured(
    client: Calls, mock: respx.MockRouter, sleeps: list[float]
) -> None:
    route = mock.post(TASKS).mock(
        side_effect=[problem(429, "rate_limited", **{"Retry-After": "7"}), created()]
    )

    await submit(client)

    assert route.call_count == 2
    assert sleeps == [7.0]


async def test_429_without_retry_after_uses_backoff(
    client: Calls, mock: respx.MockRouter, sleeps: list[float]
) -> None:
    mock.post(TASKS).mock(side_effect=[problem(429, "rate_limited"), created()])

    await submit(client)

    assert sleeps == [pytest.approx(0.2 * JITTER)]


async def test_429_retry_after_too_long_is_raised_at_once(
    client: Calls, mock: respx.MockRouter, sleeps: list[float]
) -> None:
    route = mock.post(TASKS).mock(return_value=problem(429, "rate_limited", **{"Retry-After": "120"}))

    with pytest.raises(RateLimitedError) as info:
        await submit(client)

    assert info.value.retry_after == 120.0
    assert (info.value.retryable, info.value.outcome_known) == (True, True)
    assert any("max_retry_after" in note for note in info.value.__notes__)
    assert route.call_count == 1
    assert sleeps == []


async def test_500_is_retried_and_ends_outcome_unknown(
    client: Calls, mock: respx.MockRouter, sleeps: list[float]
) -> None:
    route = mock.post(TASKS).mock(return_value=problem(500, "internal_error"))

    with pytest.raises(ServerError) as info:
        await submit(client)

    assert type(info.value) is ServerError
    assert (info.value.retryable, info.value.outcome_known) == (True, False)
    assert "find_submission()" in str(info.value)
    assert route.call_count == 4
    assert sleeps == [pytest.approx(d * JITTER) for d in (0.2, 0.4, 0.8)]


async def test_503_is_outcome_known(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.post(TASKS).mock(return_value=problem(503, "unavailable"))

    with pytest.raises(ServiceUnavailableError) as info:
        await submit(client)

    assert isinstance(info.value, ServerError)
    assert (info.value.retryable, info.value.outcome_known) == (True, True)
    assert route.call_count == 4


async def test_500_then_503_ends_outcome_unknown(client: Calls, mock: respx.MockRouter) -> None:
    mock.post(TASKS).mock(side_effect=[problem(500, "internal_error")] + [problem(503, "unavailable")] * 3)

    with pytest.raises(ServiceUnavailableError) as info:
        await submit(client)

    assert info.value.outcome_known is False
    assert "attempt 1 of 4" in str(info.value)


@pytest.mark.parametrize(
    ("status", "error_class"), [(502, ServerError), (400, BadRequestError), (404, NotFoundError)]
)
async def test_non_json_error_body(
    client: Calls, mock: respx.MockRouter, status: int, error_class: type[OrbitAPIError]
) -> None:
    html = "<html><body>Bad gateway</body></html>"
    mock.get("/v1/namespaces/acme/tasks/t-1").mock(
        return_value=httpx.Response(status, text=html, headers={"Content-Type": "text/html"})
    )

    with pytest.raises(error_class) as info:
        await client.get_task("acme", "t-1")

    error = info.value
    assert error.status_code == status
    assert error.code == f"http_{status}"
    assert error.problem is None
    assert error.request_id is None
    assert error.detail == html


async def test_json_error_body_that_is_not_a_problem(client: Calls, mock: respx.MockRouter) -> None:
    mock.get("/v1/namespaces/acme/tasks/t-1").mock(
        return_value=httpx.Response(404, json={"code": "task_not_found", "detail": "no such task"})
    )

    with pytest.raises(NotFoundError) as info:
        await client.get_task("acme", "t-1")

    assert (info.value.code, info.value.detail, info.value.problem) == (
        "task_not_found",
        "no such task",
        None,
    )


async def test_request_id_from_body_when_header_missing(client: Calls, mock: respx.MockRouter) -> None:
    body = {"title": "Forbidden", "status": 403, "code": "forbidden", "request_id": "req-body"}
    mock.post(TASKS).mock(return_value=httpx.Response(403, json=body))

    with pytest.raises(PermissionDeniedError) as info:
        await submit(client)

    assert info.value.request_id == "req-body"


async def test_invalid_success_body(client: Calls, mock: respx.MockRouter) -> None:
    mock.post(TASKS).mock(return_value=httpx.Response(201, json={"id": "t-1"}))

    with pytest.raises(OrbitAPIError) as info:
        await submit(client)

    assert info.value.code == "invalid_response"
    assert (info.value.retryable, info.value.outcome_known) == (False, False)


# --- transport failures -----------------------------------------------------------------------------


@pytest.mark.parametrize("exc", [httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout])
async def test_not_sent_is_connect_error(
    client: Calls, mock: respx.MockRouter, exc: type[httpx.HTTPError]
) -> None:
    route = mock.post(TASKS).mock(side_effect=exc)

    with pytest.raises(OrbitConnectError) as info:
        await submit(client)

    error = info.value
    assert (error.retryable, error.outcome_known) == (True, True)
    assert isinstance(error.__cause__, exc)
    assert not isinstance(error, httpx.HTTPError)
    assert (error.method, error.url) == ("POST", f"{BASE}{TASKS}")
    assert route.call_count == 4


@pytest.mark.parametrize(
    "exc",
    [httpx.ReadTimeout, httpx.WriteTimeout, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError],
)
async def test_maybe_sent_is_outcome_unknown(
    client: Calls, mock: respx.MockRouter, exc: type[httpx.HTTPError]
) -> None:
    route = mock.post(TASKS).mock(side_effect=exc)

    with pytest.raises(OrbitOutcomeUnknownError) as info:
        await submit(client)

    error = info.value
    assert (error.retryable, error.outcome_known) == (True, False)
    assert isinstance(error.__cause__, exc)
    assert "find_submission()" in str(error)
    assert route.call_count == 4


async def test_unknown_then_connect_refused_ends_outcome_unknown(
    client: Calls, mock: respx.MockRouter
) -> None:
    mock.post(TASKS).mock(
        side_effect=[httpx.ReadTimeout, httpx.ConnectError, httpx.ConnectError, httpx.ConnectError]
    )

    with pytest.raises(OrbitConnectError) as info:
        await submit(client)

    error = info.value
    assert error.outcome_known is False
    assert "outcome unknown" in str(error)
    assert any("attempt 1 of 4" in note for note in error.__notes__)
    assert isinstance(error.__cause__, httpx.ConnectError)


async def test_same_idempotency_key_and_body_on_every_retry(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.post(TASKS).mock(
        side_effect=[
            problem(500, "internal_error"),
            httpx.ReadTimeout,
            problem(503, "unavailable"),
            created(),
        ]
    )

    result = await submit(client)

    assert result.task.id == task_json()["id"]
    requests = [call.request for call in route.calls]
    assert len(requests) == 4
    assert {r.headers["Idempotency-Key"] for r in requests} == {KEY}
    assert {r.content for r in requests} == {requests[0].content}


@pytest.mark.parametrize("max_attempts", [1, 2, 6])
async def test_retries_are_bounded(
    make_client: Callable[..., Any], mock: respx.MockRouter, sleeps: list[float], max_attempts: int
) -> None:
    route = mock.post(TASKS).mock(side_effect=httpx.ReadTimeout)
    client = Calls(make_client(retry=RetryPolicy(max_attempts=max_attempts, sleep=sleeps.append)))

    with pytest.raises(OrbitOutcomeUnknownError):
        await submit(client)

    assert route.call_count == max_attempts
    assert len(sleeps) == max_attempts - 1
    assert all(0 <= delay <= 5.0 for delay in sleeps)


async def test_private_request_without_retry(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.post("/v1/namespaces/acme/things").mock(return_value=problem(503, "unavailable"))

    with pytest.raises(ServiceUnavailableError) as info:
        await client._request("POST", "/v1/namespaces/acme/things", json={}, retry=False)

    assert route.call_count == 1
    assert not getattr(info.value, "__notes__", [])


# --- misuse -----------------------------------------------------------------------------------------

MALFORMED_KEYS = ["", "k" * 256, "cl\u00e9", "a\nb", "a\x00b", "tab\there", "\x7f", " leading", "trailing "]


@pytest.mark.parametrize("key", MALFORMED_KEYS)
async def test_malformed_key_sends_nothing(client: Calls, mock: respx.MockRouter, key: str) -> None:
    with pytest.raises(OrbitUsageError) as info:
        await submit(client, key=key)
    assert isinstance(info.value, ValueError)

    with pytest.raises(OrbitUsageError):
        await client.find_submission("acme", key)

    assert mock.calls.call_count == 0


async def test_longest_key_is_accepted(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.post(TASKS).mock(return_value=created())

    await submit(client, key="k" * 255)

    assert route.calls.last.request.headers["Idempotency-Key"] == "k" * 255


@pytest.mark.parametrize(
    "kwargs",
    [
        {"params": {"secret-value": float("nan")}},
        {"params": {"card": "4111-secret"}, "options": {"max_attempts": 0}},
        {"params": {"card": "4111-secret"}, "options": {"unknown_option": 1}},
    ],
)
async def test_invalid_submission_sends_nothing(client: Calls, mock: respx.MockRouter, kwargs: Any) -> None:
    with pytest.raises(OrbitUsageError) as info:
        await submit(client, **kwargs)

    assert "secret" not in str(info.value)
    assert mock.calls.call_count == 0


async def test_invalid_queue_name_sends_nothing(client: Calls, mock: respx.MockRouter) -> None:
    with pytest.raises(OrbitUsageError, match="queue"):
        await client.submit_task("acme", "no spaces", "h", {}, idempotency_key=KEY)

    with pytest.raises(OrbitUsageError):
        await client.get_task("", "t-1")

    assert mock.calls.call_count == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"api_key": ""},
        {"api_key": "line\nbreak"},
        {"base_url": "orbit.test"},
        {"base_url": "ftp://orbit.test"},
        {"timeout": 0},
    ],
)
def test_constructor_misuse(make_client: Callable[..., Any], kwargs: Any) -> None:
    with pytest.raises(OrbitUsageError):
        make_client(**kwargs)


def test_repr_hides_the_api_key(make_client: Callable[..., Any]) -> None:
    assert API_KEY not in repr(make_client())


async def test_closed_client_raises_usage_error(mock: respx.MockRouter) -> None:
    sync_client = OrbitClient(BASE, api_key=API_KEY)
    with sync_client:
        pass
    with pytest.raises(OrbitUsageError, match="closed"):
        sync_client.get_task("acme", "t-1")

    async with AsyncOrbitClient(BASE, api_key=API_KEY) as async_client:
        pass
    with pytest.raises(OrbitUsageError, match="closed"):
        await async_client.get_task("acme", "t-1")


async def test_retry_log_has_no_secret_or_params(
    client: Calls, mock: respx.MockRouter, caplog: pytest.LogCaptureFixture
) -> None:
    mock.post(TASKS).mock(side_effect=[problem(500, "internal_error"), created()])

    with caplog.at_level(logging.DEBUG, logger="orbit_client"):
        await submit(client, params={"card": "4111-1111"})

    retries = [r for r in caplog.records if r.name == "orbit_client"]
    assert len(retries) == 1
    message = retries[0].getMessage()
    assert f"POST {TASKS}" in message and "attempt 1" in message and "req-1" in message
    assert API_KEY not in caplog.text and "4111" not in caplog.text


def test_errors_share_one_root() -> None:
    for error_class in (OrbitConnectError, ServerError, OrbitUsageError, IdempotencyKeyReusedError):
        assert issubclass(error_class, OrbitError)


@pytest.fixture
async def async_client() -> AsyncIterator[AsyncOrbitClient]:
    async with AsyncOrbitClient(BASE, api_key=API_KEY, retry=RetryPolicy.no_wait()) as client:
        yield client


async def test_async_client_with_no_wait_policy(
    async_client: AsyncOrbitClient, mock: respx.MockRouter
) -> None:
    route = mock.post(TASKS).mock(side_effect=[httpx.ReadTimeout, created()])

    result = await async_client.submit_task("acme", "orders", "orders.fulfil", {}, idempotency_key=KEY)

    assert result.replayed is False
    assert route.call_count == 2


async def test_get_settings_reads_the_key_window(client: Calls, mock: respx.MockRouter) -> None:
    body = {"submission_key_ttl_seconds": 604800, "max_batch_items": 500, "max_body_bytes": 262144, "new": 1}
    mock.get("/v1/settings").mock(return_value=httpx.Response(200, json=body))

    info = await client.get_settings()

    assert (info.submission_key_ttl_seconds, info.max_batch_items, info.max_body_bytes) == (
        604800,
        500,
        262144,
    )


async def test_cookies_are_kept_replaced_and_deleted_exactly_as_httpx_keeps_them(
    client: Calls, mock: respx.MockRouter
) -> None:
    """Header names in any case, several cookies in one answer, a deletion (``Max-Age=0``), a
    path the request is under, a domain it is not: what the client sends back is what a plain
    ``httpx`` client sends back after the same answers."""
    headers: list[list[tuple[str, str]]] = [
        [("SET-COOKIE", "A=1; Path=/"), ("set-cookie", "B=2; Path=/v1/namespaces/acme")],
        [],
        [("Set-Cookie", "A=; Max-Age=0; Path=/"), ("Set-Cookie", "C=3; Domain=elsewhere.example; Path=/")],
        [("x-other", "1")],
        [("set-cookie", "D=4; Path=/nowhere"), ("Set-Cookie", "B=5; Path=/v1/namespaces/acme")],
        [],
    ]

    def answers() -> Iterator[httpx.Response]:
        return iter(httpx.Response(200, json=task_json(), headers=h) for h in headers)

    ours = answers()
    route = mock.get("/v1/namespaces/acme/tasks/t-1").mock(side_effect=lambda request: next(ours))
    for _ in headers:
        await client.get_task("acme", "t-1")
    sent = [call.request.headers.get("Cookie") for call in route.calls]

    theirs = answers()
    plain: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        plain.append(request.headers.get("Cookie"))
        return next(theirs)

    with httpx.Client(base_url=BASE, transport=httpx.MockTransport(handler)) as http:
        for _ in headers:
            http.get("/v1/namespaces/acme/tasks/t-1")
    assert sent == plain
    assert sent[1] is not None and "A=1" in sent[1] and "B=2" in sent[1]
    assert sent[3] == "B=2" and sent[5] == "B=5"
