"""Batched attempt calls over HTTP against a real server, on SQLite and MariaDB (DESIGN §4).

``POST /v1/namespaces/{ns}/attempts/start|heartbeat|complete|fail``: one result per item, in
request order, each item fenced exactly like the single call; one item's refusal never undoes
another's; a terminal item writes its result event in the request's transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from functools import partial
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from orbit_client import MAX_ATTEMPT_BATCH_ITEMS, AttemptState, TaskStatus
from orbit_server import errors
from orbit_server.api.attempt_batches import Redo, run_items
from orbit_server.db.engine import db_now
from orbit_server.db.schema import result_events, task_attempts, tasks
from orbit_server.db.transact import transact
from orbit_server.tasks import attempt_locks
from orbit_server.tasks import attempts as attempt_reports
from tests.conftest import DatabaseFactory
from tests.execution_support import check_attempt_history
from tests.integration.conftest import BACKENDS
from tests.integration.test_execution_api import Api
from tests.integration.test_flows_break import _lock_waits
from tests.integration.test_result_events import _until
from tests.servers import RunningServer, run_server


@pytest.fixture(scope="module", params=BACKENDS)
def quiet_server(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[RunningServer]:
    """A server without the periodic sweep: a lapsed lease is found by the call that meets it."""
    with run_server(make_database(request.param), sweep_interval_seconds=0) as running:
        yield running


@pytest.fixture(scope="module")
def api(quiet_server: RunningServer) -> Iterator[Api]:
    with Api.in_new_namespace(quiet_server) as helper:
        yield helper


def batch(api: Api, action: str, items: list[dict[str, Any]], role: str = "work") -> httpx.Response:
    return api.http[role].post(f"/v1/namespaces/{api.ns}/attempts/{action}", json={"items": items})


def ok_batch(api: Api, action: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    response = batch(api, action, items)
    assert response.status_code == 200, response.text
    results = list(response.json()["items"])
    assert len(results) == len(items)
    return results


def item(grant: dict[str, Any], token: str | None = None, **fields: Any) -> dict[str, Any]:
    attempt = grant["attempt"]
    return {"attempt_id": attempt["id"], "lease_token": token or attempt["lease_token"], **fields}


def leased(api: Api, queue: str, n: int, **options: Any) -> list[dict[str, Any]]:
    for _ in range(n):
        api.submit(queue, **options)
    grants = api.lease(queue, n)
    assert len(grants) == n
    return grants


def lapse(api: Api, grant: dict[str, Any]) -> None:
    """Make an attempt's lease lapse now, as if its heartbeats had been lost."""
    with api.server.engine.begin() as conn:
        conn.execute(
            task_attempts.update()
            .where(task_attempts.c.id == grant["attempt"]["id"])
            .values(lease_expires_at=db_now(conn) - timedelta(seconds=1))
        )


def test_mixed_start_batch_answers_each_item_like_the_single_call(api: Api) -> None:
    queue = api.queue()
    good, stale, finished, lapsed = leased(api, queue, 4)
    api.ok(finished, "start")
    api.ok(finished, "complete", result="done")
    lapse(api, lapsed)
    results = ok_batch(api, "start", [
        item(good),
        item(stale, token="not-the-token"),
        {"attempt_id": str(uuid.uuid4()), "lease_token": "whatever"},
        item(finished),
        item(lapsed),
        item(good),  # a repeat of an item already done: answered alike
    ])  # fmt: skip
    assert [r["status"] for r in results] == [200, 409, 404, 409, 409, 200]
    assert [r["error"]["code"] for r in results if r["error"]] == [
        "lease_lost", "attempt_not_found", "lease_lost", "lease_lost",
    ]  # fmt: skip
    assert results[0]["attempt"]["status"] == "RUNNING" and results[0]["attempt"]["task_status"] == "RUNNING"
    assert results[5]["attempt"] == results[0]["attempt"]
    assert all(r["attempt"] is None for r in results[1:5])
    assert all(r["error"]["request_id"] for r in results[1:5])
    # The refused items changed nothing, except that the lapsed lease was expired (kept, not rolled back).
    assert api.task(stale["task"]["id"])["status"] == "LEASED"
    assert api.task(finished["task"]["id"])["status"] == "SUCCEEDED"
    assert api.task(lapsed["task"]["id"])["status"] == "WAITING"
    assert api.attempts(lapsed["task"]["id"])[0]["status"] == "EXPIRED"
    assert api.task(good["task"]["id"])["status"] == "RUNNING"
    check_attempt_history(api.server.engine, [g["task"]["id"] for g in (good, stale, finished, lapsed)])


