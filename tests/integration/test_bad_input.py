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


def test_a_body_without_the_json_content_type_is_415_naming_the_header(http: httpx.Client) -> None:
    """Issue 23: `curl -d '{...}'` (form-encoded by default) got `422 "body: Input should be a valid dictionary"`."""
    body = b'{"queue": "default", "handler": "h"}'
    key = {"Idempotency-Key": f"k-{uuid.uuid4()}"}
    for content_type in ("application/x-www-form-urlencoded", "text/plain", None):
        headers = {**key, **({"Content-Type": content_type} if content_type else {})}
        request = http.build_request("POST", "/tasks", content=body, headers=headers)
        assert content_type is not None or "Content-Type" not in request.headers
        problem = _problem(http.send(request), 415, "unsupported_media_type")
        assert "Content-Type: application/json" in problem["detail"]
    assert http.get(f"/submissions/{key['Idempotency-Key']}").status_code == 404  # nothing was created
    ok = {**key, "Content-Type": "application/json; charset=utf-8"}
    assert http.post("/tasks", content=body, headers=ok).status_code == 201
    # A bodiless POST needs no Content-Type (e.g. pause without a reason).
    assert http.post("/queues/default/pause").status_code == 200
    assert http.post("/queues/default/resume").status_code == 200


def test_malformed_json_is_400_with_line_and_column(http: httpx.Client) -> None:
    """Issue 23: malformed JSON answered `422 "body.24: JSON decode error"`; the README promised 400."""
    headers = {"Content-Type": "application/json", "Idempotency-Key": f"k-{uuid.uuid4()}"}
    body = b'{"queue": "default",\n "handler": h}'
    problem = _problem(http.post("/tasks", content=body, headers=headers), 400, "invalid_json")
    assert "line 2, column 13" in problem["detail"] and "Expecting value" in problem["detail"]


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
    assert {"400", "415", "413", "422"} <= set(submit["responses"])


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


# ---------------------------------------------- issue 30: what the last bad-input pass left


