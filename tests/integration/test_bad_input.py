"""What a robustness run against the OpenAPI document found (issue 9), each replayed over HTTP
against a real server on SQLite and MariaDB: the answer must be the same documented 4xx on both."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from orbit_server.api.metrics import method_label
from tests.servers import RunningServer


@pytest.fixture(scope="module")
def ns(server: RunningServer) -> tuple[str, dict[str, str]]:
    name = f"ns-{uuid.uuid4().hex[:8]}"
    return name, server.add_namespace(name, ("default",))


@pytest.fixture(scope="module")
def http(server: RunningServer, ns: tuple[str, dict[str, str]]) -> Iterator[httpx.Client]:
    """An admin client (the admin role may do everything) of the module's namespace."""
    with httpx.Client(
        base_url=f"{server.base_url}/v1/namespaces/{ns[0]}",
        headers={"Authorization": f"Bearer {ns[1]['admin']}"},
        timeout=30,
    ) as client:
        yield client


def _problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = response.json()
    assert body["code"] == code, body
    assert body["request_id"] == response.headers["x-request-id"]
    return body


def _submit(http: httpx.Client, params: Any = None, **extra: Any) -> dict[str, Any]:
    body = {"queue": "default", "handler": "h", **extra}
    if params is not None:
        body["params"] = params
    response = http.post("/tasks", json=body, headers={"Idempotency-Key": f"k-{uuid.uuid4()}"})
    assert response.status_code == 201, response.text
    task: dict[str, Any] = response.json()
    return task


def _running_attempt(http: httpx.Client) -> tuple[str, str]:
    """Submit a task, lease and start it: ``(attempt_id, lease_token)``."""
    _submit(http)
    grants = http.post("/queues/default/leases", json={"worker_id": "w", "max_tasks": 1}).json()
    attempt = grants[0]["attempt"]
    started = http.post(f"/attempts/{attempt['id']}/start", json={"lease_token": attempt["lease_token"]})
    assert started.status_code == 200, started.text
    return attempt["id"], attempt["lease_token"]


# ------------------------------------------------- non-ASCII ids and cursors (MariaDB answered 500)

NON_ASCII = "%C3%A9"  # "é", percent-encoded as a client sends it in a path


def test_a_non_ascii_id_is_a_404_and_a_non_ascii_cursor_a_400(http: httpx.Client) -> None:
    for path in (f"/tasks/{NON_ASCII}", f"/tasks/{NON_ASCII}/attempts", f"/tasks/{NON_ASCII}/events"):
        _problem(http.get(path), 404, "task_not_found")
    _problem(http.post(f"/tasks/{NON_ASCII}/cancel", json={"reason": "r"}), 404, "task_not_found")
    _problem(http.post(f"/tasks/{NON_ASCII}/retry", json={"reason": "r"}), 404, "task_not_found")
    review = {"outcome": "failed", "reason": "r", "evidence_ref": "e"}
    _problem(http.post(f"/tasks/{NON_ASCII}/review", json=review), 404, "task_not_found")
    _problem(http.get(f"/submissions/{NON_ASCII}"), 404, "submission_not_found")
    for call, body in (("start", {}), ("heartbeat", {}), ("complete", {"result": 1}),
                       ("fail", {"error": {"type": "E"}})):  # fmt: skip
        answer = http.post(f"/attempts/{NON_ASCII}/{call}", json={"lease_token": "t", **body})
        _problem(answer, 404, "attempt_not_found")
        # The same id inside a batch: that item is a 404, the batch itself answers.
        batch = http.post(
            f"/attempts/{call}", json={"items": [{"attempt_id": "é", "lease_token": "t", **body}]}
        )
        assert batch.status_code == 200, batch.text
        assert batch.json()["items"][0]["status"] == 404
        assert batch.json()["items"][0]["error"]["code"] == "attempt_not_found"
    _problem(http.get("/tasks", params={"cursor": "é"}), 400, "invalid_cursor")
    forged = base64.urlsafe_b64encode(json.dumps(["2026-01-01T00:00:00", "é"]).encode()).decode().rstrip("=")
    _problem(http.get("/tasks", params={"cursor": forged}), 400, "invalid_cursor")
    _problem(http.get("/schedules", params={"after": "é"}), 422, "validation_error")


# ----------------------------------------- numbers stored as sent (SQLite changed top-level ones)

EXACT = ["18446744073709551616", "-0.0", "1" + "0" * 400, "1.0", "0.1", "-5"]


@pytest.mark.parametrize("text", EXACT)
def test_a_top_level_number_comes_back_as_sent(http: httpx.Client, text: str) -> None:
    raw = '{"queue":"default","handler":"h","params":' + text + "}"
    created = http.post("/tasks", content=raw, headers={"Idempotency-Key": f"k-{uuid.uuid4()}",
                                                        "Content-Type": "application/json"})  # fmt: skip
    assert created.status_code == 201, created.text
    read = http.get(f"/tasks/{created.json()['id']}")
    assert json.loads(read.text)["params"] == json.loads(text)
    assert f'"params":{text}' in read.text