def test_complete_batch_writes_one_result_event_per_task(api: Api) -> None:
    queue = api.queue()
    grants = leased(api, queue, 5)
    assert all(r["status"] == 200 for r in ok_batch(api, "start", [item(g) for g in grants]))
    never_started = leased(api, queue, 1)[0]
    results = ok_batch(api, "complete", [
        *[item(g, result={"n": n}) for n, g in enumerate(grants)],
        item(never_started, result=1),
        item(grants[0], token="forged", result=2),
    ])  # fmt: skip
    assert [r["status"] for r in results] == [200] * 5 + [409, 409]
    assert results[5]["error"]["code"] == "invalid_transition"
    assert results[6]["error"]["code"] == "lease_lost" and results[6]["error"]["evidence_recorded"] is False
    assert {r["attempt"]["task_status"] for r in results[:5]} == {"SUCCEEDED"}
    ids = [g["task"]["id"] for g in grants]
    assert [api.task(i)["result"] for i in ids] == [{"n": n} for n in range(5)]
    with api.server.engine.connect() as conn:
        counts = dict(
            conn.execute(
                sa.select(result_events.c.task_id, sa.func.count())
                .where(result_events.c.task_id.in_([*ids, never_started["task"]["id"]]))
                .group_by(result_events.c.task_id)
            ).all()
        )
    assert counts == dict.fromkeys(ids, 1)
    # Repeating the batch answers alike and writes nothing more.
    again = ok_batch(api, "complete", [item(g, result={"n": n}) for n, g in enumerate(grants)])
    assert [r["attempt"] for r in again] == [r["attempt"] for r in results[:5]]
    with api.server.engine.connect() as conn:
        total = conn.scalar(
            sa.select(sa.func.count()).select_from(result_events).where(result_events.c.task_id.in_(ids))
        )
    assert total == 5
    check_attempt_history(api.server.engine, ids)


def test_a_late_complete_in_a_batch_is_kept_as_evidence_and_the_others_succeed(api: Api) -> None:
    queue = api.queue()
    late, on_time = leased(api, queue, 2, retry_safe=True)
    ok_batch(api, "start", [item(late), item(on_time)])
    lapse(api, late)
    results = ok_batch(api, "complete", [item(late, result="late"), item(on_time, result="on time")])
    assert results[0]["status"] == 409 and results[0]["error"]["code"] == "lease_lost"
    assert results[0]["error"]["evidence_recorded"] is True
    assert results[1]["status"] == 200
    (attempt,) = api.attempts(late["task"]["id"])
    assert attempt["status"] == "EXPIRED" and attempt["late_report"] == {
        "outcome": "succeeded",
        "result": "late",
    }
    assert api.task(late["task"]["id"])["status"] == "WAITING"  # retry-safe: leased again later
    assert api.task(on_time["task"]["id"])["result"] == "on time"


