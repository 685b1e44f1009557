"""The client against a real server: what a user of OrbitClient / AsyncOrbitClient relies on."""

from __future__ import annotations

import socket
import uuid

import pytest

from orbit_client import (
    AsyncOrbitClient,
    AuthenticationError,
    IdempotencyKeyReusedError,
    NotFoundError,
    OrbitClient,
    OrbitConnectError,
    PermissionDeniedError,
    RetryPolicy,
    SubmitOptions,
    TaskStatus,
)
from tests.servers import RunningServer


@pytest.fixture(scope="module")
def ns(server: RunningServer) -> tuple[str, dict[str, str]]:
    name = f"client-{uuid.uuid4().hex[:8]}"
    return name, server.add_namespace(name, ("default",))


def test_submit_replay_and_lookups(server: RunningServer, ns: tuple[str, dict[str, str]]) -> None:
    name, keys = ns
    key = f"order-{uuid.uuid4()}"
    params = {"sku": "TEE-ÉTÉ-42", "amount_cents": 1999, "tags": [], "gift": None}
    with OrbitClient(server.base_url, api_key=keys["submit"]) as client:
        first = client.submit_task(name, "default", "orders.fulfil", params, idempotency_key=key,
                                   options=SubmitOptions(max_attempts=5))  # fmt: skip
        again = client.submit_task(name, "default", "orders.fulfil", params, idempotency_key=key,
                                   options={"max_attempts": 5})  # fmt: skip
        assert (first.replayed, again.replayed) == (False, True)
        assert again.task == first.task
        assert first.task.status is TaskStatus.WAITING and first.task.max_attempts == 5
        assert first.task.params == params
        assert client.get_task(name, first.task.id) == first.task
        assert client.find_submission(name, key) == first.task
        assert client.find_submission(name, f"never-{uuid.uuid4()}") is None
        assert client.get_queue(name, "default").counts[TaskStatus.WAITING] >= 1
        with pytest.raises(IdempotencyKeyReusedError) as reused:
            client.submit_task(
                name, "default", "orders.fulfil", {**params, "amount_cents": 1}, idempotency_key=key
            )
        assert reused.value.status_code == 422 and not reused.value.retryable and reused.value.outcome_known
        assert reused.value.request_id
        with pytest.raises(NotFoundError) as missing:
            client.submit_task(name, "nope", "orders.fulfil", params, idempotency_key=f"k-{uuid.uuid4()}")
        assert missing.value.code == "queue_not_found"


async def test_async_client_same_behaviour(server: RunningServer, ns: tuple[str, dict[str, str]]) -> None:
    name, keys = ns
    key = f"order-{uuid.uuid4()}"
    async with AsyncOrbitClient(server.base_url, api_key=keys["submit"]) as client:
        first = await client.submit_task(name, "default", "orders.fulfil", [1, [2, []]], idempotency_key=key)
        again = await client.submit_task(name, "default", "orders.fulfil", [1, [2, []]], idempotency_key=key)
        assert (first.replayed, again.replayed) == (False, True) and again.task.id == first.task.id
        assert await client.find_submission(name, key) == first.task
        assert (await client.get_task(name, first.task.id)).params == [1, [2, []]]


def test_auth_errors_are_typed(server: RunningServer, ns: tuple[str, dict[str, str]]) -> None:
    name, keys = ns
    with OrbitClient(server.base_url, api_key="orbit_unknown") as client, pytest.raises(AuthenticationError):
        client.get_queue(name, "default")
    with (
        OrbitClient(server.base_url, api_key=keys["read"]) as client,
        pytest.raises(PermissionDeniedError) as denied,
    ):
        client.submit_task(name, "default", "h", None, idempotency_key=f"k-{uuid.uuid4()}")
    assert denied.value.code == "forbidden" and denied.value.outcome_known


def test_refused_connection_is_known_not_accepted() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    policy = RetryPolicy(max_attempts=2, sleep=lambda _s: None)
    with (
        OrbitClient(f"http://127.0.0.1:{port}", api_key="k", retry=policy) as client,
        pytest.raises(OrbitConnectError) as refused,
    ):
        client.submit_task("ns", "q", "h", {}, idempotency_key="k-1")
    assert refused.value.outcome_known is True and refused.value.retryable is True
