"""Task priority over HTTP, on SQLite and MariaDB (issue 31 item 5, README "Task priority").

- A lease grants the highest ``priority`` first, then the oldest due (``available_at``, then id), on the
  plain path and on a queue with concurrency limits (including its reads past a full key).
- ``priority`` is part of the request digest: a replay must carry the same one (0 and none are alike).
- Batch items carry their own priority; a manual retry keeps it; bad values are 422 ``validation_error``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from orbit_client import OrbitClient, TaskStatus, UnprocessableEntityError
from orbit_server import errors
from orbit_server.tasks import admin, store
from tests.flow_support import FlowApi, until
from tests.servers import RunningServer

NS = "prio"


@pytest.fixture(scope="module")
def keys(server: RunningServer) -> dict[str, str]:
    return server.add_namespace(NS)


@pytest.fixture(scope="module")
def client(server: RunningServer, keys: dict[str, str]) -> Iterator[OrbitClient]:
    with OrbitClient(server.base_url, api_key=keys["admin"], timeout=30) as made:
        yield made


def _queue(server: RunningServer, **limits: int) -> str:
    name = f"q-{uuid.uuid4().hex[:10]}"
    with server.engine.begin() as conn:
        store.create_queue(conn, NS, name, **limits)  # type: ignore[arg-type]
    return name


def _submit(client: OrbitClient, queue: str, label: str, **options: Any) -> str:
    result = client.submit_task(
        NS, queue, "h", {"label": label}, idempotency_key=str(uuid.uuid4()), options=options
    )
    return result.task.id


def _leased(client: OrbitClient, queue: str, n: int) -> list[str]:
    grants = client.lease_tasks(NS, queue, worker_id="w", max_tasks=n)
    return [grant.task.params["label"] for grant in grants]  # type: ignore[index,call-overload]


def test_a_lease_grants_the_highest_priority_first_then_the_oldest_due(
    server: RunningServer, client: OrbitClient
) -> None:
    queue = _queue(server)
    past = datetime.now(UTC) - timedelta(hours=1)
    for label, options in [
        ("p0-first", {}),
        ("p5-first", {"priority": 5}),
        ("low", {"priority": -100}),
        ("p5-second", {"priority": 5}),
        ("p0-due-earlier", {"available_at": past}),  # submitted later, due earlier: first of the 0s
        ("top", {"priority": 100}),
        ("p0-second", {"priority": 0}),
    ]:
        _submit(client, queue, label, **options)
    assert _leased(client, queue, 3) == ["top", "p5-first", "p5-second"]
    assert _leased(client, queue, 10) == ["p0-due-earlier", "p0-first", "p0-second", "low"]


def test_a_task_due_later_waits_whatever_its_priority(server: RunningServer, client: OrbitClient) -> None:
    queue = _queue(server)
    _submit(client, queue, "later", priority=100, available_at=datetime.now(UTC) + timedelta(hours=1))
    _submit(client, queue, "now", priority=-1)
    assert _leased(client, queue, 10) == ["now"]


def test_a_limited_queue_grants_in_priority_order_and_reads_on_past_a_full_key(
    server: RunningServer, client: OrbitClient
) -> None:
    """A lease for 2 reads 8 rows at a time (``permits._OVERSAMPLE``): ten tasks of key A fill the head,
    A reaches its limit at the first pick, and the read past the last row must still find B, which is due
    earlier but has a lower priority (a read on by due time alone passed over it)."""
    queue = _queue(server, max_concurrency_per_key=1)
    _submit(client, queue, "b", priority=0, concurrency_key="B")
    for n in range(10):
        _submit(client, queue, f"a{n}", priority=50, concurrency_key="A")
    assert _leased(client, queue, 2) == ["a0", "b"]
    _submit(client, queue, "c", priority=50, concurrency_key="C")
    _submit(client, queue, "d", priority=90)
    assert _leased(client, queue, 2) == ["d", "c"]  # A and B are full: their permits are held
    assert _leased(client, queue, 2) == []


def test_priority_is_part_of_the_request_digest(client: OrbitClient) -> None:
    key = f"k-{uuid.uuid4()}"
    first = client.submit_task(NS, "default", "h", {}, idempotency_key=key, options={"priority": 7})
    assert first.task.priority == 7
    again = client.submit_task(NS, "default", "h", {}, idempotency_key=key, options={"priority": 7})
    assert again.replayed and again.task.id == first.task.id
    with pytest.raises(UnprocessableEntityError) as refused:
        client.submit_task(NS, "default", "h", {}, idempotency_key=key, options={"priority": 8})
    assert refused.value.code == "idempotency_key_reused"
    with pytest.raises(UnprocessableEntityError):
        client.submit_task(NS, "default", "h", {}, idempotency_key=key)
    # 0 is what no priority means: a submission without one replays one that said 0, and the other way.
    zero = f"k-{uuid.uuid4()}"
    made = client.submit_task(NS, "default", "h", {}, idempotency_key=zero, options={"priority": 0})
    assert made.task.priority == 0
    assert client.submit_task(NS, "default", "h", {}, idempotency_key=zero).replayed


def test_batch_items_carry_their_own_priority(server: RunningServer, client: OrbitClient) -> None:
    queue = _queue(server)
    labelled = [("none", None), ("high", {"priority": 40}), ("low", {"priority": -40})]
    items = [
        {"idempotency_key": str(uuid.uuid4()), "queue": queue, "handler": "h", "params": {"label": label},
         "options": options}
        for label, options in labelled
    ]  # fmt: skip
    answers = client.submit_tasks(NS, items)
    assert [(a.status, a.task and a.task.priority) for a in answers] == [(201, 0), (201, 40), (201, -40)]
    assert _leased(client, queue, 3) == ["high", "none", "low"]


def test_a_manual_retry_keeps_the_priority(client: OrbitClient) -> None:
    task_id = _submit(client, "default", "r", priority=-20)
    client.cancel_task(NS, task_id, reason="test")
    successor = client.retry_task(NS, task_id, reason="test")
    assert successor.priority == -20 and client.get_task(NS, task_id).priority == -20


@pytest.mark.parametrize("value", [101, -101, 1.5, "5", True, None], ids=repr)
def test_a_priority_that_is_no_integer_from_minus_100_to_100_is_a_422(
    server: RunningServer, keys: dict[str, str], value: Any
) -> None:
    with httpx.Client(
        base_url=f"{server.base_url}/v1/namespaces/{NS}", headers={"Authorization": f"Bearer {keys['admin']}"}
    ) as http:
        body = {"queue": "default", "handler": "h", "options": {"priority": value}}
        answer = http.post("/tasks", json=body, headers={"Idempotency-Key": f"k-{uuid.uuid4()}"})
        if value is None:  # null means the default, as for every option
            assert answer.status_code == 201 and answer.json()["priority"] == 0
            return
        assert answer.status_code == 422, answer.text
        problem = answer.json()
        assert answer.headers["content-type"] == "application/problem+json"
        assert problem["code"] == "validation_error"
        assert [e["loc"][-2:] for e in problem["errors"]] == [["options", "priority"]]
        batch = http.post("/tasks/batch", json={"items": [{"idempotency_key": "b", **body}]})
        assert batch.status_code == 200, batch.text
        [item] = batch.json()["items"]
        assert item["status"] == 422 and item["error"]["code"] == "validation_error"


def test_a_flow_task_steps_priority_is_its_tasks(server: RunningServer, keys: dict[str, str]) -> None:
    queue = _queue(server)
    api = FlowApi(server.base_url, NS, keys)
    try:
        graph = {
            "start": "urgent",
            "nodes": {
                "urgent": {"type": "task", "queue": queue, "handler": "h", "priority": 30, "next": "done"},
                "done": {"type": "end", "status": "COMPLETED"},
            },
        }
        api.publish("prio-flow", graph)
        bad = {**graph, "nodes": {**graph["nodes"], "urgent": {**graph["nodes"]["urgent"], "priority": 101}}}
        refused = api.post("submit", "/flows/prio-flow/versions", {"graph": bad})
        assert refused.status_code == 422 and refused.json()["code"] == "validation_error", refused.text
        instance = api.start("prio-flow")
        [step] = until(lambda: api.instance(instance["id"])["steps"], what="the step's task")
        assert api.get(f"/tasks/{step['task_id']}").json()["priority"] == 30
    finally:
        api.close()


def test_a_queues_waiting_tasks_list_in_lease_order_page_by_page(
    server: RunningServer, client: OrbitClient
) -> None:
    """``admin.list_tasks(order="lease")`` (the console's and ``orbit-server task list``'s lease order)."""
    queue = _queue(server)
    later = datetime.now(UTC) + timedelta(hours=1)
    made = {label: _submit(client, queue, label, **options) for label, options in [
        ("a", {}), ("b", {"priority": 9}), ("c", {"priority": -9}), ("d", {"priority": 9}), ("e", {}),
        ("f", {"priority": 50, "available_at": later}),
    ]}  # fmt: skip
    labels = {task_id: label for label, task_id in made.items()}
    filters = admin.TaskFilter(status=TaskStatus.WAITING, queue=queue)
    seen: list[str] = []
    cursor = None
    with server.engine.connect() as conn:
        namespace_id = store.get_namespace_id(conn, NS)
        for _ in range(4):
            page = admin.list_tasks(conn, namespace_id, filters, limit=2, cursor=cursor, order="lease")
            seen += [labels[t.id] for t in page.items]
            cursor = page.next_cursor
            if cursor is None:
                break
        assert seen == ["f", "b", "d", "a", "e", "c"]  # f is not due yet: listed at its place, leased later
        with pytest.raises(errors.InvalidCursor):
            admin.list_tasks(
                conn, namespace_id, filters, cursor=store.encode_cursor(later, "x:y"), order="lease"
            )
