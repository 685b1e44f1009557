"""The result-event calls of OrbitClient / AsyncOrbitClient (subscriptions, deliveries), against respx mocks."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import respx

from orbit_client import (
    AsyncOrbitClient,
    ConflictError,
    Delivery,
    NotFoundError,
    OrbitClient,
    OrbitUsageError,
    ResultEvent,
    RetryPolicy,
    ServiceUnavailableError,
    Subscription,
    TaskStatus,
)

BASE = "https://orbit.test"
SUBS = f"{BASE}/v1/namespaces/acme/subscriptions"


def subscription_json(**changes: Any) -> dict[str, Any]:
    return {
        "namespace": "acme",
        "name": "billing",
        "queues": ["orders"],
        "created_at": "2026-01-01T00:00:00.000000Z",
        **changes,
    }


def delivery_json(delivery_id: str = "7", count: int = 1) -> dict[str, Any]:
    return {
        "id": delivery_id,
        "subscription": "billing",
        "delivery_count": count,
        "lease_expires_at": "2026-01-01T00:00:30.000000Z",
        "event": {
            "id": "0b7e4c1e-2f6a-4c1b-9d7e-0c1f2a3b4c5d",
            "task_id": "t-1",
            "namespace": "acme",
            "queue": "orders",
            "handler": "orders.fulfil",
            "status": "SUCCEEDED",
            "result": {"receipt": "R-1", "amount": 1999},
            "error": None,
            "occurred_at": "2026-01-01T00:00:01.500000Z",
        },
    }


def problem(status: int, code: str) -> httpx.Response:
    body = {"title": code, "status": status, "code": code}
    return httpx.Response(status, json=body, headers={"content-type": "application/problem+json"})


def client() -> OrbitClient:
    return OrbitClient(BASE, api_key="k", retry=RetryPolicy.no_wait())


@respx.mock
def test_create_subscription_sends_name_and_queues_and_is_retried() -> None:
    route = respx.post(SUBS).mock(
        side_effect=[problem(503, "unavailable"), httpx.Response(201, json=subscription_json())]
    )
    with client() as orbit:
        created = orbit.create_subscription("acme", "billing", queues=["orders"])
    assert created == Subscription.model_validate(subscription_json())
    assert created.created_at.tzinfo is not None
    assert route.call_count == 2  # idempotent: the same name and queues answer 200 with the same one
    assert json.loads(route.calls.last.request.content) == {"name": "billing", "queues": ["orders"]}


@respx.mock
def test_create_subscription_for_every_queue_and_its_conflict() -> None:
    route = respx.post(SUBS).mock(
        side_effect=[
            httpx.Response(200, json=subscription_json(queues=None)),
            problem(409, "subscription_exists"),
        ]
    )
    with client() as orbit:
        assert orbit.create_subscription("acme", "billing").queues is None
        with pytest.raises(ConflictError) as caught:
            orbit.create_subscription("acme", "billing", queues=["other"])
    assert caught.value.code == "subscription_exists" and not caught.value.retryable
    assert json.loads(route.calls[0].request.content) == {"name": "billing", "queues": None}


@respx.mock
def test_bad_subscription_arguments_send_nothing() -> None:
    route = respx.post(SUBS).respond(201, json=subscription_json())
    with client() as orbit:
        with pytest.raises(OrbitUsageError, match="not one string"):
            orbit.create_subscription("acme", "billing", queues="orders")
        with pytest.raises(OrbitUsageError, match="name"):
            orbit.create_subscription("acme", "bad name")
        with pytest.raises(OrbitUsageError, match="queues"):
            orbit.create_subscription("acme", "billing", queues=[])
        with pytest.raises(OrbitUsageError, match="max"):
            orbit.lease_deliveries("acme", "billing", max=501)
        with pytest.raises(OrbitUsageError, match="lease_seconds"):
            orbit.lease_deliveries("acme", "billing", lease_seconds=0)
    assert route.call_count == 0


@respx.mock
def test_get_subscription_quotes_the_name() -> None:
    route = respx.get(f"{SUBS}/a%2Fb").respond(json=subscription_json())
    with client() as orbit:
        assert orbit.get_subscription("acme", "a/b").name == "billing"
    assert route.called


@respx.mock
def test_lease_deliveries_parses_them_and_is_not_retried() -> None:
    route = respx.post(f"{SUBS}/billing/deliveries/lease").mock(
        side_effect=[
            httpx.Response(200, json=[delivery_json("7"), delivery_json("8", count=2)]),
            problem(503, "unavailable"),
        ]
    )
    with client() as orbit:
        deliveries = orbit.lease_deliveries("acme", "billing", max=50, lease_seconds=12.5)
        with pytest.raises(ServiceUnavailableError):
            orbit.lease_deliveries("acme", "billing")
    assert route.call_count == 2  # one call each: a lost answer only delays those deliveries
    assert [json.loads(c.request.content) for c in route.calls] == [
        {"max": 50, "lease_seconds": 12.5},
        {"max": 10, "lease_seconds": 30.0},
    ]
    assert [d.id for d in deliveries] == ["7", "8"] and deliveries[1].delivery_count == 2
    event = deliveries[0].event
    assert isinstance(deliveries[0], Delivery) and isinstance(event, ResultEvent)
    assert event.status is TaskStatus.SUCCEEDED and event.result == {"receipt": "R-1", "amount": 1999}
    assert event.occurred_at.microsecond == 500000


@respx.mock
def test_ack_delivery_is_retried_and_returns_none() -> None:
    route = respx.post(f"{SUBS}/billing/deliveries/7/ack").mock(
        side_effect=[
            problem(503, "unavailable"),
            httpx.Response(
                200, json={"id": "7", "subscription": "billing", "acked_at": "2026-01-01T00:00:02Z"}
            ),
        ]
    )
    missing = respx.post(f"{SUBS}/billing/deliveries/9/ack").mock(
        return_value=problem(404, "delivery_not_found")
    )
    with client() as orbit:
        assert orbit.ack_delivery("acme", "billing", "7") is None
        with pytest.raises(NotFoundError) as caught:
            orbit.ack_delivery("acme", "billing", "9")
    assert route.call_count == 2 and missing.call_count == 1
    assert caught.value.code == "delivery_not_found"
    assert route.calls.last.request.content == b""


@respx.mock
async def test_async_twins() -> None:
    create = respx.post(SUBS).respond(201, json=subscription_json())
    get = respx.get(f"{SUBS}/billing").respond(json=subscription_json())
    lease = respx.post(f"{SUBS}/billing/deliveries/lease").mock(
        side_effect=[problem(503, "unavailable"), httpx.Response(200, json=[delivery_json()])]
    )
    ack = respx.post(f"{SUBS}/billing/deliveries/7/ack").mock(
        side_effect=[
            problem(503, "unavailable"),
            httpx.Response(
                200, json={"id": "7", "subscription": "billing", "acked_at": "2026-01-01T00:00:02Z"}
            ),
        ]
    )
    async with AsyncOrbitClient(BASE, api_key="k", retry=RetryPolicy.no_wait()) as orbit:
        assert (await orbit.create_subscription("acme", "billing", queues=["orders"])).queues == ["orders"]
        assert (await orbit.get_subscription("acme", "billing")).name == "billing"
        with pytest.raises(ServiceUnavailableError):
            await orbit.lease_deliveries("acme", "billing", max=3)
        (delivery,) = await orbit.lease_deliveries("acme", "billing", max=3)
        assert await orbit.ack_delivery("acme", "billing", delivery.id) is None
    assert create.called and get.called
    assert lease.call_count == 2 and ack.call_count == 2
    assert json.loads(lease.calls.last.request.content) == {"max": 3, "lease_seconds": 30.0}
