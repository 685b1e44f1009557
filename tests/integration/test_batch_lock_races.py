"""Adversarial tests of the set-based batched ``start``/``complete`` (attempt rows locked with their tasks in one
statement), items naming their tasks (``task_id``), the one-statement result-event fan-out and multi-grant
leases: races against other transactions, on SQLite, MariaDB and PostgreSQL."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from orbit_client import TaskStatus
from orbit_server.db.engine import db_now
from orbit_server.db.schema import event_deliveries, result_events, subscriptions, task_attempts, tasks
from orbit_server.db.transact import transact
from orbit_server.results import deliveries as results
from orbit_server.tasks import result_events as result_events_module
from orbit_server.tasks import store
from tests.execution_support import check_attempt_history
from tests.integration.test_attempt_batches import item, lapse, leased, ok_batch, quiet_server  # noqa: F401
from tests.integration.test_execution_api import Api
from tests.integration.test_flows_break import _lock_waits
from tests.integration.test_result_events import _until, _waiting_for
from tests.servers import RunningServer


@pytest.fixture(scope="module")
def api(quiet_server: RunningServer) -> Iterator[Api]:  # noqa: F811
    with Api.in_new_namespace(quiet_server) as helper:
        yield helper


@pytest.fixture
def set_based(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What each set-based attempt of a batch did (the server runs in this process): ``"written"`` or
    ``"declined"`` (run item by item), in order."""
    from orbit_server.tasks import attempt_sets

    seen: list[str] = []
    for name in ("start_all", "complete_all"):
        original = getattr(attempt_sets, name)

        def traced(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            out = _original(*args, **kwargs)
            seen.append("declined" if out is None else "written")
            return out

        monkeypatch.setattr(attempt_sets, name, traced)
    return seen


def _no_row_locks(api: Api) -> None:
    if api.server.engine.dialect.name == "sqlite":
        pytest.skip("SQLite has one writer at a time: no transaction waits inside a statement for a row")


def _ns_id(api: Api, name: str | None = None) -> int:
    with api.server.engine.connect() as conn:
        return int(conn.scalar(sa.text("SELECT id FROM namespaces WHERE name = :n"), {"n": name or api.ns}))


def _session_id(conn: sa.Connection) -> int:
    postgres = conn.dialect.name == "postgresql"
    return int(
        conn.exec_driver_sql("SELECT pg_backend_pid()" if postgres else "SELECT CONNECTION_ID()").scalar_one()
    )


def _named(grant: dict[str, Any], task_id: str | None = None, **fields: Any) -> dict[str, Any]:
    """An item naming its task (as a Worker's items do), or ``task_id`` when given."""
    return item(grant, task_id=task_id or grant["task"]["id"], **fields)


def _answers(results: list[dict[str, Any]]) -> list[tuple[int, str | None]]:
    return [(r["status"], r["error"]["code"] if r["error"] else None) for r in results]


def _waited(api: Api, probe: sa.Engine, session: int) -> bool:
    """Whether a statement waits for the holder's lock. On MariaDB a wait met in the optimizer's range analysis
    shows in the process list only, not in ``INNODB_LOCK_WAITS`` (``test_flows_break._lock_waits``)."""
    return _waiting_for(probe, session) > 0 or _lock_waits(api.server.engine) > 0


def _occurred(api: Api, task_ids: list[str]) -> list[Any]:
    """When the result events of ``task_ids`` occurred (their ``occurred_at``)."""
    with api.server.engine.connect() as conn:
        return list(
            conn.execute(
                sa.select(result_events.c.occurred_at).where(result_events.c.task_id.in_(task_ids))
            ).scalars()
        )


def _lock_task(conn: sa.Connection, task_id: str) -> None:
    conn.execute(sa.text("SELECT id FROM tasks WHERE id = :t FOR UPDATE"), {"t": task_id}).all()


def _post_while_holding(
    api: Api, hold: Callable[[sa.Connection], None], path: str, body: dict[str, Any],
    while_waiting: Callable[[sa.Engine], None] | None = None,
) -> httpx.Response:  # fmt: skip
    """Run ``hold`` in a transaction, send ``body`` to ``path`` while it is open, wait until the request waits
    for one of its locks, call ``while_waiting`` (with an engine apart from the server's), commit, and return the
    answer."""
    probe = sa.create_engine(api.server.engine.url, poolclass=sa.NullPool)
    answers: list[httpx.Response] = []
    try:
        with api.server.engine.connect() as holder, ThreadPoolExecutor(max_workers=1) as pool:
            held = holder.begin()
            session = _session_id(holder)
            hold(holder)
            sent = pool.submit(
                lambda: answers.append(api.http["work"].post(f"/v1/namespaces/{api.ns}/{path}", json=body))
            )
            _until(lambda: sent.done() or _waited(api, probe, session), "the request never waited")
            assert not sent.done(), (
                f"the request did not wait for the held lock: {answers and answers[0].text}"
            )
            if while_waiting is not None:
                while_waiting(probe)
            held.commit()
            sent.result(timeout=60)
    finally:
        probe.dispose()
    return answers[0]


# --- 1. The attempts read by the one locking statement are current -------------------------------------------


@pytest.mark.parametrize("named", [False, True], ids=["ids read", "ids named"])
@pytest.mark.parametrize("change", ["lapsed", "renewed", "cancel requested", "re-leased"])
def test_a_complete_batch_that_waited_for_a_task_answers_from_the_rows_as_committed(
    api: Api, change: str, named: bool, set_based: list[str]
) -> None:
    """A set-based complete of three whose middle task is locked by a transaction that changes the task or its
    attempt and commits while the batch waits: the batch acts on the rows as committed, never on the older
    versions it would have seen had it read them before the lock."""
    _no_row_locks(api)
    queue = api.queue()
    grants = leased(api, queue, 3, retry_safe=True)
    ok_batch(api, "start", [item(g) for g in grants])
    middle = grants[1]
    task_id, attempt_id = middle["task"]["id"], middle["attempt"]["id"]

    def hold(conn: sa.Connection) -> None:
        conn.execute(sa.select(tasks.c.id).where(tasks.c.id == task_id).with_for_update())
        now = db_now(conn)
        if change == "lapsed":  # the lease ran out (what the expiry sees)
            conn.execute(task_attempts.update().where(task_attempts.c.id == attempt_id)
                         .values(lease_expires_at=now - timedelta(seconds=1)))  # fmt: skip
        elif change == "renewed":  # what a heartbeat with lease_seconds=777 writes
            conn.execute(task_attempts.update().where(task_attempts.c.id == attempt_id)
                         .values(lease_seconds=777, lease_expires_at=now + timedelta(seconds=777),
                                 heartbeat_at=now))  # fmt: skip
        elif change == "cancel requested":
            conn.execute(tasks.update().where(tasks.c.id == task_id)
                         .values(cancel_requested=True, state_version=tasks.c.state_version + 1))  # fmt: skip
        else:  # the task's lease expired, its attempt too, and it is current no more (leased again)
            conn.execute(task_attempts.update().where(task_attempts.c.id == attempt_id)
                         .values(status="EXPIRED", lease_expires_at=now - timedelta(seconds=1)))  # fmt: skip
            conn.execute(tasks.update().where(tasks.c.id == task_id)
                         .values(status="WAITING", current_attempt_id=None,
                                 state_version=tasks.c.state_version + 1))  # fmt: skip

    make = _named if named else item
    body = {"items": [make(g, result={"i": i}) for i, g in enumerate(grants)]}
    set_based.clear()
    answer = _post_while_holding(api, hold, "attempts/complete", body)
    # written set-based after the wait, unless the change made the batch decline (then item by item)
    assert set_based == (["declined"] if change in ("lapsed", "re-leased") else ["written"]), set_based
    assert answer.status_code == 200, answer.text
    got = answer.json()["items"]
    assert got[0]["status"] == got[2]["status"] == 200, got
    for g, i in ((grants[0], 0), (grants[2], 2)):
        assert api.task(g["task"]["id"])["result"] == {"i": i}
    task = api.task(task_id)
    if change in ("lapsed", "re-leased"):
        assert got[1]["status"] == 409 and got[1]["error"]["code"] == "lease_lost", got[1]
        assert task["status"] != "SUCCEEDED", task
        (attempt,) = api.attempts(task_id)
        assert attempt["status"] == "EXPIRED", attempt
    else:
        assert got[1]["status"] == 200, got[1]
        assert task["status"] == "SUCCEEDED" and task["result"] == {"i": 1}
        with api.server.engine.connect() as conn:
            row = (
                conn.execute(sa.select(task_attempts).where(task_attempts.c.id == attempt_id))
                .mappings()
                .one()
            )
        answered = datetime.fromisoformat(got[1]["attempt"]["lease_expires_at"]).replace(tzinfo=None)
        assert answered == row["lease_expires_at"], (got[1]["attempt"], row)
        if change == "renewed":
            assert row["lease_seconds"] == 777
        else:
            assert got[1]["attempt"]["cancel_requested"] is True, got[1]
    with api.server.engine.connect() as conn:
        events = conn.scalar(
            sa.select(sa.func.count()).select_from(result_events).where(result_events.c.task_id == task_id)
        )
    assert events == (1 if task["status"] == "SUCCEEDED" else 0)


@pytest.mark.parametrize("named", [False, True], ids=["ids read", "ids named"])
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("change", ["lapsed", "renewed"])
def test_a_start_batch_that_waited_for_a_task_acts_on_its_attempt_as_committed(
    api: Api, named: bool, size: int, change: str, set_based: list[str]
) -> None:
    """Two or three items (both set-based): the last item's task is held by a transaction that lets its lease
    lapse, or renews it for 777 s (a heartbeat with ``lease_seconds``); the start waits, then starts the others
    only, or grants the renewed attempt a lease of 777 s from the start, not the 30 s it had when read."""
    _no_row_locks(api)
    queue = api.queue()
    grants = leased(api, queue, size)
    last = grants[-1]

    def hold(conn: sa.Connection) -> None:
        conn.execute(sa.select(tasks.c.id).where(tasks.c.id == last["task"]["id"]).with_for_update())
        now = db_now(conn)
        values: dict[str, Any] = (
            {"lease_expires_at": now - timedelta(seconds=1)} if change == "lapsed"
            else {"lease_seconds": 777, "lease_expires_at": now + timedelta(seconds=777), "heartbeat_at": now}
        )  # fmt: skip
        conn.execute(
            task_attempts.update().where(task_attempts.c.id == last["attempt"]["id"]).values(**values)
        )

    make = _named if named else item
    set_based.clear()
    answer = _post_while_holding(api, hold, "attempts/start", {"items": [make(g) for g in grants]})
    assert answer.status_code == 200, answer.text
    assert set_based == (["declined"] if change == "lapsed" else ["written"]), set_based
    got = answer.json()["items"]
    if change == "lapsed":
        assert _answers(got) == [(200, None)] * (size - 1) + [(409, "lease_lost")]
        assert [api.task(g["task"]["id"])["status"] for g in grants] == ["RUNNING"] * (size - 1) + ["WAITING"]
    else:
        assert _answers(got) == [(200, None)] * size
        with api.server.engine.connect() as conn:
            row = conn.execute(
                sa.select(task_attempts.c.started_at, task_attempts.c.lease_expires_at)
                .where(task_attempts.c.id == last["attempt"]["id"])
            ).one()  # fmt: skip
        assert row.lease_expires_at - row.started_at == timedelta(seconds=777)
        assert datetime.fromisoformat(got[-1]["attempt"]["lease_expires_at"]).replace(tzinfo=None) == (
            row.lease_expires_at
        )
    check_attempt_history(api.server.engine, [g["task"]["id"] for g in grants])


# --- 1. No deadlock with the other paths that lock tasks then attempts ----------------------------------------


def test_batches_racing_heartbeats_cancels_fails_and_leases_answer_every_request(api: Api) -> None:
    """Set-based complete batches (in opposite orders), heartbeat batches, single fails, admin cancels and a
    lease on the same queue, all at once over the same tasks, a few rounds: no request fails whole (a deadlock
    is run again), every task ends with one current story, and each task's success is answered to one caller."""
    queue = api.queue()
    for _ in range(3):
        _race_round(api, queue)


def _race_round(api: Api, queue: str) -> None:
    grants = leased(api, queue, 8, retry_safe=True)
    ok_batch(api, "start", [item(g) for g in grants])
    for _ in range(4):
        api.submit(queue)
    barrier = threading.Barrier(7)
    out: dict[str, Any] = {}
    errors: list[BaseException] = []
    headers = {"Authorization": f"Bearer {api.keys['work']}"}
    admin = {"Authorization": f"Bearer {api.keys['admin']}"}
    base = f"/v1/namespaces/{api.ns}"

    def run(name: str, send: Callable[[httpx.Client], Any], auth: dict[str, str] = headers) -> None:
        try:
            with httpx.Client(base_url=api.server.base_url, timeout=60, headers=auth) as http:
                barrier.wait()
                out[name] = send(http)
        except BaseException as exc:
            errors.append(exc)

    def post(path: str, body: dict[str, Any]) -> Callable[[httpx.Client], httpx.Response]:
        return lambda http: http.post(f"{base}/{path}", json=body)

    def cancels(http: httpx.Client) -> list[httpx.Response]:
        return [
            http.post(f"{base}/tasks/{g['task']['id']}/cancel", json={"reason": "r"}) for g in grants[5:7]
        ]

    def fails(http: httpx.Client) -> list[httpx.Response]:
        fatal = {"type": "E", "message": "m", "retryable": False}
        return [
            http.post(f"{base}/attempts/{g['attempt']['id']}/fail",
                      json={"lease_token": g["attempt"]["lease_token"], "error": fatal})
            for g in (grants[7], grants[0])
        ]  # fmt: skip

    jobs: list[tuple[str, Callable[[httpx.Client], Any], dict[str, str]]] = [
        ("a", post("attempts/complete", {"items": [_named(g, result="a") for g in grants]}), headers),
        ("b", post("attempts/complete", {"items": [item(g, result="b") for g in grants[::-1]]}), headers),
        ("beat", post("attempts/heartbeat", {"items": [item(g, lease_seconds=60) for g in grants[2:8]]}), headers),
        ("lease", post(f"queues/{queue}/leases",
                       {"worker_id": "w", "max_tasks": 4, "lease_seconds": 30, "wait_seconds": 0}), headers),
        ("cancel", cancels, admin),
        ("fail", fails, headers),
        ("start", post("attempts/start", {"items": [_named(g) for g in grants[:4]]}), headers),
    ]  # fmt: skip
    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    assert not errors, errors
    responses = [out[k] for k in ("a", "b", "beat", "lease", "start")]
    assert [r.status_code for r in responses] == [200] * len(responses), [
        r.text for r in responses if r.status_code != 200
    ]
    singles = out["cancel"] + out["fail"]  # a report or cancel that lost the race is a 409, never a 5xx
    assert all(r.status_code in (200, 409) for r in singles), [r.text for r in singles]
    for g, failed in zip((grants[7], grants[0]), out["fail"], strict=True):
        if failed.status_code == 200:
            assert api.task(g["task"]["id"])["status"] == "FAILED"
    a, b = out["a"].json()["items"], out["b"].json()["items"][::-1]
    for g, x, y in zip(grants, a, b, strict=True):
        task = api.task(g["task"]["id"])
        wins = [label for label, answer in (("a", x), ("b", y)) if answer["status"] == 200]
        if task["status"] == "SUCCEEDED":
            assert wins == [task["result"]], (task, x, y)
        else:
            assert wins == [], (task, x, y)
    check_attempt_history(api.server.engine, [g["task"]["id"] for g in grants])
    with api.server.engine.connect() as conn:
        ids = [g["task"]["id"] for g in grants]
        done = dict(conn.execute(sa.select(result_events.c.task_id, sa.func.count())
                                 .where(result_events.c.task_id.in_(ids)).group_by(result_events.c.task_id)).all())  # fmt: skip
        statuses = dict(conn.execute(sa.select(tasks.c.id, tasks.c.status).where(tasks.c.id.in_(ids))).all())
    assert done == {t: 1 for t, s in statuses.items() if s in ("SUCCEEDED", "FAILED", "CANCELLED")}, (
        done, statuses)  # fmt: skip


# --- 3. Items naming their tasks: a wrong name changes nothing -------------------------------------------------


def _stale_and_newer(api: Api, queue: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A grant whose attempt expired and whose task was leased again: ``(old, new)``."""
    (old,) = leased(api, queue, 1)
    lapse(api, old)
    assert api.call(old, "start").status_code == 409  # expires it: the task waits again
    new = api.lease_one(queue)
    assert new["task"]["id"] == old["task"]["id"] and new["attempt"]["id"] != old["attempt"]["id"]
    return old, new


@pytest.mark.parametrize("action", ["start", "complete"])
@pytest.mark.parametrize(
    "case",
    ["another namespace's task", "a duplicate name", "the task of a newer attempt", "a finished task", "mixture",
     "two items, one foreign"],
)  # fmt: skip
def test_a_batch_naming_wrong_tasks_is_answered_as_the_same_batch_without_names(
    api: Api,
    quiet_server: RunningServer,  # noqa: F811
    case: str,
    action: str,
) -> None:
    """Two identical set-ups; one batch names tasks (some wrongly), the other names none: the same answers,
    the same tasks' states, and another namespace's task untouched."""
    other_ns = f"ns-{uuid.uuid4().hex[:8]}"
    other = Api(quiet_server, other_ns, quiet_server.add_namespace(other_ns))
    try:
        foreign_queue = other.queue()
        (foreign,) = leased(other, foreign_queue, 1)
        queue = api.queue()
        outcomes = []
        for with_names in (True, False):
            grants = leased(api, queue, 3)
            old, new = _stale_and_newer(api, queue)
            finished = leased(api, queue, 1)[0]
            api.ok(finished, "start")
            api.ok(finished, "complete", result="done")
            if action == "complete":
                ok_batch(api, "start", [item(g) for g in [*grants, new]])
            body = {"result": 7} if action == "complete" else {}
            plan: list[tuple[dict[str, Any], str]] = {
                "another namespace's task": [(grants[0], foreign["task"]["id"]), (grants[1], grants[1]["task"]["id"]),
                                             (grants[2], grants[2]["task"]["id"])],
                "a duplicate name": [(grants[0], grants[0]["task"]["id"]), (grants[1], grants[0]["task"]["id"]),
                                     (grants[2], grants[2]["task"]["id"])],
                "the task of a newer attempt": [(grants[0], grants[0]["task"]["id"]), (old, old["task"]["id"]),
                                                (grants[1], grants[1]["task"]["id"])],
                "a finished task": [(grants[0], grants[0]["task"]["id"]), (grants[1], finished["task"]["id"]),
                                    (finished, finished["task"]["id"])],
                "mixture": [(grants[2], foreign["task"]["id"]), (old, new["task"]["id"]), (new, old["task"]["id"]),
                            (grants[0], finished["task"]["id"]), (grants[1], grants[1]["task"]["id"])],
                "two items, one foreign": [(grants[0], grants[0]["task"]["id"]), (grants[1], foreign["task"]["id"])],
            }[case]  # fmt: skip
            items = [item(g, **body, **({"task_id": named} if with_names else {})) for g, named in plan]
            answers = ok_batch(api, action, items)
            states = [
                (api.task(g["task"]["id"])["status"], api.task(g["task"]["id"]).get("result"))
                for g in (*grants, new, finished)
            ]
            outcomes.append(
                (_answers(answers), [a["attempt"] and a["attempt"]["status"] for a in answers], states)
            )
        assert outcomes[0] == outcomes[1]
        assert other.task(foreign["task"]["id"])["status"] == "LEASED"
        assert other.attempts(foreign["task"]["id"])[0]["status"] == "LEASED"
        assert other.ok(foreign, "start")["status"] == "RUNNING"
    finally:
        other.close()


def test_a_batch_naming_another_namespace_s_task_takes_no_lock_on_it(
    api: Api,
    quiet_server: RunningServer,  # noqa: F811
) -> None:
    """While a batch of this namespace waits for one of its own tasks, a task of another namespace that one of
    its items names is not locked: that namespace's workers are never held up by this one's batch."""
    _no_row_locks(api)
    with Api.in_new_namespace(quiet_server) as other:
        foreign_queue = other.queue()
        queue = api.queue()
        grants = leased(api, queue, 3)
        held = max(grants, key=lambda g: g["task"]["id"])  # locked last in key order (MariaDB)
        foreigners: list[dict[str, Any]] = []
        while not foreigners or min(g["task"]["id"] for g in foreigners) > held["task"]["id"]:
            assert len(foreigners) < 40, "no foreign task id sorted before the held one"
            foreigners += leased(other, foreign_queue, 2)
    lowest = min(foreigners, key=lambda g: g["task"]["id"])
    items = [_named(g) for g in grants]
    items[0 if grants[0] is not held else 1]["task_id"] = lowest["task"]["id"]
    locked: list[bool] = []

    def try_the_foreign_task(probe: sa.Engine) -> None:
        with probe.connect() as conn, conn.begin():
            try:
                conn.execute(sa.text("SELECT id FROM tasks WHERE id = :t FOR UPDATE NOWAIT"),
                             {"t": lowest["task"]["id"]}).all()  # fmt: skip
                locked.append(False)
            except sa.exc.OperationalError:
                locked.append(True)

    answer = _post_while_holding(
        api, lambda holder: _lock_task(holder, held["task"]["id"]), "attempts/start", {"items": items},
        while_waiting=try_the_foreign_task,
    )  # fmt: skip
    assert answer.status_code == 200
    assert [a["status"] for a in answer.json()["items"]] == [200, 200, 200]
    assert locked == [False], "a batch of one namespace locked another namespace's task it named"


# --- 4. Result-event fan-out: a subscription created concurrently --------------------------------------------


def _deliveries(api: Api, subscription_id: Any, task_ids: list[str]) -> set[str]:
    with api.server.engine.connect() as conn:
        return set(
            conn.execute(
                sa.select(result_events.c.task_id)
                .join(event_deliveries, event_deliveries.c.event_id == result_events.c.id)
                .where(event_deliveries.c.subscription_id == subscription_id, result_events.c.task_id.in_(task_ids))
            ).scalars()
        )  # fmt: skip


def _subscription_id(api: Api, name: str) -> Any:
    with api.server.engine.connect() as conn:
        return conn.scalar(sa.select(subscriptions.c.id).where(subscriptions.c.name == name))


def _running_on(api: Api, queues: list[str], per_queue: int) -> list[dict[str, Any]]:
    grants = [g for q in queues for g in leased(api, q, per_queue)]
    ok_batch(api, "start", [item(g) for g in grants])
    return grants


def test_subscriptions_created_while_a_complete_batch_waits_get_its_events(
    api: Api, set_based: list[str]
) -> None:
    """Subscriptions (one to every queue, one to one queue, one to a queue outside the batch) being created when a
    set-based complete over two queues reaches its fan-out: the batch waits, then delivers each matching event."""
    _no_row_locks(api)
    q1, q2, q3 = api.queue(), api.queue(), api.queue()
    grants = _running_on(api, [q1, q2], 2)
    ns_id = _ns_id(api)
    tag = uuid.uuid4().hex[:6]
    names = {"all": f"all-{tag}", "q1": f"q1-{tag}", "q3": f"q3-{tag}"}

    def hold(conn: sa.Connection) -> None:
        results.create_subscription(conn, ns_id, api.ns, names["all"], None)
        results.create_subscription(conn, ns_id, api.ns, names["q1"], [q1])
        results.create_subscription(conn, ns_id, api.ns, names["q3"], [q3])

    body = {"items": [_named(g, result=i) for i, g in enumerate(grants)]}
    set_based.clear()
    answer = _post_while_holding(api, hold, "attempts/complete", body)
    assert [a["status"] for a in answer.json()["items"]] == [200] * 4
    assert set_based == ["written"]
    ids = [g["task"]["id"] for g in grants]
    with api.server.engine.connect() as conn:
        created = conn.scalar(
            sa.select(subscriptions.c.created_at).where(subscriptions.c.name == names["all"])
        )
    assert all(created <= at for at in _occurred(api, ids))
    assert _deliveries(api, _subscription_id(api, names["all"]), ids) == set(ids)
    assert _deliveries(api, _subscription_id(api, names["q1"]), ids) == {g["task"]["id"] for g in grants[:2]}
    assert _deliveries(api, _subscription_id(api, names["q3"]), ids) == set()


def test_a_subscription_created_while_a_complete_batch_holds_its_fan_out_locks_gets_none_of_its_events(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other order: the batch has taken its fan-out's shared locks (and not committed) when a subscription is
    created; the creation waits, its ``created_at`` is later than the events, and it gets none of them."""
    _no_row_locks(api)
    q1, q2 = api.queue(), api.queue()
    grants = _running_on(api, [q1, q2], 2)
    ns_id = _ns_id(api)
    fanned, release = threading.Event(), threading.Event()
    original = result_events_module.record_result_events

    def paused(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        fanned.set()
        assert release.wait(60)
        return out

    monkeypatch.setattr(result_events_module, "record_result_events", paused)
    name = f"late-{uuid.uuid4().hex[:6]}"
    made: list[Any] = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        sent = pool.submit(ok_batch, api, "complete", [_named(g, result=i) for i, g in enumerate(grants)])
        assert fanned.wait(30), "the batch never reached its fan-out"
        creating = pool.submit(lambda: made.append(transact(api.server.engine, results.create_subscription,
                                                            ns_id, api.ns, name, None)))  # fmt: skip
        probe = sa.create_engine(api.server.engine.url, poolclass=sa.NullPool)
        try:
            _until(
                lambda: creating.done() or _lock_waits(probe, reads_only=False) > 0,
                "the creation never waited",
            )
        finally:
            probe.dispose()
        assert not creating.done(), "the subscription was created while the batch held the fan-out's locks"
        release.set()
        answers = sent.result(timeout=60)
        creating.result(timeout=60)
    assert [a["status"] for a in answers] == [200] * 4
    ((subscription, created),) = made
    assert created
    ids = [g["task"]["id"] for g in grants]
    assert subscription.created_at.replace(tzinfo=None) > max(_occurred(api, ids))
    assert _deliveries(api, _subscription_id(api, name), ids) == set()


def test_a_complete_batch_in_a_namespace_without_subscriptions_writes_events_and_no_deliveries(
    quiet_server: RunningServer,  # noqa: F811
) -> None:
    name = f"ns-{uuid.uuid4().hex[:8]}"
    fresh = Api(quiet_server, name, quiet_server.add_namespace(name))
    try:
        grants = _running_on(fresh, [fresh.queue(), fresh.queue(), fresh.queue()], 1)
        done = ok_batch(fresh, "complete", [_named(g, result=None) for g in grants])
        assert [d["status"] for d in done] == [200] * 3
        ids = [g["task"]["id"] for g in grants]
        with quiet_server.engine.connect() as conn:
            events = list(
                conn.execute(sa.select(result_events.c.id).where(result_events.c.task_id.in_(ids))).scalars()
            )
            delivered = conn.scalar(
                sa.select(sa.func.count())
                .select_from(event_deliveries)
                .where(event_deliveries.c.event_id.in_(events))
            )
        assert len(events) == 3 and delivered == 0
    finally:
        fresh.close()


# --- 5. Multi-grant leases racing ------------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [None, 3])
def test_racing_leases_of_several_grants_never_grant_a_task_twice(api: Api, limit: int | None) -> None:
    queue = f"q-{uuid.uuid4().hex[:10]}"
    with api.server.engine.begin() as conn:
        store.create_queue(conn, api.ns, queue, **({"max_concurrency": limit} if limit else {}))
    for _ in range(10):
        api.submit(queue)
    barrier = threading.Barrier(3)

    def take(n: int) -> list[dict[str, Any]]:
        with httpx.Client(base_url=api.server.base_url, timeout=30,
                          headers={"Authorization": f"Bearer {api.keys['work']}"}) as http:  # fmt: skip
            barrier.wait()
            r = http.post(f"/v1/namespaces/{api.ns}/queues/{queue}/leases",
                          json={"worker_id": f"w{n}", "max_tasks": 4, "lease_seconds": 30, "wait_seconds": 0})  # fmt: skip
            assert r.status_code == 200, r.text
            return list(r.json())

    with ThreadPoolExecutor(max_workers=3) as pool:
        got = [g for grants in pool.map(take, range(3)) for g in grants]
    task_ids = [g["task"]["id"] for g in got]
    assert len(task_ids) == len(set(task_ids))
    assert len(got) == (limit or 10)
    with api.server.engine.connect() as conn:
        leased_now = conn.scalar(sa.select(sa.func.count()).select_from(tasks).where(
            tasks.c.id.in_(task_ids), tasks.c.status == "LEASED"))  # fmt: skip
    assert leased_now == len(got)
    done = ok_batch(api, "start", [_named(g) for g in got])
    assert [d["status"] for d in done] == [200] * len(got)
    done = ok_batch(api, "complete", [_named(g, result=1) for g in got])
    assert [d["status"] for d in done] == [200] * len(got)
    if limit:  # the permits are released: the next ones are leased
        assert len(api.lease(queue, 4)) == 3


# --- 2. The largest batch, set-based, with names ---------------------------------------------------------------


def test_a_batch_of_the_largest_size_is_written_set_based_with_and_without_names(
    api: Api, set_based: list[str]
) -> None:
    from orbit_client import MAX_ATTEMPT_BATCH_ITEMS

    queue = api.queue()
    for _ in range(MAX_ATTEMPT_BATCH_ITEMS):
        api.submit(queue)
    grants: list[dict[str, Any]] = []
    while len(grants) < MAX_ATTEMPT_BATCH_ITEMS:
        more = api.lease(queue, 100)
        assert more
        grants.extend(more)
    set_based.clear()
    started = ok_batch(api, "start", [_named(g) for g in grants])
    assert [s["status"] for s in started] == [200] * len(grants)
    done = ok_batch(api, "complete", [item(g, result=i) for i, g in enumerate(grants)])
    assert [d["status"] for d in done] == [200] * len(grants)
    with api.server.engine.connect() as conn:
        stored = dict(conn.execute(sa.select(tasks.c.id, tasks.c.result).where(
            tasks.c.id.in_([g["task"]["id"] for g in grants]))).all())  # fmt: skip
    assert [stored[g["task"]["id"]] for g in grants] == list(range(len(grants)))
    assert set_based == ["written", "written"]


# --- 1. Lease lapse races with the expiry sweep and the lease path ----------------------------------------------


def _racing(*calls: Callable[[], Any]) -> list[Any]:
    """Run ``calls`` at once, each in its own thread (released together); their returns, in order."""
    barrier = threading.Barrier(len(calls))

    def run(call: Callable[[], Any]) -> Any:
        barrier.wait()
        return call()

    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(run, call) for call in calls]
        return [future.result(timeout=90) for future in futures]


@pytest.mark.parametrize("action", ["start", "complete"])
def test_a_batch_racing_the_expiry_sweep_over_lapsed_leases(api: Api, action: str) -> None:
    """Half the batch's leases have lapsed and the sweep runs at the same moment: each lapsed item is a 409
    ``lease_lost`` whoever expires it first, each live one a 200, and every lapsed attempt is expired once."""
    from orbit_server.tasks.leases import expire_leases

    for _ in range(4):
        grants = leased(
            api, api.queue(), 6, retry_safe=True
        )  # a queue each round: the lapsed tasks wait in it
        if action == "complete":
            ok_batch(api, "start", [item(g) for g in grants])
        lapsed = grants[1::2]
        for g in lapsed:
            lapse(api, g)
        body = {"result": "r"} if action == "complete" else {}
        answers, _ = _racing(
            lambda grants=grants, body=body: ok_batch(api, action, [_named(g, **body) for g in grants]),
            lambda: transact(api.server.engine, expire_leases),
        )
        expect = [(409, "lease_lost") if g in lapsed else (200, None) for g in grants]
        assert _answers(answers) == expect
        for g in lapsed:
            (attempt,) = api.attempts(g["task"]["id"])
            assert attempt["status"] == "EXPIRED", attempt
            assert api.task(g["task"]["id"])["status"] == "WAITING"
            assert [e["event"] for e in api.events(g["task"]["id"])].count("lease_expired") <= 1
        check_attempt_history(api.server.engine, [g["task"]["id"] for g in grants])


def test_a_start_batch_racing_a_lease_that_takes_its_lapsed_tasks_again(api: Api) -> None:
    """A start batch over lapsed leases and a lease of the same queue at once: a task leased again belongs to its
    new attempt (the batch's item for the old one is a 409 and starts nothing), and the new grant starts."""
    queue = api.queue()
    for _ in range(4):
        grants = leased(api, queue, 4)
        for g in grants[:2]:
            lapse(api, g)
        answers, fresh = _racing(
            lambda grants=grants: ok_batch(api, "start", [_named(g) for g in grants]),
            lambda: api.lease(queue, 4),
        )
        assert _answers(answers) == [(409, "lease_lost")] * 2 + [(200, None)] * 2
        assert {g["task"]["id"] for g in fresh} <= {g["task"]["id"] for g in grants[:2]}
        if fresh:
            again = ok_batch(api, "start", [_named(g) for g in fresh])
            assert [a["status"] for a in again] == [200] * len(fresh)
        for g in grants[:2]:
            task = api.task(g["task"]["id"])
            assert task["status"] in ("WAITING", "RUNNING"), task
        check_attempt_history(api.server.engine, [g["task"]["id"] for g in grants])
        for g in api.lease(queue, 4):  # leave nothing for the next round
            api.ok(g, "start")


# --- 5. A lease of several grants maps each task to its own attempt ---------------------------------------------


@pytest.mark.parametrize("limited", [False, True], ids=["unlimited", "limited"])
def test_a_lease_and_start_of_several_grants_mixing_retry_safe_tasks(api: Api, limited: bool) -> None:
    """Each task of a multi-grant lease-and-start gets its own attempt (the claim's ``CASE``), retry-safe ones
    started; on a limited queue each holds a permit, released by the set-based complete."""
    from orbit_server.db.schema import concurrency_permits

    queue = f"q-{uuid.uuid4().hex[:10]}"
    with api.server.engine.begin() as conn:
        store.create_queue(conn, api.ns, queue, **({"max_concurrency": 7} if limited else {}))
    for n in range(6):
        api.submit(queue, retry_safe=bool(n % 2))
    r = api.http["work"].post(f"/v1/namespaces/{api.ns}/queues/{queue}/leases",
                              json={"worker_id": "w", "max_tasks": 6, "lease_seconds": 30, "start": True})  # fmt: skip
    assert r.status_code == 200, r.text
    grants = list(r.json())
    assert len(grants) == 6
    with api.server.engine.connect() as conn:
        rows = {
            row.id: row
            for row in conn.execute(
                sa.select(tasks.c.id, tasks.c.current_attempt_id, tasks.c.status, tasks.c.retry_safe,
                          tasks.c.state_version)
                .where(tasks.c.id.in_([g["task"]["id"] for g in grants]))
            )
        }  # fmt: skip
        owners = dict(
            conn.execute(
                sa.select(task_attempts.c.id, task_attempts.c.task_id).where(
                    task_attempts.c.id.in_([g["attempt"]["id"] for g in grants])
                )
            ).all()
        )
    for g in grants:
        row = rows[g["task"]["id"]]
        assert row.current_attempt_id == g["attempt"]["id"] and owners[g["attempt"]["id"]] == row.id
        assert (row.status, row.state_version) == (("RUNNING", 3) if row.retry_safe else ("LEASED", 2))
        assert g["task"]["status"] == row.status
    attempt_ids = [g["attempt"]["id"] for g in grants]

    def permits() -> int:
        with api.server.engine.connect() as conn:
            return int(conn.scalar(sa.select(sa.func.count()).select_from(concurrency_permits)
                                   .where(concurrency_permits.c.attempt_id.in_(attempt_ids))))  # fmt: skip

    assert permits() == (6 if limited else 0)
    items = [_named(g) for g in grants if not rows[g["task"]["id"]].retry_safe]
    assert [a["status"] for a in ok_batch(api, "start", items)] == [200] * 3
    done = ok_batch(api, "complete", [_named(g, result=g["task"]["id"]) for g in grants])
    assert [d["status"] for d in done] == [200] * 6
    assert [api.task(g["task"]["id"])["result"] for g in grants] == [g["task"]["id"] for g in grants]
    assert permits() == 0


# --- 3. The client leaves task_id out when None; the server says it takes it ------------------------------------


def test_items_without_a_task_leave_it_out_of_the_body_and_the_server_offers_named_tasks(api: Api) -> None:
    import json

    from orbit_client import CompleteBatch, CompleteItem, StartBatch, StartItem

    start = StartBatch(items=[StartItem(attempt_id="a", lease_token="t"),
                              StartItem(attempt_id="b", lease_token="t", task_id="x")])  # fmt: skip
    complete = CompleteBatch(items=[CompleteItem(attempt_id="a", lease_token="t", result=None)])
    for body in (json.loads(start.model_dump_json()), start.model_dump(mode="json"), start.model_dump()):
        assert "task_id" not in body["items"][0] and body["items"][1]["task_id"] == "x"
    for body in (json.loads(complete.model_dump_json()), complete.model_dump(mode="json")):
        assert "task_id" not in body["items"][0] and body["items"][0]["result"] is None
    r = api.http["read"].get("/v1/settings")
    assert r.status_code == 200, r.text
    assert r.json().get("item_task_ids") is True or r.json().get("features", {}).get("item_task_ids") is True


# --- 6. Two items: set-based, with a foreign attempt ----------------------------------------------------------


def test_a_two_item_batch_with_another_namespace_s_attempt(api: Api, quiet_server: RunningServer) -> None:  # noqa: F811
    """One item of this namespace, one of another (its own token, its task named): 200 and 404, the other
    namespace's attempt untouched, whether the items name their tasks or not."""
    other_ns = f"ns-{uuid.uuid4().hex[:8]}"
    other = Api(quiet_server, other_ns, quiet_server.add_namespace(other_ns))
    try:
        queue, foreign_queue = api.queue(), other.queue()
        for make in (item, _named):
            (mine,) = leased(api, queue, 1)
            (theirs,) = leased(other, foreign_queue, 1)
            answers = ok_batch(api, "start", [make(mine), make(theirs)])
            assert _answers(answers) == [(200, None), (404, "attempt_not_found")]
            answers = ok_batch(api, "complete", [make(theirs, result=1), make(mine, result=2)])
            assert _answers(answers) == [(404, "attempt_not_found"), (200, None)]
            assert other.task(theirs["task"]["id"])["status"] == "LEASED"
            assert other.ok(theirs, "start")["status"] == "RUNNING"
    finally:
        other.close()


# --- 1/2. What the one locking read reads (packed on MariaDB) is what the single call reads ----------------------


@pytest.mark.parametrize("seconds", [12.345678, 0.1, 3599.999999, 30.0])
def test_a_set_based_start_grants_the_lease_the_single_start_grants(api: Api, seconds: float) -> None:
    """The lease a start grants is its attempt's ``lease_seconds`` from the start's clock: the set-based start
    (the attempt read in the task's locking read, packed on MariaDB) and the single start grant the same length,
    for a lease of any length a worker may ask."""
    queue = api.queue()
    worker = 'w"\\ö\n😀' + "x" * 200
    for _ in range(3):
        api.submit(queue)
    # Leased for 30 s, then given the duration under test as a heartbeat with lease_seconds writes it: a start
    # computes its lease from it, and a lease of 0.1 s granted at the lease call could lapse before the start on
    # a loaded machine (seen in CI: 409 lease_lost).
    r = api.http["work"].post(f"/v1/namespaces/{api.ns}/queues/{queue}/leases",
                              json={"worker_id": worker, "max_tasks": 3, "lease_seconds": 30})  # fmt: skip
    assert r.status_code == 200, r.text
    single, *pair = r.json()
    with api.server.engine.begin() as conn:
        conn.execute(task_attempts.update()
                     .where(task_attempts.c.id.in_([g["attempt"]["id"] for g in (single, *pair)]))
                     .values(lease_seconds=seconds))  # fmt: skip
    one = api.ok(single, "start")
    two = ok_batch(api, "start", [_named(g) for g in pair])
    assert [t["status"] for t in two] == [200, 200]
    with api.server.engine.connect() as conn:
        rows = {
            row.id: row
            for row in conn.execute(
                sa.select(task_attempts.c.id, task_attempts.c.started_at, task_attempts.c.lease_expires_at,
                          task_attempts.c.lease_seconds)
                .where(task_attempts.c.id.in_([g["attempt"]["id"] for g in (single, *pair)]))
            )
        }  # fmt: skip
    lengths = {g["attempt"]["id"]: rows[g["attempt"]["id"]].lease_expires_at - rows[g["attempt"]["id"]].started_at
               for g in (single, *pair)}  # fmt: skip
    assert len(set(lengths.values())) == 1, lengths
    answered = [one["lease_expires_at"], *(t["attempt"]["lease_expires_at"] for t in two)]
    stored = [rows[g["attempt"]["id"]].lease_expires_at for g in (single, *pair)]
    assert [datetime.fromisoformat(a).replace(tzinfo=None) for a in answered] == stored
    actors = {
        e["actor"] for g in (single, *pair) for e in api.events(g["task"]["id"]) if e["event"] == "started"
    }
    assert actors == {f"worker:{worker}"}


# --- All of it at once: workers with short leases, the sweep, heartbeats, a subscription ------------------------


def test_workers_with_lapsing_leases_and_the_sweep_complete_each_task_at_most_once(api: Api) -> None:
    """Four workers lease, start and complete in named batches with leases short enough to lapse while they work,
    one heartbeats, and the sweep runs all along: every request is answered, a complete answered 200 is the
    task's one success with its result, every success has one result event and one delivery to a subscription
    made before, and no task ever had two live attempts."""
    import random

    from orbit_server.tasks.leases import expire_leases
    from orbit_server.tasks.result_events import RESULT_STATUSES

    queue = api.queue()
    sub = f"all-{uuid.uuid4().hex[:6]}"
    r = api.http["admin"].post(
        f"/v1/namespaces/{api.ns}/subscriptions", json={"name": sub, "queues": [queue]}
    )
    assert r.status_code == 201, r.text
    # retries at once: a retry-safe task whose running leases lapse is retried after an exponential backoff (1 s
    # doubling by default), so one that lapsed six times in a row waited 16-32 s more and outlived the test
    ids = [
        api.submit(queue, retry_safe=bool(n % 2), max_attempts=20, backoff_base_seconds=0.01,
                   backoff_cap_seconds=0.05)["id"]
        for n in range(24)
    ]  # fmt: skip
    stop = threading.Event()
    wins: list[tuple[str, str, Any]] = []  # (task, attempt, result) of each complete answered 200
    failures: list[str] = []
    headers = {"Authorization": f"Bearer {api.keys['work']}"}
    base = f"/v1/namespaces/{api.ns}"

    def worker(n: int) -> None:
        rng = random.Random(n)
        with httpx.Client(base_url=api.server.base_url, timeout=60, headers=headers) as http:
            while not stop.is_set():
                r = http.post(f"{base}/queues/{queue}/leases",
                              json={"worker_id": f"w{n}", "max_tasks": rng.choice([2, 3, 4]), "lease_seconds": 0.3})  # fmt: skip
                if r.status_code != 200:
                    failures.append(r.text)
                    return
                grants = r.json()
                if not grants:
                    if _all_done():
                        return
                    continue
                if rng.random() < 0.3:
                    stop.wait(0.35)  # a slow worker: its leases lapse before it starts
                r = http.post(f"{base}/attempts/start", json={"items": [_named(g) for g in grants]})
                if r.status_code != 200:
                    failures.append(r.text)
                    return
                started = [g for g, a in zip(grants, r.json()["items"], strict=True) if a["status"] == 200]
                if n == 0 and started:
                    http.post(
                        f"{base}/attempts/heartbeat",
                        json={"items": [item(g, lease_seconds=5) for g in started]},
                    )
                stop.wait(rng.choice([0, 0.05, 0.4]))
                body = [_named(g, result={"by": g["attempt"]["id"]}) for g in started]
                if not body:
                    continue
                r = http.post(f"{base}/attempts/complete", json={"items": body})
                if r.status_code != 200:
                    failures.append(r.text)
                    return
                for g, a in zip(started, r.json()["items"], strict=True):
                    if a["status"] == 200:
                        wins.append((g["task"]["id"], g["attempt"]["id"], {"by": g["attempt"]["id"]}))

    def _all_done() -> bool:
        with api.server.engine.connect() as conn:
            live = conn.scalar(sa.select(sa.func.count()).select_from(tasks).where(
                tasks.c.id.in_(ids), tasks.c.status.in_(["WAITING", "LEASED", "RUNNING"])))  # fmt: skip
        return live == 0

    def sweeper() -> None:
        while not stop.is_set():
            transact(api.server.engine, expire_leases)
            stop.wait(0.05)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)] + [
        threading.Thread(target=sweeper)
    ]
    for thread in threads:
        thread.start()
    try:
        _until(
            lambda: _all_done() or failures or not any(t.is_alive() for t in threads[:4]),
            "tasks left",
            timeout=40,
        )
    except AssertionError:
        with api.server.engine.connect() as conn:
            left = conn.execute(
                sa.select(
                    tasks.c.status, tasks.c.retry_safe, tasks.c.attempt_count, tasks.c.available_at
                ).where(tasks.c.id.in_(ids), tasks.c.status.in_(["WAITING", "LEASED", "RUNNING"]))
            ).all()
        raise AssertionError(f"tasks left: {left}") from None
    finally:  # the threads end with the test, also a failed one (its database is dropped after the module)
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    assert not failures, failures
    assert _all_done()
    check_attempt_history(api.server.engine, ids)
    by_task: dict[str, list[tuple[str, Any]]] = {}
    for task_id, attempt_id, result in wins:
        by_task.setdefault(task_id, []).append((attempt_id, result))
    with api.server.engine.connect() as conn:
        rows = {row.id: row for row in conn.execute(
            sa.select(tasks.c.id, tasks.c.status, tasks.c.result, tasks.c.current_attempt_id).where(tasks.c.id.in_(ids)))}  # fmt: skip
        events = dict(conn.execute(sa.select(result_events.c.task_id, sa.func.count())
                                   .where(result_events.c.task_id.in_(ids)).group_by(result_events.c.task_id)).all())  # fmt: skip
        delivered = dict(conn.execute(
            sa.select(result_events.c.task_id, sa.func.count())
            .join(event_deliveries, event_deliveries.c.event_id == result_events.c.id)
            .join(subscriptions, subscriptions.c.id == event_deliveries.c.subscription_id)
            .where(result_events.c.task_id.in_(ids), subscriptions.c.name == sub)
            .group_by(result_events.c.task_id)).all())  # fmt: skip
    assert any(row.status == "SUCCEEDED" for row in rows.values())
    for task_id, row in rows.items():
        if row.status == "SUCCEEDED":
            assert by_task.get(task_id) == [(row.current_attempt_id, row.result)], (
                task_id,
                by_task.get(task_id),
            )
        else:
            assert task_id not in by_task, (row, by_task[task_id])
        finished = TaskStatus(row.status) in RESULT_STATUSES
        assert events.get(task_id, 0) == (1 if finished else 0), (row, events.get(task_id))
        assert delivered.get(task_id, 0) == events.get(task_id, 0), (row, delivered.get(task_id))