def _schedule(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    body = {"name": f"s-{uuid.uuid4().hex[:8]}", "queue": "default", "handler": "h", "interval_seconds": 3600,
            **fields}  # fmt: skip
    created = http.post("/schedules", json=body)
    assert created.status_code == 201, created.text
    schedule: dict[str, Any] = created.json()
    return schedule


def test_occurrences_before_takes_only_an_rfc3339_time_that_exists_in_utc(http: httpx.Client) -> None:
    """``before=0001-01-01T00:00:00+14:00`` answered 500 (before year 1 in UTC); naive, date-only and
    epoch values were taken as UTC or seconds."""
    path = f"/schedules/{_schedule(http)['name']}/occurrences"
    for before in ("0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00", "2026-01-01T00:00:00",
                   "2026-01-01", "1700000000"):  # fmt: skip
        problem = _problem(http.get(path, params={"before": before}), 422, "validation_error")
        assert problem["errors"][0]["loc"] == ["query", "before"], problem
    assert http.get(path, params={"before": "9999-12-31T23:59:59Z"}).json() == []


def test_a_schedule_names_five_cron_fields_and_a_real_time_zone(http: httpx.Client) -> None:
    """A six-field cron was read with seconds first, and ``localtime``/``Factory`` were time zones."""
    for cron in ("0 0 * * * *", "0 0 * *"):
        problem = _problem(http.post("/schedules", json={"name": "c", "queue": "default", "handler": "h",
                                                         "cron": cron}), 422, "invalid_cron")  # fmt: skip
        assert "five fields" in problem["detail"]
    for zone in ("localtime", "Factory", "posixrules"):
        _problem(http.post("/schedules", json={"name": "z", "queue": "default", "handler": "h",
                                               "cron": "0 0 * * *", "timezone": zone}), 422, "unknown_timezone")  # fmt: skip
    assert http.get("/schedules/c").status_code == 404 and http.get("/schedules/z").status_code == 404
    assert _schedule(http, interval_seconds=None, cron="0 0 * * *", timezone="Europe/Berlin")


def test_a_schedule_without_params_gives_its_tasks_an_empty_object_as_a_submission_does(
    http: httpx.Client,
) -> None:
    assert _schedule(http)["params"] == {}


def test_schedule_patch_treats_null_alike_for_every_field_it_cannot_be_without(http: httpx.Client) -> None:
    """``null`` was ignored for queue and the policies but refused for handler and timezone."""
    schedule = _schedule(http)
    path = f"/schedules/{schedule['name']}"
    for field in ("queue", "handler", "timezone", "misfire_policy", "overlap_policy", "catch_up_max",
                  "misfire_grace_seconds"):  # fmt: skip
        problem = _problem(http.patch(path, json={field: None}), 422, "invalid_schedule")
        assert f"{field} cannot be null" in problem["detail"]
    assert http.get(path).json()["version"] == schedule["version"]  # nothing was written
    cleared = http.patch(path, json={"params": None, "end_at": None})
    assert cleared.status_code == 200 and cleared.json()["params"] is None


def test_a_nan_lease_duration_is_refused_as_not_finite(http: httpx.Client) -> None:
    raw = '{"worker_id": "w", "lease_seconds": NaN}'
    problem = _problem(http.post("/queues/default/leases", content=raw,
                                 headers={"Content-Type": "application/json"}), 422, "validation_error")  # fmt: skip
    assert "finite" in problem["detail"] and "less than" not in problem["detail"]


def test_a_list_refuses_a_filter_given_twice_or_one_it_does_not_know(http: httpx.Client) -> None:
    """``?status=A&status=B`` kept the last, and ``?stauts=A`` listed everything."""
    problem = _problem(http.get("/tasks", params=[("status", "FAILED"), ("status", "WAITING")]), 422,
                       "validation_error")  # fmt: skip
    assert problem["errors"][0]["loc"] == ["query", "status"] and "more than once" in problem["detail"]
    problem = _problem(http.get("/tasks", params={"stauts": "FAILED"}), 422, "validation_error")
    assert problem["errors"][0]["loc"] == ["query", "stauts"] and "status" in problem["detail"]
    for path in ("/schedules", "/flow-instances"):
        _problem(http.get(path, params={"nosuch": "1"}), 422, "validation_error")
    assert http.get("/tasks", params={"status": "FAILED", "limit": 1}).status_code == 200


def test_a_batch_item_with_a_bad_key_field_is_not_told_about_a_header(http: httpx.Client) -> None:
    items = [
        {"queue": "default", "handler": "h"},
        {"idempotency_key": "\x01", "queue": "default", "handler": "h"},
    ]
    answer = http.post("/tasks/batch", json={"items": items})
    assert answer.status_code == 200, answer.text
    errors = [item["error"] for item in answer.json()["items"]]
    assert [e["code"] for e in errors] == ["idempotency_key_missing", "idempotency_key_invalid"]
    assert not [e for e in errors if "header" in e["title"].lower()], errors


def test_a_subscription_conflict_names_both_sets_of_queues(http: httpx.Client) -> None:
    name = f"sub-{uuid.uuid4().hex[:6]}"
    assert http.post("/subscriptions", json={"name": name}).status_code == 201
    problem = _problem(http.post("/subscriptions", json={"name": name, "queues": ["default"]}), 409,
                       "subscription_exists")  # fmt: skip
    assert "None" not in problem["detail"] and "every queue" in problem["detail"], problem


def test_another_result_for_a_succeeded_attempt_is_a_report_conflict(http: httpx.Client) -> None:
    """It answered ``lease_lost``, which tells a worker its lease lapsed: it did not."""
    while http.post("/queues/default/leases", json={"worker_id": "w", "max_tasks": 100}).json():
        pass
    attempt_id, token = _running_attempt(http)
    assert http.post(f"/attempts/{attempt_id}/complete", json={"lease_token": token, "result": 1}).is_success
    assert http.post(f"/attempts/{attempt_id}/complete", json={"lease_token": token, "result": 1}).is_success
    for call, body in (("complete", {"result": 2}), ("fail", {"error": {"type": "E"}})):
        _problem(http.post(f"/attempts/{attempt_id}/{call}", json={"lease_token": token, **body}), 409,
                 "report_conflict")  # fmt: skip
        batch = http.post(f"/attempts/{call}", json={"items": [{"attempt_id": attempt_id, "lease_token": token,
                                                                **body}]})  # fmt: skip
        assert batch.json()["items"][0]["error"]["code"] == "report_conflict", batch.text
    _problem(http.post(f"/attempts/{attempt_id}/complete", json={"lease_token": "forged", "result": 2}), 409,
             "lease_lost")  # fmt: skip


def test_a_retry_with_a_deadline_already_past_is_refused(http: httpx.Client) -> None:
    failed = _submit(http, options={"max_attempts": 1})
    assert http.post(f"/tasks/{failed['id']}/cancel", json={"reason": "r"}).status_code == 200
    for deadline in ("2001-01-01T00:00:00Z", "2001-01-01T00:00:00+02:00"):
        problem = _problem(http.post(f"/tasks/{failed['id']}/retry", json={"reason": "r", "deadline": deadline}),
                           422, "deadline_passed")  # fmt: skip
        assert "later deadline" in problem["detail"]
    assert http.post(f"/tasks/{failed['id']}/retry", json={"reason": "r", "deadline": "2999-01-01T00:00:00Z"}
                     ).status_code == 201  # fmt: skip


def test_a_flow_graph_error_names_the_node_as_written_not_pydantics_union_tag(http: httpx.Client) -> None:
    """Pydantic's internals leaked: ``graph.nodes.b.task.handler`` (the tag it picked) and "Input tag 'x'
    found using 'type' does not match any of the expected tags"."""
    graph = {"start": "a", "nodes": {"a": {"type": "nope"}, "b": {"type": "task", "queue": "default"}}}
    problem = _problem(http.post("/flows/f/versions", json={"graph": graph}), 422, "validation_error")
    locs = [".".join(map(str, e["loc"])) for e in problem["errors"]]
    assert "body.graph.nodes.b.handler" in locs and not [loc for loc in locs if ".task." in loc], locs
    assert "type 'nope' is not a node type" in problem["detail"] and "Input tag" not in problem["detail"]
