"""The flow calls of OrbitClient / AsyncOrbitClient against respx mocks: every test runs on both clients."""

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
    FlowInstanceStatus,
    FlowSignalResult,
    FlowStartResult,
    IdempotencyConflictError,
    InvalidTransitionError,
    NotFoundError,
    OrbitClient,
    OrbitConnectError,
    OrbitOutcomeUnknownError,
    OrbitUsageError,
    PermissionDeniedError,
    RetryPolicy,
    ServerError,
)

BASE = "https://orbit.test"
NS = "/v1/namespaces/acme"
INSTANCE_ID = "0b6f6f0e-4a4f-4d55-8f3e-3d8b2b7f2a10"
TASK_ID = "7d4c0a52-0f0e-4d2b-9a43-3c1f3e4f5a6b"
T0 = "2026-12-01T15:00:00.000000Z"

GRAPH: dict[str, Any] = {
    "start": "reserve",
    "nodes": {
        "reserve": {"type": "task", "queue": "orders", "handler": "reserve_stock",
                    "params": {"order_id": "$.input.order_id"}, "next": "wait_cancel"},
        "wait_cancel": {"type": "signal", "signal": "cancel", "timeout_seconds": 2,
                        "next": "released", "on_timeout": "done"},
        "done": {"type": "end"},
        "released": {"type": "end", "status": "CANCELLED"},
    },
}  # fmt: skip


def version_json(**changes: Any) -> dict[str, Any]:
    return {"namespace": "acme", "flow": "order", "version": 1, "digest": "ab" * 32, "graph": GRAPH,
            "description": None, "published_at": T0, "published_by": "api_key:1", **changes}  # fmt: skip


def instance_json(**changes: Any) -> dict[str, Any]:
    return {
        "id": INSTANCE_ID, "namespace": "acme", "flow": "order", "version": 1, "status": "RUNNING",
        "paused": False, "input": {"order_id": 7}, "output": None, "error": None, "idempotency_key": "order-7",
        "control_version": 1, "state_version": 3, "created_at": T0, "updated_at": T0, "finished_at": None,
        "tokens": [{"id": "tok-1", "node": "reserve", "state": "WAITING", "activation": 1, "parent_id": None,
                    "task_id": TASK_ID, "waiting_for": "task", "fire_at": None}],
        "steps": [{"node": "reserve", "activation": 1, "token_id": "tok-1", "task_id": TASK_ID,
                   "status": "RUNNING", "result": None, "error": None, "round": None, "created_at": T0,
                   "finished_at": None}],
        "pending_events": 0, **changes,
    }  # fmt: skip


def signal_json(**changes: Any) -> dict[str, Any]:
    return {"id": "sig-1", "instance_id": INSTANCE_ID, "name": "cancel", "idempotency_key": "cancel-7",
            "payload": {"why": "customer"}, "received_at": T0, "consumed_by_token": None,
            "consumed_at": None, **changes}  # fmt: skip


def history_json(n: int) -> dict[str, Any]:
    return {"id": n, "at": T0, "event": "token_moved", "token_id": "tok-1", "node": "reserve", "activation": 1,
            "from_state": "ACTIVE", "to_state": "WAITING", "actor": "engine", "data": {}}  # fmt: skip


def problem(status: int, code: str) -> httpx.Response:
    body = {
        "type": "about:blank",
        "title": code,
        "status": status,
        "code": code,
        "detail": f"detail of {code}",
    }
    return httpx.Response(status, json=body, headers={"Content-Type": "application/problem+json"})


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
def mock() -> Iterator[respx.MockRouter]:
    with respx.mock(base_url=BASE, assert_all_called=False) as router:
        yield router


@pytest.fixture(params=["sync", "async"])
async def client(request: pytest.FixtureRequest, mock: respx.MockRouter) -> AsyncIterator[Calls]:
    cls = OrbitClient if request.param == "sync" else AsyncOrbitClient
    made = cls(BASE, api_key="k", retry=RetryPolicy.no_wait(), transport=httpx.MockTransport(mock.handler))
    yield Calls(made)
    if isinstance(made, OrbitClient):
        made.close()
    else:
        await made.aclose()


def sent(route: respx.Route, index: int = -1) -> Any:
    content = route.calls[index].request.content
    return json.loads(content) if content else None


# --- definitions -----------------------------------------------------------------------------------