def test_a_completed_big_number_result_is_kept_and_its_repeat_answers_200(http: httpx.Client) -> None:
    while http.post("/queues/default/leases", json={"worker_id": "w", "max_tasks": 100}).json():
        pass  # the module's earlier tasks, out of the way
    attempt_id, token = _running_attempt(http)
    raw = f'{{"lease_token":"{token}","result":1{"0" * 400}}}'
    headers = {"Content-Type": "application/json"}
    first = http.post(f"/attempts/{attempt_id}/complete", content=raw, headers=headers)
    again = http.post(f"/attempts/{attempt_id}/complete", content=raw, headers=headers)
    assert first.status_code == 200 and again.status_code == 200, again.text
    task = http.get(f"/tasks/{first.json()['task_id']}").json()
    assert task["result"] == 10**400
    # The batched path keeps it too.
    attempt_id, token = _running_attempt(http)
    raw = f'{{"items":[{{"attempt_id":"{attempt_id}","lease_token":"{token}","result":-0.0}}]}}'
    batched = http.post("/attempts/complete", content=raw, headers=headers)
    assert batched.json()["items"][0]["status"] == 200, batched.text
    assert '"result":-0.0' in http.get(f"/tasks/{batched.json()['items'][0]['attempt']['task_id']}").text


# ------------------------------------------------------------ bodies the JSON parser cannot read


def test_unreadable_bodies_answer_documented_codes(http: httpx.Client) -> None:
    headers = {"Content-Type": "application/json", "Idempotency-Key": "unreadable"}
    bad_utf8 = b'{"queue":"default","handler":"h","params":"\xff"}'
    _problem(http.post("/tasks", content=bad_utf8, headers=headers), 400, "invalid_utf8")
    digits = b'{"queue":"default","handler":"h","params":' + b"7" * 4301 + b"}"
    _problem(http.post("/tasks", content=digits, headers=headers), 400, "integer_too_long")
    deep = b'{"queue":"default","handler":"h","params":' + b"[" * 1000 + b"]" * 1000 + b"}"
    _problem(http.post("/tasks", content=deep, headers=headers), 400, "nesting_too_deep")
    # Parseable but past the limits of JSON data: 422, naming the limit.
    deep = b'{"queue":"default","handler":"h","params":' + b"[" * 31 + b"]" * 31 + b"}"
    assert "30 levels" in _problem(http.post("/tasks", content=deep, headers=headers), 422,
                                   "validation_error")["detail"]  # fmt: skip


# ------------------------------------------------------------- strict types, schema and server agree


def test_values_the_schema_forbids_are_refused(http: httpx.Client) -> None:
    for body in ({"worker_id": "w", "lease_seconds": True}, {"worker_id": "w", "max_tasks": "1"},
                 {"worker_id": "w", "wait_seconds": False}):  # fmt: skip
        _problem(http.post("/queues/default/leases", json=body), 422, "validation_error")
    key = {"Idempotency-Key": f"k-{uuid.uuid4()}"}
    for options in ({"deadline": 0.0}, {"available_at": 1700000000}, {"deadline": "1700000000"},
                    {"backoff_base_seconds": True}):  # fmt: skip
        body = {"queue": "default", "handler": "h", "options": options}
        _problem(http.post("/tasks", json=body, headers=key), 422, "validation_error")
    failed = _submit(http, options={"max_attempts": 1})
    _problem(http.post(f"/tasks/{failed['id']}/retry", json={"reason": "r", "deadline": 0.0}), 422,
             "validation_error")  # fmt: skip
    _problem(http.post("/subscriptions/none/deliveries/lease", json={"max": "1"}), 422, "validation_error")
    fail = {"lease_token": "t", "error": {"type": "E", "retryable": 1}}
    _problem(http.post("/attempts/x/fail", json=fail), 422, "validation_error")


def test_the_openapi_document_marks_the_idempotency_key_required(server: RunningServer) -> None:
    schema = httpx.get(f"{server.base_url}/openapi.json").json()
    submit = schema["paths"]["/v1/namespaces/{namespace}/tasks"]["post"]
    (header,) = [p for p in submit["parameters"] if p["name"] == "Idempotency-Key"]
    assert header["in"] == "header" and header["required"] is True
    assert header["schema"]["maxLength"] == 255


# -------------------------------------------------------------------------------- HEAD and /metrics


def test_head_answers_like_get_without_a_body(server: RunningServer, http: httpx.Client) -> None:
    task = _submit(http)
    for client, path in ((http, f"/tasks/{task['id']}"), (httpx, f"{server.base_url}/healthz")):
        got = client.get(path)  # type: ignore[attr-defined]
        head = client.head(path)  # type: ignore[attr-defined]
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-type"] == got.headers["content-type"]
        assert head.headers["x-request-id"]
    # A POST-only route still says which methods it has.
    refused = http.head("/queues/default/leases")
    assert refused.status_code == 405 and "POST" in refused.headers["allow"]


def test_other_methods_share_one_metrics_label(server: RunningServer) -> None:
    # httptools refuses unregistered tokens (400) before the app; these it passes on.
    others = ["PROPFIND", "MKCOL", "LOCK", "UNLOCK", "SEARCH", "PURGE", "REPORT", "COPY", "MOVE", "LINK"]
    with httpx.Client(base_url=server.base_url) as client:
        for method in others:
            assert client.request(method, "/healthz").status_code == 405
        page = client.get("/metrics").text
    assert not [method for method in others if f'method="{method}"' in page]
    assert 'method="OTHER"' in page
    # Any token a pure-Python HTTP parser (h11) lets through is counted the same way.
    assert {method_label(f"MADEUP{n}") for n in range(200)} == {"OTHER"}
    assert method_label("GET") == "GET" and method_label("HEAD") == "HEAD"