def test_heartbeat_and_fail_batches(api: Api) -> None:
    queue = api.queue()
    grants = leased(api, queue, 3, backoff_base_seconds=0, max_attempts=2)
    ok_batch(api, "start", [item(g) for g in grants])
    cancelled = grants[2]
    api.admin(cancelled["task"]["id"], "cancel", reason="stop it")
    beats = ok_batch(api, "heartbeat", [item(grants[0], lease_seconds=120), item(grants[1]), item(cancelled)])
    assert [b["status"] for b in beats] == [200, 200, 200]
    assert [b["attempt"]["cancel_requested"] for b in beats] == [False, False, True]
    renewed = [datetime.fromisoformat(b["attempt"]["lease_expires_at"].replace("Z", "+00:00")) for b in beats]
    assert 85 < (renewed[0] - renewed[1]).total_seconds() < 95  # 120 s asked vs the 30 s of the lease
    retryable = {"type": "Timeout", "message": "upstream", "retryable": True}
    fatal = {"type": "ValueError", "message": "bad", "retryable": False}
    stopped = {"type": "cancelled", "message": "asked to stop", "retryable": False}
    failed = ok_batch(api, "fail", [
        item(grants[0], error=retryable),
        item(grants[1], error=fatal),
        item(cancelled, error=stopped),
        item(grants[1], token="forged", error=fatal),
    ])  # fmt: skip
    assert [f["status"] for f in failed] == [200, 200, 200, 409]
    assert [f["attempt"]["task_status"] for f in failed[:3]] == ["WAITING", "FAILED", "CANCELLED"]
    assert api.task(grants[1]["task"]["id"])["error"] == fatal
    check_attempt_history(api.server.engine, [g["task"]["id"] for g in grants])


def test_whole_request_refusals(api: Api, quiet_server: RunningServer) -> None:
    queue = api.queue()
    (grant,) = leased(api, queue, 1)
    too_many = [item(grant)] * (MAX_ATTEMPT_BATCH_ITEMS + 1)
    for action in ("start", "heartbeat", "complete", "fail"):
        assert batch(api, action, []).status_code == 422
    assert batch(api, "start", too_many).status_code == 422
    assert batch(api, "start", [{"lease_token": "t"}]).status_code == 422
    assert batch(api, "start", [item(grant)], role="submit").status_code == 403
    assert batch(api, "start", [item(grant)], role="read").status_code == 403
    other = f"ns-{uuid.uuid4().hex[:8]}"
    other_keys = quiet_server.add_namespace(other)
    with httpx.Client(
        base_url=quiet_server.base_url, headers={"Authorization": f"Bearer {other_keys['work']}"}
    ) as http:
        # Another namespace's key: the route's namespace does not exist for it.
        response = http.post(f"/v1/namespaces/{api.ns}/attempts/start", json={"items": [item(grant)]})
        assert response.status_code == 404 and response.json()["code"] == "namespace_not_found"
        # In its own namespace, this namespace's attempt does not exist.
        response = http.post(f"/v1/namespaces/{other}/attempts/start", json={"items": [item(grant)]})
        assert response.status_code == 200 and response.json()["items"][0]["status"] == 404
    assert api.task(grant["task"]["id"])["status"] == "LEASED"
    # The full batch size is accepted.
    assert len(ok_batch(api, "heartbeat", [item(grant)] * MAX_ATTEMPT_BATCH_ITEMS)) == MAX_ATTEMPT_BATCH_ITEMS


def test_an_item_refused_after_writing_is_undone_alone(api: Api) -> None:
    """The savepoint path: an item that wrote and was then refused leaves nothing; the others stay."""
    queue = api.queue()
    first, middle, last = leased(api, queue, 3)
    with api.server.engine.connect() as conn:
        ns_id = conn.scalar(sa.select(tasks.c.namespace_id).where(tasks.c.id == first["task"]["id"]))
    calls: list[str] = []

    def start(grant: dict[str, Any]) -> Any:
        attempt = grant["attempt"]
        return partial(
            attempt_reports.start_attempt,
            namespace_id=ns_id,
            attempt_id=attempt["id"],
            lease_token=attempt["lease_token"],
        )

    def writes_then_refused(conn: Connection) -> Any:
        calls.append("refused")
        conn.execute(
            tasks.update().where(tasks.c.id == middle["task"]["id"]).values(cancel_reason="half-written")
        )
        raise errors.InvalidTransition("refused after a write")

    def conflicts_once(conn: Connection) -> Any:
        calls.append("conflict")
        if calls.count("conflict") == 1:
            raise errors.ConcurrentUpdate("changed")
        return start(last)(conn)

    items = [start(first), writes_then_refused, conflicts_once]
    with pytest.raises(Redo):
        transact(api.server.engine, run_items, items)
    assert api.task(first["task"]["id"])["status"] == "LEASED"  # the first try was rolled back whole
    outcomes = transact(api.server.engine, run_items, items, savepoints=True)
    assert isinstance(outcomes[0], AttemptState) and outcomes[0].status == "RUNNING"
    assert isinstance(outcomes[1], errors.InvalidTransition)
    assert isinstance(outcomes[2], AttemptState) and outcomes[2].status == "RUNNING"
    assert api.task(middle["task"]["id"])["cancel_reason"] is None
    assert [api.task(g["task"]["id"])["status"] for g in (first, middle, last)] == [
        "RUNNING",
        "LEASED",
        "RUNNING",
    ]


