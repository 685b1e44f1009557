"""Edge cases of batched start/complete calls (set-based from two items, one item on the single call's path):
JSON results of every kind, batch sizes that recur, racing batches, paused queues, permits."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from orbit_server.db.schema import result_events, task_attempts, task_events, tasks
from tests.integration.test_attempt_batches import item, leased, ok_batch, quiet_server  # noqa: F401
from tests.integration.test_execution_api import Api
from tests.servers import RunningServer

#: JSON results a handler returns, of every kind (a complete batch must store what the single call stores).
RESULTS: list[Any] = [
    None, False, True, 0, -1, 1.5, "", "null", "ünïcødé ✓ 😀 \"q\" \\ \n",
    {"nested": {"a": [1, {"b": None}], "t": False}}, [], {}, 2**63 + 1, -(2**64), 10**30, [None, 0, ""],
]  # fmt: skip


@pytest.fixture(scope="module")
def api(quiet_server: RunningServer) -> Iterator[Api]:  # noqa: F811
    with Api.in_new_namespace(quiet_server) as helper:
        yield helper


def _stored(api: Api, grants: list[dict[str, Any]]) -> list[tuple[Any, Any, Any]]:
    """Each task's result, its attempt's result and its result event's result, as stored."""
    out = []
    with api.server.engine.connect() as conn:
        for grant in grants:
            task_id = grant["task"]["id"]
            out.append((
                conn.scalar(sa.select(tasks.c.result).where(tasks.c.id == task_id)),
                conn.scalar(sa.select(task_attempts.c.result).where(task_attempts.c.task_id == task_id)),
                conn.scalar(sa.select(result_events.c.result).where(result_events.c.task_id == task_id)),
            ))  # fmt: skip
    return out