# --- 6. Two items: a paused queue beside a running one; lease-and-start; one item with a wrong name -------------


def test_a_two_item_start_with_one_paused_queue_is_answered_as_the_single_starts(api: Api) -> None:
    paused, free = api.queue(), api.queue()
    singles = [leased(api, paused, 1)[0], leased(api, free, 1)[0]]
    pair = [leased(api, paused, 1)[0], leased(api, free, 1)[0]]
    r = api.http["admin"].post(f"/v1/namespaces/{api.ns}/queues/{paused}/pause", json={})
    assert r.status_code in (200, 204), r.text
    try:
        one = [api.call(g, "start") for g in singles]
        got = ok_batch(api, "start", [_named(g) for g in pair])
    finally:
        r = api.http["admin"].post(f"/v1/namespaces/{api.ns}/queues/{paused}/resume", json={})
        assert r.status_code in (200, 204), r.text
    assert [(a["status"], a["error"] and a["error"].get("queue_paused")) for a in got] == [
        (o.status_code, o.json().get("queue_paused") if o.status_code != 200 else None) for o in one
    ]
    assert got[0]["status"] == 409 and got[1]["status"] == 200
    assert [api.task(g["task"]["id"])["status"] for g in pair] == [
        api.task(g["task"]["id"])["status"] for g in singles
    ]


