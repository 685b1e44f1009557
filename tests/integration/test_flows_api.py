"""Flows through the HTTP API of a real server, on SQLite and MariaDB (issue 13; DESIGN §12).

Every node type: task (success, on_failure, failure without it), timer (seconds, until, past), signal
(buffered before its wait, consumed by a wait, timeout branch, after the timeout), parallel/join, poll
(done, budget spent), choice, end (each status); publish and start idempotency, versions kept by
running instances, pause with results in flight then resume, cancel, history.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from orbit_server.db.engine import db_now
from orbit_server.db.schema import flow_events, submission_keys, tasks
from tests.flow_support import FlowApi, failing, ok, until
from tests.servers import RunningServer

QUEUE = "steps"


@pytest.fixture(scope="module")
def api(server: RunningServer) -> Iterator[FlowApi]:
    keys = server.add_namespace("flows", queues=(QUEUE, "other"))
    client = FlowApi(server.base_url, "flows", keys)
    yield client
    client.close()


def _flow() -> str:
    return f"f-{uuid.uuid4().hex[:10]}"


def _drain(api: FlowApi, instance_id: str, handler: Any = None, *, timeout: float = 20.0) -> dict[str, Any]:
    """Run the instance's step tasks with ``handler`` until it finishes.

    The module's tests share one namespace and queue: a task another test left behind (a step of a
    cancelled or unfinished instance) is completed with :func:`ok` here, never shown to ``handler``,
    whose answers may depend on how often it is called."""
    handler = handler or ok()

    def own_tasks_only(task: dict[str, Any]) -> tuple[str, Any]:
        mine = {s["task_id"] for s in api.instance(instance_id)["steps"]}
        return handler(task) if task["id"] in mine else ok()(task)

    def finished() -> dict[str, Any] | None:
        api.work(QUEUE, own_tasks_only, wait=0.1)
        found = api.instance(instance_id)
        return found if found["status"] in ("COMPLETED", "FAILED", "CANCELLED") else None

    result: dict[str, Any] = until(finished, timeout=timeout, what=f"instance {instance_id} to finish")
    return result


def _lease_own(api: FlowApi, instance_id: str, wait: float = 0.0) -> list[dict[str, Any]]:
    """Lease from the module's shared queue: the grants of ``instance_id``'s step tasks; a task
    another test left behind is completed with :func:`ok` on the way (see :func:`_drain`)."""
    grants = api.lease(QUEUE, 10, wait)
    mine = {s["task_id"] for s in api.instance(instance_id)["steps"]}
    for grant in grants:
        if grant["task"]["id"] not in mine:
            api.finish(grant, ok()(grant["task"]))
    return [grant for grant in grants if grant["task"]["id"] in mine]


def test_three_task_steps_run_in_order_with_params_from_input_and_results(api: FlowApi) -> None:
    flow = _flow()
    graph = {
        "start": "reserve",
        "nodes": {
            "reserve": {"type": "task", "queue": QUEUE, "handler": "reserve",
                        "params": {"order": "$.input.order_id", "note": {"$literal": "$.not-a-path"}}, "next": "charge"},
            "charge": {"type": "task", "queue": QUEUE, "handler": "charge",
                       "params": {"reservation": "$.steps.reserve.result.params.order"}, "next": "receipt"},
            "receipt": {"type": "task", "queue": QUEUE, "handler": "receipt", "next": "done"},
            "done": {"type": "end", "output": {"charged": "$.steps.charge.result.params.reservation"}},
        },
    }  # fmt: skip
    version = api.publish(flow, graph)
    assert version["version"] == 1 and len(version["digest"]) == 64
    assert api.publish(flow, graph, expect=200)["version"] == 1  # same digest: the same version
    started = api.start(flow, {"order_id": "o-1"})
    assert started["status"] == "RUNNING" and started["version"] == 1
    # The first task exists when the start answers (created in the start's transaction).
    assert [s["node"] for s in started["steps"]] == ["reserve"]
    seen: list[tuple[str, Any]] = []

    def handler(task: dict[str, Any]) -> tuple[str, Any]:
        seen.append((task["handler"], task["params"]))
        return ok()(task)

    done = _drain(api, started["id"], handler)
    assert done["status"] == "COMPLETED", done
    assert done["output"] == {"charged": "o-1"}
    assert seen == [
        ("reserve", {"order": "o-1", "note": "$.not-a-path"}),
        ("charge", {"reservation": "o-1"}),
        ("receipt", {}),
    ]
    assert [(s["node"], s["status"]) for s in done["steps"]] == [
        ("reserve", "SUCCEEDED"), ("charge", "SUCCEEDED"), ("receipt", "SUCCEEDED"),
    ]  # fmt: skip
    assert done["pending_events"] == 0 and done["finished_at"] is not None
    assert [t["state"] for t in done["tokens"]] == ["DONE"]
    events = [h["event"] for h in api.history(started["id"])]
    assert events[0] == "instance_started" and events[-1] == "instance_completed"
    assert events.count("task_succeeded") == 3


def test_start_is_idempotent_per_key(api: FlowApi, server: RunningServer) -> None:
    flow = _flow()
    api.publish(flow, {"start": "a", "nodes": {"a": {"type": "task", "queue": QUEUE, "handler": "h", "next": "e"},
                                                 "e": {"type": "end"}}})  # fmt: skip
    key = str(uuid.uuid4())
    first = api.start(flow, {"x": 1}, key=key)
    again = api.start(flow, {"x": 1.0}, key=key, expect=200)  # 1.0 means 1 (RFC 8785)
    assert again["id"] == first["id"]
    r = api.post("submit", f"/flows/{flow}/instances", {"input": {"x": 2}}, **{"Idempotency-Key": key})
    assert r.status_code == 409 and r.json()["code"] == "idempotency_conflict"
    assert f"already started instance {first['id']} with another" in r.json()["detail"]  # where to look
    r = api.post("submit", f"/flows/{flow}/instances", {"input": {}})
    assert r.status_code == 400 and r.json()["code"] == "idempotency_key_missing"
    r = api.post("submit", "/flows/nope/instances", {"input": {}}, **{"Idempotency-Key": "k"})
    assert r.status_code == 404 and r.json()["code"] == "flow_not_found"
    r = api.post("submit", f"/flows/{flow}/instances", {"version": 9}, **{"Idempotency-Key": "k2"})
    assert r.status_code == 404 and r.json()["code"] == "flow_version_not_found"
    # Regression: a version past a 32-bit INTEGER answered 500 on PostgreSQL ("integer out of range"; found
    # by the OpenAPI fuzz), on a start and on a read of the version.
    for version in (2**31, 2**63 - 1):
        r = api.post("submit", f"/flows/{flow}/instances", {"version": version}, **{"Idempotency-Key": "k3"})
        assert r.status_code == 404 and r.json()["code"] == "flow_version_not_found", r.text
        assert api.get(f"/flows/{flow}/versions/{version}").json()["code"] == "flow_version_not_found"
    # One task for the start, with the submission key derived from instance, node, token and activation.
    with server.engine.connect() as conn:
        keys = conn.execute(
            sa.select(submission_keys.c.idempotency_key).join(tasks, tasks.c.id == submission_keys.c.task_id)
            .where(tasks.c.flow_instance_id == first["id"])
        ).scalars().all()  # fmt: skip
    token = first["tokens"][0]["id"]
    assert keys == [f"flow:{first['id']}:a:{token}.1"]
    page = api.get("/flow-instances", flow=flow, idempotency_key=key).json()
    assert [i["id"] for i in page["items"]] == [first["id"]]


def test_roles(api: FlowApi) -> None:
    flow = _flow()
    r = api.post(
        "read", f"/flows/{flow}/versions", {"graph": {"start": "e", "nodes": {"e": {"type": "end"}}}}
    )
    assert r.status_code == 403
    instance = api.start(api.publish(flow, {"start": "e", "nodes": {"e": {"type": "end"}}})["flow"])
    assert instance["status"] == "COMPLETED"
    r = api.post("submit", f"/flow-instances/{instance['id']}/cancel", {})
    assert r.status_code == 403
    r = api.post("admin", f"/flow-instances/{instance['id']}/cancel", {})
    assert r.status_code == 409 and r.json()["code"] == "invalid_transition"
    assert r.json()["title"] == "The flow instance is finished"  # not the task wording
    assert "is COMPLETED: it cannot be cancelled" in r.json()["detail"]
    assert api.get("/flow-instances/nope").json()["code"] == "flow_instance_not_found"


def test_failed_step_takes_on_failure_else_fails_the_instance(api: FlowApi) -> None:
    flow = _flow()
    api.publish(flow, {"start": "a", "nodes": {
        "a": {"type": "task", "queue": QUEUE, "handler": "h", "max_attempts": 1, "next": "b", "on_failure": "undo"},
        "undo": {"type": "task", "queue": QUEUE, "handler": "undo", "max_attempts": 1, "next": "released"},
        "b": {"type": "end"},
        "released": {"type": "end", "status": "CANCELLED"}}})  # fmt: skip
    done = _drain(api, api.start(flow)["id"], lambda t: failing()(t) if t["handler"] == "h" else ok()(t))
    assert done["status"] == "CANCELLED" and [s["node"] for s in done["steps"]] == ["a", "undo"]
    done = _drain(api, api.start(flow)["id"], failing())
    assert done["status"] == "FAILED"
    assert done["error"]["code"] == "step_failed" and done["error"]["node"] == "undo"
    assert done["error"]["task_error"]["type"] == "boom"


def test_choice_and_end_statuses(api: FlowApi) -> None:
    flow = _flow()
    api.publish(flow, {"start": "route", "nodes": {
        "route": {"type": "choice", "rules": [
            {"path": "$.input.big", "equals": True, "next": "big"},
            {"path": "$.input.note", "present": True, "next": "noted"}], "default": "small"},
        "big": {"type": "end", "output": "big"},
        "noted": {"type": "end", "status": "FAILED"},
        "small": {"type": "end", "output": "$.input"}}})  # fmt: skip
    assert api.start(flow, {"big": True})["output"] == "big"
    assert api.start(flow, {"big": 1, "note": None})["status"] == "FAILED"  # 1 is not true; null is present
    assert api.start(flow, {"big": False})["output"] == {"big": False}


def test_a_missing_path_fails_the_instance_naming_node_and_path(api: FlowApi) -> None:
    flow = _flow()
    api.publish(flow, {"start": "a", "nodes": {
        "a": {"type": "task", "queue": QUEUE, "handler": "h", "params": {"x": "$.input.missing"}, "next": "e"},
        "e": {"type": "end"}}})  # fmt: skip
    failed = api.start(flow, {})
    assert failed["status"] == "FAILED" and failed["steps"] == []
    assert failed["error"]["code"] == "flow_path_missing" and failed["error"]["node"] == "a"
    assert failed["error"]["path"] == "$.input.missing"


def test_timers_fire_after_seconds_until_a_time_and_at_once_in_the_past(api: FlowApi) -> None:
    flow = _flow()
    api.publish(flow, {"start": "wait", "nodes": {
        "wait": {"type": "timer", "seconds": 0.3, "next": "until"},
        "until": {"type": "timer", "until": "$.input.at", "next": "e"},
        "e": {"type": "end"}}})  # fmt: skip
    soon = (datetime.now(UTC) + timedelta(seconds=0.5)).isoformat()
    instance = api.start(flow, {"at": soon})
    assert instance["tokens"][0]["waiting_for"] == "timer" and instance["tokens"][0]["fire_at"]
    assert api.wait_status(instance["id"], "COMPLETED")["status"] == "COMPLETED"
    past = api.start(flow, {"at": "2000-01-01T00:00:00+02:00"})
    assert api.wait_status(past["id"], "COMPLETED")
    bad = api.start(flow, {"at": "tomorrow"})
    failed = api.wait_status(bad["id"], "FAILED")
    assert failed["error"]["node"] == "until" and failed["error"]["code"] == "flow_path_invalid_value"


def test_signals_are_buffered_consumed_once_and_time_out(api: FlowApi) -> None:
    flow = _flow()
    api.publish(flow, {"start": "first", "nodes": {
        "first": {"type": "task", "queue": QUEUE, "handler": "h", "next": "wait"},
        "wait": {"type": "signal", "signal": "go", "timeout_seconds": 1, "next": "got", "on_timeout": "late"},
        "got": {"type": "end", "output": "$.signals.go"},
        "late": {"type": "end", "status": "CANCELLED"}}})  # fmt: skip
    # Before its wait exists: buffered, consumed by the wait that starts later.
    early = api.start(flow)
    sent = api.signal(early["id"], "go", {"n": 1}, key="s1")
    assert sent["consumed_at"] is None
    assert api.signal(early["id"], "go", {"n": 1}, key="s1", expect=200)["id"] == sent["id"]  # a replay
    r = api.post("submit", f"/flow-instances/{early['id']}/signals", {"name": "go", "payload": 2},
                 **{"Idempotency-Key": "s1"})  # fmt: skip
    assert r.status_code == 409 and r.json()["code"] == "idempotency_conflict"
    done = _drain(api, early["id"])
    assert done["status"] == "COMPLETED" and done["output"] == {"n": 1}
    # While the wait exists: consumed at once.
    waiting = api.start(flow)
    api.work(QUEUE, ok())
    until(lambda: api.instance(waiting["id"])["tokens"][0]["waiting_for"] == "signal:go")
    consumed = api.signal(waiting["id"], "go", "now")
    assert consumed["consumed_by_token"] == waiting["tokens"][0]["id"]
    assert api.instance(waiting["id"])["status"] == "COMPLETED"
    # After it timed out: recorded, never consumed.
    late = api.start(flow)
    api.work(QUEUE, ok())
    assert api.wait_status(late["id"], "CANCELLED")["status"] == "CANCELLED"
    r = api.post(
        "submit", f"/flow-instances/{late['id']}/signals", {"name": "go"}, **{"Idempotency-Key": "x"}
    )
    assert r.status_code == 409 and r.json()["code"] == "invalid_transition"


def test_a_signal_after_its_wait_timed_out_stays_unconsumed(api: FlowApi) -> None:
    flow = _flow()
    api.publish(flow, {"start": "wait", "nodes": {
        "wait": {"type": "signal", "signal": "go", "timeout_seconds": 0.2, "next": "e", "on_timeout": "later"},
        "later": {"type": "signal", "signal": "other", "next": "e"},
        "e": {"type": "end"}}})  # fmt: skip
    instance = api.start(flow)
    until(lambda: api.instance(instance["id"])["tokens"][0]["node"] == "later")
    record = api.signal(instance["id"], "go", "too late")
    assert record["consumed_at"] is None
    api.signal(instance["id"], "other")
    done = api.wait_status(instance["id"], "COMPLETED")
    assert [h["event"] for h in api.history(instance["id"])].count("signal_timed_out") == 1
    assert done["status"] == "COMPLETED"


def test_parallel_branches_join_once(api: FlowApi) -> None:
    flow = _flow()
    api.publish(flow, {"start": "fork", "nodes": {
        "fork": {"type": "parallel", "branches": ["a", "b", "c"], "join": "joined"},
        "a": {"type": "task", "queue": QUEUE, "handler": "a", "next": "joined"},
        "b": {"type": "task", "queue": QUEUE, "handler": "b", "next": "b2"},
        "b2": {"type": "task", "queue": QUEUE, "handler": "b2", "next": "joined"},
        "c": {"type": "timer", "seconds": 0.1, "next": "joined"},
        "joined": {"type": "join", "next": "after"},
        "after": {"type": "task", "queue": QUEUE, "handler": "after", "next": "e"},
        "e": {"type": "end"}}})  # fmt: skip
    done = _drain(api, api.start(flow)["id"])
    assert done["status"] == "COMPLETED"
    assert sorted(s["node"] for s in done["steps"]) == ["a", "after", "b", "b2"]
    states = sorted(t["state"] for t in done["tokens"])
    assert states == ["ARRIVED", "ARRIVED", "ARRIVED", "DONE"]
    assert [h["event"] for h in api.history(done["id"])].count("joined") == 1


def test_poll_until_done_and_until_its_budget_is_spent(api: FlowApi) -> None:
    flow = _flow()
    api.publish(flow, {"start": "check", "nodes": {
        "check": {"type": "poll", "queue": QUEUE, "handler": "check", "interval_seconds": 0.05, "max_rounds": 4,
                  "max_attempts": 1, "done_path": "$.result.done", "next": "e", "on_exhausted": "gave_up"},
        "e": {"type": "end"},
        "gave_up": {"type": "end", "status": "FAILED"}}})  # fmt: skip
    # Answered by the task's round, not by call order: only ``true`` is done.
    answers = {1: {"done": False}, 2: {"done": "yes"}, 3: {"done": True}}
    polled = api.start(flow)["id"]

    def by_round(task: dict[str, Any]) -> tuple[str, Any]:
        round_ = next(s["round"] for s in api.instance(polled)["steps"] if s["task_id"] == task["id"])
        return "complete", answers[round_]

    done = _drain(api, polled, by_round)
    assert done["status"] == "COMPLETED" and [s["round"] for s in done["steps"]] == [1, 2, 3]
    spent = _drain(api, api.start(flow)["id"], failing())
    assert spent["status"] == "FAILED" and len(spent["steps"]) == 4
    assert [s["status"] for s in spent["steps"]] == ["FAILED"] * 4


def test_publish_during_running_instances_keeps_their_version(api: FlowApi) -> None:
    flow = _flow()
    v1 = {"start": "a", "nodes": {"a": {"type": "task", "queue": QUEUE, "handler": "v1", "next": "b"},
                                  "b": {"type": "task", "queue": QUEUE, "handler": "v1b", "next": "e"},
                                  "e": {"type": "end"}}}  # fmt: skip
    api.publish(flow, v1)
    old = api.start(flow)
    v2 = {"start": "a", "nodes": {"a": {"type": "task", "queue": QUEUE, "handler": "v2", "next": "b"},
                                  "b": {"type": "task", "queue": QUEUE, "handler": "v2b", "next": "e"},
                                  "e": {"type": "end"}}}  # fmt: skip
    assert api.publish(flow, v2)["version"] == 2
    new = api.start(flow)
    pinned = api.start(flow, version=1)
    handlers: dict[str, list[str]] = {}

    def handler(task: dict[str, Any]) -> tuple[str, Any]:
        return ok()(task)

    for instance in (old, new, pinned):
        _drain(api, instance["id"], handler)
        done = api.instance(instance["id"])
        with_tasks = [api.get(f"/tasks/{s['task_id']}").json()["handler"] for s in done["steps"]]
        handlers[instance["id"]] = with_tasks
    assert handlers[old["id"]] == ["v1", "v1b"] and handlers[pinned["id"]] == ["v1", "v1b"]
    assert handlers[new["id"]] == ["v2", "v2b"]
    assert [v["version"] for v in api.get(f"/flows/{flow}/versions").json()] == [2, 1]


def test_pause_with_results_in_flight_then_resume(api: FlowApi, server: RunningServer) -> None:
    flow = _flow()
    api.publish(flow, {"start": "a", "nodes": {
        "a": {"type": "task", "queue": QUEUE, "handler": "a", "next": "t"},
        "t": {"type": "timer", "seconds": 0.05, "next": "b"},
        "b": {"type": "task", "queue": QUEUE, "handler": "b", "next": "e"},
        "e": {"type": "end"}}})  # fmt: skip
    instance = api.start(flow)
    grants = until(lambda: _lease_own(api, instance["id"], 0.2), what="the first step's task")
    paused = api.control(instance["id"], "pause", reason="maintenance", actor="ops")
    assert paused["status"] == "PAUSED" and paused["paused"] and paused["control_version"] == 2
    assert api.control(instance["id"], "pause")["control_version"] == 2  # idempotent
    r = api.http["admin"].post(
        f"/v1/namespaces/{api.ns}/flow-instances/{instance['id']}/pause"
    )  # no body at all
    assert r.status_code == 200 and r.json()["control_version"] == 2
    for grant in grants:  # the result in flight is recorded, the flow does not advance
        api.finish(grant, ("complete", {"ok": 1}))
    view = until(lambda: (v := api.instance(instance["id"]))["pending_events"] == 1 and v)
    assert view["steps"][0]["status"] == "SUCCEEDED" and view["tokens"][0]["node"] == "a"
    with server.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(flow_events).where(
            flow_events.c.instance_id == instance["id"], flow_events.c.consumed_at.is_(None))).scalar_one() == 1  # fmt: skip
    assert _lease_own(api, instance["id"]) == []  # no new task while paused
    resumed = api.control(instance["id"], "resume", reason="done")
    assert resumed["control_version"] == 3
    done = _drain(api, instance["id"])
    assert done["status"] == "COMPLETED" and [s["node"] for s in done["steps"]] == ["a", "b"]
    events = [h["event"] for h in api.history(instance["id"])]
    assert events.index("instance_paused") < events.index("instance_resumed") < events.index("task_succeeded")


def test_cancel_stops_tokens_timers_and_step_tasks(api: FlowApi) -> None:
    flow = _flow()
    api.publish(flow, {"start": "fork", "nodes": {
        "fork": {"type": "parallel", "branches": ["a", "t"], "join": "j"},
        "a": {"type": "task", "queue": QUEUE, "handler": "a", "next": "j"},
        "t": {"type": "timer", "seconds": 3600, "next": "j"},
        "j": {"type": "join", "next": "e"},
        "e": {"type": "end"}}})  # fmt: skip
    instance = api.start(flow)
    view = until(lambda: (v := api.instance(instance["id"]))["steps"] and len(v["tokens"]) == 3 and
                 all(t["state"] != "ACTIVE" for t in v["tokens"]) and v)  # fmt: skip
    task_id = view["steps"][0]["task_id"]
    cancelled = api.control(instance["id"], "cancel", reason="customer asked")
    assert cancelled["status"] == "CANCELLED" and cancelled["control_version"] == 2
    assert {t["state"] for t in cancelled["tokens"]} == {"CANCELLED"}
    assert api.get(f"/tasks/{task_id}").json()["status"] == "CANCELLED"
    assert _lease_own(api, instance["id"]) == []


def test_metrics_show_the_flow_backlog_and_advances(api: FlowApi, server: RunningServer) -> None:
    flow = _flow()
    api.publish(flow, {"start": "a", "nodes": {"a": {"type": "task", "queue": QUEUE, "handler": "h", "next": "e"},
                                                 "e": {"type": "end"}}})  # fmt: skip
    _drain(api, api.start(flow)["id"])
    text = api.http["read"].get("/metrics").text
    assert "orbit_flow_events_pending " in text and "orbit_flow_events_oldest_pending_age_seconds " in text
    assert 'orbit_flow_advances_total{outcome="applied"}' in text


def test_a_paused_instance_keeps_signals_and_due_timers_for_its_resume(api: FlowApi) -> None:
    flow = _flow()
    api.publish(flow, {"start": "fork", "nodes": {
        "fork": {"type": "parallel", "branches": ["wait", "nap"], "join": "j"},
        "wait": {"type": "signal", "signal": "go", "next": "j"},
        "nap": {"type": "timer", "seconds": 0.1, "next": "j"},
        "j": {"type": "join", "next": "e"},
        "e": {"type": "end"}}})  # fmt: skip
    instance = api.start(flow)
    until(lambda: sorted(t["waiting_for"] or "" for t in api.instance(instance["id"])["tokens"])
          == ["join", "signal:go", "timer"])  # fmt: skip
    api.control(instance["id"], "pause")
    record = api.signal(instance["id"], "go", {"why": "paused"})
    assert record["consumed_at"] is None  # recorded only
    view = api.instance(instance["id"])
    timer = next(t for t in view["tokens"] if t["waiting_for"] == "timer")
    until(lambda: datetime.fromisoformat(timer["fire_at"]) < datetime.now(UTC) - timedelta(seconds=0.3))
    view = api.instance(instance["id"])  # the timer fell due while paused: it waits for the resume
    assert view["status"] == "PAUSED" and any(t["waiting_for"] == "timer" for t in view["tokens"])
    api.control(instance["id"], "resume")
    done = api.wait_status(instance["id"], "COMPLETED")
    assert done["output"] is None
    events = [h["event"] for h in api.history(instance["id"])]
    assert events.count("signal_received") == 2 and events.count("timer_fired") == 1  # received, consumed


def test_nested_parallel_blocks_and_a_loop_back_make_new_activations(api: FlowApi) -> None:
    flow = _flow()
    api.publish(flow, {"start": "outer", "nodes": {
        "outer": {"type": "parallel", "branches": ["inner", "solo"], "join": "outer_j"},
        "inner": {"type": "parallel", "branches": ["x", "y"], "join": "inner_j"},
        "x": {"type": "task", "queue": QUEUE, "handler": "x", "next": "inner_j"},
        "y": {"type": "task", "queue": QUEUE, "handler": "y", "next": "inner_j"},
        "inner_j": {"type": "join", "next": "outer_j"},
        "solo": {"type": "task", "queue": QUEUE, "handler": "solo", "next": "outer_j"},
        "outer_j": {"type": "join", "next": "again"},
        "again": {"type": "task", "queue": QUEUE, "handler": "again", "max_attempts": 1, "next": "e",
                  "on_failure": "route"},
        "route": {"type": "choice", "rules": [{"path": "$.steps.again.status", "equals": "FAILED", "next": "again"}],
                  "default": "e"},
        "e": {"type": "end"}}})  # fmt: skip
    tries = {"again": 0}

    def handler(task: dict[str, Any]) -> tuple[str, Any]:
        if task["handler"] == "again":
            tries["again"] += 1
            if tries["again"] == 1:
                return failing()(task)
        return ok()(task)

    done = _drain(api, api.start(flow)["id"], handler)
    assert done["status"] == "COMPLETED"
    again = [s for s in done["steps"] if s["node"] == "again"]
    assert [s["status"] for s in again] == ["FAILED", "SUCCEEDED"]
    assert again[0]["activation"] < again[1]["activation"] and again[0]["token_id"] == again[1]["token_id"]
    events = [h["event"] for h in api.history(done["id"])]
    assert events.count("joined") == 2 and events.count("forked") == 4


def test_listing_pages_newest_first_with_filters_and_a_bad_graph_is_422(api: FlowApi) -> None:
    flow = _flow()
    api.publish(flow, {"start": "e", "nodes": {"e": {"type": "end"}}})
    ids = [api.start(flow)["id"] for _ in range(5)]
    seen: list[str] = []
    cursor = None
    while True:
        page = api.get("/flow-instances", flow=flow, limit=2, **({"cursor": cursor} if cursor else {})).json()
        seen += [item["id"] for item in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert sorted(seen) == sorted(
        ids
    )  # each once (newest first: SQLite's clock has milliseconds, ties may swap)
    created = [api.instance(i)["created_at"] for i in seen]
    assert created == sorted(created, reverse=True)
    assert api.get("/flow-instances", flow=flow, status="RUNNING").json()["items"] == []
    assert len(api.get("/flow-instances", flow=flow, status="COMPLETED").json()["items"]) == 5
    assert api.get("/flow-instances", cursor="nope").json()["code"] == "invalid_cursor"
    assert [f["name"] for f in api.get("/flows").json()].count(flow) == 1
    bad = {"start": "a", "nodes": {"a": {"type": "task", "queue": QUEUE, "handler": "h", "next": "nowhere"}}}
    r = api.post("submit", f"/flows/{flow}/versions", {"graph": bad})
    assert r.status_code == 422 and "'a'" in r.text
    # The validator's message as the README quotes it, without pydantic's "Value error, " prefix.
    assert r.json()["detail"] == "body.graph: node 'a': next 'nowhere' is not a node of the graph"
    assert api.get(f"/flows/{flow}/versions/1").json()["version"] == 1
    assert api.get(f"/flows/{flow}/versions/2").json()["code"] == "flow_version_not_found"


def test_a_failed_step_task_cannot_be_retried_by_hand(api: FlowApi) -> None:
    """A manual retry of a step's task would run the step outside its flow (its result would reach
    nothing), so it is refused with a 409 naming the instance; the flow's own failure handling stands."""
    flow = _flow()
    api.publish(flow, {"start": "a", "nodes": {
        "a": {"type": "task", "queue": QUEUE, "handler": "h", "max_attempts": 1, "next": "b"},
        "b": {"type": "end"}}})  # fmt: skip
    done = _drain(api, api.start(flow)["id"], failing())
    assert done["status"] == "FAILED"
    task_id = done["steps"][0]["task_id"]
    refused = api.post("admin", f"/tasks/{task_id}/retry", {"reason": "try again"})
    assert refused.status_code == 409, refused.text
    problem = refused.json()
    assert problem["code"] == "not_retryable" and problem["flow_instance_id"] == done["id"]
    assert "on_failure" in problem["detail"] and "README" in problem["detail"]
    assert api.instance(done["id"])["status"] == "FAILED"  # nothing changed


