"""Task execution over HTTP against a real server, on SQLite and MariaDB (DESIGN §4; seed 001 §2, §3, §5).

Every allowed transition of §2 is driven through the API here:

| transition | test |
| --- | --- |
| WAITING → LEASED | ``test_lease_grants_an_attempt_with_generation_and_token`` |
| LEASED → RUNNING, RUNNING → SUCCEEDED | ``test_start_heartbeat_complete`` |
| LEASED → WAITING | ``test_expired_lease_before_start_returns_task_to_waiting``, ``test_failure_before_start`` |
| LEASED → FAILED | ``test_expired_lease_before_start_fails_when_budget_is_spent``, ``test_failure_before_start`` |
| WAITING → CANCELLED, LEASED → CANCELLED, RUNNING → CANCELLED | ``test_cancel_*`` |
| WAITING → FAILED | ``test_deadline_passed_while_waiting_fails_the_task`` |
| RUNNING → WAITING | ``test_retryable_failure_*``, ``test_expired_running_retry_safe_task_*`` |
| RUNNING → FAILED | ``test_retryable_failure_is_retried_until_the_budget_is_spent`` |
| RUNNING → NEEDS_REVIEW, NEEDS_REVIEW → FAILED | ``test_expired_running_task_needs_review_*`` |
| NEEDS_REVIEW → SUCCEEDED | ``test_review_as_succeeded`` |
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from orbit_client import TaskStatus
from orbit_server.db.schema import task_attempts, task_events
from orbit_server.tasks import store
from orbit_server.tasks.transitions import TRANSITIONS
from tests.conftest import DatabaseFactory
from tests.integration.conftest import BACKENDS
from tests.servers import RunningServer, run_server


class Api:
    """A thin HTTP helper over one namespace, with a key per role."""

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

    @classmethod
    @contextlib.contextmanager
    def in_new_namespace(cls, server: RunningServer) -> Iterator[Api]:
        """A helper over a new namespace of ``server`` (``ns-<8 hex>``), closed on exit."""
        name = f"ns-{uuid.uuid4().hex[:8]}"
        helper = cls(server, name, server.add_namespace(name))
        try:
            yield helper
        finally:
            helper.close()

    def close(self) -> None:
        for client in self.http.values():
            client.close()

    def queue(self) -> str:
        """A new queue of its own, so no other test's lease takes its tasks."""
        name = f"q-{uuid.uuid4().hex[:10]}"
        with self.server.engine.begin() as conn:
            store.create_queue(conn, self.ns, name)
        return name

    def submit(self, queue: str, handler: str = "h", params: Any = None, **options: Any) -> dict[str, Any]:
        body = {"queue": queue, "handler": handler, "params": params, "options": options}
        r = self.http["submit"].post(
            f"/v1/namespaces/{self.ns}/tasks", json=body, headers={"Idempotency-Key": str(uuid.uuid4())}
        )
        assert r.status_code == 201, r.text
        return dict(r.json())

    def lease_response(
        self, queue: str, n: int = 1, lease_seconds: float = 30, wait: float = 0, role: str = "work"
    ) -> httpx.Response:
        return self.http[role].post(
            f"/v1/namespaces/{self.ns}/queues/{queue}/leases",
            json={
                "worker_id": "w-test",
                "max_tasks": n,
                "lease_seconds": lease_seconds,
                "wait_seconds": wait,
            },
        )

    def lease(
        self, queue: str, n: int = 1, lease_seconds: float = 30, wait: float = 0
    ) -> list[dict[str, Any]]:
        r = self.lease_response(queue, n, lease_seconds, wait)
        assert r.status_code == 200, r.text
        return list(r.json())

    def lease_one(self, queue: str, lease_seconds: float = 30) -> dict[str, Any]:
        grants = self.lease(queue, 1, lease_seconds)
        assert len(grants) == 1, grants
        return grants[0]

    def call(
        self, grant: dict[str, Any], action: str, *, token: str | None = None, **body: Any
    ) -> httpx.Response:
        attempt = grant["attempt"]
        return self.http["work"].post(
            f"/v1/namespaces/{self.ns}/attempts/{attempt['id']}/{action}",
            json={"lease_token": token or attempt["lease_token"], **body},
        )

    def ok(self, grant: dict[str, Any], action: str, **body: Any) -> dict[str, Any]:
        r = self.call(grant, action, **body)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def running(self, queue: str, lease_seconds: float = 30, **options: Any) -> dict[str, Any]:
        """Submit, lease and start one task; return its grant."""
        self.submit(queue, **options)
        grant = self.lease_one(queue, lease_seconds)
        self.ok(grant, "start")
        return grant

    def admin(self, task_id: str, action: str, role: str = "admin", **body: Any) -> httpx.Response:
        return self.http[role].post(f"/v1/namespaces/{self.ns}/tasks/{task_id}/{action}", json=body)

    def task(self, task_id: str) -> dict[str, Any]:
        r = self.http["read"].get(f"/v1/namespaces/{self.ns}/tasks/{task_id}")
        assert r.status_code == 200, r.text
        return dict(r.json())

    def attempts(self, task_id: str) -> list[dict[str, Any]]:
        r = self.http["read"].get(f"/v1/namespaces/{self.ns}/tasks/{task_id}/attempts")
        assert r.status_code == 200, r.text
        return list(r.json())

    def events(self, task_id: str) -> list[dict[str, Any]]:
        r = self.http["read"].get(f"/v1/namespaces/{self.ns}/tasks/{task_id}/events")
        assert r.status_code == 200, r.text
        return list(r.json())

    def moves(self, task_id: str) -> list[tuple[str, str | None, str | None]]:
        return [(e["event"], e["from_status"], e["to_status"]) for e in self.events(task_id)]

    def wait_status(self, task_id: str, *statuses: str, timeout: float = 15) -> dict[str, Any]:
        """Poll the task until it reaches one of ``statuses`` (the sweep has no event to await)."""
        deadline = time.monotonic() + timeout
        while True:
            task = self.task(task_id)
            if task["status"] in statuses:
                return task
            assert time.monotonic() < deadline, f"task stayed {task['status']}, expected {statuses}"
            time.sleep(0.05)


