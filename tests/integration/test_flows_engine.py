"""The token engine against real databases (SQLite and MariaDB), with the server's own flow loop off so
each test drives the advances itself: duplicate and out-of-order internal events, joins under
concurrent arrivals, a timer claimed by two engines, a poll's budget across server restarts.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from orbit_server.db.engine import create_engine, db_now
from orbit_server.db.schema import (
    flow_events,
    flow_history,
    flow_steps,
    flow_timers,
    flow_tokens,
    task_attempts,
    tasks,
)
from orbit_server.db.transact import transact
from orbit_server.flows import engine
from orbit_server.flows.loop import run_pass
from orbit_server.tasks import leases, store
from tests.conftest import DatabaseFactory
from tests.flow_support import FlowApi, failing, ok, until
from tests.integration.conftest import BACKENDS
from tests.servers import RunningServer, run_server

QUEUE = "steps"
SETTINGS = engine.EngineSettings()


@pytest.fixture(scope="module", params=BACKENDS)
def url(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> URL:
    return make_database(request.param)


@pytest.fixture(scope="module")
def quiet(url: URL) -> Iterator[tuple[RunningServer, FlowApi]]:
    """A server whose flow loop is off: the tests advance the flows themselves. Its other background work
    (sweep, scheduler, metric samples) is off too, so the statements a test sees on its engine are its own."""
    with run_server(url, flow_interval_seconds=0, sweep_interval_seconds=0, scheduler_interval_seconds=0,
                    metrics_sample_interval_seconds=0) as server:  # fmt: skip
        namespace = f"ns{uuid.uuid4().hex[:6]}"
        api = FlowApi(server.base_url, namespace, server.add_namespace(namespace, queues=(QUEUE,)))
        yield server, api
        api.close()


def _pending(server: RunningServer, instance_id: str) -> list[dict[str, Any]]:
    with server.engine.connect() as conn:
        return [dict(r) for r in conn.execute(
            sa.select(flow_events).where(flow_events.c.instance_id == instance_id, flow_events.c.consumed_at.is_(None))
            .order_by(flow_events.c.created_at)).mappings()]  # fmt: skip


def _history(server: RunningServer, instance_id: str) -> list[str]:
    with server.engine.connect() as conn:
        return list(conn.execute(sa.select(flow_history.c.event).where(flow_history.c.instance_id == instance_id)
                                 .order_by(flow_history.c.id)).scalars())  # fmt: skip


def _drive(server: RunningServer, *, rounds: int = 50) -> None:
    for _ in range(rounds):
        if not run_pass(server.engine, SETTINGS).handled:
            return


def _queue(server: RunningServer, api: FlowApi) -> str:
    """A queue of the test's own, so no other test's leftover step is leased."""
    name = f"q{uuid.uuid4().hex[:8]}"
    with server.engine.begin() as conn:
        store.create_queue(conn, api.ns, name)
    return name


def _two_steps(queue: str) -> dict[str, Any]:
    return {"start": "a", "nodes": {
        "a": {"type": "task", "queue": queue, "handler": "a", "next": "b"},
        "b": {"type": "task", "queue": queue, "handler": "b", "next": "e"},
        "e": {"type": "end"}}}  # fmt: skip


def test_a_duplicate_event_changes_nothing(quiet: tuple[RunningServer, FlowApi]) -> None:
    server, api = quiet
    flow = f"dup{uuid.uuid4().hex[:6]}"
    queue = _queue(server, api)
    api.publish(flow, _two_steps(queue))
    instance = api.start(flow)
    assert len(api.work(queue, ok(), wait=0)) == 1
    (event,) = _pending(server, instance["id"])
    assert transact(server.engine, engine.apply_event, event["id"], SETTINGS).outcome == "applied"
    assert transact(server.engine, engine.apply_event, event["id"], SETTINGS).outcome == "none"  # consumed
    # The same outcome redelivered under another identity: not the token's current task any more.
    copy = {**event, "id": str(uuid.uuid4())}
    with server.engine.begin() as conn:
        conn.execute(flow_events.insert(), copy)
    assert transact(server.engine, engine.apply_event, copy["id"], SETTINGS).outcome == "stale"
    # An event of an older activation of the same token: stale too.
    old = {**event, "id": str(uuid.uuid4()), "activation": event["activation"] - 1}
    with server.engine.begin() as conn:
        conn.execute(flow_events.insert(), old)
    assert transact(server.engine, engine.apply_event, old["id"], SETTINGS).outcome == "stale"
    view = api.instance(instance["id"])
    assert [s["node"] for s in view["steps"]] == ["a", "b"]  # one task for b, whatever came twice
    assert view["tokens"][0]["node"] == "b" and view["pending_events"] == 0
    with server.engine.connect() as conn:
        outcomes = Counter(conn.execute(sa.select(flow_events.c.outcome).where(
            flow_events.c.instance_id == instance["id"])).scalars())  # fmt: skip
    assert outcomes == {"applied": 1, "stale": 2}


def test_out_of_order_events_review_then_success(quiet: tuple[RunningServer, FlowApi]) -> None:
    """NEEDS_REVIEW and then SUCCEEDED (after review) are both pending: applied newest first, the review
    event is stale; applied in order, the token waits for the review and then moves once."""
    server, api = quiet
    for newest_first in (True, False):
        flow = f"ooo{uuid.uuid4().hex[:6]}"
        queue = _queue(server, api)
        api.publish(flow, _two_steps(queue))
        instance = api.start(flow)
        grants = api.lease(queue, 1)
        api.finish(grants[0], ("skip", None))  # started, never reported
        task_id = grants[0]["task"]["id"]
        with server.engine.begin() as conn:  # its lease lapses: not retry-safe, so NEEDS_REVIEW
            conn.execute(task_attempts.update().where(task_attempts.c.task_id == task_id).values(
                lease_expires_at=db_now(conn) - timedelta(seconds=1)))  # fmt: skip
        transact(server.engine, leases.expire_leases)
        r = api.post("admin", f"/tasks/{task_id}/review",
                     {"outcome": "succeeded", "reason": "checked", "evidence_ref": "ticket-1", "result": {"ok": 1}})  # fmt: skip
        assert r.status_code == 200, r.text
        review, success = _pending(server, instance["id"])
        assert (review["status"], success["status"]) == ("NEEDS_REVIEW", "SUCCEEDED")
        order = [success, review] if newest_first else [review, success]
        outcomes = [transact(server.engine, engine.apply_event, e["id"], SETTINGS).outcome for e in order]
        assert outcomes == (["applied", "stale"] if newest_first else ["applied", "applied"])
        view = api.instance(instance["id"])
        assert [s["node"] for s in view["steps"]] == ["a", "b"] and view["tokens"][0]["waiting_for"] == "task"
        assert _history(server, instance["id"]).count("task_succeeded") == 1


def test_join_passes_exactly_once_under_concurrent_arrivals(quiet: tuple[RunningServer, FlowApi]) -> None:
    server, api = quiet
    flow = f"join{uuid.uuid4().hex[:6]}"
    branches = [f"b{n}" for n in range(8)]
    queue = _queue(server, api)
    nodes: dict[str, Any] = {b: {"type": "task", "queue": queue, "handler": b, "next": "j"} for b in branches}
    nodes |= {"fork": {"type": "parallel", "branches": branches, "join": "j"}, "j": {"type": "join", "next": "after"},
              "after": {"type": "task", "queue": queue, "handler": "after", "next": "e"}, "e": {"type": "end"}}  # fmt: skip
    api.publish(flow, {"start": "fork", "nodes": nodes})
    instances = [api.start(flow)["id"] for _ in range(4)]
    _drive(server)  # enter the children: one task each
    assert api.work_batch(queue, ok(), n=100, wait=0) == 8 * len(instances)
    events = [e["id"] for i in instances for e in _pending(server, i)]
    assert len(events) == 8 * len(instances)
    barrier = threading.Barrier(len(events))
    outcomes: list[str] = []

    def arrive(event_id: str) -> None:
        barrier.wait()
        outcomes.append(transact(server.engine, engine.apply_event, event_id, SETTINGS).outcome)

    threads = [threading.Thread(target=arrive, args=(e,)) for e in events]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes.count("applied") == len(events)
    for instance_id in instances:
        assert _history(server, instance_id).count("joined") == 1
        view = api.instance(instance_id)
        assert sorted(s["node"] for s in view["steps"]) == sorted([*branches, "after"])
        parent = next(t for t in view["tokens"] if t["parent_id"] is None)
        assert parent["node"] == "after" and parent["state"] == "WAITING"
        assert sorted(t["state"] for t in view["tokens"] if t["parent_id"]) == ["ARRIVED"] * 8


def test_a_timer_claimed_by_two_engines_fires_once(quiet: tuple[RunningServer, FlowApi], url: URL) -> None:
    server, api = quiet
    flow = f"timer{uuid.uuid4().hex[:6]}"
    api.publish(flow, {"start": "t", "nodes": {"t": {"type": "timer", "seconds": 0.2, "next": "a"},
                                               "a": {"type": "task", "queue": QUEUE, "handler": "a", "next": "e"},
                                               "e": {"type": "end"}}})  # fmt: skip
    instances = [api.start(flow)["id"] for _ in range(30)]
    engines = [create_engine(url, pool_size=8), create_engine(url, pool_size=8)]
    barrier = threading.Barrier(2)
    fired: list[int] = [0, 0]

    def run(n: int) -> None:
        barrier.wait()
        deadline = time.monotonic() + 20  # until every timer fired (each is due 0.2 s after its start)
        while time.monotonic() < deadline:
            result = run_pass(engines[n], SETTINGS)
            fired[n] += result.handled
            with engines[n].connect() as conn:
                if not conn.execute(
                    sa.select(flow_timers.c.id).where(flow_timers.c.state == "PENDING")
                ).first():
                    return

    try:
        threads = [threading.Thread(target=run, args=(n,)) for n in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for db in engines:
            db.dispose()
    assert sum(fired) >= len(instances)
    for instance_id in instances:
        events = _history(server, instance_id)
        assert events.count("timer_fired") == 1, events
    with server.engine.connect() as conn:
        steps = Counter(conn.execute(sa.select(flow_steps.c.instance_id)
                                     .where(flow_steps.c.instance_id.in_(instances))).scalars())  # fmt: skip
        assert steps == dict.fromkeys(instances, 1)
        assert conn.execute(sa.select(sa.func.count()).select_from(flow_timers).where(
            flow_timers.c.instance_id.in_(instances), flow_timers.c.state == "FIRED")).scalar_one() == len(instances)  # fmt: skip


def test_a_poll_whose_task_keeps_failing_stops_at_its_budget_across_restarts(url: URL) -> None:
    graph = {"start": "check", "nodes": {
        "check": {"type": "poll", "queue": QUEUE, "handler": "check", "interval_seconds": 0.05, "max_rounds": 3,
                  "max_attempts": 1, "done_path": "$.result.done", "next": "e"},
        "e": {"type": "end"}}}  # fmt: skip
    namespace = f"polls{uuid.uuid4().hex[:6]}"
    keys: dict[str, str] = {}
    instance_id = ""
    for life in range(4):  # a new server process's engine and loop each time; the last one only checks
        with run_server(url, flow_interval_seconds=0.05) as server:
            if life == 0:
                keys = server.add_namespace(namespace, queues=(QUEUE,))
            api = FlowApi(server.base_url, namespace, keys)
            try:
                if life == 0:
                    api.publish("p", graph)
                    instance_id = api.start("p")["id"]
                if life < 3:  # one failed round per server life
                    until(lambda: api.work(QUEUE, failing(), n=1, wait=0.1), what="a round's task")  # noqa: B023
                    want = "FAILED" if life == 2 else f"poll round {life + 2} of 3"

                    def settled(want: str = want) -> bool:
                        view = api.instance(instance_id)  # noqa: B023
                        return view["pending_events"] == 0 and want in (
                            view["status"],
                            view["tokens"][0]["waiting_for"],
                        )

                    until(settled, what=want)
                    continue
                final = api.instance(instance_id)
                assert final["status"] == "FAILED" and final["error"]["code"] == "poll_exhausted"
                assert [s["round"] for s in final["steps"]] == [1, 2, 3]
                assert api.lease(QUEUE, 10, 0.3) == []  # no fourth round, ever
                with server.engine.connect() as conn:
                    assert conn.execute(sa.select(sa.func.count()).select_from(tasks).where(
                        tasks.c.flow_instance_id == instance_id)).scalar_one() == 3  # fmt: skip
            finally:
                api.close()


def test_tokens_are_rows_with_versions(quiet: tuple[RunningServer, FlowApi]) -> None:
    """Every token change bumps its version (conditional update); a stale version changes nothing."""
    server, api = quiet
    flow = f"ver{uuid.uuid4().hex[:6]}"
    api.publish(flow, _two_steps(_queue(server, api)))
    instance = api.start(flow)
    with server.engine.connect() as conn:
        token = dict(conn.execute(sa.select(flow_tokens).where(flow_tokens.c.instance_id == instance["id"])).mappings().one())  # fmt: skip
    assert token["version"] == 2 and token["activation"] == 1  # created, then moved onto "a"
    with server.engine.begin() as conn:
        stale = conn.execute(flow_tokens.update().where(flow_tokens.c.id == token["id"], flow_tokens.c.version == 1)
                             .values(version=2, node_id="b"))  # fmt: skip
        assert stale.rowcount == 0


def test_a_plain_task_s_complete_gets_no_statement_from_flows(quiet: tuple[RunningServer, FlowApi]) -> None:
    """The hot path of plain tasks is untouched: a step task's complete runs exactly one statement more
    (its internal event), a plain task's none that touches a flow table."""
    server, api = quiet
    queue = _queue(server, api)
    flow = f"hot{uuid.uuid4().hex[:6]}"
    api.publish(flow, _two_steps(queue))
    api.start(flow)
    r = api.post(
        "submit", "/tasks", {"queue": queue, "handler": "plain"}, **{"Idempotency-Key": str(uuid.uuid4())}
    )
    assert r.status_code == 201, r.text
    grants = {g["task"]["handler"]: g for g in api.lease(queue, 2)}
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        seen.append(statement)

    counts = {}
    for handler in ("plain", "a"):
        api.finish(grants[handler], ("skip", None))  # started
        sa.event.listen(server.engine, "before_cursor_execute", record)
        try:
            api.finish_only(grants[handler], ("complete", {"ok": True}))
        finally:
            sa.event.remove(server.engine, "before_cursor_execute", record)
        counts[handler] = list(seen)
        seen.clear()
    touches_flows = re.compile(r"\b(INTO|FROM|UPDATE|JOIN)\s+flow_", re.IGNORECASE)
    assert not any(touches_flows.search(statement) for statement in counts["plain"]), counts["plain"]
    flow_statements = [s for s in counts["a"] if touches_flows.search(s)]
    assert len(flow_statements) == 1 and flow_statements[0].lstrip().upper().startswith(
        "INSERT INTO FLOW_EVENTS"
    )
    assert len(counts["a"]) == len(counts["plain"]) + 1