def assert_task_locked_alone(probe: Connection, grant: dict[str, Any]) -> None:
    """From another connection: the grant's attempt row can be locked, its task row cannot (MariaDB)."""
    with probe.begin():
        probe.execute(
            sa.text("SELECT id FROM task_attempts WHERE id = :a FOR UPDATE NOWAIT"),
            {"a": grant["attempt"]["id"]},
        ).all()
    with probe.begin(), pytest.raises(sa.exc.OperationalError):
        probe.execute(
            sa.text("SELECT id FROM tasks WHERE id = :t FOR UPDATE NOWAIT"), {"t": grant["task"]["id"]}
        ).all()


def test_an_attempt_call_locks_the_task_row_and_not_the_attempt_row(api: Api) -> None:
    """Lock order (task first) holds with the one-statement read of task, attempt and clock."""
    if api.server.engine.dialect.name != "mysql":
        pytest.skip("SQLite has no row locks: one writer at a time")
    queue = api.queue()
    (grant,) = leased(api, queue, 1)
    engine = api.server.engine
    with engine.connect() as holder, engine.connect() as probe:
        held = holder.begin()
        ns_id = holder.scalar(sa.select(tasks.c.namespace_id).where(tasks.c.id == grant["task"]["id"]))
        task, attempt, _ = attempt_locks._locked_attempt(holder, ns_id, grant["attempt"]["id"])
        assert task["id"] == grant["task"]["id"] and attempt["id"] == grant["attempt"]["id"]
        assert attempt["status"] == "LEASED" and attempt["generation"] == 1
        assert_task_locked_alone(probe, grant)
        held.rollback()


def test_the_lean_read_gives_each_column_as_the_full_read_does(api: Api) -> None:
    """A lean read (on MySQL/MariaDB two ``JSON_ARRAY`` columns, attempt_locks._packed) gives the same values,
    of the same types, as the full read's columns: NULLs, booleans both ways, datetimes with and without a
    fraction, a float lease, a worker id that JSON must escape; and it locks the task row alone."""
    queue = api.queue()
    leased_grant, running_grant = leased(api, queue, 2)
    ok_batch(api, "start", [item(running_grant)])
    engine = api.server.engine
    with engine.begin() as conn:
        conn.execute(
            tasks.update().where(tasks.c.id == running_grant["task"]["id"]).values(cancel_requested=True)
        )
        conn.execute(
            task_attempts.update()
            .where(task_attempts.c.id == running_grant["attempt"]["id"])
            .values(worker_id='w"\\ö\n1', lease_seconds=12.5, started_at=datetime(2026, 12, 5, 13, 0, 0))
        )
    for grant in (leased_grant, running_grant):
        for ending in (False, True):
            with engine.connect() as holder, engine.connect() as probe:
                held = holder.begin()
                ns_id = holder.scalar(
                    sa.select(tasks.c.namespace_id).where(tasks.c.id == grant["task"]["id"])
                )
                full = attempt_locks._locked_attempt(holder, ns_id, grant["attempt"]["id"], ending=ending)
                lean = attempt_locks._locked_attempt(
                    holder, ns_id, grant["attempt"]["id"], ending=ending, lean=True
                )
                if engine.dialect.name == "mysql":
                    assert_task_locked_alone(probe, grant)
                held.rollback()
            for whole, part in zip(full[:2], lean[:2], strict=True):
                assert part == {key: whole[key] for key in part}
                assert {key: type(value) for key, value in part.items()} == {
                    key: type(whole[key]) for key in part
                }
            assert lean[2] <= full[2] + timedelta(seconds=5)
    assert lean[1]["worker_id"] == 'w"\\ö\n1' and lean[1]["lease_seconds"] == 12.5
    assert lean[0]["cancel_requested"] is True and lean[0]["flow_instance_id"] is None
    if not attempt_locks._records_as_it_locks(engine.dialect):
        return
    # MariaDB's complete reads as it records its result event (_lock_and_record, packed too): the same values.
    with engine.connect() as conn, conn.begin():
        ns_id = conn.scalar(sa.select(tasks.c.namespace_id).where(tasks.c.id == running_grant["task"]["id"]))
        full = attempt_locks._locked_attempt(conn, ns_id, running_grant["attempt"]["id"], ending=True)
        recorded = attempt_locks._lock_and_record(
            conn, ns_id, running_grant["attempt"]["id"], running_grant["attempt"]["lease_token"],
            to=TaskStatus.SUCCEEDED, values={"result": {"ok": True}},
        )  # fmt: skip
        assert recorded is not None
        for whole, part in zip(full[:2], recorded[:2], strict=True):
            assert {key: (value, type(value)) for key, value in part.items()} == {
                key: (whole[key], type(whole[key])) for key in part
            }
        conn.rollback()