async def test_publish_validates_the_graph_and_posts_it(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.post(f"{NS}/flows/order/versions").mock(
        return_value=httpx.Response(201, json=version_json())
    )
    version = await client.publish_flow("acme", "order", GRAPH, description="first")
    assert version.version == 1 and version.flow == "order"
    body = sent(route)
    assert body["description"] == "first"
    assert body["graph"]["start"] == "reserve"
    assert body["graph"]["nodes"]["reserve"]["params"] == {"order_id": "$.input.order_id"}


async def test_republishing_the_same_graph_answers_the_existing_version(
    client: Calls, mock: respx.MockRouter
) -> None:
    mock.post(f"{NS}/flows/order/versions").mock(
        return_value=httpx.Response(200, json=version_json(version=2))
    )
    assert (await client.publish_flow("acme", "order", GRAPH)).version == 2


async def test_a_flow_name_the_route_refuses_is_refused_before_sending(
    client: Calls, mock: respx.MockRouter
) -> None:
    """'a/b' would otherwise reach no route (a bare 404 not_found); the name rule is the queue names'."""
    route = mock.post(url__regex=r".*/flows/.*")
    for name in ("a/b", "Bad Name", "", "x" * 65):
        with pytest.raises(OrbitUsageError, match=r"is not a flow name.*nothing was sent"):
            await client.publish_flow("acme", name, GRAPH)
        with pytest.raises(OrbitUsageError, match="is not a flow name"):
            await client.start_flow("acme", name, {}, idempotency_key="k")
    assert not route.called


async def test_an_invalid_graph_is_refused_before_sending(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.post(f"{NS}/flows/order/versions")
    broken = {"start": "reserve", "nodes": {"reserve": {"type": "task", "queue": "q", "handler": "h",
                                                        "next": "nowhere"}}}  # fmt: skip
    with pytest.raises(OrbitUsageError, match="nothing was sent") as refused:
        await client.publish_flow("acme", "order", broken)
    assert "node 'reserve': next 'nowhere' is not a node" in str(refused.value)
    assert "Value error" not in str(refused.value)
    with pytest.raises(OrbitUsageError, match="FlowGraph or a mapping"):
        await client.publish_flow("acme", "order", json.dumps(GRAPH))
    assert not route.called


async def test_publish_is_retried_after_a_lost_answer(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.post(f"{NS}/flows/order/versions").mock(
        side_effect=[httpx.ReadTimeout("lost"), httpx.Response(200, json=version_json())]
    )
    assert (await client.publish_flow("acme", "order", GRAPH)).version == 1
    assert route.call_count == 2 and sent(route, 0) == sent(route, 1)


async def test_list_flows_versions_and_one_version(client: Calls, mock: respx.MockRouter) -> None:
    summary = {"namespace": "acme", "name": "order", "latest_version": 2, "created_at": T0, "updated_at": T0}
    mock.get(f"{NS}/flows").mock(return_value=httpx.Response(200, json=[summary]))
    mock.get(f"{NS}/flows/order/versions").mock(
        return_value=httpx.Response(200, json=[version_json(version=2), version_json()])
    )
    mock.get(f"{NS}/flows/order/versions/2").mock(
        return_value=httpx.Response(200, json=version_json(version=2))
    )
    mock.get(f"{NS}/flows/order/versions/9").mock(return_value=problem(404, "flow_version_not_found"))
    flows = await client.list_flows("acme")
    assert [(f.name, f.latest_version) for f in flows] == [("order", 2)]
    assert [v.version for v in await client.list_flow_versions("acme", "order")] == [2, 1]
    assert (await client.get_flow_version("acme", "order", 2)).version == 2
    with pytest.raises(NotFoundError) as info:
        await client.get_flow_version("acme", "order", 9)
    assert info.value.code == "flow_version_not_found"
    for bad in (0, -1, True, "2"):
        with pytest.raises(OrbitUsageError):
            await client.get_flow_version("acme", "order", bad)


async def test_names_are_quoted_into_one_path_segment(client: Calls, mock: respx.MockRouter) -> None:
    # A flow name with "/" is refused before sending (see above); the namespace is still quoted.
    route = mock.get(f"{NS.replace('/acme', '/a%2Fb')}/flows/order/versions").mock(
        return_value=httpx.Response(200, json=[])
    )
    assert await client.list_flow_versions("a/b", "order") == []
    assert route.called


# --- start -------------------------------------------------------------------------------------------


async def test_start_201_is_new_and_200_a_replay(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.post(f"{NS}/flows/order/instances").mock(
        side_effect=[httpx.Response(201, json=instance_json()), httpx.Response(200, json=instance_json())]
    )
    first = await client.start_flow("acme", "order", {"order_id": 7}, idempotency_key="order-7")
    again = await client.start_flow("acme", "order", {"order_id": 7}, idempotency_key="order-7")
    assert isinstance(first, FlowStartResult)
    assert first.replayed is False and again.replayed is True
    assert first.instance.id == again.instance.id == INSTANCE_ID
    assert first.instance.status is FlowInstanceStatus.RUNNING
    assert first.instance.tokens[0].task_id == TASK_ID and first.instance.steps[0].node == "reserve"
    request = route.calls[0].request
    assert request.headers["Idempotency-Key"] == "order-7"
    assert sent(route, 0) == {"input": {"order_id": 7}}  # no version: the newest


async def test_start_names_a_version_and_defaults_input_to_an_object(
    client: Calls, mock: respx.MockRouter
) -> None:
    route = mock.post(f"{NS}/flows/order/instances").mock(
        return_value=httpx.Response(201, json=instance_json())
    )
    await client.start_flow("acme", "order", idempotency_key="k-1", version=3)
    assert sent(route) == {"input": {}, "version": 3}


async def test_start_refuses_bad_arguments_before_sending(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.post(f"{NS}/flows/order/instances")
    for kwargs in (
        {"idempotency_key": ""},
        {"idempotency_key": " padded"},
        {"idempotency_key": "k", "version": 0},
        {"idempotency_key": "k", "input": [1, 2]},
        {"idempotency_key": "k", "traceparent": "not-a-traceparent"},
    ):
        with pytest.raises(OrbitUsageError, match="nothing was sent"):
            await client.start_flow("acme", "order", **kwargs)
    with pytest.raises(OrbitUsageError):  # NaN is no JSON: refused by the model or by the encoder
        await client.start_flow("acme", "order", {"x": float("nan")}, idempotency_key="k")
    assert not route.called


async def test_start_sends_the_trace_context(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.post(f"{NS}/flows/order/instances").mock(
        return_value=httpx.Response(201, json=instance_json())
    )
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    await client.start_flow("acme", "order", idempotency_key="k", traceparent=traceparent, tracestate="a=b")
    headers = route.calls.last.request.headers
    assert headers["traceparent"] == traceparent and headers["tracestate"] == "a=b"


async def test_start_after_a_lost_answer_retries_with_the_same_key(
    client: Calls, mock: respx.MockRouter
) -> None:
    route = mock.post(f"{NS}/flows/order/instances").mock(
        side_effect=[httpx.ReadTimeout("lost"), httpx.Response(200, json=instance_json())]
    )
    result = await client.start_flow("acme", "order", {"order_id": 7}, idempotency_key="order-7")
    assert result.replayed is True
    keys = [call.request.headers["Idempotency-Key"] for call in route.calls]
    assert keys == ["order-7", "order-7"] and sent(route, 0) == sent(route, 1)


async def test_start_outcome_unknown_says_how_to_settle_it(client: Calls, mock: respx.MockRouter) -> None:
    mock.post(f"{NS}/flows/order/instances").mock(side_effect=httpx.ReadTimeout("lost"))
    with pytest.raises(OrbitOutcomeUnknownError) as info:
        await client.start_flow("acme", "order", idempotency_key="order-7")
    assert info.value.outcome_known is False and info.value.retryable is True
    assert any("find_flow_instance('acme', 'order-7')" in note for note in info.value.__notes__)


async def test_start_5xx_is_outcome_unknown_and_connect_refused_is_not(
    client: Calls, mock: respx.MockRouter
) -> None:
    route = mock.post(f"{NS}/flows/order/instances").mock(return_value=problem(500, "internal_error"))
    with pytest.raises(ServerError) as info:
        await client.start_flow("acme", "order", idempotency_key="k")
    assert info.value.outcome_known is False and route.call_count == 4
    route.mock(side_effect=httpx.ConnectError("refused"))
    with pytest.raises(OrbitConnectError) as connect:
        await client.start_flow("acme", "order", idempotency_key="k")
    assert connect.value.outcome_known is True
    assert not any("find_flow_instance" in note for note in getattr(connect.value, "__notes__", []))


async def test_start_refusals_are_definite(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.post(f"{NS}/flows/order/instances")
    for status, code, error in (
        (409, "idempotency_conflict", IdempotencyConflictError),
        (404, "flow_not_found", NotFoundError),
        (404, "flow_version_not_found", NotFoundError),
        (403, "forbidden", PermissionDeniedError),
    ):
        route.mock(return_value=problem(status, code))
        route.reset()
        with pytest.raises(error) as info:
            await client.start_flow("acme", "order", idempotency_key="k")
        assert info.value.code == code and info.value.outcome_known is True
        assert info.value.retryable is False and route.call_count == 1


async def test_find_flow_instance_settles_an_unknown_start(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.get(f"{NS}/flow-instances").mock(
        side_effect=[
            httpx.Response(200, json={"items": [instance_json()], "next_cursor": None}),
            httpx.Response(200, json={"items": [], "next_cursor": None}),
        ]
    )
    found = await client.find_flow_instance("acme", "order-7")
    assert found is not None and found.id == INSTANCE_ID
    assert await client.find_flow_instance("acme", "order-8") is None
    assert dict(route.calls[0].request.url.params) == {"idempotency_key": "order-7", "limit": "1"}
    with pytest.raises(OrbitUsageError):
        await client.find_flow_instance("acme", "")


# --- signals ------------------------------------------------------------------------------------------


async def test_signal_posts_name_payload_and_key(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.post(f"{NS}/flow-instances/{INSTANCE_ID}/signals").mock(
        side_effect=[httpx.Response(201, json=signal_json()), httpx.Response(200, json=signal_json())]
    )
    first = await client.signal_flow(
        "acme", INSTANCE_ID, "cancel", {"why": "customer"}, idempotency_key="c-7"
    )
    again = await client.signal_flow(
        "acme", INSTANCE_ID, "cancel", {"why": "customer"}, idempotency_key="c-7"
    )
    assert isinstance(first, FlowSignalResult)
    assert (first.replayed, again.replayed) == (False, True)
    assert first.signal.name == "cancel"
    assert sent(route, 0) == {"name": "cancel", "payload": {"why": "customer"}}
    assert route.calls[0].request.headers["Idempotency-Key"] == "c-7"


async def test_signal_without_payload_sends_none(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.post(f"{NS}/flow-instances/{INSTANCE_ID}/signals").mock(
        return_value=httpx.Response(201, json=signal_json(payload=None))
    )
    await client.signal_flow("acme", INSTANCE_ID, "cancel", idempotency_key="c-7")
    assert sent(route) == {"name": "cancel"}


async def test_signal_refusals_and_unknown_outcome(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.post(f"{NS}/flow-instances/{INSTANCE_ID}/signals")
    with pytest.raises(OrbitUsageError):
        await client.signal_flow("acme", INSTANCE_ID, "Not A Name", idempotency_key="c")
    with pytest.raises(OrbitUsageError):
        await client.signal_flow("acme", INSTANCE_ID, "cancel", idempotency_key="")
    assert not route.called
    route.mock(return_value=problem(409, "invalid_transition"))
    with pytest.raises(InvalidTransitionError):
        await client.signal_flow("acme", INSTANCE_ID, "cancel", idempotency_key="c")
    route.mock(return_value=problem(409, "idempotency_conflict"))
    with pytest.raises(IdempotencyConflictError):
        await client.signal_flow("acme", INSTANCE_ID, "cancel", idempotency_key="c")
    route.mock(side_effect=httpx.RemoteProtocolError("reset"))
    with pytest.raises(OrbitOutcomeUnknownError) as info:
        await client.signal_flow("acme", INSTANCE_ID, "cancel", idempotency_key="c")
    assert any("same idempotency key" in note for note in info.value.__notes__)


# --- instances ----------------------------------------------------------------------------------------


async def test_get_and_list_instances(client: Calls, mock: respx.MockRouter) -> None:
    mock.get(f"{NS}/flow-instances/{INSTANCE_ID}").mock(
        return_value=httpx.Response(200, json=instance_json(pending_events=2))
    )
    route = mock.get(f"{NS}/flow-instances").mock(
        return_value=httpx.Response(200, json={"items": [instance_json()], "next_cursor": "c2"})
    )
    assert (await client.get_flow_instance("acme", INSTANCE_ID)).pending_events == 2
    page = await client.list_flow_instances("acme", flow="order", status="RUNNING", limit=10, cursor="c1")
    assert page.next_cursor == "c2" and page.items[0].id == INSTANCE_ID
    assert dict(route.calls.last.request.url.params) == {
        "flow": "order", "status": "RUNNING", "limit": "10", "cursor": "c1"
    }  # fmt: skip
    await client.list_flow_instances("acme", status=FlowInstanceStatus.PAUSED)
    assert route.calls.last.request.url.params["status"] == "PAUSED"
    for bad in ({"limit": 0}, {"limit": 501}, {"status": "BOGUS"}):
        with pytest.raises(OrbitUsageError):
            await client.list_flow_instances("acme", **bad)


async def test_history_pages(client: Calls, mock: respx.MockRouter) -> None:
    route = mock.get(f"{NS}/flow-instances/{INSTANCE_ID}/history").mock(
        side_effect=[
            httpx.Response(200, json={"items": [history_json(1), history_json(2)], "next_cursor": "2"}),
            httpx.Response(200, json={"items": [history_json(3)], "next_cursor": None}),
        ]
    )
    first = await client.get_flow_history("acme", INSTANCE_ID, limit=2)
    second = await client.get_flow_history("acme", INSTANCE_ID, limit=2, cursor=first.next_cursor)
    assert [e.id for e in [*first.items, *second.items]] == [1, 2, 3] and second.next_cursor is None
    assert dict(route.calls[1].request.url.params) == {"limit": "2", "cursor": "2"}


async def test_control_calls_post_reason_and_actor(client: Calls, mock: respx.MockRouter) -> None:
    base = f"{NS}/flow-instances/{INSTANCE_ID}"
    pause = mock.post(f"{base}/pause").mock(
        return_value=httpx.Response(200, json=instance_json(status="PAUSED", paused=True, control_version=2))
    )
    resume = mock.post(f"{base}/resume").mock(return_value=httpx.Response(200, json=instance_json()))
    cancel = mock.post(f"{base}/cancel").mock(
        return_value=httpx.Response(200, json=instance_json(status="CANCELLED", finished_at=T0))
    )
    paused = await client.pause_flow_instance(
        "acme", INSTANCE_ID, reason="stock audit", actor="ops@example.com"
    )
    assert paused.paused and paused.status is FlowInstanceStatus.PAUSED
    assert sent(pause) == {"reason": "stock audit", "actor": "ops@example.com"}
    assert (await client.resume_flow_instance("acme", INSTANCE_ID)).status is FlowInstanceStatus.RUNNING
    assert sent(resume) == {}
    done = await client.cancel_flow_instance("acme", INSTANCE_ID, reason="customer left")
    assert done.status is FlowInstanceStatus.CANCELLED and sent(cancel) == {"reason": "customer left"}


async def test_cancelling_a_finished_instance_is_an_invalid_transition(
    client: Calls, mock: respx.MockRouter
) -> None:
    route = mock.post(f"{NS}/flow-instances/{INSTANCE_ID}/cancel").mock(
        return_value=problem(409, "invalid_transition")
    )
    with pytest.raises(InvalidTransitionError) as info:
        await client.cancel_flow_instance("acme", INSTANCE_ID)
    assert info.value.outcome_known is True and route.call_count == 1
    assert "get_flow_instance()" in str(info.value)  # the hint names the flow call, not only the task one


async def test_a_cancel_whose_answer_was_lost_ends_outcome_unknown(
    client: Calls, mock: respx.MockRouter
) -> None:
    """The retry after a lost answer finds the instance finished: the error must not claim it did nothing."""
    mock.post(f"{NS}/flow-instances/{INSTANCE_ID}/cancel").mock(
        side_effect=[httpx.ReadTimeout("lost"), problem(409, "invalid_transition")]
    )
    with pytest.raises(InvalidTransitionError) as info:
        await client.cancel_flow_instance("acme", INSTANCE_ID)
    assert info.value.outcome_known is False


async def test_a_body_that_is_not_an_instance_is_an_invalid_response(
    client: Calls, mock: respx.MockRouter
) -> None:
    mock.get(f"{NS}/flow-instances/{INSTANCE_ID}").mock(return_value=httpx.Response(200, json={"id": 1}))
    with pytest.raises(Exception) as info:
        await client.get_flow_instance("acme", INSTANCE_ID)
    assert getattr(info.value, "code", None) == "invalid_response"


def test_the_async_client_has_every_flow_call_with_the_same_signature() -> None:
    from orbit_client._flows import FlowMixin

    names = [n for n in vars(FlowMixin) if not n.startswith("_") and callable(getattr(FlowMixin, n))]
    assert len(names) == 13
    for name in names:
        sync, twin = getattr(OrbitClient, name), getattr(AsyncOrbitClient, name)
        assert inspect.iscoroutinefunction(twin), name
        assert inspect.signature(sync) == inspect.signature(twin), name
