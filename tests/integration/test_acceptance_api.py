"""The acceptance API over HTTP against a real server, on SQLite and MariaDB (DESIGN §3, §8)."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from orbit_server.db.schema import submission_keys, task_events, tasks
from tests.servers import RunningServer


@pytest.fixture(scope="module")
def ns(server: RunningServer) -> tuple[str, dict[str, str]]:
    name = f"ns-{uuid.uuid4().hex[:8]}"
    return name, server.add_namespace(name, ("default", "other"))


def _client(server: RunningServer, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.base_url, headers=headers, timeout=30)


def _submit(http: httpx.Client, namespace: str, key: str | None, body: dict[str, Any]) -> httpx.Response:
    headers = {"Idempotency-Key": key.encode("utf-8")} if key is not None else {}
    return http.post(f"/v1/namespaces/{namespace}/tasks", json=body, headers=headers)


BODY = {"queue": "default", "handler": "orders.fulfil", "params": {"order_id": 1}}


def _assert_problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body = response.json()
    assert body["code"] == code
    assert body["status"] == status
    assert body["title"]
    assert body["request_id"] == response.headers["x-request-id"]
    return body


def test_first_submission_creates_task_and_replay_returns_it(
    server: RunningServer, ns: tuple[str, dict[str, str]]
):
    name, keys = ns
    key = f"k-{uuid.uuid4()}"
    with _client(server, keys["submit"]) as http:
        first = _submit(http, name, key, BODY)
        second = _submit(http, name, key, BODY)
    assert first.status_code == 201, first.text
    assert "idempotent-replayed" not in first.headers
    task = first.json()
    assert task["status"] == "WAITING"
    assert task["namespace"] == name and task["queue"] == "default" and task["handler"] == "orders.fulfil"
    assert task["state_version"] == 1 and task["attempt_count"] == 0
    assert task["created_at"].endswith("Z") and task["updated_at"].endswith("Z")
    assert first.headers["location"] == f"/v1/namespaces/{name}/tasks/{task['id']}"
    assert second.status_code == 200
    assert second.headers["idempotent-replayed"] == "true"
    assert second.json() == task
    # One transaction wrote the key, the task and its accepted event.
    with server.engine.connect() as conn:
        assert conn.scalar(sa.select(sa.func.count()).select_from(submission_keys).where(
            submission_keys.c.idempotency_key == key)) == 1  # fmt: skip
        events = (
            conn.execute(sa.select(task_events).where(task_events.c.task_id == task["id"])).mappings().all()
        )
    assert [(e["event"], e["to_status"], e["state_version"]) for e in events] == [("accepted", "WAITING", 1)]


def test_options_are_part_of_the_digest_and_of_the_task(
    server: RunningServer, ns: tuple[str, dict[str, str]]
):
    name, keys = ns
    key = f"k-{uuid.uuid4()}"
    body = {
        **BODY,
        "options": {"max_attempts": 7, "retry_safe": True, "available_at": "2030-01-01T01:00:00+01:00"},
    }
    with _client(server, keys["submit"]) as http:
        created = _submit(http, name, key, body)
        assert created.status_code == 201, created.text
        task = created.json()
        assert task["max_attempts"] == 7 and task["retry_safe"] is True
        assert task["available_at"] == "2030-01-01T00:00:00.000000Z"
        other = _submit(http, name, key, {**body, "options": {"max_attempts": 8}})
    _assert_problem(other, 422, "idempotency_key_reused")


def test_empty_options_mean_no_options(server: RunningServer, ns: tuple[str, dict[str, str]]):
    name, keys = ns
    key = f"k-{uuid.uuid4()}"
    with _client(server, keys["submit"]) as http:
        assert _submit(http, name, key, BODY).status_code == 201
        assert _submit(http, name, key, {**BODY, "options": {}}).status_code == 200


@pytest.mark.parametrize(
    "change",
    [{"params": {"order_id": 2}}, {"handler": "orders.refund"}, {"queue": "other"}, {"params": None}],
    ids=["params", "handler", "queue", "null-params"],
)
def test_key_reused_with_other_content_is_422_and_creates_nothing(
    server: RunningServer, ns: tuple[str, dict[str, str]], change: dict[str, Any]
):
    name, keys = ns
    key = f"k-{uuid.uuid4()}"
    with _client(server, keys["submit"]) as http:
        original = _submit(http, name, key, BODY).json()
        reused = _submit(http, name, key, {**BODY, **change})
        _assert_problem(reused, 422, "idempotency_key_reused")
        # The original is untouched and still what the key names.
        found = http.get(f"/v1/namespaces/{name}/submissions/{key}")
    assert found.json() == original


@pytest.mark.parametrize(
    ("key", "code"),
    [
        (None, "idempotency_key_missing"),
        ("", "idempotency_key_missing"),
        ("x" * 256, "idempotency_key_invalid"),
        ("ключ-non-ascii", "idempotency_key_invalid"),
    ],
    ids=["missing", "empty", "256-chars", "non-ascii"],
)
def test_missing_or_malformed_key_is_400(
    server: RunningServer, ns: tuple[str, dict[str, str]], key: str | None, code: str
):
    name, keys = ns
    with _client(server, keys["submit"]) as http:
        response = _submit(http, name, key, BODY)
    _assert_problem(response, 400, code)


def test_255_character_key_and_odd_printable_characters_work(
    server: RunningServer, ns: tuple[str, dict[str, str]]
):
    name, keys = ns
    long_key = ("k" * 200 + uuid.uuid4().hex)[:255]
    odd_key = f"a/b?c#d%20e f~{uuid.uuid4().hex}"
    with _client(server, keys["submit"]) as http:
        for key in (long_key, odd_key):
            created = _submit(http, name, key, BODY)
            assert created.status_code == 201, created.text
            quoted = httpx.URL(f"/v1/namespaces/{name}/submissions/").join(
                __import__("urllib.parse").parse.quote(key, safe="")
            )
            found = http.get(quoted)
            assert found.status_code == 200, found.text
            assert found.json()["id"] == created.json()["id"]


def test_keys_are_case_sensitive(server: RunningServer, ns: tuple[str, dict[str, str]]):
    name, keys = ns
    base = uuid.uuid4().hex
    with _client(server, keys["submit"]) as http:
        lower = _submit(http, name, f"key-{base}", BODY)
        upper = _submit(http, name, f"KEY-{base.upper()}", BODY)
    assert lower.status_code == upper.status_code == 201
    assert lower.json()["id"] != upper.json()["id"]


def test_unknown_queue_is_404_and_creates_nothing(server: RunningServer, ns: tuple[str, dict[str, str]]):
    name, keys = ns
    key = f"k-{uuid.uuid4()}"
    with _client(server, keys["submit"]) as http:
        _assert_problem(_submit(http, name, key, {**BODY, "queue": "nope"}), 404, "queue_not_found")
        _assert_problem(http.get(f"/v1/namespaces/{name}/submissions/{key}"), 404, "submission_not_found")
        # The key was not burnt: it can still be used once the request is right.
        assert _submit(http, name, key, BODY).status_code == 201


def test_params_round_trip_unchanged(server: RunningServer, ns: tuple[str, dict[str, str]]):
    name, keys = ns
    params = {
        "unicode": "Grüße, 你好, emoji 🚀, rtl שלום, combining é",
        "empty_list": [],
        "empty_object": {},
        "nested": [[1, [2, [3, []]]], {"a": [{"b": None}]}],
        "max_int64": 2**63 - 1,
        "min_int64": -(2**63),
        "beyond_int64": 2**70,
        "null": None,
        "float": 0.1,
        "bool": False,
        "quote": 'he said "hi"\n\t\\',
    }
    with _client(server, keys["submit"]) as http:
        created = _submit(http, name, f"k-{uuid.uuid4()}", {**BODY, "params": params})
        assert created.status_code == 201, created.text
        fetched = http.get(f"/v1/namespaces/{name}/tasks/{created.json()['id']}")
    assert created.json()["params"] == params
    assert fetched.json()["params"] == params
    assert fetched.json()["params"]["max_int64"] == 9223372036854775807


@pytest.mark.parametrize("params", [[], "text", 0, None], ids=["list", "string", "zero", "null"])
def test_params_may_be_any_json_value(server: RunningServer, ns: tuple[str, dict[str, str]], params: Any):
    name, keys = ns
    with _client(server, keys["submit"]) as http:
        created = _submit(http, name, f"k-{uuid.uuid4()}", {**BODY, "params": params})
    assert created.status_code == 201, created.text
    assert created.json()["params"] == params


def test_a_body_without_params_stores_an_empty_object_and_means_params_empty(
    server: RunningServer, ns: tuple[str, dict[str, str]]
):
    """Regression (issue 10, first hour): a body without ``params`` stored ``null``."""
    name, keys = ns
    bare = {"queue": "default", "handler": "orders.ping"}
    key = f"k-{uuid.uuid4()}"
    with _client(server, keys["submit"]) as http:
        created = _submit(http, name, key, bare)
        assert created.status_code == 201, created.text
        assert created.json()["params"] == {}
        assert http.get(f"/v1/namespaces/{name}/tasks/{created.json()['id']}").json()["params"] == {}
        assert _submit(http, name, key, {**bare, "params": {}}).status_code == 200  # the same submission
        _assert_problem(_submit(http, name, key, {**bare, "params": []}), 422, "idempotency_key_reused")
        batch = http.post(
            f"/v1/namespaces/{name}/tasks/batch", json={"items": [{**bare, "idempotency_key": key}]}
        )
        assert batch.json()["items"][0]["status"] == 200


def test_a_submission_without_params_sent_before_the_upgrade_still_replays(
    server: RunningServer, ns: tuple[str, dict[str, str]]
):
    """Before the ``{}`` default, a body without params digested as ``"params": null``: its replay
    after the upgrade (now ``{}``) is still a replay, on the single and the batch endpoint."""
    from orbit_client import TaskSubmission
    from orbit_server.tasks.store import request_digest

    name, keys = ns
    bare = {"queue": "default", "handler": "orders.ping"}
    key = f"k-{uuid.uuid4()}"
    with _client(server, keys["submit"]) as http:
        created = _submit(http, name, key, bare)
        assert created.status_code == 201
        legacy = request_digest(TaskSubmission(**bare, params=None))  # what the old server stored
        with server.engine.begin() as conn:
            conn.execute(sa.update(submission_keys).where(submission_keys.c.task_id == created.json()["id"])
                         .values(request_digest=legacy))  # fmt: skip
        replayed = _submit(http, name, key, bare)
        assert replayed.status_code == 200 and replayed.json()["id"] == created.json()["id"]
        assert _submit(http, name, key, {**bare, "params": {}}).status_code == 200
        batch = http.post(
            f"/v1/namespaces/{name}/tasks/batch", json={"items": [{**bare, "idempotency_key": key}]}
        )
        assert batch.json()["items"][0]["status"] == 200
        _assert_problem(_submit(http, name, key, {**bare, "params": {"a": 1}}), 422, "idempotency_key_reused")


def test_oversized_body_is_413_and_creates_nothing(server: RunningServer, ns: tuple[str, dict[str, str]]):
    name, keys = ns
    key = f"k-{uuid.uuid4()}"
    big = {**BODY, "params": {"blob": "x" * (256 * 1024)}}
    with _client(server, keys["submit"]) as http:
        _assert_problem(_submit(http, name, key, big), 413, "payload_too_large")
        # Without Content-Length (chunked), the limit holds while the body streams in.
        chunks = iter([b'{"queue":"default","handler":"h","params":"', b"x" * (300 * 1024), b'"}'])
        streamed = http.post(
            f"/v1/namespaces/{name}/tasks",
            content=chunks,
            headers={"Idempotency-Key": key, "Content-Type": "application/json"},
        )
        _assert_problem(streamed, 413, "payload_too_large")
        _assert_problem(http.get(f"/v1/namespaces/{name}/submissions/{key}"), 404, "submission_not_found")


def test_invalid_body_is_422_validation_error(server: RunningServer, ns: tuple[str, dict[str, str]]):
    name, keys = ns
    with _client(server, keys["submit"]) as http:
        body = _assert_problem(
            _submit(http, name, f"k-{uuid.uuid4()}", {"queue": "default", "params": {"secret": "s3cr3t"}}),
            422,
            "validation_error",
        )
        assert "handler" in body["detail"]
        assert "s3cr3t" not in str(body)
        bad_option = _submit(http, name, f"k-{uuid.uuid4()}", {**BODY, "options": {"max_attempts": 0}})
        _assert_problem(bad_option, 422, "validation_error")
        naive = _submit(
            http, name, f"k-{uuid.uuid4()}", {**BODY, "options": {"deadline": "2030-01-01T00:00:00"}}
        )
        _assert_problem(naive, 422, "validation_error")
        not_json = http.post(
            f"/v1/namespaces/{name}/tasks",
            content=b"{not json",
            headers={"Idempotency-Key": f"k-{uuid.uuid4()}", "Content-Type": "application/json"},
        )
        _assert_problem(not_json, 400, "invalid_json")  # README "HTTP API"


def test_authentication_and_roles(server: RunningServer, ns: tuple[str, dict[str, str]]):
    name, keys = ns
    with _client(server, keys["submit"]) as http:
        task = _submit(http, name, f"k-{uuid.uuid4()}", BODY).json()
    with _client(server, None) as anonymous:
        response = _submit(anonymous, name, f"k-{uuid.uuid4()}", BODY)
        _assert_problem(response, 401, "unauthenticated")
        assert response.headers["www-authenticate"].startswith("Bearer")
        _assert_problem(anonymous.get(f"/v1/namespaces/{name}/tasks/{task['id']}"), 401, "unauthenticated")
    with _client(server, "orbit_not-a-real-key") as forged:
        _assert_problem(forged.get(f"/v1/namespaces/{name}/tasks/{task['id']}"), 401, "unauthenticated")
    for role in ("read", "work"):
        with _client(server, keys[role]) as http:
            _assert_problem(_submit(http, name, f"k-{uuid.uuid4()}", BODY), 403, "forbidden")
            assert http.get(f"/v1/namespaces/{name}/tasks/{task['id']}").status_code == 200
    with _client(server, keys["admin"]) as http:
        assert _submit(http, name, f"k-{uuid.uuid4()}", BODY).status_code == 201


def test_other_namespace_is_invisible(server: RunningServer, ns: tuple[str, dict[str, str]]):
    name, keys = ns
    other = f"ns-{uuid.uuid4().hex[:8]}"
    other_keys = server.add_namespace(other)
    key = f"k-{uuid.uuid4()}"
    with _client(server, keys["submit"]) as http:
        task = _submit(http, name, key, BODY).json()
    with _client(server, other_keys["admin"]) as intruder:
        _assert_problem(intruder.get(f"/v1/namespaces/{name}/tasks/{task['id']}"), 404, "namespace_not_found")
        _assert_problem(intruder.get(f"/v1/namespaces/{name}/submissions/{key}"), 404, "namespace_not_found")
        _assert_problem(intruder.get(f"/v1/namespaces/{name}/queues/default"), 404, "namespace_not_found")
        _assert_problem(_submit(intruder, name, key, BODY), 404, "namespace_not_found")
        # Its own namespace does not see the task either, nor the key.
        _assert_problem(intruder.get(f"/v1/namespaces/{other}/tasks/{task['id']}"), 404, "task_not_found")
        _assert_problem(
            intruder.get(f"/v1/namespaces/{other}/submissions/{key}"), 404, "submission_not_found"
        )
        # The same key in another namespace is another submission.
        assert _submit(intruder, other, key, BODY).status_code == 201


def test_queue_reports_counts(server: RunningServer, ns: tuple[str, dict[str, str]]):
    name, keys = ns
    with _client(server, keys["read"]) as http:
        before = http.get(f"/v1/namespaces/{name}/queues/other").json()
    with _client(server, keys["submit"]) as http:
        _submit(http, name, f"k-{uuid.uuid4()}", {**BODY, "queue": "other"})
    with _client(server, keys["read"]) as http:
        after = http.get(f"/v1/namespaces/{name}/queues/other")
        _assert_problem(http.get(f"/v1/namespaces/{name}/queues/missing"), 404, "queue_not_found")
    assert after.status_code == 200
    assert after.json()["counts"].get("WAITING", 0) == before["counts"].get("WAITING", 0) + 1


def test_concurrent_first_submissions_create_one_task(server: RunningServer, ns: tuple[str, dict[str, str]]):
    name, keys = ns
    key = f"k-{uuid.uuid4()}"
    body = {**BODY, "params": {"n": 32}}

    def count_tasks() -> int:
        with server.engine.connect() as conn:
            return int(conn.scalar(sa.select(sa.func.count()).select_from(tasks)) or 0)

    def send(_: int) -> httpx.Response:
        with _client(server, keys["submit"]) as http:
            return _submit(http, name, key, body)

    before = count_tasks()
    with ThreadPoolExecutor(max_workers=32) as pool:
        responses = list(pool.map(send, range(32)))
    statuses = sorted(r.status_code for r in responses)
    assert statuses.count(201) == 1, statuses
    assert set(statuses) <= {200, 201, 409}, statuses
    assert len({r.json()["id"] for r in responses if r.status_code in (200, 201)}) == 1
    assert count_tasks() == before + 1


def test_every_response_has_a_request_id(server: RunningServer, ns: tuple[str, dict[str, str]]):
    with httpx.Client(base_url=server.base_url) as http:
        assert http.get("/healthz").headers["x-request-id"]
        echoed = http.get("/healthz", headers={"X-Request-Id": "trace-123"})
        assert echoed.headers["x-request-id"] == "trace-123"
        _assert_problem(http.get("/no/such/route"), 404, "not_found")
        ready = http.get("/readyz")
    assert ready.status_code == 200 and ready.json() == {"status": "ok"}


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize(
    "raw_params",
    ["NaN", "Infinity", "-Infinity", "1e400", '"\\ud800"', '{"k": ["\\udfff"]}', "[" * 31 + "]" * 31],
    ids=["nan", "inf", "-inf", "1e400", "lone-surrogate", "surrogate-in-list", "31-levels"],
)
def test_params_json_cannot_hold_faithfully_are_422(
    server: RunningServer, ns: tuple[str, dict[str, str]], raw_params: str
):
    """Regression (adversarial review): these gave 500, or a 500 on MariaDB only, and logged the params."""
    name, keys = ns
    key = f"k-{uuid.uuid4()}"
    body = '{"queue": "default", "handler": "h", "params": ' + raw_params + "}"
    with _client(server, keys["submit"]) as http:
        response = http.post(
            f"/v1/namespaces/{name}/tasks",
            content=body.encode(),
            headers={"Idempotency-Key": key, "Content-Type": "application/json"},
        )
        _assert_problem(response, 422, "validation_error")
        _assert_problem(http.get(f"/v1/namespaces/{name}/submissions/{key}"), 404, "submission_not_found")
        # 30 levels is the deepest accepted, and it round-trips on every backend.
        deep = _submit(http, name, key, {**BODY, "params": _nested(30)})
    assert deep.status_code == 201, deep.text
    assert deep.json()["params"] == _nested(30)


@pytest.mark.parametrize(
    "options",
    [
        {"available_at": "9999-12-31T23:59:59-01:00"},
        {"deadline": "0001-01-01T00:00:00+01:00"},
        {"max_attempts": True},
        {"retry_safe": "yes"},
    ],
    ids=["year-10000", "year-0", "bool-as-int", "string-as-bool"],
)
def test_out_of_range_or_mistyped_options_are_422(
    server: RunningServer, ns: tuple[str, dict[str, str]], options: dict[str, Any]
):
    name, keys = ns
    with _client(server, keys["submit"]) as http:
        response = _submit(http, name, f"k-{uuid.uuid4()}", {**BODY, "options": options})
    _assert_problem(response, 422, "validation_error")


def test_equal_meanings_replay_instead_of_422(server: RunningServer, ns: tuple[str, dict[str, str]]):
    """1 and 1.0 are one JSON number (RFC 8785); retry_safe false is what leaving it out means."""
    name, keys = ns
    key = f"k-{uuid.uuid4()}"
    with _client(server, keys["submit"]) as http:
        first = _submit(http, name, key, {**BODY, "params": {"qty": 1, "price": 2.5}})
        again = _submit(
            http, name, key, {**BODY, "params": {"price": 2.5, "qty": 1.0}, "options": {"retry_safe": False}}
        )
    assert first.status_code == 201 and again.status_code == 200
    assert again.json() == first.json()


def test_two_idempotency_key_headers_are_400(server: RunningServer, ns: tuple[str, dict[str, str]]):
    name, keys = ns
    with _client(server, keys["submit"]) as http:
        response = http.post(
            f"/v1/namespaces/{name}/tasks",
            json=BODY,
            headers=[("Idempotency-Key", f"a-{uuid.uuid4()}"), ("Idempotency-Key", f"b-{uuid.uuid4()}")],
        )
    _assert_problem(response, 400, "idempotency_key_invalid")


def test_metrics_count_submissions_and_time_requests_without_identifiers(
    server: RunningServer, ns: tuple[str, dict[str, str]]
):
    name, keys = ns
    key = f"k-{uuid.uuid4()}"
    with _client(server, keys["submit"]) as http:
        _submit(http, name, key, BODY)
        _submit(http, name, key, BODY)
        metrics = http.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert 'orbit_submissions_total{outcome="created"}' in text
    assert 'orbit_submissions_total{outcome="replayed"}' in text
    assert 'route="/v1/namespaces/{namespace}/tasks",status="201"' in text
    # No key or id in any label; the namespace is only a label of the sampled gauges (README "Security":
    # same-named queues of two namespaces are two series), never of the request metrics.
    assert key not in text
    assert all(name not in line for line in text.splitlines() if not line.startswith("orbit_tasks{"))