def _written(engine: sa.Engine, task_ids: list[str]) -> list[Any]:
    """What a task's start and complete wrote, without ids and times (compared between two tasks)."""
    from orbit_server.db.schema import event_deliveries, subscriptions, task_events

    out = []
    with engine.connect() as conn:
        for task_id in task_ids:
            task = conn.execute(sa.select(tasks).where(tasks.c.id == task_id)).mappings().one()
            attempt = conn.execute(
                sa.select(task_attempts).where(task_attempts.c.task_id == task_id)
            ).mappings().one()  # fmt: skip
            events = conn.execute(
                sa.select(task_events.c.state_version, task_events.c.event, task_events.c.from_status,
                          task_events.c.to_status, task_events.c.actor, task_events.c.reason,
                          task_events.c.data)
                .where(task_events.c.task_id == task_id).order_by(task_events.c.state_version)
            ).all()  # fmt: skip
            result = conn.execute(
                sa.select(result_events).where(result_events.c.task_id == task_id)
            ).mappings().one()  # fmt: skip
            delivered = conn.execute(
                sa.select(subscriptions.c.name, event_deliveries.c.state, event_deliveries.c.delivery_count)
                .join(subscriptions, subscriptions.c.id == event_deliveries.c.subscription_id)
                .where(event_deliveries.c.event_id == result["id"]).order_by(subscriptions.c.name)
            ).all()  # fmt: skip
            assert (
                task["finished_at"] == task["updated_at"] == attempt["finished_at"] == result["occurred_at"]
            )
            assert attempt["started_at"] is not None and attempt["lease_expires_at"] > attempt["started_at"]
            out.append({
                "task": (task["status"], task["state_version"], task["attempt_count"], task["result"],
                         task["error"], task["current_attempt_id"] == attempt["id"]),
                "attempt": (attempt["status"], attempt["generation"], attempt["result"], attempt["error"],
                            attempt["started_at"] <= attempt["finished_at"]),
                "events": [(*e[:-1], sorted(e[-1] or {})) for e in events],
                "result": (result["status"], result["result"], result["error"], result["handler"],
                           result["state_version"], result["queue_id"] == task["queue_id"]),
                "delivered": delivered,
            })  # fmt: skip
    return out


