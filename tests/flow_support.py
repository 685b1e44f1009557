"""Helpers of the flow tests: a thin HTTP client over one namespace, a worker that runs step tasks, and
polling with a deadline (never a bare sleep as synchronisation)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx

#: What a handler returns: ("complete", result) or ("fail", error) or ("skip", None) (leave it leased).
Outcome = tuple[str, Any]


def until(check: Callable[[], Any], *, timeout: float = 20.0, interval: float = 0.02, what: str = "") -> Any:
    """Poll ``check()`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what or check}"
        time.sleep(interval)


class FlowApi:
    """One namespace of a running server, with a client per role."""

    def __init__(self, base_url: str, namespace: str, keys: dict[str, str]) -> None:
        self.ns = namespace
        self.http = {
            role: httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
            for role, key in keys.items()
        }

    def close(self) -> None:
        for client in self.http.values():
            client.close()

    def post(self, role: str, path: str, body: Any = None, **headers: str) -> httpx.Response:
        return self.http[role].post(f"/v1/namespaces/{self.ns}{path}", json=body, headers=headers)

    def get(self, path: str, **params: Any) -> httpx.Response:
        return self.http["read"].get(f"/v1/namespaces/{self.ns}{path}", params=params)

    def publish(self, flow: str, graph: dict[str, Any], expect: int = 201) -> dict[str, Any]:
        r = self.post("submit", f"/flows/{flow}/versions", {"graph": graph})
        assert r.status_code == expect, r.text
        return dict(r.json())

    def start(self, flow: str, input: Any = None, *, key: str | None = None, version: int | None = None,
              expect: int = 201) -> dict[str, Any]:  # fmt: skip
        body: dict[str, Any] = {"input": input or {}}
        if version is not None:
            body["version"] = version
        r = self.post(
            "submit", f"/flows/{flow}/instances", body, **{"Idempotency-Key": key or str(uuid.uuid4())}
        )
        assert r.status_code == expect, r.text
        return dict(r.json())

    def instance(self, instance_id: str) -> dict[str, Any]:
        r = self.get(f"/flow-instances/{instance_id}")
        assert r.status_code == 200, r.text
        return dict(r.json())

    def history(self, instance_id: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        cursor = None
        while True:
            r = self.get(f"/flow-instances/{instance_id}/history", **({"cursor": cursor} if cursor else {}))
            assert r.status_code == 200, r.text
            page = r.json()
            items.extend(page["items"])
            cursor = page["next_cursor"]
            if cursor is None:
                return items

    def signal(self, instance_id: str, name: str, payload: Any = None, *, key: str | None = None,
               expect: int = 201) -> dict[str, Any]:  # fmt: skip
        r = self.post("submit", f"/flow-instances/{instance_id}/signals", {"name": name, "payload": payload},
                      **{"Idempotency-Key": key or str(uuid.uuid4())})  # fmt: skip
        assert r.status_code == expect, r.text
        return dict(r.json())

    def control(self, instance_id: str, action: str, expect: int = 200, **body: Any) -> dict[str, Any]:
        r = self.post("admin", f"/flow-instances/{instance_id}/{action}", body)
        assert r.status_code == expect, r.text
        return dict(r.json())

    def wait_status(self, instance_id: str, *statuses: str, timeout: float = 20.0) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            found = self.instance(instance_id)
            return found if found["status"] in statuses else None

        result: dict[str, Any] = until(done, timeout=timeout, what=f"instance {instance_id} to be {statuses}")
        return result

    # ------------------------------------------------------------------ a worker

    def lease(self, queue: str, n: int = 10, wait: float = 0.0) -> list[dict[str, Any]]:
        r = self.post("work", f"/queues/{queue}/leases",
                      {"worker_id": "flow-test", "max_tasks": n, "lease_seconds": 30, "wait_seconds": wait})  # fmt: skip
        assert r.status_code == 200, r.text
        return list(r.json())

    def finish(self, grant: dict[str, Any], outcome: Outcome) -> None:
        attempt = grant["attempt"]
        path = f"/attempts/{attempt['id']}"
        r = self.post("work", f"{path}/start", {"lease_token": attempt["lease_token"]})
        assert r.status_code == 200, r.text
        action, value = outcome
        if action == "skip":
            return
        body = {"lease_token": attempt["lease_token"]}
        body.update({"result": value} if action == "complete" else {"error": value})
        r = self.post("work", f"{path}/{action}", body)
        assert r.status_code == 200, r.text

    def finish_only(self, grant: dict[str, Any], outcome: Outcome) -> None:
        """Report the outcome of an attempt already started."""
        attempt = grant["attempt"]
        action, value = outcome
        body = {"lease_token": attempt["lease_token"]}
        body.update({"result": value} if action == "complete" else {"error": value})
        r = self.post("work", f"/attempts/{attempt['id']}/{action}", body)
        assert r.status_code == 200, r.text

    def work(self, queue: str, handler: Callable[[dict[str, Any]], Outcome], *, n: int = 10,
             wait: float = 0.2) -> list[dict[str, Any]]:  # fmt: skip
        """Lease up to ``n`` tasks (long-polling ``wait`` s), run ``handler(task)`` on each; return the tasks."""
        grants = self.lease(queue, n, wait)
        for grant in grants:
            self.finish(grant, handler(grant["task"]))
        return [grant["task"] for grant in grants]

    def work_batch(self, queue: str, handler: Callable[[dict[str, Any]], Outcome], *, n: int = 200,
                   wait: float = 0.2) -> int:  # fmt: skip
        """Like :meth:`work` through the batched attempt calls (start, then complete and fail set-based)."""
        grants = self.lease(queue, n, wait)
        if not grants:
            return 0
        items = [
            {"attempt_id": g["attempt"]["id"], "lease_token": g["attempt"]["lease_token"]} for g in grants
        ]
        r = self.post("work", "/attempts/start", {"items": items})
        assert r.status_code == 200, r.text
        done: dict[str, list[dict[str, Any]]] = {"complete": [], "fail": []}
        for grant, item in zip(grants, items, strict=True):
            action, value = handler(grant["task"])
            done[action].append({**item, **({"result": value} if action == "complete" else {"error": value})})
        for action, batch in done.items():
            if batch:
                r = self.post("work", f"/attempts/{action}", {"items": batch})
                assert r.status_code == 200, r.text
                assert all(item["status"] == 200 for item in r.json()["items"]), r.text
        return len(grants)


def ok(result: Any = None) -> Callable[[dict[str, Any]], Outcome]:
    """A handler that completes every task with ``result`` (or ``{"handler": ..., "params": ...}``)."""

    def handle(task: dict[str, Any]) -> Outcome:
        return (
            "complete",
            result if result is not None else {"handler": task["handler"], "params": task["params"]},
        )

    return handle


def failing(retryable: bool = False) -> Callable[[dict[str, Any]], Outcome]:
    def handle(task: dict[str, Any]) -> Outcome:
        return ("fail", {"type": "boom", "message": "it failed", "retryable": retryable})

    return handle
