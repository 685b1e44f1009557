"""Tasks in the states the console tests look at, made through the HTTP API of a real server."""

from __future__ import annotations

import re
import uuid
from datetime import datetime
from typing import Any

import httpx

from orbit_server.db.schema import task_attempts
from orbit_server.db.transact import transact
from orbit_server.tasks import leases as leasing
from orbit_server.tasks import store
from tests.servers import RunningServer

#: What the worker SDK will store with a failure (issue 10, item 3); the console shows it.
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "shop/handlers.py", line 12, in charge\n'
    '    order = params["order_id"]\n'
    "KeyError: 'order_id'\n"
)


class Seeder:
    """Submit, lease, start and fail tasks over HTTP in one namespace, with a key per role."""

    def __init__(self, server: RunningServer, namespace: str, keys: dict[str, str]) -> None:
        self.server = server
        self.ns = namespace
        self.keys = keys
        self.http = {
            role: httpx.Client(
                base_url=server.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30
            )
            for role, key in keys.items()
        }

    def close(self) -> None:
        for client in self.http.values():
            client.close()

    def submit(
        self,
        queue: str = "default",
        handler: str = "charge",
        params: Any = None,
        key: str | None = None,
        **options: Any,
    ) -> dict[str, Any]:
        r = self.http["submit"].post(
            f"/v1/namespaces/{self.ns}/tasks",
            json={
                "queue": queue,
                "handler": handler,
                "params": params if params is not None else {},
                "options": options,
            },
            headers={"Idempotency-Key": key or str(uuid.uuid4())},
        )
        assert r.status_code == 201, r.text
        return dict(r.json())

    def _running(self, queue: str) -> dict[str, Any]:
        r = self.http["work"].post(
            f"/v1/namespaces/{self.ns}/queues/{queue}/leases",
            json={"worker_id": "worker-7", "max_tasks": 1, "lease_seconds": 30},
        )
        assert r.status_code == 200 and len(r.json()) == 1, r.text
        grant = dict(r.json()[0])
        self._attempt(grant, "start")
        return grant

    def _attempt(self, grant: dict[str, Any], action: str, **body: Any) -> dict[str, Any]:
        attempt = grant["attempt"]
        r = self.http["work"].post(
            f"/v1/namespaces/{self.ns}/attempts/{attempt['id']}/{action}",
            json={"lease_token": attempt["lease_token"], **body},
        )
        assert r.status_code == 200, r.text
        return dict(r.json())

    def queue(self) -> str:
        """A new queue, so no other test's task is leased instead."""
        name = f"q-{uuid.uuid4().hex[:8]}"
        with self.server.engine.begin() as conn:
            store.create_queue(conn, self.ns, name)
        return name

    def failed(self, key: str, *, queue: str | None = None, with_traceback: bool = True) -> str:
        """A task leased, started and failed (``KeyError: 'order_id'``, not retryable); its id.

        With ``with_traceback`` the fail report carries :data:`TRACEBACK`, as the worker SDK sends it.
        """
        queue = queue or self.queue()
        task = self.submit(queue, params={"customer": 41}, key=key)
        grant = self._running(queue)
        assert grant["task"]["id"] == task["id"]
        error: dict[str, Any] = {"type": "KeyError", "message": "'order_id'", "retryable": False}
        if with_traceback:
            error["traceback"] = TRACEBACK
        self._attempt(grant, "fail", error=error)
        return str(task["id"])

    def needs_review(self, queue: str | None = None) -> str:
        """A task whose running attempt of a not retry-safe task expired: ``NEEDS_REVIEW``; its id.

        The lease is made to lapse in the database (no waiting) and the server's expiry
        sweep is run, as its periodic sweep would.
        """
        queue = queue or self.queue()
        task = self.submit(queue, params={"order_id": 7})
        grant = self._running(queue)
        with self.server.engine.begin() as conn:
            conn.execute(
                task_attempts.update()
                .where(task_attempts.c.id == grant["attempt"]["id"])
                .values(lease_expires_at=datetime(2000, 1, 1))
            )
        transact(self.server.engine, leasing.expire_leases)
        assert self.task(task["id"])["status"] == "NEEDS_REVIEW"
        return str(task["id"])

    def task(self, task_id: str) -> dict[str, Any]:
        r = self.http["read"].get(f"/v1/namespaces/{self.ns}/tasks/{task_id}")
        assert r.status_code == 200, r.text
        return dict(r.json())

    def events(self, task_id: str) -> list[dict[str, Any]]:
        r = self.http["read"].get(f"/v1/namespaces/{self.ns}/tasks/{task_id}/events")
        assert r.status_code == 200, r.text
        return list(r.json())


def sign_in(base_url: str, key: str) -> tuple[httpx.Client, str]:
    """An httpx client signed in to the console with ``key``, and its session's CSRF token."""
    client = httpx.Client(base_url=base_url, timeout=30)
    r = client.post("/ui/login", data={"api_key": key, "next": "/ui/"})
    assert r.status_code == 303, r.text
    return client, csrf_of(client.get("/ui/").text)


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert found, "no CSRF token on the page"
    return found.group(1)
