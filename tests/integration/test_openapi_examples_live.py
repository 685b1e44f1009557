"""A client author who copies a request example of ``/openapi.json`` gets an answer about the state of
things, never a refusal of the body (issue 29, item 5): every request-body example, sent as it is to a live
server on each database, is read by the server (no ``422``), and answered without a server error. An
example naming an attempt that does not exist gets ``404 attempt_not_found``, a review of a task that does
not need one ``409 invalid_transition``: the server's answers to the state, after reading the body.

``tests/unit/test_openapi_examples.py`` checks the examples against their schemas and models; this checks
what neither can: the server's own rules beyond the models (a cron expression and a time zone it can
evaluate, a flow start, a signal, a schedule's bounds).
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from tests.servers import RunningServer

GRAPH = {
    "start": "a",
    "nodes": {"a": {"type": "task", "queue": "emails", "handler": "h", "next": "e"}, "e": {"type": "end"}},
}


def test_every_request_example_is_read_by_the_server(server: RunningServer) -> None:
    namespace = f"examples-{uuid.uuid4().hex[:8]}"
    keys = server.add_namespace(namespace, ("emails", "reports", "sync", "payments"))
    with httpx.Client(
        base_url=server.base_url, headers={"Authorization": f"Bearer {keys['admin']}"}, timeout=60
    ) as http:
        document = http.get("/openapi.json").json()
        prefix = f"/v1/namespaces/{namespace}"
        tasks = [
            http.post(
                f"{prefix}/tasks",
                json={"queue": "emails", "handler": "h"},
                headers={"Idempotency-Key": f"seed-{i}"},
            ).json()
            for i in range(2)
        ]  # due, so that the long-poll lease example answers at once
        assert http.post(f"{prefix}/flows/order/versions", json={"graph": GRAPH}).status_code == 201
        instance = http.post(f"{prefix}/flows/order/instances", json={}, headers={"Idempotency-Key": "seed"})
        assert instance.status_code == 201, instance.text
        ids = {
            "namespace": namespace,
            "queue": "emails",
            "task_id": tasks[0]["id"],
            "attempt_id": "ae27e1ef-231b-4054-9521-88a4f9b82357",
            "instance_id": instance.json()["id"],
        }
        sent: list[str] = []
        failures: list[str] = []
        for path, operations in document["paths"].items():
            for method, operation in operations.items():
                media: dict[str, Any] = (
                    operation.get("requestBody", {}).get("content", {}).get("application/json", {})
                )
                if not media.get("examples"):
                    continue
                name = "billing" if "/subscriptions/" in path else "order"
                url = path.format(**ids, name=name)
                for example_name, example in media.get("examples", {}).items():
                    where = f"{operation['operationId']} ({example_name})"
                    response = http.request(
                        method, url, json=example["value"], headers={"Idempotency-Key": str(uuid.uuid4())}
                    )
                    sent.append(where)
                    if response.status_code == 422 or response.status_code >= 500:
                        failures.append(f"{where}: {response.status_code} {response.text[:300]}")
    assert not failures, "\n".join(failures)
    assert len(sent) >= 25, sent
