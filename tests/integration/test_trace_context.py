"""The task's W3C trace context on the server (README "Tracing"), on SQLite and MariaDB: stored as
submitted (header or batch item), shown as ``traceparent`` (null when none), handed out with the
lease, carried by the result event; never part of the request digest; a malformed one is ignored."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from orbit_client import OrbitClient
from tests.integration.test_execution_api import Api
from tests.servers import RunningServer

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TP2 = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def api(server: RunningServer) -> Iterator[Api]:
    with Api.in_new_namespace(server) as helper:
        yield helper


def _submit(api: Api, queue: str, key: str, **headers: str) -> tuple[int, dict[str, object]]:
    r = api.http["submit"].post(
        f"/v1/namespaces/{api.ns}/tasks",
        json={"queue": queue, "handler": "h"},
        headers={"Idempotency-Key": key, **headers},
    )
    return r.status_code, r.json()


def test_the_traceparent_header_is_stored_shown_leased_and_carried_by_the_result_event(api: Api) -> None:
    queue = api.queue()
    api.http["admin"].post(f"/v1/namespaces/{api.ns}/subscriptions", json={"name": "s", "queues": [queue]})
    status, task = _submit(api, queue, "k1", traceparent=TP, tracestate="congo=t61rcWkgMzE")
    assert status == 201 and task["traceparent"] == TP and task["tracestate"] == "congo=t61rcWkgMzE"
    # A replay with another trace context names the original task, unchanged: not part of the digest.
    status, replay = _submit(api, queue, "k1", traceparent=TP2)
    assert status == 200 and replay["id"] == task["id"] and replay["traceparent"] == TP
    assert api.http["read"].get(f"/v1/namespaces/{api.ns}/tasks/{task['id']}").json()["traceparent"] == TP
    [grant] = api.lease_response(queue).json()
    assert grant["task"]["traceparent"] == TP and grant["task"]["tracestate"] == "congo=t61rcWkgMzE"
    attempt = grant["attempt"]
    work = api.http["work"]
    assert work.post(f"/v1/namespaces/{api.ns}/attempts/{attempt['id']}/start",
                     json={"lease_token": attempt["lease_token"]}).status_code == 200  # fmt: skip
    assert work.post(f"/v1/namespaces/{api.ns}/attempts/{attempt['id']}/complete",
                     json={"lease_token": attempt["lease_token"], "result": 1}).status_code == 200  # fmt: skip
    [delivery] = work.post(f"/v1/namespaces/{api.ns}/subscriptions/s/deliveries/lease", json={}).json()
    assert delivery["event"]["traceparent"] == TP and delivery["event"]["tracestate"] == "congo=t61rcWkgMzE"


def test_no_or_a_malformed_traceparent_is_null(api: Api) -> None:
    queue = api.queue()
    status, plain = _submit(api, queue, "plain")
    assert status == 201 and plain["traceparent"] is None and plain["tracestate"] is None
    for bad in ("00-" + "0" * 32 + "-00f067aa0ba902b7-01", TP.upper(), "01-nonsense", TP + "-extra"):
        status, task = _submit(api, queue, f"bad-{bad}", traceparent=bad, tracestate="a=b")
        assert status == 201 and task["traceparent"] is None and task["tracestate"] is None, bad


def test_batch_items_carry_their_own_trace_context(api: Api) -> None:
    queue = api.queue()
    with OrbitClient(api.server.base_url, api_key=api.keys["submit"]) as client:
        results = client.submit_tasks(
            api.ns,
            [
                {"idempotency_key": "b1", "queue": queue, "handler": "h", "traceparent": TP},
                {"idempotency_key": "b2", "queue": queue, "handler": "h"},
                {
                    "idempotency_key": "b3",
                    "queue": queue,
                    "handler": "h",
                    "traceparent": TP2,
                    "tracestate": "x=1",
                },
            ],
        )
        assert [r.status for r in results] == [201, 201, 201]
        assert [(r.task.traceparent, r.task.tracestate) for r in results if r.task] == [
            (TP, None), (None, None), (TP2, "x=1"),
        ]  # fmt: skip
        # Same keys, other trace contexts: replays of the same tasks (the digest ignores them).
        again = client.submit_tasks(
            api.ns, [{"idempotency_key": "b2", "queue": queue, "handler": "h", "traceparent": TP}]
        )
        assert again[0].status == 200 and again[0].task is not None and again[0].task.traceparent is None
        # The single call sends them as headers.
        single = client.submit_task(api.ns, queue, "h", {}, idempotency_key="s1", traceparent=TP2)
        assert single.task.traceparent == TP2
