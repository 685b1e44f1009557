"""Batch acceptance over HTTP against a real server, on SQLite and MariaDB (DESIGN §3 "Batch acceptance")."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from orbit_client import BatchItem, OrbitClient, PermissionDeniedError, RetryPolicy, UnprocessableEntityError
from orbit_server.db.schema import submission_keys, task_events, tasks
from tests.conftest import DatabaseFactory
from tests.servers import RunningServer, run_server

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ns(server: RunningServer) -> tuple[str, dict[str, str]]:
    name = f"ns-{uuid.uuid4().hex[:8]}"
    return name, server.add_namespace(name, ("default", "other"))


def _client(server: RunningServer, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.base_url, headers=headers, timeout=60)


def _batch(http: httpx.Client, namespace: str, items: list[Any]) -> httpx.Response:
    return http.post(f"/v1/namespaces/{namespace}/tasks/batch", json={"items": items})


def _single(http: httpx.Client, namespace: str, key: str, body: dict[str, Any]) -> httpx.Response:
    return http.post(f"/v1/namespaces/{namespace}/tasks", json=body, headers={"Idempotency-Key": key})


BODY: dict[str, Any] = {"queue": "default", "handler": "orders.fulfil", "params": {"order_id": 1}}


def _item(key: str, **changes: Any) -> dict[str, Any]:
    return {"idempotency_key": key, **BODY, **changes}


def _new_key() -> str:
    return f"k-{uuid.uuid4()}"


def _assert_problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body = response.json()
    assert (body["code"], body["status"]) == (code, status)
    assert body["request_id"] == response.headers["x-request-id"]
    return body


def _results(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    items: list[dict[str, Any]] = response.json()["items"]
    for result in items:
        assert result["replayed"] is (result["status"] == 200)
        if result["status"] in (200, 201):
            assert result["task"] is not None and result["error"] is None
        else:
            assert result["task"] is None
            assert result["error"]["status"] == result["status"]
            assert result["error"]["title"]
            assert result["error"]["request_id"] == response.headers["x-request-id"]
    return items


def _count(server: RunningServer, table: sa.Table, *where: Any) -> int:
    with server.engine.connect() as conn:
        return int(conn.scalar(sa.select(sa.func.count()).select_from(table).where(*where)) or 0)


def test_mixed_batch_answers_each_item_in_order(server: RunningServer, ns: tuple[str, dict[str, str]]):
    name, keys = ns
    sent_singly, new, twice, twice_other, unknown_queue, no_handler, reused = (_new_key() for _ in range(7))
    with _client(server, keys["submit"]) as http:
        original = _single(http, name, sent_singly, BODY).json()
        assert _single(http, name, reused, BODY).status_code == 201
        response = _batch(
            http,
            name,
            [
                _item(new, options={"max_attempts": 7}),  # 0 new
                _item(sent_singly),  # 1 replay of a single submission
                _item(reused, params={"order_id": 2}),  # 2 key reused for another request
                _item(unknown_queue, queue="nope"),  # 3 unknown queue
                {"idempotency_key": no_handler, "queue": "default", "params": {"secret": "s3cr3t"}},  # 4
                _item("x" * 256),  # 5 malformed key
                _item(twice),  # 6 new ...
                _item(twice),  # 7 ... and the same again: a replay of item 6
                _item(twice_other),  # 8 new ...
                _item(twice_other, handler="orders.refund"),  # 9 ... then another request with its key
                {"queue": "default", "handler": "h"},  # 10 no key
                "not an object",  # 11
                _item(unknown_queue),  # 12 the key of item 3 was not burnt
            ],
        )
    results = _results(response)
    assert [r["status"] for r in results] == [201, 200, 422, 404, 422, 400, 201, 200, 201, 422, 400, 422, 201]
    codes = [r["error"]["code"] if r["error"] else None for r in results]
    assert codes[2:6] == [
        "idempotency_key_reused",
        "queue_not_found",
        "validation_error",
        "idempotency_key_invalid",
    ]
    assert codes[9:12] == ["idempotency_key_reused", "idempotency_key_missing", "validation_error"]
    assert results[0]["task"]["max_attempts"] == 7
    assert results[1]["task"] == original
    assert results[7]["task"] == results[6]["task"]
    validation = results[4]["error"]
    assert [e["loc"] for e in validation["errors"]] == [["body", "items", 4, "handler"]]
    assert "s3cr3t" not in response.text
    assert results[11]["error"]["errors"][0]["loc"] == ["body", "items", 11]
    # Exactly one key row and one accepted event per new task; nothing for the refused items.
    created = [results[i]["task"]["id"] for i in (0, 6, 8, 12)]
    assert len(set(created)) == 4
    for key in (new, twice, twice_other, unknown_queue):
        assert _count(server, submission_keys, submission_keys.c.idempotency_key == key) == 1
    for task_id in created:
        assert _count(server, task_events, task_events.c.task_id == task_id) == 1
    assert _count(server, submission_keys, submission_keys.c.idempotency_key == no_handler) == 0


def test_batch_and_single_endpoint_agree(server: RunningServer, ns: tuple[str, dict[str, str]]):
    """A key first sent singly replays in a batch, and the other way round, with the same task body."""
    name, keys = ns
    first_single, first_batch = _new_key(), _new_key()
    options = {"max_attempts": 4, "retry_safe": True, "available_at": "2030-01-01T01:00:00+01:00"}
    with _client(server, keys["submit"]) as http:
        single = _single(http, name, first_single, {**BODY, "options": options})
        assert single.status_code == 201, single.text
        batch = _results(
            _batch(http, name, [_item(first_batch, params=1.0), _item(first_single, options=options)])
        )
        assert [r["status"] for r in batch] == [201, 200]
        assert batch[1]["task"] == single.json()
        # The same digest as the single endpoint: 1.0 and 1 are one number, {} and no options one meaning.
        replay = _single(http, name, first_batch, {**BODY, "params": 1, "options": {}})
        assert replay.status_code == 200 and replay.headers["idempotent-replayed"] == "true"
        assert replay.json() == batch[0]["task"]
        assert http.get(f"/v1/namespaces/{name}/tasks/{batch[0]['task']['id']}").json() == batch[0]["task"]
        assert http.get(f"/v1/namespaces/{name}/submissions/{first_batch}").json() == batch[0]["task"]
        _assert_problem(
            _single(http, name, first_batch, {**BODY, "params": 2}), 422, "idempotency_key_reused"
        )
        again = _results(_batch(http, name, [_item(first_batch, params=1), _item(first_single)]))
        assert [r["status"] for r in again] == [200, 422]
        assert again[0]["task"] == batch[0]["task"]


@pytest.mark.parametrize("overlap", ["same-order", "shuffled"])
def test_concurrent_overlapping_batches_create_one_task_per_key(
    server: RunningServer, ns: tuple[str, dict[str, str]], overlap: str
):
    name, keys = ns
    pool_keys = [_new_key() for _ in range(60)]
    body_of = {key: _item(key, params={"key": key}) for key in pool_keys}
    rng = random.Random(7)
    batches = []
    for _ in range(12):
        chosen = rng.sample(pool_keys, 30)
        if overlap == "same-order":
            chosen.sort(key=pool_keys.index)
        batches.append([body_of[key] for key in chosen])
    start = threading.Barrier(len(batches) + 4)

    def send_batch(items: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        with _client(server, keys["submit"]) as http:
            start.wait()
            return items, _results(_batch(http, name, items))

    def send_singles(offset: int) -> list[tuple[str, httpx.Response]]:
        with _client(server, keys["submit"]) as http:
            start.wait()
            chosen = pool_keys[offset::4][:8]
            return [(key, _single(http, name, key, {**BODY, "params": {"key": key}})) for key in chosen]

    with ThreadPoolExecutor(max_workers=len(batches) + 4) as pool:
        batch_futures = [pool.submit(send_batch, items) for items in batches]
        single_futures = [pool.submit(send_singles, offset) for offset in range(4)]
        answered = [f.result() for f in batch_futures]
        singles = [pair for f in single_futures for pair in f.result()]

    task_of: dict[str, set[str]] = {key: set() for key in pool_keys}
    created_per_key: dict[str, int] = dict.fromkeys(pool_keys, 0)
    for items, results in answered:
        assert len(results) == len(items)
        for item, result in zip(items, results, strict=True):
            assert result["status"] in (200, 201, 409), result
            if result["status"] == 409:
                assert result["error"]["code"] == "request_in_progress"
                continue
            assert result["task"]["params"] == {"key": item["idempotency_key"]}
            task_of[item["idempotency_key"]].add(result["task"]["id"])
            created_per_key[item["idempotency_key"]] += result["status"] == 201
    for key, response in singles:
        assert response.status_code in (200, 201, 409), response.text
        if response.status_code != 409:
            task_of[key].add(response.json()["id"])
            created_per_key[key] += response.status_code == 201
    answered_keys = [key for key in pool_keys if task_of[key]]
    assert all(len(task_of[key]) == 1 for key in answered_keys), task_of
    assert all(created_per_key[key] == 1 for key in answered_keys), created_per_key
    with server.engine.connect() as conn:
        rows = conn.execute(
            sa.select(submission_keys.c.idempotency_key, submission_keys.c.task_id).where(
                submission_keys.c.idempotency_key.in_(pool_keys)
            )
        ).all()
        task_rows = conn.scalar(
            sa.select(sa.func.count())
            .select_from(tasks)
            .where(tasks.c.id.in_([task_id for ids in task_of.values() for task_id in ids]))
        )
    assert len(rows) == len({key for key, _ in rows})  # one key row per key
    assert {key: {task_id} for key, task_id in rows if key in answered_keys} == {
        k: task_of[k] for k in answered_keys
    }
    assert task_rows == len(answered_keys)


def test_at_most_max_batch_items(server: RunningServer, ns: tuple[str, dict[str, str]]):
    name, keys = ns
    full = [_item(_new_key(), params=i) for i in range(500)]
    with _client(server, keys["submit"]) as http:
        results = _results(_batch(http, name, full))
        assert [r["status"] for r in results] == [201] * 500
        assert [r["task"]["params"] for r in results] == list(range(500))
        too_many = [_item(_new_key()) for _ in range(501)]
        body = _assert_problem(_batch(http, name, too_many), 422, "validation_error")
        assert "at most 500" in body["detail"]
        _assert_problem(_batch(http, name, []), 422, "validation_error")
    assert (
        _count(server, submission_keys, submission_keys.c.idempotency_key == too_many[0]["idempotency_key"])
        == 0
    )


def test_max_batch_items_setting(make_database: DatabaseFactory):
    with run_server(make_database("sqlite"), max_batch_items=2) as small:
        keys = small.add_namespace("acme")
        with _client(small, keys["submit"]) as http:
            assert len(_results(_batch(http, "acme", [_item(_new_key()), _item(_new_key())]))) == 2
            body = _assert_problem(
                _batch(http, "acme", [_item(_new_key()) for _ in range(3)]), 422, "validation_error"
            )
            assert "at most 2" in body["detail"]
            spec = http.get("/openapi.json").json()
    assert spec["components"]["schemas"]["BatchSubmission"]["properties"]["items"]["maxItems"] == 2


def test_oversized_batch_is_413_and_creates_nothing(server: RunningServer, ns: tuple[str, dict[str, str]]):
    name, keys = ns
    items = [_item(_new_key(), params={"blob": "x" * 1024}) for _ in range(300)]  # ~330 KB > 256 KiB
    with _client(server, keys["submit"]) as http:
        _assert_problem(_batch(http, name, items), 413, "payload_too_large")
    assert (
        _count(server, submission_keys, submission_keys.c.idempotency_key == items[0]["idempotency_key"]) == 0
    )


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"[]",
        b'{"items": {}}',
        b'{"items": "x"}',
        b"{}",
        b'{"items": [], "more": 1}',
        b'{"items": null}',
    ],
)
def test_malformed_body_fails_the_whole_request(
    server: RunningServer, ns: tuple[str, dict[str, str]], content: bytes
):
    name, keys = ns
    with _client(server, keys["submit"]) as http:
        response = http.post(
            f"/v1/namespaces/{name}/tasks/batch",
            content=content,
            headers={"Content-Type": "application/json"},
        )
    # Not JSON at all is 400 invalid_json (README "HTTP API"); JSON of the wrong shape is 422.
    if content == b"{not json":
        _assert_problem(response, 400, "invalid_json")
    else:
        _assert_problem(response, 422, "validation_error")


def test_roles_and_namespaces(server: RunningServer, ns: tuple[str, dict[str, str]]):
    name, keys = ns
    key = _new_key()
    with _client(server, None) as anonymous:
        _assert_problem(_batch(anonymous, name, [_item(key)]), 401, "unauthenticated")
    for role in ("read", "work"):
        with _client(server, keys[role]) as http:
            body = _assert_problem(_batch(http, name, [_item(key)]), 403, "forbidden")
            assert "'submit' key" in body["detail"]
    other_keys = server.add_namespace(f"ns-{uuid.uuid4().hex[:8]}")
    with _client(server, other_keys["admin"]) as intruder:
        _assert_problem(_batch(intruder, name, [_item(key)]), 404, "namespace_not_found")
    assert _count(server, submission_keys, submission_keys.c.idempotency_key == key) == 0
    with _client(server, keys["admin"]) as http:
        assert [r["status"] for r in _results(_batch(http, name, [_item(key)]))] == [201]


def test_metrics_count_created_and_replayed(server: RunningServer, ns: tuple[str, dict[str, str]]):
    name, keys = ns

    def counts(http: httpx.Client) -> dict[str, float]:
        found = {}
        for line in http.get("/metrics").text.splitlines():
            if line.startswith("orbit_submissions_total{"):
                found[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
        return found

    first, second = _new_key(), _new_key()
    with _client(server, keys["submit"]) as http:
        before = counts(http)
        _results(
            _batch(http, name, [_item(first), _item(second), _item(first), _item(_new_key(), queue="nope")])
        )
        after = counts(http)
        text = http.get("/metrics").text
    assert after["created"] - before.get("created", 0) == 2
    assert after["replayed"] - before.get("replayed", 0) == 1
    assert 'route="/v1/namespaces/{namespace}/tasks/batch",status="200"' in text


def test_a_batch_wakes_a_long_polling_lease(make_database: DatabaseFactory):
    """With a 60 s poll interval, only the batch's wake-up can end a 30 s long-poll early.

    The batch is sent once the lease call has looked for due tasks (the first transaction
    committed after the lease request left, with both keys cached and no sweeper running).
    """
    settings = {
        "lease_poll_interval_seconds": 60,
        "sweep_interval_seconds": 0,
        "scheduler_interval_seconds": 0,
        "api_key_cache_seconds": 300,
    }
    with run_server(make_database("sqlite"), **settings) as running:
        keys = running.add_namespace("acme")
        lease_path = "/v1/namespaces/acme/queues/default/leases"
        looked = threading.Event()
        with (
            _client(running, keys["work"]) as worker,
            _client(running, keys["submit"]) as http,
            ThreadPoolExecutor(max_workers=1) as pool,
        ):
            assert worker.post(lease_path, json={"worker_id": "w"}).json() == []  # caches the work key
            _assert_problem(_batch(http, "acme", []), 422, "validation_error")  # caches the submit key
            sa.event.listen(running.engine, "commit", lambda _conn: looked.set())
            lease = pool.submit(worker.post, lease_path, json={"worker_id": "w", "wait_seconds": 30})
            assert looked.wait(10)
            results = _results(_batch(http, "acme", [_item(_new_key())]))
            grants = lease.result(timeout=15).json()  # without the wake-up: 30 s
    assert [grant["task"]["id"] for grant in grants] == [results[0]["task"]["id"]]


def test_client_submit_tasks_against_the_server(server: RunningServer, ns: tuple[str, dict[str, str]]):
    name, keys = ns
    key = _new_key()
    items: list[BatchItem | dict[str, Any]] = [
        BatchItem(idempotency_key=key, queue="default", handler="h", params={"n": 1}),
        {"idempotency_key": key, "queue": "default", "handler": "h", "params": {"n": 1}},
        {"idempotency_key": _new_key(), "queue": "nope", "handler": "h"},
    ]
    with OrbitClient(server.base_url, api_key=keys["submit"], retry=RetryPolicy.no_wait()) as client:
        results = client.submit_tasks(name, items)
        assert [(r.status, r.replayed, r.ok) for r in results] == [
            (201, False, True),
            (200, True, True),
            (404, False, False),
        ]
        assert results[0].task == results[1].task
        assert results[2].error is not None and results[2].error.code == "queue_not_found"
        assert client.find_submission(name, key) == results[0].task
        with pytest.raises(UnprocessableEntityError):
            client.submit_tasks(
                name, [{"idempotency_key": _new_key(), "queue": "default", "handler": "h"}] * 501
            )
    with OrbitClient(server.base_url, api_key=keys["read"]) as reader, pytest.raises(PermissionDeniedError):
        reader.submit_tasks(name, items)


def test_openapi_documents_the_batch_endpoint(server: RunningServer):
    spec = httpx.get(f"{server.base_url}/openapi.json").json()
    operation = spec["paths"]["/v1/namespaces/{namespace}/tasks/batch"]["post"]
    ok = operation["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok == {"$ref": "#/components/schemas/BatchSubmitResponse"}
    assert operation["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/BatchSubmission"
    }
    schemas = spec["components"]["schemas"]
    assert set(schemas["BatchItemResult"]["properties"]) == {"status", "task", "error", "replayed"}
    items = schemas["BatchSubmission"]["properties"]["items"]
    assert (items["minItems"], items["maxItems"]) == (1, 500)
    assert set(items["items"]["required"]) == {"idempotency_key", "queue", "handler"}
    assert {"400", "401", "403", "413", "422"} <= set(operation["responses"])


def test_batch_example_runs(make_database: DatabaseFactory) -> None:
    """examples/batch_example.py (the README's batch example) runs as written."""
    with run_server(make_database("sqlite")) as running:
        keys = running.add_namespace("shop", ("fulfilment",))
        env = {**os.environ, "ORBIT_URL": running.base_url, "ORBIT_API_KEY": keys["submit"]}
        done = subprocess.run(
            [sys.executable, str(REPO / "examples" / "batch_example.py")], env=env, capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [line.split() for line in done.stdout.splitlines()]
    assert [line[1:3] for line in lines] == [["201", "new"], ["201", "new"], ["404", "queue_not_found"]]
    assert [line[0].rsplit("-", 2)[1] for line in lines] == ["1001", "1002", "1003"]


KINDS = [
    pytest.param("sqlite"),
    pytest.param("mariadb", marks=pytest.mark.mariadb),
    pytest.param("postgres", marks=pytest.mark.postgres),
]
#: The most parameters one PostgreSQL statement may carry (its wire protocol counts them in 16 bits).
POSTGRES_MAX_PARAMETERS = 65_535


@pytest.mark.postgres
def test_a_batch_past_postgresql_s_parameter_limit_is_accepted_in_statements_within_it(
    make_database: DatabaseFactory,
) -> None:
    """5,000 items (the largest ORBIT_MAX_BATCH_ITEMS) carry about 150,000 task values: the multi-row
    INSERTs are split so that none carries more than PostgreSQL's 65,535 parameters, and each carries many
    rows (not one INSERT per row); every item is created once, and the same batch replays them all."""
    with run_server(
        make_database("postgres"), max_batch_items=5000, max_body_bytes=4_000_000, sweep_interval_seconds=0,
        scheduler_interval_seconds=0, flow_interval_seconds=0,
    ) as running:  # fmt: skip
        keys = running.add_namespace("big")
        inserts: list[tuple[str, int]] = []

        def capture(_conn: Any, _cursor: Any, sql: str, parameters: Any, _context: Any, many: bool) -> None:
            if sql.startswith("INSERT INTO tasks "):
                rows = len(parameters) if many and not isinstance(parameters, dict) else 1
                inserts.append((sql, rows))

        batch = [_item(_new_key(), params={"n": n}) for n in range(5000)]
        with _client(running, keys["submit"]) as http:
            sa.event.listen(running.engine, "before_cursor_execute", capture)
            try:
                created = _results(_batch(http, "big", batch))
            finally:
                sa.event.remove(running.engine, "before_cursor_execute", capture)
            replayed = _results(_batch(http, "big", batch))
        assert [r["status"] for r in created] == [201] * 5000
        assert [r["status"] for r in replayed] == [200] * 5000
        assert [r["task"]["id"] for r in replayed] == [r["task"]["id"] for r in created]
        with running.engine.connect() as conn:
            assert conn.scalar(sa.select(sa.func.count()).select_from(tasks)) == 5000
    # One statement per page of rows (not one per row); each page's parameters within the limit.
    assert 1 < len(inserts) < 5000 // 100, [rows for _, rows in inserts]
    for sql, _ in inserts:
        values = sql.count("%(")
        assert len(tasks.c) * 100 <= values <= POSTGRES_MAX_PARAMETERS, (values, sql[:200])


@pytest.mark.parametrize("kind", KINDS)
def test_statements_per_batch_do_not_grow_with_its_size(make_database: DatabaseFactory, kind: str):
    """Set-based: a batch costs the same statements for 5 items as for 200, new or replayed."""
    with run_server(
        make_database(kind),
        sweep_interval_seconds=0,
        scheduler_interval_seconds=0,
        flow_interval_seconds=0,
        # The /metrics sampler shares the engine: a sample taken while a request runs counted its statements
        # as the request's ([7, 8, 7, 2] once at load 7: a replay's 2 and a sample's).
        metrics_sample_interval_seconds=0,
        api_key_cache_seconds=300,
    ) as running:
        keys = running.add_namespace("acme")
        statements: list[str] = []
        with _client(running, keys["submit"]) as http:
            _results(_batch(http, "acme", [_item(_new_key())]))  # warm-up: the key cache, the pool
            sa.event.listen(
                running.engine, "before_cursor_execute", lambda _c, _cur, sql, *_: statements.append(sql)
            )
            counts = []
            for size in (5, 200):
                batch = [_item(_new_key(), params=n) for n in range(size)]
                for _ in ("new", "replay"):
                    statements.clear()
                    assert len(_results(_batch(http, "acme", batch))) == size
                    counts.append(len(statements))
    begin = 1 if kind == "sqlite" else 0  # BEGIN IMMEDIATE
    # keys, queues, clock, 3 multi-row inserts, tasks; a replay: keys, tasks.
    assert counts == [7 + begin, 2 + begin, 7 + begin, 2 + begin]