def test_purge_keeps_a_step_task_whose_result_its_paused_instance_has_not_applied(
    api: FlowApi, server: RunningServer
) -> None:
    """Retention never deletes a step's task while its internal event is pending (the resume reads the
    task's result); once the flow applied it, the task goes like any other."""
    from orbit_server.retention import purge as retention

    flow = _flow()
    api.publish(flow, {"start": "a", "nodes": {
        "a": {"type": "task", "queue": "other", "handler": "a", "next": "b"},
        "b": {"type": "task", "queue": "other", "handler": "b", "params": {"got": "$.steps.a.result"}, "next": "e"},
        "e": {"type": "end"}}})  # fmt: skip
    instance = api.start(flow)
    grants = api.lease("other", 10, 1)  # a queue no other test leaves tasks in
    assert [g["task"]["handler"] for g in grants] == ["a"]
    api.control(instance["id"], "pause", reason="maintenance")
    api.finish(grants[0], ("complete", {"n": 7}))
    until(lambda: api.instance(instance["id"])["pending_events"] == 1)
    task_id = grants[0]["task"]["id"]

    def purge_all() -> None:
        with server.engine.connect() as conn:
            cutoff = db_now(conn) + timedelta(days=1)
        retention.purge(server.engine, actor="test", tasks_before=cutoff, keys=False)

    def exists() -> bool:
        with server.engine.connect() as conn:
            return conn.execute(sa.select(sa.func.count()).select_from(tasks).where(tasks.c.id == task_id)).scalar_one() == 1  # fmt: skip

    purge_all()
    assert exists(), "the step task with an unapplied result was purged"
    api.control(instance["id"], "resume", reason="done")
    seen: list[Any] = []

    def finished() -> dict[str, Any] | None:
        api.work("other", lambda t: (seen.append(t["params"]), ok()(t))[1], wait=0.1)
        found = api.instance(instance["id"])
        return found if found["status"] == "COMPLETED" else None

    done = until(finished, what="the resumed instance to complete")
    assert done["status"] == "COMPLETED" and seen == [{"got": {"n": 7}}]  # the result survived the purge
    purge_all()
    assert not exists()
