"""Flow rows of the outbox (README "Starting flows from the outbox") on SQLite, MariaDB and PostgreSQL:
``enqueue_flow`` in the caller's transaction, the relay starting each instance with the row's key
(outcomes classified as for tasks), reconcile and resolve by the key. The Orbit side is an in-memory
fake (``httpx.MockTransport``) that speaks the flows contract, so every outcome class is reachable;
tests/integration/outbox/test_flow_rows_server.py runs the same path against a real server."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from orbit_client import OrbitClient, RetryPolicy
from outbox_adapter import (
    Backoff,
    Outbox,
    OutboxDatabaseError,
    OutboxTables,
    OutboxUsageError,
    ParamsTooLargeError,
    Relay,
    RowKind,
    enqueue,
    enqueue_flow,
    enqueue_flow_async,
)
from tests.integration.outbox.conftest import Biz

NOW = "2030-01-01T00:00:00Z"
Handler = Callable[[httpx.Request], httpx.Response]


def problem(status: int, code: str, **headers: str) -> httpx.Response:
    body = {"title": code, "status": status, "code": code}
    return httpx.Response(status, json=body, headers={"content-type": "application/problem+json", **headers})


def instance(flow: str, key: str, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"inst-{key}", "namespace": "shop", "flow": flow, "version": body.get("version", 1),
        "status": "RUNNING", "input": body.get("input", {}), "idempotency_key": key, "control_version": 0,
        "state_version": 1, "created_at": NOW, "updated_at": NOW,
    }  # fmt: skip


class FakeFlows:
    """Starts instances (``start`` decides the answer per request; default: 201, then 200 replays of the
    same key and body, 409 ``idempotency_conflict`` for another body), looks them up by key, and
    takes task batches (every item 201)."""

    def __init__(self, start: Handler | None = None) -> None:
        self.start = start
        self.started: dict[str, dict[str, Any]] = {}  # key -> instance
        self.starts: list[tuple[str, str]] = []  # (flow, key) per start request
        self.batches: list[int] = []  # items per task batch request

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "POST" and path.endswith("/instances"):
            flow = path.split("/")[-2]
            key = request.headers["Idempotency-Key"]
            self.starts.append((flow, key))
            if self.start is not None:
                return self.start(request)
            return self.answer(flow, key, json.loads(request.content))
        if request.method == "GET" and path.endswith("/flow-instances"):
            found = self.started.get(request.url.params["idempotency_key"])
            return httpx.Response(200, json={"items": [found] if found else [], "next_cursor": None})
        if request.method == "GET" and "/flow-instances/" in path:
            wanted = path.rsplit("/", 1)[-1]
            for found in self.started.values():
                if found["id"] == wanted:
                    return httpx.Response(200, json=found)
            return problem(404, "flow_instance_not_found")
        if request.method == "POST" and path.endswith("/tasks/batch"):
            items = json.loads(request.content)["items"]
            self.batches.append(len(items))
            results = [
                {"status": 201, "replayed": False, "task": {
                    "id": f"task-{item['idempotency_key']}", "namespace": "shop", "queue": item["queue"],
                    "handler": item["handler"], "status": "WAITING", "state_version": 1, "attempt_count": 0,
                    "max_attempts": 3, "available_at": NOW, "created_at": NOW, "updated_at": NOW}}
                for item in items
            ]  # fmt: skip
            return httpx.Response(200, json={"items": results})
        return problem(404, "not_found")

    def answer(self, flow: str, key: str, body: dict[str, Any]) -> httpx.Response:
        new = instance(flow, key, body)
        old = self.started.get(key)
        if old is None:
            self.started[key] = new
            return httpx.Response(201, json=new)
        same = (old["flow"], old["input"], old["version"]) == (new["flow"], new["input"], new["version"])
        return httpx.Response(200, json=old) if same else problem(409, "idempotency_conflict")


def make_relay(biz: Biz, tables: OutboxTables, server: FakeFlows, **options: Any) -> Relay:
    client = OrbitClient("http://orbit.test", api_key="k", retry=RetryPolicy(max_attempts=1),
                         transport=httpx.MockTransport(server))  # fmt: skip
    options.setdefault("backoff", Backoff.no_wait())
    return Relay(client=client, engine=biz.engine, tables=tables, **options)


def add_flow(biz: Biz, tables: OutboxTables, **kwargs: Any) -> int:
    kwargs.setdefault("flow", "order-fulfilment")
    kwargs.setdefault("input", {"order_id": "o-1"})
    with biz.engine.begin() as conn:
        return enqueue_flow(conn, namespace="shop", tables=tables, **kwargs).id


def test_enqueue_flow_writes_one_flow_row_in_the_callers_transaction(biz: Biz, tables: OutboxTables) -> None:
    with biz.engine.begin() as conn:
        entry = enqueue_flow(conn, namespace="shop", flow="order-fulfilment", input={"order_id": "o-1"},
                             idempotency_key="o-1:fulfil", version=3, business_ref="order:o-1", tables=tables)  # fmt: skip
    assert (entry.kind, entry.flow, entry.queue, entry.handler) == ("flow", "order-fulfilment", "", "")
    row = Outbox(biz.engine, tables=tables).get(entry.id)
    assert (row.kind, row.flow, row.params, row.options, row.state) == (
        RowKind.FLOW,
        "order-fulfilment",
        {"order_id": "o-1"},
        {"version": 3},
        "PENDING",
    )
    with pytest.raises(RuntimeError), biz.engine.begin() as conn:  # a rollback leaves nothing to send
        enqueue_flow(conn, namespace="shop", flow="order-fulfilment", idempotency_key="gone", tables=tables)
        raise RuntimeError
    assert [r.idempotency_key for r in Outbox(biz.engine, tables=tables).list_rows()] == ["o-1:fulfil"]
    with pytest.raises(OutboxDatabaseError, match="already exists"), biz.engine.begin() as conn:
        enqueue_flow(conn, namespace="shop", flow="other", idempotency_key="o-1:fulfil", tables=tables)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"flow": "no spaces"}, "not a valid flow name"),
        ({"input": [1, 2]}, "input must be a JSON object"),
        ({"input": {"x": float("nan")}}, "input cannot be stored"),
        ({"version": 0}, "version must be"),
        ({"version": True}, "version must be"),
        ({"idempotency_key": " padded"}, "idempotency_key"),
    ],
)
def test_enqueue_flow_refuses_what_the_server_would_refuse_and_writes_nothing(
    biz: Biz, tables: OutboxTables, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(OutboxUsageError, match=message), biz.engine.begin() as conn:
        enqueue_flow(conn, namespace="shop", **{"flow": "f", **kwargs}, tables=tables)
    with pytest.raises(ParamsTooLargeError), biz.engine.begin() as conn:
        enqueue_flow(
            conn, namespace="shop", flow="f", input={"x": "y" * 100}, max_params_bytes=50, tables=tables
        )
    assert Outbox(biz.engine, tables=tables).list_rows() == []


def test_the_relay_starts_each_flow_row_once_with_its_key_beside_batched_task_rows(
    biz: Biz, tables: OutboxTables
) -> None:
    flow_ids = [
        add_flow(biz, tables, input={"order_id": f"o-{i}"}, idempotency_key=f"o-{i}:fulfil") for i in range(5)
    ]
    with biz.engine.begin() as conn:
        for i in range(3):
            enqueue(conn, namespace="shop", queue="default", handler="h", params={"i": i}, tables=tables)
    server = FakeFlows()
    stats = make_relay(biz, tables, server, batch_size=20, concurrency=2).run_once()
    assert stats.delivered == 8 and server.batches == [3]  # the tasks in one batch request, each flow alone
    assert sorted(server.starts) == [("order-fulfilment", f"o-{i}:fulfil") for i in range(5)]
    outbox = Outbox(biz.engine, tables=tables)
    for i, row_id in enumerate(flow_ids):
        row = outbox.get(row_id)
        assert (row.state, row.orbit_task_id, row.last_status_code) == (
            "DELIVERED",
            f"inst-o-{i}:fulfil",
            201,
        )
        [*_, event] = outbox.events(row_id)
        assert "started an instance of flow 'order-fulfilment' (201)" in event.reason


def test_a_flow_start_resent_after_an_unknown_outcome_replays_the_first_instance(
    biz: Biz, tables: OutboxTables
) -> None:
    row_id = add_flow(biz, tables, idempotency_key="o-1:fulfil")
    server = FakeFlows()
    calls = 0

    def lose_the_first_answer(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        answer = server.answer("order-fulfilment", "o-1:fulfil", json.loads(request.content))
        if calls == 1:  # the server started it, the answer never came back
            raise httpx.ReadTimeout("timed out", request=request)
        return answer

    server.start = lose_the_first_answer
    stats = make_relay(biz, tables, server).run_once()
    assert (stats.retried, stats.delivered, stats.replayed) == (1, 1, 1)
    row = Outbox(biz.engine, tables=tables).get(row_id)
    assert (row.state, row.orbit_task_id, row.attempts, row.last_status_code) == (
        "DELIVERED",
        "inst-o-1:fulfil",
        2,
        200,
    )
    assert server.starts == [("order-fulfilment", "o-1:fulfil")] * 2 and len(server.started) == 1


@pytest.mark.parametrize(
    ("response", "state", "attempts", "status", "hint"),
    [
        (lambda r: problem(429, "rate_limited", **{"Retry-After": "30"}), "PENDING", 0, 429, None),
        (lambda r: problem(409, "request_in_progress"), "PENDING", 0, 409, None),
        (lambda r: problem(503, "unavailable"), "PENDING", 0, 503, None),
        (lambda r: problem(500, "internal_error"), "PENDING", 1, 500, None),
        (
            lambda r: problem(404, "flow_not_found"),
            "DEAD",
            1,
            404,
            "orbit-server flow publish GRAPH.json --flow order-fulfilment --namespace shop",
        ),
        (
            lambda r: problem(404, "flow_version_not_found"),
            "DEAD",
            1,
            404,
            # Publishing would make the next number, not 2: the hint lists the versions instead.
            "version 2 of flow 'order-fulfilment' of namespace 'shop' does not exist for the relay's API key "
            "(`orbit-server flow versions order-fulfilment --namespace shop` lists",
        ),
        (lambda r: problem(404, "not_found"), "DEAD", 1, 404, "no flows API"),
        (lambda r: problem(422, "validation_error"), "DEAD", 1, 422, None),
        (lambda r: problem(409, "idempotency_conflict"), "NEEDS_RECONCILE", 1, 409, "orbit-outbox resolve"),
    ],
)
def test_flow_start_outcomes_are_classified_as_for_tasks(
    biz: Biz,
    tables: OutboxTables,
    response: Handler,
    state: str,
    attempts: int,
    status: int,
    hint: str | None,
) -> None:
    row_id = add_flow(biz, tables, version=2)
    make_relay(
        biz, tables, FakeFlows(response), backoff=Backoff(base=5.0, cap=5.0, random=lambda: 1.0)
    ).run_once()
    row = Outbox(biz.engine, tables=tables).get(row_id)
    assert (row.state, row.attempts, row.send_count, row.last_status_code) == (state, attempts, 1, status)
    assert row.lease_token is None
    if hint is not None:
        assert hint in (row.last_error or "")


def test_once_unknown_a_refused_flow_start_needs_reconcile_never_dead(biz: Biz, tables: OutboxTables) -> None:
    row_id = add_flow(biz, tables)
    answers = iter([problem(500, "internal_error"), problem(404, "flow_not_found")])
    make_relay(biz, tables, FakeFlows(lambda r: next(answers))).run_once()
    row = Outbox(biz.engine, tables=tables).get(row_id)
    assert row.state == "NEEDS_RECONCILE" and "earlier send" in (row.last_error or "")


def _to_reconcile(biz: Biz, tables: OutboxTables, row_id: int) -> None:
    o = tables.outbox
    with biz.engine.begin() as conn:
        conn.execute(sa.update(o).where(o.c.id == row_id).values(state="NEEDS_RECONCILE", attempts=5))


def test_reconcile_settles_flow_rows_by_their_key(biz: Biz, tables: OutboxTables) -> None:
    started = add_flow(biz, tables, input={"order_id": "a"}, idempotency_key="a:fulfil")
    other = add_flow(biz, tables, input={"order_id": "b"}, idempotency_key="b:fulfil")
    never = add_flow(biz, tables, input={"order_id": "c"}, idempotency_key="c:fulfil")
    server = FakeFlows()
    server.answer("order-fulfilment", "a:fulfil", {"input": {"order_id": "a"}})
    server.answer("order-fulfilment", "b:fulfil", {"input": {"order_id": "not b"}})
    for row_id in (started, other, never):
        _to_reconcile(biz, tables, row_id)
    client = OrbitClient("http://orbit.test", api_key="k", transport=httpx.MockTransport(server))
    outbox = Outbox(biz.engine, tables=tables)
    decisions = {d.row_id: d for d in outbox.reconcile(client, actor="test")}
    assert {k: (d.decision, d.applied) for k, d in decisions.items()} == {
        started: ("delivered", True),
        other: ("mismatch", False),
        never: ("pending", True),
    }
    assert outbox.get(started).orbit_task_id == "inst-a:fulfil"
    assert (outbox.get(never).state, outbox.get(never).attempts) == ("PENDING", 0)  # sent again, same key
    assert "another start" in (outbox.get(other).last_error or "")
    # A person settles the mismatch: delivered as an instance that exists (looked up first), audited.
    row = outbox.resolve(other, actor="operator:test", reason="checked by hand", delivered_as="inst-b:fulfil",
                         client=client)  # fmt: skip
    assert (row.state, row.orbit_task_id) == ("DELIVERED", "inst-b:fulfil")
    assert "flow instance inst-b:fulfil" in outbox.events(other)[-1].reason


def test_the_delivered_hook_is_told_the_row_started_a_flow(biz: Biz, tables: OutboxTables) -> None:
    add_flow(biz, tables, business_ref=f"order:{uuid.uuid4().hex}")
    seen: list[tuple[str, str]] = []
    make_relay(
        biz, tables, FakeFlows(), on_delivered=lambda conn, row: seen.append((row.kind, row.orbit_task_id))
    ).run_once()
    assert [kind for kind, _ in seen] == ["flow"] and seen[0][1].startswith("inst-")


_ASYNC = {"sqlite": "sqlite+aiosqlite", "mariadb": "mysql+aiomysql", "postgres": "postgresql+psycopg"}


async def test_async_enqueue_flow_commits_and_rolls_back_with_the_caller(
    biz: Biz, tables: OutboxTables
) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    engine = create_async_engine(biz.url.set(drivername=_ASYNC[biz.kind]))
    try:
        async with engine.connect() as conn:
            await enqueue_flow_async(conn, namespace="shop", flow="f", input={"n": 1}, tables=tables)
            await conn.rollback()
        async with AsyncSession(engine) as session, session.begin():
            entry = await enqueue_flow_async(session, namespace="shop", flow="f", input={"n": 2}, version=1,
                                             tables=tables)  # fmt: skip
    finally:
        await engine.dispose()
    [row] = Outbox(biz.engine, tables=tables).list_rows()
    assert (row.id, row.kind, row.flow, row.params, row.options) == (
        entry.id,
        "flow",
        "f",
        {"n": 2},
        {"version": 1},
    )
