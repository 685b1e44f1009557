"""The queue control calls of OrbitClient / AsyncOrbitClient (update, pause, resume), against respx mocks."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import respx

from orbit_client import AsyncOrbitClient, OrbitClient, SubmitOptions

BASE = "https://orbit.test"
QUEUE = f"{BASE}/v1/namespaces/acme/queues/fulfil"


def queue_json(**changes: Any) -> dict[str, Any]:
    return {"namespace": "acme", "name": "fulfil", "created_at": "2026-12-01T00:00:00Z", "counts": {},
            "paused": False, "max_concurrency_per_key": None, "max_concurrency": None, "control_version": 1,
            **changes}  # fmt: skip


@respx.mock
def test_update_sends_only_the_limits_given_and_null_removes_one() -> None:
    route = respx.patch(QUEUE).mock(
        return_value=httpx.Response(200, json=queue_json(max_concurrency_per_key=1))
    )
    with OrbitClient(BASE, api_key="k") as client:
        queue = client.update_queue("acme", "fulfil", max_concurrency_per_key=1, reason="one per customer")
        client.update_queue("acme", "fulfil", max_concurrency=None)
    assert queue.max_concurrency_per_key == 1 and queue.max_concurrency is None
    bodies = [json.loads(call.request.content) for call in route.calls]
    assert bodies == [{"max_concurrency_per_key": 1, "reason": "one per customer"}, {"max_concurrency": None}]


@respx.mock
def test_pause_and_resume_post_the_audit_fields() -> None:
    pause = respx.post(f"{QUEUE}/pause").mock(return_value=httpx.Response(200, json=queue_json(paused=True)))
    resume = respx.post(f"{QUEUE}/resume").mock(return_value=httpx.Response(200, json=queue_json()))
    with OrbitClient(BASE, api_key="k") as client:
        assert client.pause_queue("acme", "fulfil", reason="maintenance", actor="ops@example.com").paused
        assert not client.resume_queue("acme", "fulfil").paused
    assert json.loads(pause.calls[0].request.content) == {"reason": "maintenance", "actor": "ops@example.com"}
    assert resume.calls[0].request.content in (b"", b"null")


@respx.mock
async def test_async_twins() -> None:
    respx.post(f"{QUEUE}/pause").mock(return_value=httpx.Response(200, json=queue_json(paused=True)))
    respx.patch(QUEUE).mock(return_value=httpx.Response(200, json=queue_json(max_concurrency=5)))
    async with AsyncOrbitClient(BASE, api_key="k") as client:
        assert (await client.pause_queue("acme", "fulfil")).paused
        assert (await client.update_queue("acme", "fulfil", max_concurrency=5)).max_concurrency == 5


def test_concurrency_key_is_printable_ascii_and_digested_only_when_set() -> None:
    from orbit_client import TaskSubmission

    plain = TaskSubmission(queue="q", handler="h").canonical_meaning()
    assert TaskSubmission(queue="q", handler="h", options=SubmitOptions()).canonical_meaning() == plain
    keyed = TaskSubmission(queue="q", handler="h", options=SubmitOptions(concurrency_key="customer-7"))
    assert keyed.canonical_meaning()["options"] == {"concurrency_key": "customer-7"}
    with pytest.raises(ValueError):
        SubmitOptions(concurrency_key="has space")