def test_a_plain_batch_writes_exactly_what_the_single_calls_write(api: Api) -> None:
    """The set-based path (all items plain) and the single calls leave the same rows behind."""
    queue, other = api.queue(), api.queue()
    for name, queues in ((f"all-{queue}", None), (f"mine-{queue}", [queue]), (f"other-{queue}", [other])):
        r = api.http["admin"].post(
            f"/v1/namespaces/{api.ns}/subscriptions", json={"name": name, "queues": queues}
        )
        assert r.status_code == 201, r.text
    results: list[Any] = [{"n": 1}, None, [1, "two"], "text", 0]
    singles = leased(api, queue, len(results))
    for grant, result in zip(singles, results, strict=True):
        r = api.http["work"].post(f"/v1/namespaces/{api.ns}/attempts/{grant['attempt']['id']}/start",
                                  json={"lease_token": grant["attempt"]["lease_token"]})  # fmt: skip
        assert r.status_code == 200, r.text
        r = api.http["work"].post(f"/v1/namespaces/{api.ns}/attempts/{grant['attempt']['id']}/complete",
                                  json={"lease_token": grant["attempt"]["lease_token"], "result": result})  # fmt: skip
        assert r.status_code == 200, r.text
    batched = leased(api, queue, len(results))
    started = ok_batch(api, "start", [item(g) for g in batched])
    assert [s["attempt"]["status"] for s in started] == ["RUNNING"] * len(results)
    assert [s["attempt"]["task_id"] for s in started] == [g["task"]["id"] for g in batched]
    done = ok_batch(api, "complete", [item(g, result=x) for g, x in zip(batched, results, strict=True)])
    assert [(d["status"], d["attempt"]["status"], d["attempt"]["task_status"]) for d in done] == [
        (200, "SUCCEEDED", "SUCCEEDED")
    ] * len(results)
    assert [api.task(g["task"]["id"])["result"] for g in batched] == results
    ours = _written(api.server.engine, [g["task"]["id"] for g in batched])
    theirs = _written(api.server.engine, [g["task"]["id"] for g in singles])
    assert ours == theirs
    assert [d[0] for d in ours[0]["delivered"]] == [f"all-{queue}", f"mine-{queue}"]
    # The same batch again takes the item-by-item path and answers alike (idempotent repeat).
    again = ok_batch(api, "complete", [item(g, result=x) for g, x in zip(batched, results, strict=True)])
    assert [a["attempt"] for a in again] == [d["attempt"] for d in done]
    assert _written(api.server.engine, [g["task"]["id"] for g in batched]) == ours
    check_attempt_history(api.server.engine, [g["task"]["id"] for g in batched])


def test_a_complete_batch_over_two_queues_delivers_each_event_to_its_queues_subscriptions(api: Api) -> None:
    """A set-based complete reads each task's subscriptions (on MariaDB with the tasks' locks): an event goes
    to the subscriptions of every queue and of its own queue, never to another queue's, as the single call's."""
    first, second, third = api.queue(), api.queue(), api.queue()
    subscribed = {
        "all": None,
        "first": [first],
        "second": [second],
        "both": [first, second],
        "third": [third],
    }
    for name, queues in subscribed.items():
        r = api.http["admin"].post(
            f"/v1/namespaces/{api.ns}/subscriptions", json={"name": f"{name}-{first}", "queues": queues}
        )
        assert r.status_code == 201, r.text
    grants = [*leased(api, first, 2), *leased(api, second, 2)]
    ok_batch(api, "start", [item(g, task_id=g["task"]["id"]) for g in grants])
    done = ok_batch(
        api, "complete", [item(g, task_id=g["task"]["id"], result=i) for i, g in enumerate(grants)]
    )
    assert [d["status"] for d in done] == [200] * 4
    # this test's subscriptions only: others of the module's namespace (for every queue) get the events too
    delivered = [[name for name, _, _ in written["delivered"] if name.endswith(f"-{first}")]
                 for written in _written(api.server.engine, [g["task"]["id"] for g in grants])]  # fmt: skip
    mine = [f"all-{first}", f"both-{first}"]
    assert delivered == [[*mine, f"first-{first}"]] * 2 + [[*mine, f"second-{first}"]] * 2


def test_a_batch_naming_an_attempt_twice_is_answered_item_by_item(api: Api) -> None:
    queue = api.queue()
    (grant,) = leased(api, queue, 1)
    started = ok_batch(api, "start", [item(grant), item(grant)])
    assert [s["status"] for s in started] == [200, 200]
    assert started[0]["attempt"] == started[1]["attempt"]
    done = ok_batch(api, "complete", [item(grant, result=1), item(grant, result=2)])
    assert [d["status"] for d in done] == [200, 409]
    assert api.task(grant["task"]["id"])["result"] == 1


