"""Attempts to break the token engine (issue 13 review): races of a signal with its wait's timeout, two
signals for one wait, a cancel racing an advance, and templates that render values too large to store.
Real databases (SQLite and MariaDB), a real server with its flow loop off: the tests drive the advances.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import partial
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from orbit_client import FlowControl
from orbit_server.db.engine import db_now
from orbit_server.db.schema import flow_events, flow_history, flow_signals, flow_timers, tasks
from orbit_server.db.transact import transact
from orbit_server.flows import control, engine
from orbit_server.flows.loop import run_pass
from orbit_server.tasks import store
from tests.conftest import DatabaseFactory
from tests.flow_support import FlowApi, ok, until
from tests.integration.conftest import BACKENDS
from tests.servers import RunningServer, run_server

SETTINGS = engine.EngineSettings()


@pytest.fixture(scope="module", params=BACKENDS)
def url(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> URL:
    return make_database(request.param)


@pytest.fixture(scope="module")
def quiet(url: URL) -> Iterator[tuple[RunningServer, FlowApi]]:
    with run_server(url, flow_interval_seconds=0, sweep_interval_seconds=0, scheduler_interval_seconds=0,
                    metrics_sample_interval_seconds=0) as server:  # fmt: skip
        namespace = f"ns{uuid.uuid4().hex[:6]}"
        api = FlowApi(server.base_url, namespace, server.add_namespace(namespace, queues=("steps",)))
        yield server, api
        api.close()


def _queue(server: RunningServer, api: FlowApi) -> str:
    name = f"q{uuid.uuid4().hex[:8]}"
    with server.engine.begin() as conn:
        store.create_queue(conn, api.ns, name)
    return name


def _history(server: RunningServer, instance_id: str) -> list[str]:
    with server.engine.connect() as conn:
        return list(conn.execute(sa.select(flow_history.c.event).where(flow_history.c.instance_id == instance_id)
                                 .order_by(flow_history.c.id)).scalars())  # fmt: skip


def _race(*work: Callable[[], Any]) -> list[Any]:
    """Run the callables at once (a barrier), return their results (an exception is a result)."""
    barrier = threading.Barrier(len(work))
    out: list[Any] = [None] * len(work)

    def run(n: int) -> None:
        barrier.wait()
        try:
            out[n] = work[n]()
        except Exception as exc:
            out[n] = exc

    threads = [threading.Thread(target=run, args=(n,)) for n in range(len(work))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def _signal_wait_graph(queue: str) -> dict[str, Any]:
    return {"start": "w", "nodes": {
        "w": {"type": "signal", "signal": "go", "timeout_seconds": 0.1, "next": "got", "on_timeout": "late"},
        "got": {"type": "task", "queue": queue, "handler": "got", "next": "e"},
        "late": {"type": "task", "queue": queue, "handler": "late", "next": "e"},
        "e": {"type": "end"}}}  # fmt: skip


def test_a_signal_racing_its_wait_s_timeout_exactly_one_wins(quiet: tuple[RunningServer, FlowApi]) -> None:
    server, api = quiet
    flow = f"race{uuid.uuid4().hex[:6]}"
    api.publish(flow, _signal_wait_graph(_queue(server, api)))
    for _ in range(6):
        instance_id = api.start(flow)["id"]
        with server.engine.connect() as conn:
            timer_id, fire_at = conn.execute(sa.select(flow_timers.c.id, flow_timers.c.fire_at).where(
                flow_timers.c.instance_id == instance_id)).one()  # fmt: skip
        until(partial(_due, server, fire_at), what="the signal timeout to be due")
        results = _race(
            partial(api.signal, instance_id, "go", {"n": 1}),
            partial(_outcome, server, engine.fire_timer, timer_id),
        )
        assert not any(isinstance(r, Exception) for r in results), results
        view = api.instance(instance_id)
        (token,) = view["tokens"]
        steps = [s["node"] for s in view["steps"]]
        with server.engine.connect() as conn:
            consumed = conn.execute(sa.select(flow_signals.c.consumed_at).where(
                flow_signals.c.instance_id == instance_id)).scalar_one()  # fmt: skip
        events = _history(server, instance_id)
        if steps == ["got"]:
            assert consumed is not None and results[1] in ("stale", "none"), (results, events)
            assert "signal_timed_out" not in events
        else:
            assert steps == ["late"] and consumed is None and results[1] == "applied", (steps, events)
        assert token["node"] == steps[0] and token["state"] == "WAITING"


def _outcome(server: RunningServer, work: Callable[..., engine.Outcome], item: Any) -> str:
    return transact(server.engine, work, item, SETTINGS).outcome


def _due(server: RunningServer, fire_at: Any) -> bool:
    with server.engine.connect() as conn:
        return bool(db_now(conn).replace(tzinfo=None) >= fire_at)


def test_two_signals_for_one_wait_move_it_once(quiet: tuple[RunningServer, FlowApi]) -> None:
    server, api = quiet
    flow = f"two{uuid.uuid4().hex[:6]}"
    graph = _signal_wait_graph(_queue(server, api))
    graph["nodes"]["w"] = {"type": "signal", "signal": "go", "next": "got"}
    del graph["nodes"]["late"]
    api.publish(flow, graph)
    for _ in range(4):
        instance_id = api.start(flow)["id"]
        results = _race(partial(api.signal, instance_id, "go", 1), partial(api.signal, instance_id, "go", 2))
        assert not any(isinstance(r, Exception) for r in results), results
        assert sorted(r["consumed_at"] is not None for r in results) == [False, True], results
        view = api.instance(instance_id)
        assert [s["node"] for s in view["steps"]] == ["got"]
        assert _history(server, instance_id).count("signal_received") == 3  # two recorded, one consumed


def test_a_cancel_racing_an_advance_leaves_no_live_task(quiet: tuple[RunningServer, FlowApi]) -> None:
    server, api = quiet
    flow = f"cx{uuid.uuid4().hex[:6]}"
    queue = _queue(server, api)
    api.publish(flow, {"start": "a", "nodes": {
        "a": {"type": "task", "queue": queue, "handler": "a", "next": "b"},
        "b": {"type": "task", "queue": queue, "handler": "b", "next": "e"},
        "e": {"type": "end"}}})  # fmt: skip
    for _ in range(6):
        instance_id = api.start(flow)["id"]
        assert len(api.work(queue, ok(), wait=0)) == 1
        with server.engine.connect() as conn:
            event_id = conn.execute(sa.select(flow_events.c.id).where(
                flow_events.c.instance_id == instance_id, flow_events.c.consumed_at.is_(None))).scalar_one()  # fmt: skip
        results = _race(
            partial(api.control, instance_id, "cancel"),
            partial(_outcome, server, engine.apply_event, event_id),
        )
        assert not any(isinstance(r, Exception) for r in results), results
        assert api.instance(instance_id)["status"] == "CANCELLED"
        with server.engine.connect() as conn:
            live = conn.execute(sa.select(tasks.c.id).where(
                tasks.c.flow_instance_id == instance_id, tasks.c.status.in_(["WAITING", "LEASED", "RUNNING"]),
                sa.not_(tasks.c.cancel_requested))).all()  # fmt: skip
        assert live == [], results
        api.work(queue, ok(), wait=0)  # whatever is left of this instance's tasks


def test_a_rendered_value_too_large_fails_the_instance_instead_of_storing_it(
    quiet: tuple[RunningServer, FlowApi],
) -> None:
    """A template can repeat a path: ten copies of a 200 KB result are 2 MB of params, more than any request
    may carry (ORBIT_MAX_BODY_BYTES). The instance must fail naming the node, not store (or, past the
    database's packet size, retry for ever) a task no client could have submitted."""
    server, api = quiet
    flow = f"big{uuid.uuid4().hex[:6]}"
    queue = _queue(server, api)
    api.publish(flow, {"start": "a", "nodes": {
        "a": {"type": "task", "queue": queue, "handler": "a", "next": "b"},
        "b": {"type": "task", "queue": queue, "handler": "b", "next": "e",
              "params": {f"k{n}": "$.steps.a.result" for n in range(10)}},
        "e": {"type": "end"}}})  # fmt: skip
    instance_id = api.start(flow)["id"]
    assert len(api.work(queue, ok("x" * 200_000), wait=0)) == 1
    for _ in range(5):
        if not run_pass(server.engine, SETTINGS).handled:
            break
    view = api.instance(instance_id)
    assert view["status"] == "FAILED", view["status"]
    assert view["error"]["node"] == "b" and view["error"]["code"] == "flow_value_too_large", view["error"]
    assert [s["node"] for s in view["steps"]] == ["a"]


def test_a_signal_received_while_paused_before_the_timeout_wins_on_resume(
    quiet: tuple[RunningServer, FlowApi],
) -> None:
    """The signal came (by the database's clock) before the wait's timeout fell due; the pause only delayed
    applying it. On resume the wait must take the signal, not time out with the signal left unconsumed."""
    server, api = quiet
    flow = f"ps{uuid.uuid4().hex[:6]}"
    graph = _signal_wait_graph(_queue(server, api))
    graph["nodes"]["w"]["timeout_seconds"] = 1.0
    api.publish(flow, graph)
    instance_id = api.start(flow)["id"]
    api.control(instance_id, "pause")
    record = api.signal(instance_id, "go", {"n": 1})
    assert record["consumed_at"] is None  # paused: recorded only
    with server.engine.connect() as conn:
        fire_at = conn.execute(sa.select(flow_timers.c.fire_at).where(
            flow_timers.c.instance_id == instance_id)).scalar_one()  # fmt: skip
    until(partial(_due, server, fire_at), what="the signal timeout to be due")
    # The resume's transaction commits; before the API's own signal match runs, another server's loop
    # (or this one, woken by the resume; or the recovery after a crash here) fires the due timeout.
    with server.engine.connect() as conn:
        principal = store.Principal(key_id=0, namespace_id=store.get_namespace_id(conn, api.ns), namespace=api.ns,
                                    role="admin")  # fmt: skip
    transact(server.engine, control.resume, principal, instance_id, FlowControl(), SETTINGS)
    for _ in range(5):
        if not run_pass(server.engine, SETTINGS).handled:
            break
    view = api.instance(instance_id)
    assert [s["node"] for s in view["steps"]] == ["got"], _history(server, instance_id)
    assert "signal_timed_out" not in _history(server, instance_id)


def _lock_waits(engine: sa.Engine, *, reads_only: bool = True) -> int:
    """Statements of ``engine``'s database blocked in a locking read (MariaDB; a wait in the optimizer's range
    analysis shows in the process list, not in innodb_trx; PostgreSQL: waiting on a lock). ``reads_only=False``
    (MariaDB): any statement still running, a write waiting for its lock among them."""
    with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            return int(conn.scalar(sa.text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid() AND wait_event_type = 'Lock'")))  # fmt: skip
        return int(conn.scalar(sa.text(
            "SELECT count(*) FROM information_schema.processlist WHERE db = DATABASE() AND id <> CONNECTION_ID()"
            " AND command = 'Query'" + (" AND info LIKE '%FOR UPDATE%'" if reads_only else ""))))  # fmt: skip


def test_a_cancel_racing_a_step_task_s_completion_still_cancels(quiet: tuple[RunningServer, FlowApi]) -> None:
    """The instance's cancel reads its step tasks' statuses, then cancels the live ones. A task that succeeds
    in between (its completion commits while the cancel waits for its row) must not make the cancel a 409
    ``invalid_transition`` about the task: the instance cancel still succeeds."""
    server, api = quiet
    if server.engine.dialect.name == "sqlite":
        pytest.skip(
            "SQLite has one writer: a completion cannot commit between the cancel's read and its lock"
        )
    flow = f"cc{uuid.uuid4().hex[:6]}"
    queue = _queue(server, api)
    api.publish(flow, {"start": "a", "nodes": {"a": {"type": "task", "queue": queue, "handler": "a", "next": "e"},
                                               "e": {"type": "end"}}})  # fmt: skip
    view = api.start(flow)
    task_id = view["tokens"][0]["task_id"]
    with server.engine.connect() as holder:
        holder.execute(sa.select(tasks.c.id).where(tasks.c.id == task_id).with_for_update())
        # What a completion writes last, before its commit (the rest does not matter to the cancel).
        holder.execute(tasks.update().where(tasks.c.id == task_id).values(status="SUCCEEDED",
                                                                          state_version=tasks.c.state_version + 1))  # fmt: skip
        out: list[Any] = []
        thread = threading.Thread(
            target=lambda: out.append(api.post("admin", f"/flow-instances/{view['id']}/cancel", {}))
        )
        thread.start()
        until(lambda: _lock_waits(server.engine) > 0 or out, what="the cancel to wait for the task's row")
        holder.commit()
        thread.join()
    (response,) = out
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "CANCELLED"


def test_a_poll_round_due_after_the_poll_s_deadline_starts_no_task(
    quiet: tuple[RunningServer, FlowApi],
) -> None:
    """The next round fell due before the poll's deadline, but fires after it (the instance was paused, or
    no loop ran): the poll is exhausted; no round task is created past its deadline."""
    server, api = quiet
    flow = f"pd{uuid.uuid4().hex[:6]}"
    queue = _queue(server, api)
    api.publish(flow, {"start": "check", "nodes": {
        "check": {"type": "poll", "queue": queue, "handler": "check", "interval_seconds": 0.1, "max_rounds": 50,
                  "deadline_seconds": 1, "done_path": "$.result.done", "next": "e", "on_exhausted": "gave_up"},
        "gave_up": {"type": "end", "status": "FAILED"},
        "e": {"type": "end"}}})  # fmt: skip
    instance_id = api.start(flow)["id"]
    assert len(api.work(queue, ok({"done": False}), wait=0)) == 1
    (event_id,) = [e for e in _pending_ids(server, instance_id)]
    assert _outcome(server, engine.apply_event, event_id) == "applied"  # round 2 is due in 0.1 s
    api.control(instance_id, "pause")
    with server.engine.connect() as conn:
        started = conn.execute(sa.select(sa.func.min(tasks.c.created_at)).where(
            tasks.c.flow_instance_id == instance_id)).scalar_one()  # fmt: skip
    until(partial(_due, server, started + timedelta(seconds=1.05)), what="the poll's deadline to pass")
    api.control(instance_id, "resume")
    for _ in range(5):
        if not run_pass(server.engine, SETTINGS).handled:
            break
    view = api.instance(instance_id)
    assert [s["round"] for s in view["steps"]] == [1], view["steps"]
    assert view["status"] == "FAILED" and view["error"]["node"] == "gave_up", view


def _pending_ids(server: RunningServer, instance_id: str) -> list[str]:
    with server.engine.connect() as conn:
        return list(conn.execute(sa.select(flow_events.c.id).where(
            flow_events.c.instance_id == instance_id, flow_events.c.consumed_at.is_(None))).scalars())  # fmt: skip


def test_a_pause_racing_advances_lets_none_move_a_token_after_it(
    quiet: tuple[RunningServer, FlowApi],
) -> None:
    """Results are pending for many instances; a loop pass applies them while an operator pauses them all.
    Whatever the interleaving, no instance's history shows a token moving (or a task made) after its pause,
    and every result not applied before the pause is still pending."""
    server, api = quiet
    flow = f"pr{uuid.uuid4().hex[:6]}"
    queue = _queue(server, api)
    api.publish(flow, {"start": "a", "nodes": {
        "a": {"type": "task", "queue": queue, "handler": "a", "next": "b"},
        "b": {"type": "task", "queue": queue, "handler": "b", "next": "e"},
        "e": {"type": "end"}}})  # fmt: skip
    instances = [api.start(flow)["id"] for _ in range(12)]
    assert api.work_batch(queue, ok(), n=100, wait=0) == len(instances)

    def pause_all() -> None:
        for instance_id in instances:
            api.control(instance_id, "pause")

    results = _race(pause_all, partial(run_pass, server.engine, SETTINGS))
    assert not any(isinstance(r, Exception) for r in results), results
    for instance_id in instances:
        events = _history(server, instance_id)
        after = events[events.index("instance_paused") + 1 :]
        assert after == [], events
        view = api.instance(instance_id)
        moved = [s["node"] for s in view["steps"]] == ["a", "b"]
        assert view["pending_events"] == (0 if moved else 1), view


def test_a_signal_after_the_timeout_fell_due_loses_even_before_the_timer_fired(
    quiet: tuple[RunningServer, FlowApi],
) -> None:
    """Who wins is decided by the database clock, not by how fast a loop fires the timer: a signal received
    after the wait's timeout fell due stays unconsumed, and the timeout moves the token."""
    server, api = quiet
    flow = f"sl{uuid.uuid4().hex[:6]}"
    api.publish(flow, _signal_wait_graph(_queue(server, api)))
    instance_id = api.start(flow)["id"]
    with server.engine.connect() as conn:
        fire_at = conn.execute(sa.select(flow_timers.c.fire_at).where(
            flow_timers.c.instance_id == instance_id)).scalar_one()  # fmt: skip
    until(partial(_due, server, fire_at + timedelta(milliseconds=10)), what="the signal timeout to be due")
    record = api.signal(instance_id, "go", {"late": True})
    assert record["consumed_at"] is None, record
    for _ in range(5):
        if not run_pass(server.engine, SETTINGS, scan_signals=True).handled:
            break
    view = api.instance(instance_id)
    assert [s["node"] for s in view["steps"]] == ["late"], _history(server, instance_id)