def test_two_lease_and_start_attempts_completed_set_based_are_confirmed(api: Api) -> None:
    queue = api.queue()
    for _ in range(2):
        api.submit(queue, retry_safe=True)
    r = api.http["work"].post(f"/v1/namespaces/{api.ns}/queues/{queue}/leases",
                              json={"worker_id": "w", "max_tasks": 2, "lease_seconds": 30, "start": True})  # fmt: skip
    grants = list(r.json())
    assert [g["task"]["status"] for g in grants] == ["RUNNING"] * 2
    done = ok_batch(api, "complete", [_named(g, result=n) for n, g in enumerate(grants)])
    assert [d["status"] for d in done] == [200, 200]
    with api.server.engine.connect() as conn:
        rows = conn.execute(
            sa.select(task_attempts.c.started_at, task_attempts.c.leased_at, task_attempts.c.status)
            .where(task_attempts.c.id.in_([g["attempt"]["id"] for g in grants]))
        ).all()  # fmt: skip
    assert len(rows) == 2 and all(r.started_at == r.leased_at and r.status == "SUCCEEDED" for r in rows), rows


def test_a_one_item_batch_naming_a_wrong_task_is_answered_as_without_it(api: Api) -> None:
    queue = api.queue()
    grant, bystander = leased(api, queue, 2)
    got = ok_batch(api, "start", [_named(grant, task_id=bystander["task"]["id"])])
    assert got[0]["status"] == 200 and got[0]["attempt"]["task_id"] == grant["task"]["id"]
    got = ok_batch(api, "complete", [_named(grant, task_id="no-such-task", result=1)])
    assert got[0]["status"] == 200 and api.task(grant["task"]["id"])["result"] == 1
    assert api.task(bystander["task"]["id"])["status"] == "LEASED"