def _race(api: Api, action: str, batches: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """Send the ``batches`` of ``action`` at once, each from its own thread and connection; their items' answers."""
    answers: dict[int, list[dict[str, Any]]] = {}
    barrier = threading.Barrier(len(batches))

    def send(n: int) -> None:
        headers = {"Authorization": f"Bearer {api.keys['work']}"}
        with httpx.Client(base_url=api.server.base_url, timeout=30, headers=headers) as http:
            barrier.wait()
            r = http.post(f"/v1/namespaces/{api.ns}/attempts/{action}", json={"items": batches[n]})
            assert r.status_code == 200, r.text
            answers[n] = r.json()["items"]

    threads = [threading.Thread(target=send, args=(n,)) for n in range(len(batches))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(answers) == list(range(len(batches)))
    return [answers[n] for n in range(len(batches))]


def test_a_complete_batch_stores_every_kind_of_result_as_the_single_call_does(api: Api) -> None:
    queue = api.queue()
    singles = leased(api, queue, len(RESULTS))
    for grant, result in zip(singles, RESULTS, strict=True):
        api.ok(grant, "start")
        api.ok(grant, "complete", result=result)
    batched = leased(api, queue, len(RESULTS))
    assert [r["status"] for r in ok_batch(api, "start", [item(g) for g in batched])] == [200] * len(RESULTS)
    done = ok_batch(api, "complete", [item(g, result=x) for g, x in zip(batched, RESULTS, strict=True)])
    assert [d["status"] for d in done] == [200] * len(RESULTS)
    theirs, ours = _stored(api, singles), _stored(api, batched)
    assert ours == theirs
    assert [(type(t), type(a), type(e)) for t, a, e in ours] == [
        (type(t), type(a), type(e)) for t, a, e in theirs
    ]
    assert [api.task(g["task"]["id"])["result"] for g in batched] == [
        api.task(g["task"]["id"])["result"] for g in singles
    ]
    # And within a batch of three of one kind each (every CASE branch of one size given the same kind).
    for result in (None, False, 0, 2**63 + 1, "ü"):
        trio = leased(api, queue, 3)
        ok_batch(api, "start", [item(g) for g in trio])
        assert [d["status"] for d in ok_batch(api, "complete", [item(g, result=result) for g in trio])] == [
            200
        ] * 3
        assert {repr(s) for s in _stored(api, trio)} == {repr((result, result, result))}


def test_batches_of_sizes_that_recur_write_each_item_its_own_result(api: Api) -> None:
    queue = api.queue()
    for size in (3, 4, 7, 3, 16, 4, 33, 3, 7, 100):
        grants = leased(api, queue, size)
        started = ok_batch(api, "start", [item(g) for g in grants])
        assert [s["attempt"]["attempt_id"] for s in started] == [g["attempt"]["id"] for g in grants]
        results = [{"size": size, "i": i} for i in range(size)]
        done = ok_batch(api, "complete", [item(g, result=r) for g, r in zip(grants, results, strict=True)])
        assert [d["status"] for d in done] == [200] * size
        assert [t for t, _, _ in _stored(api, grants)] == results
        assert [a for _, a, _ in _stored(api, grants)] == results


def test_two_racing_complete_batches_on_the_same_attempts_never_both_succeed(api: Api) -> None:
    queue = api.queue()
    for _ in range(3):
        grants = leased(api, queue, 4)
        ok_batch(api, "start", [item(g) for g in grants])
        answered = _race(api, "complete", [[item(g, result="a") for g in grants],
                                            [item(g, result="b") for g in grants[::-1]]])  # fmt: skip
        answers = {"a": answered[0], "b": answered[1]}
        stored = [t for t, _, _ in _stored(api, grants)]
        # Each task completed once, by one batch or the other; the other batch's item is a 409.
        by_task: dict[str, dict[str, Any]] = {}
        for label, order in (("a", grants), ("b", list(reversed(grants)))):
            for grant, answer in zip(order, answers[label], strict=True):
                by_task.setdefault(grant["task"]["id"], {})[label] = answer
        for grant, result in zip(grants, stored, strict=True):
            both = by_task[grant["task"]["id"]]
            assert result in ("a", "b")
            loser = "b" if result == "a" else "a"
            assert both[result]["status"] == 200, both
            assert both[loser]["status"] == 409 and both[loser]["error"]["code"] in (
                "lease_lost", "invalid_transition", "report_conflict"
            ), both  # fmt: skip
        with api.server.engine.connect() as conn:
            ids = [g["task"]["id"] for g in grants]
            completed = conn.scalar(
                sa.select(sa.func.count()).select_from(task_events)
                .where(task_events.c.task_id.in_(ids), task_events.c.event == "completed")
            )  # fmt: skip
            events = conn.scalar(
                sa.select(sa.func.count()).select_from(result_events).where(result_events.c.task_id.in_(ids))
            )
        assert completed == 4 and events == 4


def test_a_start_batch_on_a_paused_queue_is_answered_as_the_single_start(api: Api) -> None:
    queue = api.queue()
    for size in (2, 3):
        grants = leased(api, queue, size + 1)
        single, grants = grants[0], grants[1:]
        r = api.http["admin"].post(f"/v1/namespaces/{api.ns}/queues/{queue}/pause", json={})
        assert r.status_code in (200, 204), r.text
        one = api.call(single, "start")
        answers = ok_batch(api, "start", [item(g) for g in grants])
        assert [a["status"] for a in answers] == [one.status_code] * size
        if one.status_code != 200:
            assert [_problem(a["error"]) for a in answers] == [_problem(one.json())] * size
        assert [api.task(g["task"]["id"])["status"] for g in grants] == [
            api.task(single["task"]["id"])["status"]
        ] * size
        r = api.http["admin"].post(f"/v1/namespaces/{api.ns}/queues/{queue}/resume", json={})
        assert r.status_code in (200, 204), r.text


def _problem(body: dict[str, Any]) -> dict[str, Any]:
    """A problem's fields but those naming the request (the same refusal answered twice)."""
    return {k: v for k, v in body.items() if k not in ("request_id", "instance") and v is not None}


@pytest.mark.parametrize("action", ["start", "complete"])
@pytest.mark.parametrize("size", [2, 3])
def test_a_mixed_batch_is_answered_alike_by_both_paths(api: Api, size: int, action: str) -> None:
    """Sizes 2 and 3 (set-based, declined to item by item): each item answered as the single call answers
    it (a stale token, an unknown attempt, a lapsed lease, a repeated report)."""
    from tests.integration.test_attempt_batches import lapse

    queue = api.queue()

    def ready(n: int) -> list[dict[str, Any]]:
        grants = leased(api, queue, n)
        if action == "complete":
            ok_batch(api, "start", [item(g) for g in grants])
        return grants

    def body(i: int) -> dict[str, Any]:
        return {"result": i} if action == "complete" else {}

    unknown = str(uuid.uuid4())
    for kind in ("stale", "unknown", "lapsed", "repeat"):
        grants = ready(size)
        items = [item(g, **body(i)) for i, g in enumerate(grants)]
        last = size - 1
        if kind == "stale":
            items[last] = item(grants[last], token="stale", **body(9))
        elif kind == "unknown":
            items[last] = {"attempt_id": unknown, "lease_token": "x", **body(9)}
        elif kind == "lapsed":
            lapse(api, grants[last])
        else:
            api.ok(grants[last], action, **body(last))
        got = ok_batch(api, action, items)
        expect = []
        for i, g in enumerate(ready(size)):
            if i == last and kind == "stale":
                r = api.call(g, action, token="stale", **body(9))
            elif i == last and kind == "unknown":
                r = api.http["work"].post(f"/v1/namespaces/{api.ns}/attempts/{unknown}/{action}",
                                          json={"lease_token": "x", **body(9)})  # fmt: skip
            else:
                if i == last and kind == "lapsed":
                    lapse(api, g)
                elif i == last and kind == "repeat":
                    api.ok(g, action, **body(i))
                r = api.call(g, action, **body(i))
            expect.append((r.status_code, _problem(r.json()) if r.status_code != 200 else None))
        assert [(a["status"], _problem(a["error"]) if a["error"] else None) for a in got] == expect, kind


def _shape(answer: dict[str, Any]) -> dict[str, Any]:
    """An item's answer without what differs between two tasks (ids, tokens and times)."""
    return {
        k: (type(v).__name__ if k.endswith(("_id", "_at", "token")) or k in ("id",) else v)
        for k, v in answer.items()
    }


def test_the_set_based_answers_are_those_of_the_item_path(api: Api) -> None:
    queue = api.queue()
    answers: dict[int, tuple[list[Any], list[Any]]] = {}
    for size in (1, 2, 3, 5):
        grants = leased(api, queue, size)
        started = ok_batch(api, "start", [item(g) for g in grants])
        done = ok_batch(api, "complete", [item(g, result={"x": [1, None]}) for g in grants])
        answers[size] = ([_shape(s["attempt"]) for s in started], [_shape(d["attempt"]) for d in done])
        assert [s["status"] for s in started] == [200] * size
    single = leased(api, queue, 1)[0]
    one_start, one_done = (
        _shape(api.ok(single, "start")),
        _shape(api.ok(single, "complete", result={"x": [1, None]})),
    )
    for size, (started_shapes, done_shapes) in answers.items():
        assert started_shapes == [one_start] * size, size
        assert done_shapes == [one_done] * size, size


def test_a_batch_of_three_naming_an_attempt_twice_is_answered_item_by_item(api: Api) -> None:
    queue = api.queue()
    first, second = leased(api, queue, 2)
    started = ok_batch(api, "start", [item(first), item(second), item(first)])
    assert [s["status"] for s in started] == [200, 200, 200]
    assert started[0]["attempt"] == started[2]["attempt"]
    done = ok_batch(api, "complete", [item(first, result=1), item(second, result=2), item(first, result=3)])
    assert [d["status"] for d in done] == [200, 200, 409]
    assert done[2]["error"]["code"] == "report_conflict"
    assert [api.task(g["task"]["id"])["result"] for g in (first, second)] == [1, 2]
    again = ok_batch(api, "complete", [item(first, result=1), item(second, result=2), item(first, result=1)])
    assert [a["status"] for a in again] == [200, 200, 200]


def test_flow_steps_completed_in_a_set_based_batch_move_their_flows_on(api: Api) -> None:
    from orbit_client import FlowInstanceStatus, OrbitClient
    from tests.flow_support import until

    queue = api.queue()
    graph = {
        "start": "step",
        "nodes": {
            "step": {
                "type": "task",
                "queue": queue,
                "handler": "h",
                "params": {"n": "$.input.n"},
                "next": "done",
            },
            "done": {"type": "end"},
        },
    }
    flow = f"f-{uuid.uuid4().hex[:6]}"
    with OrbitClient(api.server.base_url, api_key=api.keys["submit"], timeout=30) as submit:
        submit.publish_flow(api.ns, flow, graph)
        instances = [
            submit.start_flow(api.ns, flow, {"n": n}, idempotency_key=str(uuid.uuid4())).instance.id
            for n in range(3)
        ]
        grants: list[dict[str, Any]] = []

        def all_leased() -> bool:
            grants.extend(api.lease(queue, 3 - len(grants)))
            return len(grants) == 3

        until(all_leased, what="steps")
        plain = leased(api, queue, 1)
        everything = [*grants, *plain]
        assert [s["status"] for s in ok_batch(api, "start", [item(g) for g in everything])] == [200] * 4
        done = ok_batch(api, "complete", [item(g, result={"r": g["task"]["params"]}) for g in everything])
        assert [d["status"] for d in done] == [200] * 4
        for instance_id in instances:

            def completed(i: str = instance_id) -> bool:
                found = submit.get_flow_instance(api.ns, i)
                return found.status is FlowInstanceStatus.COMPLETED and found.pending_events == 0

            until(completed, what="completed")


def test_two_racing_start_batches_on_the_same_attempts_start_each_once(api: Api) -> None:
    queue = api.queue()
    grants = leased(api, queue, 5)
    answers = _race(api, "start", [[item(g) for g in grants], [item(g) for g in grants[::-1]]])
    assert [a["status"] for a in answers[0]] == [200] * 5 and [a["status"] for a in answers[1]] == [200] * 5
    assert [a["attempt"] for a in answers[0]] == [
        a["attempt"] for a in answers[1][::-1]
    ]  # a repeat answers alike
    with api.server.engine.connect() as conn:
        started = conn.scalar(
            sa.select(sa.func.count()).select_from(task_events)
            .where(task_events.c.task_id.in_([g["task"]["id"] for g in grants]), task_events.c.event == "started")
        )  # fmt: skip
    assert started == 5


def test_lease_and_start_attempts_completed_set_based_are_confirmed_as_by_the_single_call(api: Api) -> None:
    queue = api.queue()

    def granted_running(n: int) -> list[dict[str, Any]]:
        for _ in range(n):
            api.submit(queue, retry_safe=True)
        r = api.http["work"].post(f"/v1/namespaces/{api.ns}/queues/{queue}/leases",
                                  json={"worker_id": "w-test", "max_tasks": n, "lease_seconds": 30, "start": True})  # fmt: skip
        assert r.status_code == 200, r.text
        grants = list(r.json())
        assert [g["task"]["status"] for g in grants] == ["RUNNING"] * n
        return grants

    (single,) = granted_running(1)
    one = _shape(api.ok(single, "complete", result=[1]))
    grants = granted_running(3)
    done = ok_batch(api, "complete", [item(g, result=[1]) for g in grants])
    assert [_shape(d["attempt"]) for d in done] == [one] * 3
    with api.server.engine.connect() as conn:
        rows = conn.execute(
            sa.select(task_attempts.c.started_at, task_attempts.c.leased_at, task_attempts.c.status)
            .where(task_attempts.c.task_id.in_([g["task"]["id"] for g in [single, *grants]]))
        ).all()  # fmt: skip
    assert all(r.started_at == r.leased_at and r.status == "SUCCEEDED" for r in rows), rows


def test_a_set_based_complete_releases_the_permits_of_the_tasks_holding_one(api: Api) -> None:
    """Three tasks of a queue limited to three at a time, with one of an unlimited queue: the batch releases the
    three permits (the fourth task of the limited queue is leased at once) and leaves no permit behind."""
    from orbit_server.db.schema import concurrency_permits
    from orbit_server.tasks import store

    limited, free = f"q-{uuid.uuid4().hex[:10]}", api.queue()
    with api.server.engine.begin() as conn:
        store.create_queue(conn, api.ns, limited, max_concurrency=3)
    holders = leased(api, limited, 3)
    api.submit(limited)
    assert api.lease(limited, 1) == []  # every permit held
    other = leased(api, free, 1)
    everything = [holders[0], other[0], *holders[1:]]
    ok_batch(api, "start", [item(g) for g in everything])
    with api.server.engine.connect() as conn:
        held = (
            conn.execute(
                sa.select(tasks.c.holds_permit).where(tasks.c.id.in_([g["task"]["id"] for g in everything]))
            )
            .scalars()
            .all()
        )
    assert sorted(held) == [False, True, True, True]
    done = ok_batch(api, "complete", [item(g, result=i) for i, g in enumerate(everything)])
    assert [d["status"] for d in done] == [200] * 4
    with api.server.engine.connect() as conn:
        left = conn.scalar(
            sa.select(sa.func.count()).select_from(concurrency_permits)
            .where(concurrency_permits.c.attempt_id.in_([g["attempt"]["id"] for g in everything]))
        )  # fmt: skip
        held = (
            conn.execute(
                sa.select(tasks.c.holds_permit).where(tasks.c.id.in_([g["task"]["id"] for g in everything]))
            )
            .scalars()
            .all()
        )
    assert left == 0 and set(held) == {False}
    assert len(api.lease(limited, 1)) == 1


def test_three_racing_complete_batches_overlapping_in_part_answer_every_item(api: Api) -> None:
    """Batches sharing some attempts, sent at once: each attempt completes once, by one batch, and every
    other batch's item for it is a conflict; no request fails whole (a deadlock is run again)."""
    queue = api.queue()
    grants = leased(api, queue, 8)
    ok_batch(api, "start", [item(g) for g in grants])
    picks = [[0, 1, 2, 3, 4], [7, 3, 5, 1, 6], [6, 2, 4, 0, 5, 7]]
    answers = _race(
        api, "complete", [[item(grants[i], result=n) for i in pick] for n, pick in enumerate(picks)]
    )
    stored = [t for t, _, _ in _stored(api, grants)]
    for n, (pick, answered) in enumerate(zip(picks, answers, strict=True)):
        for i, answer in zip(pick, answered, strict=True):
            if stored[i] == n:
                assert answer["status"] == 200, answer
            else:
                assert answer["status"] == 409 and answer["error"]["code"] == "report_conflict", answer
    assert all(isinstance(s, int) for s in stored)