def test_the_set_based_path_locks_the_tasks_and_their_current_attempts(api: Api) -> None:
    """The batch's one locking read takes each task's lock and its current attempt's (lock order: task first,
    as every path takes them; checked in the plan by ``test_lock_plans``), so the attempts it reads are current
    (a locking read reads the newest row)."""
    if api.server.engine.dialect.name != "mysql":
        pytest.skip("SQLite has no row locks: one writer at a time")
    from orbit_server.tasks import attempt_sets

    queue = api.queue()
    grants = leased(api, queue, 3)
    engine = api.server.engine
    with engine.connect() as holder, engine.connect() as probe:
        held = holder.begin()
        ns_id = holder.scalar(sa.select(tasks.c.namespace_id).where(tasks.c.id == grants[0]["task"]["id"]))
        locked, attempts = attempt_sets._lock_tasks(holder, ns_id, [g["attempt"]["id"] for g in grants])
        assert sorted(row["id"] for row in locked) == sorted(g["task"]["id"] for g in grants)
        assert sorted(attempts) == sorted(g["attempt"]["id"] for g in grants)
        for grant in grants:
            for table, key in (("tasks", grant["task"]["id"]), ("task_attempts", grant["attempt"]["id"])):
                with probe.begin(), pytest.raises(sa.exc.OperationalError):
                    probe.execute(
                        sa.text(f"SELECT id FROM {table} WHERE id = :k FOR UPDATE NOWAIT"), {"k": key}
                    )
        held.rollback()