@pytest.fixture(scope="module", params=BACKENDS)
def xserver(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[RunningServer]:
    """A server whose expiry sweep runs every 0.2 s, so short leases lapse quickly."""
    with run_server(make_database(request.param), sweep_interval_seconds=0.2) as running:
        yield running


@pytest.fixture(scope="module")
def api(xserver: RunningServer) -> Iterator[Api]:
    with Api.in_new_namespace(xserver) as helper:
        yield helper


def _problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body = dict(response.json())
    assert body["code"] == code, body
    return body


def _at(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


# ------------------------------------------------------------------ leases


def test_lease_grants_an_attempt_with_generation_and_token(api: Api) -> None:
    queue = api.queue()
    submitted = api.submit(queue, params={"n": 1})
    grants = api.lease(queue, n=5, lease_seconds=30)
    assert len(grants) == 1
    task, attempt = grants[0]["task"], grants[0]["attempt"]
    assert task["id"] == submitted["id"] and task["status"] == "LEASED" and task["state_version"] == 2
    assert task["attempt_count"] == 1 and task["current_attempt_id"] == attempt["id"]
    assert attempt["generation"] == 1 and len(attempt["lease_token"]) >= 43
    leased = api.attempts(task["id"])[0]
    assert "lease_token" not in leased and leased["status"] == "LEASED" and leased["worker_id"] == "w-test"
    # The lease is judged by the database clock: 30 s after the attempt was leased.
    assert abs((_at(attempt["lease_expires_at"]) - _at(leased["leased_at"])).total_seconds() - 30) < 0.01
    # Only the token's SHA-256 is stored.
    with api.server.engine.connect() as conn:
        stored = conn.scalar(
            sa.select(task_attempts.c.lease_token_hash).where(task_attempts.c.id == attempt["id"])
        )
    assert stored == hashlib.sha256(attempt["lease_token"].encode()).hexdigest()
    assert api.moves(task["id"]) == [("accepted", None, "WAITING"), ("leased", "WAITING", "LEASED")]
    assert api.lease(queue) == []


def test_a_grant_carries_the_task_exactly_as_it_is_read(api: Api) -> None:
    """The task of a grant is the task as ``GET .../tasks/{id}`` reads it: every field, of the same JSON type
    (on MariaDB the lease reads each task row packed into one JSON array: orbit_server.db.packed_rows)."""
    queue = api.queue()
    params = {"float": 1.0, "tiny": 1.5e-7, "big": 12345678901234567890123, "text": 'ü\u2028"\\', "none": None,
              "nested": [{"a": [1, 2.5, True, False]}], "empty": {}}  # fmt: skip
    due = datetime.now(UTC) - timedelta(seconds=1)
    submitted = api.submit(
        queue, params=params, deadline=(due + timedelta(days=1)).isoformat(), retry_safe=True,
        backoff_base_seconds=2.5, backoff_cap_seconds=60.0, priority=7, max_attempts=3,
        available_at=due.isoformat(),
    )  # fmt: skip
    (grant,) = api.lease(queue, 1)
    read = api.task(submitted["id"])
    assert grant["task"] == read
    assert {key: type(value) for key, value in grant["task"].items()} == {
        key: type(value) for key, value in read.items()
    }
    assert grant["task"]["params"] == params and isinstance(grant["task"]["params"]["float"], float)
    for scalar in ('a"b', 1.0, [1, "x", None]):  # params that are not an object come back as they went in
        task_id = api.submit(queue, params=scalar)["id"]
        (grant,) = api.lease(queue, 1)
        assert grant["task"] == api.task(task_id) and grant["task"]["params"] == scalar
        assert type(grant["task"]["params"]) is type(scalar)


def test_lease_takes_due_tasks_oldest_first_and_no_more_than_asked(api: Api) -> None:
    queue = api.queue()
    ids = [api.submit(queue, params={"i": i})["id"] for i in range(4)]
    later = api.submit(queue, available_at="2100-01-01T00:00:00Z")
    first = api.lease(queue, n=3)
    second = api.lease(queue, n=3)
    assert [g["task"]["id"] for g in first] == ids[:3]
    assert [g["task"]["id"] for g in second] == ids[3:]
    assert api.task(later["id"])["status"] == "WAITING"


def test_long_poll_answers_when_a_task_arrives(api: Api) -> None:
    queue = api.queue()
    started = time.monotonic()
    assert api.lease(queue, wait=0.5) == []
    assert time.monotonic() - started >= 0.45
    answer: list[list[dict[str, Any]]] = []
    poller = threading.Thread(target=lambda: answer.append(api.lease(queue, wait=20)))
    poller.start()
    time.sleep(0.3)  # let the long poll begin waiting; then the submission must wake it
    submitted = api.submit(queue)
    poller.join(timeout=15)
    assert not poller.is_alive(), "the long poll did not answer"
    assert [g["task"]["id"] for g in answer[0]] == [submitted["id"]]


def test_unknown_queue_is_404(api: Api) -> None:
    _problem(api.lease_response("no-such-queue"), 404, "queue_not_found")


# ---------------------------------------------------------------- attempts


def test_start_heartbeat_complete(api: Api) -> None:
    queue = api.queue()
    api.submit(queue)
    grant = api.lease_one(queue, lease_seconds=5)
    started = api.ok(grant, "start")
    assert started["status"] == "RUNNING" and started["task_status"] == "RUNNING"
    assert started["cancel_requested"] is False
    beat = api.ok(grant, "heartbeat", lease_seconds=60)
    assert _at(beat["lease_expires_at"]) > _at(started["lease_expires_at"])
    done = api.ok(grant, "complete", result={"ok": True, "n": [1, 2]})
    assert done["status"] == "SUCCEEDED" and done["task_status"] == "SUCCEEDED"
    task = api.task(grant["task"]["id"])
    assert task["result"] == {"ok": True, "n": [1, 2]} and task["finished_at"]
    events = api.events(task["id"])
    assert [(e["event"], e["from_status"], e["to_status"], e["state_version"]) for e in events] == [
        ("accepted", None, "WAITING", 1),
        ("leased", "WAITING", "LEASED", 2),
        ("started", "LEASED", "RUNNING", 3),
        ("completed", "RUNNING", "SUCCEEDED", 4),
    ]
    (attempt,) = api.attempts(task["id"])
    assert attempt["status"] == "SUCCEEDED" and attempt["result"] == task["result"]
    assert attempt["started_at"] and attempt["heartbeat_at"] and attempt["finished_at"]


def test_forged_token_is_refused_and_changes_nothing(api: Api) -> None:
    queue = api.queue()
    api.submit(queue)
    grant = api.lease_one(queue)
    forged = "x" * 43
    for action, body in [
        ("start", {}),
        ("heartbeat", {}),
        ("complete", {"result": 1}),
        ("fail", {"error": {"type": "E", "message": "m", "retryable": True}}),
    ]:
        body_ = _problem(api.call(grant, action, token=forged, **body), 409, "lease_lost")
        assert body_["evidence_recorded"] is False
    task = api.task(grant["task"]["id"])
    assert task["status"] == "LEASED" and task["state_version"] == 2
    (attempt,) = api.attempts(task["id"])
    assert attempt["status"] == "LEASED" and attempt["late_report"] is None
    api.ok(grant, "start")  # the real token still works


def test_unknown_attempt_and_other_namespace_are_404(api: Api, xserver: RunningServer) -> None:
    queue = api.queue()
    api.submit(queue)
    grant = api.lease_one(queue)
    fake = {"attempt": {"id": str(uuid.uuid4()), "lease_token": "t"}}
    _problem(api.call(fake, "start"), 404, "attempt_not_found")
    other = f"ns-{uuid.uuid4().hex[:8]}"
    other_keys = xserver.add_namespace(other)
    with httpx.Client(
        base_url=xserver.base_url, headers={"Authorization": f"Bearer {other_keys['work']}"}
    ) as http:
        path = f"/attempts/{grant['attempt']['id']}/start"
        body = {"lease_token": grant["attempt"]["lease_token"]}
        _problem(http.post(f"/v1/namespaces/{api.ns}{path}", json=body), 404, "namespace_not_found")
        _problem(http.post(f"/v1/namespaces/{other}{path}", json=body), 404, "attempt_not_found")
        _problem(
            http.get(f"/v1/namespaces/{other}/tasks/{grant['task']['id']}/attempts"), 404, "task_not_found"
        )


def test_repeated_reports_answer_alike_and_a_different_one_is_evidence(api: Api) -> None:
    queue = api.queue()
    grant = api.running(queue)
    assert api.ok(grant, "start")["status"] == "RUNNING"  # a repeated start changes nothing
    first = api.ok(grant, "complete", result={"v": 1})
    assert api.ok(grant, "complete", result={"v": 1}) == first
    # Another result is a conflicting duplicate (issue 30: it answered lease_lost), kept as evidence.
    body = _problem(api.call(grant, "complete", result={"v": 2}), 409, "report_conflict")
    assert body["evidence_recorded"] is True
    task = api.task(grant["task"]["id"])
    assert task["result"] == {"v": 1} and task["state_version"] == 4
    (attempt,) = api.attempts(task["id"])
    assert attempt["result"] == {"v": 1}
    assert attempt["late_report"] == {"outcome": "succeeded", "result": {"v": 2}}

    failing = api.running(queue)
    error = {"type": "ValueError", "message": "bad", "retryable": False}
    assert api.ok(failing, "fail", error=error) == api.ok(failing, "fail", error=error)
    assert api.task(failing["task"]["id"])["status"] == "FAILED"


def test_complete_before_start_is_an_invalid_transition(api: Api) -> None:
    queue = api.queue()
    api.submit(queue)
    grant = api.lease_one(queue)
    _problem(api.call(grant, "complete", result=1), 409, "invalid_transition")
    task = api.task(grant["task"]["id"])
    assert task["status"] == "LEASED" and task["state_version"] == 2


# ------------------------------------------------------------------ expiry

#: The lease of a task these tests start and then let lapse: its start must arrive inside it. 0.5 s is
#: two quick calls on an idle machine, but a loaded one can stall the test or the server 1-2 s (and the
#: start then met a lapsed lease: 409).
START_WITHIN = 3.0


def test_expired_lease_before_start_returns_task_to_waiting(api: Api) -> None:
    queue = api.queue()
    task = api.submit(queue)
    grant = api.lease_one(queue, lease_seconds=0.3)
    api.wait_status(task["id"], "WAITING")
    assert ("lease_expired", "LEASED", "WAITING") in api.moves(task["id"])
    assert api.attempts(task["id"])[0]["status"] == "EXPIRED"
    _problem(api.call(grant, "start"), 409, "lease_lost")
    again = api.lease_one(queue)
    assert again["attempt"]["generation"] == 2


def test_expired_lease_before_start_fails_when_budget_is_spent(api: Api) -> None:
    queue = api.queue()
    task = api.submit(queue, max_attempts=1)
    api.lease_one(queue, lease_seconds=0.3)
    failed = api.wait_status(task["id"], "FAILED")
    assert failed["error"]["type"] == "attempts_exhausted"
    assert ("lease_expired", "LEASED", "FAILED") in api.moves(task["id"])


def test_expired_running_retry_safe_task_is_leased_again_and_the_stale_report_is_evidence(api: Api) -> None:
    queue = api.queue()
    old = api.running(queue, lease_seconds=START_WITHIN, retry_safe=True, backoff_base_seconds=0)
    task_id = old["task"]["id"]
    api.wait_status(task_id, "WAITING")
    assert ("lease_expired", "RUNNING", "WAITING") in api.moves(task_id)
    new = api.lease_one(queue)
    assert new["task"]["id"] == task_id and new["attempt"]["generation"] == 2
    api.ok(new, "start")
    # The stale attempt is refused everywhere; its late result is kept as evidence only.
    _problem(api.call(old, "heartbeat"), 409, "lease_lost")
    body = _problem(api.call(old, "complete", result={"from": "old"}), 409, "lease_lost")
    assert body["evidence_recorded"] is True
    assert api.task(task_id)["status"] == "RUNNING"
    api.ok(new, "complete", result={"from": "new"})
    assert api.task(task_id)["result"] == {"from": "new"}
    first, second = api.attempts(task_id)
    assert first["status"] == "EXPIRED" and first["result"] is None
    assert first["late_report"] == {"outcome": "succeeded", "result": {"from": "old"}}
    assert second["status"] == "SUCCEEDED"


def test_expired_running_task_needs_review_then_is_reviewed_and_retried(api: Api) -> None:
    queue = api.queue()
    grant = api.running(queue, lease_seconds=START_WITHIN)
    task_id = grant["task"]["id"]
    review = api.wait_status(task_id, "NEEDS_REVIEW")
    assert review["error"]["type"] == "outcome_unknown"
    assert ("lease_expired", "RUNNING", "NEEDS_REVIEW") in api.moves(task_id)
    # Nothing runs it again on its own.
    assert api.lease(queue) == []
    decision = {"outcome": "failed", "reason": "provider says never charged", "evidence_ref": "PSP-123"}
    _problem(api.admin(task_id, "review", role="work", **decision), 403, "forbidden")
    _problem(api.admin(task_id, "review", **decision, result={"x": 1}), 422, "validation_error")
    _problem(api.admin(task_id, "retry", reason="too early"), 409, "not_retryable")
    reviewed = api.admin(task_id, "review", **decision, actor="alice")
    assert reviewed.status_code == 200, reviewed.text
    assert reviewed.json()["status"] == "FAILED" and reviewed.json()["error"]["evidence_ref"] == "PSP-123"
    event = api.events(task_id)[-1]
    assert (event["event"], event["from_status"], event["to_status"]) == (
        "reviewed",
        "NEEDS_REVIEW",
        "FAILED",
    )
    assert event["actor"] == f"api_key:{_key_id(api, 'admin')}" and event["reason"] == decision["reason"]
    assert event["data"] == {"outcome": "failed", "evidence_ref": "PSP-123", "on_behalf_of": "alice"}
    _problem(api.admin(task_id, "review", **decision), 409, "invalid_transition")

    retried = api.admin(task_id, "retry", reason="charge again")
    assert retried.status_code == 201, retried.text
    successor = retried.json()
    assert (
        successor["retry_of"] == task_id
        and successor["status"] == "WAITING"
        and successor["attempt_count"] == 0
    )
    assert retried.headers["location"].endswith(successor["id"])
    again = _problem(api.admin(task_id, "retry", reason="twice"), 409, "successor_exists")
    assert again["successor_id"] == successor["id"]
    assert api.task(task_id)["status"] == "FAILED"  # the old task's terminal state never goes back
    assert api.events(task_id)[-1]["event"] == "retried"
    assert api.lease_one(queue)["task"]["id"] == successor["id"]


def test_review_as_succeeded(api: Api) -> None:
    queue = api.queue()
    grant = api.running(queue, lease_seconds=START_WITHIN)
    task_id = grant["task"]["id"]
    api.wait_status(task_id, "NEEDS_REVIEW")
    reviewed = api.admin(
        task_id,
        "review",
        outcome="succeeded",
        reason="receipt found",
        evidence_ref="RCPT-9",
        result={"receipt": 9},
    )
    assert reviewed.status_code == 200, reviewed.text
    assert reviewed.json()["status"] == "SUCCEEDED" and reviewed.json()["result"] == {"receipt": 9}
    assert api.moves(task_id)[-1] == ("reviewed", "NEEDS_REVIEW", "SUCCEEDED")
    _problem(api.admin(task_id, "retry", reason="no"), 409, "not_retryable")


def test_review_is_only_for_needs_review(api: Api) -> None:
    queue = api.queue()
    task = api.submit(queue)
    body = {"outcome": "succeeded", "reason": "r", "evidence_ref": "e"}
    _problem(api.admin(task["id"], "review", **body), 409, "invalid_transition")
    grant = api.running(queue)
    _problem(api.admin(grant["task"]["id"], "review", **body), 409, "invalid_transition")
    assert api.task(grant["task"]["id"])["status"] == "RUNNING"


# ---------------------------------------------------------- failure, retry


def test_retryable_failure_is_retried_until_the_budget_is_spent(api: Api) -> None:
    queue = api.queue()
    first = api.running(queue, max_attempts=2, backoff_base_seconds=0)
    task_id = first["task"]["id"]
    error = {"type": "TimeoutError", "message": "upstream slow", "retryable": True}
    state = api.ok(first, "fail", error=error)
    assert state["status"] == "FAILED" and state["task_status"] == "WAITING"
    second = api.lease_one(queue)
    assert second["attempt"]["generation"] == 2
    api.ok(second, "start")
    assert api.ok(second, "fail", error=error)["task_status"] == "FAILED"
    task = api.task(task_id)
    assert task["error"] == error and task["attempt_count"] == 2
    assert [m for m in api.moves(task_id) if m[0] in ("retry_scheduled", "failed")] == [
        ("retry_scheduled", "RUNNING", "WAITING"),
        ("failed", "RUNNING", "FAILED"),
    ]
    assert api.events(task_id)[-1]["reason"] == "attempts exhausted"


def test_retryable_failure_waits_for_the_backoff(api: Api) -> None:
    queue = api.queue()
    grant = api.running(queue, backoff_base_seconds=20, backoff_cap_seconds=20)
    api.ok(grant, "fail", error={"type": "E", "message": "", "retryable": True})
    task = api.task(grant["task"]["id"])
    delay = (_at(task["available_at"]) - _at(task["updated_at"])).total_seconds()
    assert 10 <= delay <= 20  # equal jitter: between half and all of min(cap, base)
    assert api.lease(queue) == []


def test_non_retryable_failure_fails_the_task(api: Api) -> None:
    queue = api.queue()
    grant = api.running(queue, max_attempts=5)
    api.ok(grant, "fail", error={"type": "ValueError", "message": "bad input"})
    task = api.task(grant["task"]["id"])
    assert task["status"] == "FAILED" and task["error"]["retryable"] is False


def test_failure_before_start(api: Api) -> None:
    queue = api.queue()
    retryable = api.submit(queue, backoff_base_seconds=0)
    grant = api.lease_one(queue)
    api.ok(grant, "fail", error={"type": "E", "message": "not now", "retryable": True})
    assert api.moves(retryable["id"])[-1] == ("retry_scheduled", "LEASED", "WAITING")
    final = api.submit(queue)
    grant = api.lease(queue, n=2)
    by_id = {g["task"]["id"]: g for g in grant}
    api.ok(by_id[final["id"]], "fail", error={"type": "unknown_handler", "message": "no such handler"})
    assert api.moves(final["id"])[-1] == ("failed", "LEASED", "FAILED")


def test_deadline_passed_while_waiting_fails_the_task(api: Api) -> None:
    queue = api.queue()
    task = api.submit(queue, deadline="2001-01-01T00:00:00Z")
    assert api.lease(queue) == []
    failed = api.task(task["id"])
    assert failed["status"] == "FAILED" and failed["error"]["type"] == "deadline_exceeded"
    assert api.moves(task["id"])[-1] == ("deadline_exceeded", "WAITING", "FAILED")


# ------------------------------------------------------------------ cancel


def test_cancel_waiting_task_at_once(api: Api) -> None:
    queue = api.queue()
    task = api.submit(queue)
    _problem(api.admin(task["id"], "cancel", role="work", reason="no"), 403, "forbidden")
    cancelled = api.admin(task["id"], "cancel", reason="customer withdrew")
    assert cancelled.status_code == 200, cancelled.text
    body = cancelled.json()
    assert body["status"] == "CANCELLED" and body["cancel_requested"] is True
    assert body["cancel_reason"] == "customer withdrew"
    assert api.admin(task["id"], "cancel", reason="again").json()["state_version"] == body["state_version"]
    assert api.moves(task["id"])[-1] == ("cancelled", "WAITING", "CANCELLED")
    assert api.lease(queue) == []


def test_cancel_leased_task_at_once_and_its_start_is_refused(api: Api) -> None:
    queue = api.queue()
    api.submit(queue)
    grant = api.lease_one(queue)
    assert api.admin(grant["task"]["id"], "cancel", reason="stop").json()["status"] == "CANCELLED"
    _problem(api.call(grant, "start"), 409, "lease_lost")
    assert api.attempts(grant["task"]["id"])[0]["status"] == "CANCELLED"
    assert api.moves(grant["task"]["id"])[-1] == ("cancelled", "LEASED", "CANCELLED")


def test_cancel_running_task_when_the_worker_stops(api: Api) -> None:
    queue = api.queue()
    grant = api.running(queue)
    task_id = grant["task"]["id"]
    requested = api.admin(task_id, "cancel", reason="stop please").json()
    assert requested["status"] == "RUNNING" and requested["cancel_requested"] is True
    assert api.ok(grant, "heartbeat")["cancel_requested"] is True
    state = api.ok(grant, "fail", error={"type": "cancelled", "message": "stopped at step 2"})
    assert state["status"] == "CANCELLED" and state["task_status"] == "CANCELLED"
    assert [m for m in api.moves(task_id) if m[0].startswith("cancel")] == [
        ("cancel_requested", None, None),
        ("cancelled", "RUNNING", "CANCELLED"),
    ]


def test_cancel_requested_but_success_landed_stays_succeeded(api: Api) -> None:
    queue = api.queue()
    grant = api.running(queue)
    task_id = grant["task"]["id"]
    api.admin(task_id, "cancel", reason="too late")
    assert api.ok(grant, "complete", result="done")["task_status"] == "SUCCEEDED"
    _problem(api.admin(task_id, "cancel", reason="again"), 409, "invalid_transition")
    assert api.task(task_id)["status"] == "SUCCEEDED"


# ------------------------------------------------------------ roles, lists


def test_roles(api: Api) -> None:
    queue = api.queue()
    api.submit(queue)
    _problem(api.lease_response(queue, role="read"), 403, "forbidden")
    _problem(api.lease_response(queue, role="submit"), 403, "forbidden")
    grant = api.lease_one(queue)
    for role in ("read", "submit", "work", "admin"):
        assert (
            api.http[role].get(f"/v1/namespaces/{api.ns}/tasks/{grant['task']['id']}/events").status_code
            == 200
        )
    _problem(api.admin(grant["task"]["id"], "retry", role="work", reason="r"), 403, "forbidden")


def test_list_tasks_filters_and_pages(api: Api) -> None:
    queue = api.queue()
    ids = [api.submit(queue, params={"i": i})["id"] for i in range(5)]
    api.admin(ids[0], "cancel", reason="r")
    seen: list[str] = []
    cursor = None
    while True:
        params = {"queue": queue, "limit": 2, **({"cursor": cursor} if cursor else {})}
        page = api.http["read"].get(f"/v1/namespaces/{api.ns}/tasks", params=params).json()
        assert len(page["items"]) <= 2
        seen += [t["id"] for t in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == ids
    waiting = api.http["read"].get(
        f"/v1/namespaces/{api.ns}/tasks", params={"queue": queue, "status": "WAITING"}
    )
    assert [t["id"] for t in waiting.json()["items"]] == ids[1:]
    bad = api.http["read"].get(f"/v1/namespaces/{api.ns}/tasks", params={"cursor": "not-a-cursor"})
    _problem(bad, 400, "invalid_cursor")


def test_only_transitions_of_the_table_were_recorded(api: Api) -> None:
    """Whatever ran before in this module, every recorded move is an arrow of §2."""
    with api.server.engine.connect() as conn:
        moves = conn.execute(
            sa.select(task_events.c.from_status, task_events.c.to_status)
            .where(task_events.c.from_status.is_not(None))
            .distinct()
        ).all()
    assert moves
    assert {(TaskStatus(a), TaskStatus(b)) for a, b in moves} <= TRANSITIONS


def _key_id(api: Api, role: str) -> int:
    with api.server.engine.connect() as conn:
        principal = store.authenticate(conn, api.keys[role])
    assert principal is not None
    return principal.key_id


@pytest.mark.parametrize(
    "result",
    [float("nan"), float("inf"), "\ud800", {"k": "\ud800"}, "deep"],
    ids=["nan", "infinity", "lone-surrogate", "surrogate-in-object", "31-levels"],
)
def test_a_result_json_cannot_hold_is_422_and_changes_nothing(api: Api, result: Any) -> None:
    """Regression: such results were stored (SQLite) and then broke every read of the task, or gave 500."""
    if result == "deep":
        result = nested(31)
    queue = api.queue()
    api.submit(queue)
    grant = api.lease_one(queue)
    api.ok(grant, "start")
    raw = json.dumps({"lease_token": grant["attempt"]["lease_token"], "result": result})  # NaN as NaN
    response = api.http["work"].post(
        f"/v1/namespaces/{api.ns}/attempts/{grant['attempt']['id']}/complete",
        content=raw.encode(),
        headers={"Content-Type": "application/json"},
    )
    _problem(response, 422, "validation_error")
    assert api.task(grant["task"]["id"])["status"] == "RUNNING"
    api.ok(grant, "complete", result=nested(30))
    task = api.task(grant["task"]["id"])
    assert task["status"] == "SUCCEEDED" and task["result"] == nested(30)


def nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value