def test_a_set_based_start_computes_its_lease_from_the_attempt_as_it_is_once_locked(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The set-based path reads the batch's task ids before it locks the tasks, and the attempts
    in the locking read: a renewal committed in between (here: a new lease duration, as a heartbeat with
    ``lease_seconds`` writes it) is what the start's new lease is computed from."""
    if api.server.engine.dialect.name == "sqlite":
        pytest.skip("SQLite has one writer at a time: nothing commits between the read and the lock")
    from orbit_server.tasks import attempt_sets

    queue = api.queue()
    grants = leased(api, queue, 3)  # written set-based
    renewed = grants[1]["attempt"]["id"]
    original = attempt_sets._lock_statement
    locks: list[int] = []

    def renewal_before_the_lock(*args: Any) -> Any:
        if not locks:  # as if committed after the ids were read: nothing of the batch is locked yet
            with api.server.engine.begin() as other:
                other.execute(
                    task_attempts.update().where(task_attempts.c.id == renewed).values(lease_seconds=777)
                )
        locks.append(1)
        return original(*args)

    monkeypatch.setattr(attempt_sets, "_lock_statement", renewal_before_the_lock)
    results = ok_batch(api, "start", [item(grant) for grant in grants])

    assert len(locks) == 1  # set-based, in one try
    assert [result["status"] for result in results] == [200, 200, 200]
    with api.server.engine.connect() as conn:
        now = db_now(conn)
        rows = dict(
            conn.execute(
                sa.select(task_attempts.c.id, task_attempts.c.lease_expires_at).where(
                    task_attempts.c.id.in_([g["attempt"]["id"] for g in grants])
                )
            ).all()
        )
    lease = rows[renewed] - now
    assert timedelta(seconds=700) < lease <= timedelta(seconds=777)
    assert (
        datetime.fromisoformat(results[1]["attempt"]["lease_expires_at"]).replace(tzinfo=None)
        == rows[renewed]
    )
    assert rows[grants[0]["attempt"]["id"]] - now < timedelta(seconds=60)


@pytest.mark.parametrize("call", ["start", "start, one-item batch", "start, three-item batch", "heartbeat"])
def test_a_renewal_that_waited_for_its_task_computes_the_lease_from_the_attempt_as_it_is_now(
    api: Api, call: str
) -> None:
    """A ``start`` or ``heartbeat`` reads its attempt in the statement that locks the task; on MariaDB and
    PostgreSQL that read sees the attempt as it was when the statement began. A renewal committed while the
    call waited for the task's lock (here: a new lease duration, as a heartbeat with ``lease_seconds``
    writes it) must not be undone by a lease computed from the older duration."""
    engine = api.server.engine
    if engine.dialect.name == "sqlite":
        pytest.skip(
            "SQLite has one writer at a time: a call never waits inside a statement for a task's lock"
        )
    queue = api.queue()
    grants = leased(api, queue, 3 if call == "start, three-item batch" else 1)
    grant = grants[len(grants) // 2]  # the one renewed: in the middle of a set-based batch
    attempt = grant["attempt"]
    if call == "heartbeat":
        ok_batch(api, "start", [item(grant)])
    path, body = {
        "start": (f"attempts/{attempt['id']}/start", {"lease_token": attempt["lease_token"]}),
        "start, one-item batch": ("attempts/start", {"items": [item(grant)]}),
        "start, three-item batch": ("attempts/start", {"items": [item(g) for g in grants]}),
        "heartbeat": (f"attempts/{attempt['id']}/heartbeat", {"lease_token": attempt["lease_token"]}),
    }[call]
    answers: list[httpx.Response] = []
    with engine.connect() as holder, ThreadPoolExecutor(max_workers=1) as pool:
        held = holder.begin()
        holder.execute(sa.select(tasks.c.id).where(tasks.c.id == grant["task"]["id"]).with_for_update())
        now = db_now(holder)
        holder.execute(  # what a heartbeat with lease_seconds=777 writes
            task_attempts.update()
            .where(task_attempts.c.id == attempt["id"])
            .values(lease_seconds=777, lease_expires_at=now + timedelta(seconds=777), heartbeat_at=now)
        )
        sent = pool.submit(
            lambda: answers.append(api.http["work"].post(f"/v1/namespaces/{api.ns}/{path}", json=body))
        )
        _until(
            lambda: sent.done() or _lock_waits(api.server.engine) > 0, "the call never waited for the lock"
        )
        assert not sent.done(), f"the call did not wait for the task's lock: {answers and answers[0].text}"
        held.commit()
        sent.result(timeout=60)
    assert answers[0].status_code == 200, answers[0].text
    with engine.connect() as conn:
        left = conn.scalar(
            sa.select(task_attempts.c.lease_expires_at).where(task_attempts.c.id == attempt["id"])
        )
        left -= db_now(conn)
    assert timedelta(seconds=700) < left <= timedelta(seconds=777)


@pytest.mark.parametrize(
    "wrong", ["tasks swapped", "a task outside the batch", "no such task", "not ASCII", "one names none"]
)
def test_items_naming_a_wrong_task_are_answered_as_without_it(api: Api, wrong: str) -> None:
    """An item's ``task_id`` only saves the server a read: a wrong one (or one missing) leaves each item
    answered as it would be without it, and no other task touched."""
    queue = api.queue()
    grants = leased(api, queue, 4)
    batch, bystander = grants[:3], grants[3]
    named: list[str | None] = [g["task"]["id"] for g in batch]
    if wrong == "tasks swapped":
        named[0], named[1] = named[1], named[0]
    elif wrong == "a task outside the batch":
        named[0] = bystander["task"]["id"]
    else:
        named[0] = {"no such task": "no-such-task", "not ASCII": "tâche", "one names none": None}[wrong]

    def items(**fields: Any) -> list[dict[str, Any]]:
        return [
            item(g, **fields, **({"task_id": task} if task is not None else {}))
            for g, task in zip(batch, named, strict=True)
        ]

    started = ok_batch(api, "start", items())
    assert [s["status"] for s in started] == [200, 200, 200]
    assert [s["attempt"]["task_id"] for s in started] == [g["task"]["id"] for g in batch]
    done = ok_batch(api, "complete", items(result={"ok": 1}))
    assert [d["status"] for d in done] == [200, 200, 200]
    for g in batch:
        task = api.task(g["task"]["id"])
        assert (task["status"], task["result"]) == ("SUCCEEDED", {"ok": 1})
    assert api.task(bystander["task"]["id"])["status"] == "LEASED"
