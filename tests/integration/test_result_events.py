"""Result events, subscriptions and deliveries against a real server, on SQLite and MariaDB.

DESIGN §4 "Result events", §6.2 of the reliability model (seed 001): the event is saved in the
transaction of the terminal transition, delivery is tracked per subscription, an unacked
delivery comes back after its lease, receivers dedupe by event id.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from orbit_client import OrbitClient, RetryPolicy, TaskStatus
from orbit_server.db.engine import db_now
from orbit_server.db.schema import event_deliveries, result_events, subscriptions, task_events, tasks
from orbit_server.db.transact import transact
from orbit_server.results import deliveries as results
from orbit_server.tasks import attempts, operations, transitions
from orbit_server.tasks.result_events import RESULT_STATUSES
from tests.conftest import DatabaseFactory
from tests.integration.conftest import BACKENDS
from tests.integration.test_execution_api import Api, _problem
from tests.servers import RunningServer, run_server

RESULT_STATES = {s.value for s in RESULT_STATUSES}


@pytest.fixture(scope="module", params=BACKENDS)
def rserver(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[RunningServer]:
    """A server whose expiry sweep runs every 0.2 s, so a short lease lapses into NEEDS_REVIEW quickly."""
    with run_server(make_database(request.param), sweep_interval_seconds=0.2) as running:
        yield running


@pytest.fixture
def api(rserver: RunningServer) -> Iterator[Api]:
    """A namespace of its own for each test, so namespace-wide subscriptions see only its tasks."""
    with Api.in_new_namespace(rserver) as helper:
        yield helper


def subscribe(api: Api, name: str, queues: list[str] | None = None, role: str = "admin") -> httpx.Response:
    return api.http[role].post(
        f"/v1/namespaces/{api.ns}/subscriptions", json={"name": name, "queues": queues}
    )


def lease_response(
    api: Api, sub: str, max: int = 100, lease_seconds: float = 30, role: str = "work"
) -> httpx.Response:
    return api.http[role].post(
        f"/v1/namespaces/{api.ns}/subscriptions/{sub}/deliveries/lease",
        json={"max": max, "lease_seconds": lease_seconds},
    )


def lease(api: Api, sub: str, max: int = 100, lease_seconds: float = 30) -> list[dict[str, Any]]:
    r = lease_response(api, sub, max, lease_seconds)
    assert r.status_code == 200, r.text
    return list(r.json())


def ack(api: Api, sub: str, delivery_id: str, role: str = "work") -> httpx.Response:
    return api.http[role].post(f"/v1/namespaces/{api.ns}/subscriptions/{sub}/deliveries/{delivery_id}/ack")


def cancelled(api: Api, queue: str, **params: Any) -> str:
    """A task that went WAITING → CANCELLED: the quickest result event."""
    task = api.submit(queue, params=params or None)
    r = api.admin(task["id"], "cancel", reason="test")
    assert r.status_code == 200 and r.json()["status"] == "CANCELLED", r.text
    return str(task["id"])


def stored_events(api: Api, task_id: str) -> list[dict[str, Any]]:
    with api.server.engine.connect() as conn:
        rows = conn.execute(
            sa.select(result_events)
            .where(result_events.c.task_id == task_id)
            .order_by(result_events.c.state_version)
        )
        return [dict(r) for r in rows.mappings()]


def client(api: Api, role: str = "work") -> OrbitClient:
    return OrbitClient(api.server.base_url, api_key=api.keys[role], retry=RetryPolicy.no_wait())


# ------------------------------------------------------------------- events


def test_every_result_transition_writes_one_event_and_no_other_does(api: Api) -> None:
    assert subscribe(api, "all").status_code == 201
    queue = api.queue()
    # RUNNING → SUCCEEDED
    done = api.running(queue)
    api.ok(done, "complete", result={"receipt": "R-1", "amount": 1999})
    # RUNNING → WAITING (retry scheduled, no event), then RUNNING → FAILED
    flaky = api.running(queue, max_attempts=2, backoff_base_seconds=0)
    api.ok(flaky, "fail", error={"type": "Timeout", "message": "slow", "retryable": True})
    again = api.lease_one(queue)
    api.ok(again, "start")
    api.ok(again, "fail", error={"type": "ValueError", "message": "bad input"})
    # WAITING → CANCELLED
    gone = cancelled(api, queue)
    # RUNNING → NEEDS_REVIEW (lease lapsed), a late report changes nothing, then NEEDS_REVIEW → SUCCEEDED
    lost = api.running(queue, lease_seconds=3)  # its start must arrive inside it, on a loaded machine too
    lost_id = lost["task"]["id"]
    api.wait_status(lost_id, "NEEDS_REVIEW")
    _problem(api.call(lost, "complete", result="late"), 409, "lease_lost")
    review = {"outcome": "succeeded", "reason": "receipt found", "evidence_ref": "RCPT-9", "result": {"r": 9}}
    assert api.admin(lost_id, "review", **review).status_code == 200

    expected = {
        done["task"]["id"]: [("SUCCEEDED", 4)],
        flaky["task"]["id"]: [("FAILED", 7)],
        gone: [("CANCELLED", 2)],
        lost_id: [("NEEDS_REVIEW", 4), ("SUCCEEDED", 5)],
    }
    for task_id, want in expected.items():
        events = stored_events(api, task_id)
        assert [(e["status"], e["state_version"]) for e in events] == want, task_id
        # Each is the transition recorded in task_events with the same version and time.
        moves = {(e["to_status"], e["state_version"]): e["created_at"] for e in api_events(api, task_id)}
        for event in events:
            assert moves[(event["status"], event["state_version"])] == event["occurred_at"]

    deliveries = lease(api, "all")
    by_task: dict[str, list[dict[str, Any]]] = {}
    for d in deliveries:
        assert d["subscription"] == "all" and d["delivery_count"] == 1
        by_task.setdefault(d["event"]["task_id"], []).append(d["event"])
    assert {t: [e["status"] for e in evs] for t, evs in by_task.items()} == {
        t: [s for s, _ in want] for t, want in expected.items()
    }
    (success,) = by_task[done["task"]["id"]]
    assert success["namespace"] == api.ns and success["queue"] == queue and success["handler"] == "h"
    assert success["result"] == {"receipt": "R-1", "amount": 1999} and success["error"] is None
    assert by_task[flaky["task"]["id"]][0]["error"]["type"] == "ValueError"
    needs_review, reviewed = by_task[lost_id]
    assert needs_review["error"]["type"] == "outcome_unknown" and reviewed["result"] == {"r": 9}
    assert len({e["id"] for evs in by_task.values() for e in evs}) == 5


def api_events(api: Api, task_id: str) -> list[dict[str, Any]]:
    with api.server.engine.connect() as conn:
        rows = conn.execute(
            sa.select(task_events).where(
                task_events.c.task_id == task_id, task_events.c.to_status.is_not(None)
            )
        )
        return [dict(r) for r in rows.mappings()]


def test_the_event_exists_only_if_its_transition_committed(api: Api) -> None:
    assert subscribe(api, "all").status_code == 201
    task = api.submit(api.queue())
    engine = api.server.engine

    def counts(conn: sa.Connection) -> tuple[int, int]:
        events = conn.scalar(
            sa.select(sa.func.count()).select_from(result_events).where(result_events.c.task_id == task["id"])
        )
        deliveries = conn.scalar(
            sa.select(sa.func.count())
            .select_from(event_deliveries.join(result_events))
            .where(result_events.c.task_id == task["id"])
        )
        return int(events or 0), int(deliveries or 0)

    with engine.connect() as conn:
        trans = conn.begin()
        row = dict(conn.execute(sa.select(tasks).where(tasks.c.id == task["id"])).mappings().one())
        transitions.apply_transition(conn, row, TaskStatus.CANCELLED, event="test", now=db_now(conn))
        assert counts(conn) == (1, 1)  # written by the transition, in its transaction
        trans.rollback()
    with engine.connect() as conn:
        assert counts(conn) == (0, 0)
    assert api.task(task["id"])["status"] == "WAITING"
    assert lease(api, "all") == []
    # A refused transition writes nothing either.
    api.admin(task["id"], "cancel", reason="now for real")
    _problem(
        api.admin(task["id"], "review", outcome="failed", reason="r", evidence_ref="e"),
        409,
        "invalid_transition",
    )
    with engine.connect() as conn:
        assert counts(conn) == (1, 1)


# ----------------------------------------------------------------- fan-out


def test_fan_out_to_two_subscriptions_and_the_queue_filter(api: Api) -> None:
    q1, q2 = api.queue(), api.queue()
    for name, queues in [("first", None), ("second", None), ("only-q1", [q1])]:
        assert subscribe(api, name, queues).status_code == 201
    in_q1, in_q2 = cancelled(api, q1), cancelled(api, q2)
    first, second, only_q1 = lease(api, "first"), lease(api, "second"), lease(api, "only-q1")
    assert sorted(d["event"]["task_id"] for d in first) == sorted([in_q1, in_q2])
    # The same events (same ids) reach both subscriptions, as deliveries of their own.
    assert {d["event"]["id"] for d in first} == {d["event"]["id"] for d in second}
    assert not {d["id"] for d in first} & {d["id"] for d in second}
    assert [(d["event"]["task_id"], d["event"]["queue"], d["subscription"]) for d in only_q1] == [
        (in_q1, q1, "only-q1")
    ]
    # Acking in one subscription leaves the others' deliveries alone.
    for d in first:
        assert ack(api, "first", d["id"]).status_code == 200
    with api.server.engine.connect() as conn:
        states = Counter(
            conn.execute(
                sa.select(subscriptions.c.name, event_deliveries.c.state)
                .join(subscriptions)
                .where(subscriptions.c.name.in_(["first", "second", "only-q1"]))
                .where(event_deliveries.c.event_id.in_([d["event"]["id"] for d in first]))
            ).all()
        )
    assert states == {("first", "ACKED"): 2, ("second", "PENDING"): 2, ("only-q1", "PENDING"): 1}


def test_an_event_names_the_idempotency_key_that_created_its_task(api: Api) -> None:
    """An outbox row knows its task by its key; the event carries it, so no task id lookup is needed."""
    queue = api.queue()
    assert subscribe(api, "by-key").status_code == 201
    key = f"order-{uuid.uuid4()}:fulfil"
    r = api.http["submit"].post(
        f"/v1/namespaces/{api.ns}/tasks",
        json={"queue": queue, "handler": "h", "params": None},
        headers={"Idempotency-Key": key},
    )
    assert r.status_code == 201, r.text
    assert api.admin(r.json()["id"], "cancel", reason="test").status_code == 200
    [delivery] = lease(api, "by-key")
    assert delivery["event"]["task_id"] == r.json()["id"]
    assert delivery["event"]["idempotency_key"] == key


def test_events_before_the_subscription_existed_are_not_delivered(api: Api) -> None:
    queue = api.queue()
    before = cancelled(api, queue)
    running = api.running(queue)  # started before the subscription, finishes after it
    assert subscribe(api, "late").status_code == 201
    after = cancelled(api, queue)
    api.ok(running, "complete", result=1)
    assert sorted(d["event"]["task_id"] for d in lease(api, "late")) == sorted([after, running["task"]["id"]])
    assert before not in {d["event"]["task_id"] for d in lease(api, "late", lease_seconds=0.1)}


def test_subscription_created_during_transitions_gets_exactly_the_later_events(api: Api) -> None:
    """Create subscriptions while threads settle tasks: each gets the events with occurred_at >= created_at.

    This is the race the namespace lock of :mod:`orbit_server.results.deliveries` closes: an event whose
    transaction read the subscriptions just before a new one committed must be older than it.
    """
    engine = api.server.engine
    with engine.connect() as conn:
        ns_id = int(conn.scalar(sa.text("SELECT id FROM namespaces WHERE name = :n"), {"n": api.ns}))
    queue = api.queue()
    ids = [api.submit(queue)["id"] for _ in range(48)]
    chunks = [ids[i::4] for i in range(4)]
    names = [f"race-{i}" for i in range(4)]

    def settle(chunk: list[str]) -> None:
        for task_id in chunk:
            transact(engine, operations.cancel_task, ns_id, task_id, reason="race", actor="t")

    def create() -> None:
        for name in names:
            time.sleep(random.uniform(0.005, 0.05))
            transact(engine, results.create_subscription, ns_id, api.ns, name, None)

    threads = [threading.Thread(target=settle, args=(c,)) for c in chunks] + [threading.Thread(target=create)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    with engine.connect() as conn:
        events = conn.execute(
            sa.select(result_events.c.id, result_events.c.occurred_at).where(result_events.c.task_id.in_(ids))
        ).all()
        assert len(events) == len(ids)
        subs = conn.execute(
            sa.select(subscriptions.c.id, subscriptions.c.created_at).where(subscriptions.c.name.in_(names))
        ).all()
        for sub_id, created_at in subs:
            delivered = set(
                conn.execute(
                    sa.select(event_deliveries.c.event_id).where(event_deliveries.c.subscription_id == sub_id)
                ).scalars()
            )
            assert delivered == {e for e, occurred_at in events if occurred_at >= created_at}
    assert len(subs) == 4


def test_a_transition_during_a_subscription_creation_waits_for_it_and_delivers_to_it(api: Api) -> None:
    """The edge of that race, made deterministic: a subscription is created but not yet committed
    when a transition reads the clock (so the event is newer); the transition must wait and deliver."""
    engine = api.server.engine
    with engine.connect() as conn:
        ns_id = int(conn.scalar(sa.text("SELECT id FROM namespaces WHERE name = :n"), {"n": api.ns}))
    task_id = api.submit(api.queue())["id"]
    seen: dict[str, Any] = {}

    def transition() -> None:
        with engine.connect() as conn, conn.begin():
            seen["now"] = now = db_now(conn)
            row = dict(conn.execute(sa.select(tasks).where(tasks.c.id == task_id)).mappings().one())
            transitions.apply_transition(conn, row, TaskStatus.CANCELLED, event="test", now=now)

    with engine.connect() as conn:
        trans = conn.begin()
        subscription, created = results.create_subscription(conn, ns_id, api.ns, "in-flight", None)
        assert created
        worker = threading.Thread(target=transition)
        worker.start()
        time.sleep(0.3)  # the transition reads the clock now (MariaDB) or waits to begin (SQLite)
        assert worker.is_alive(), "the transition did not wait for the subscription being created"
        trans.commit()
    worker.join(timeout=30)
    assert seen["now"] >= subscription.created_at.replace(tzinfo=None)
    (delivery,) = lease(api, "in-flight")
    assert delivery["event"]["task_id"] == task_id


def _waiting_for(probe: sa.Engine, holder: int) -> int:
    """How many transactions wait for a lock that the session ``holder`` (its connection id on MariaDB, its
    backend pid on PostgreSQL) holds, seen through ``probe``: an engine of its own, so that probing takes
    no connection from the server's pool."""
    with probe.connect() as conn:
        if probe.dialect.name == "postgresql":
            query = "SELECT count(*) FROM pg_stat_activity WHERE %(holder)s = ANY(pg_blocking_pids(pid))"
        else:
            query = (
                "SELECT count(*) FROM information_schema.INNODB_LOCK_WAITS w JOIN information_schema.INNODB_TRX t"
                " ON t.trx_id = w.blocking_trx_id WHERE t.trx_mysql_thread_id = %(holder)s"
            )
        return int(conn.exec_driver_sql(query, {"holder": holder}).scalar_one())


def _until(condition: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize("first", ["subscription", "complete"])
def test_a_complete_and_a_subscription_creation_in_either_order(api: Api, first: str) -> None:
    """A worker's ``complete`` takes the result event's shared locks in its first statement (MariaDB): a
    subscription being created (uncommitted) makes it wait, and then the event is delivered to it; a
    complete holding them makes the creation wait, and the subscription is then newer than the event."""
    engine = api.server.engine
    if engine.dialect.name == "sqlite":
        pytest.skip("SQLite has one writer: the second transaction waits to begin")

    with engine.connect() as conn:
        ns_id = int(conn.scalar(sa.text("SELECT id FROM namespaces WHERE name = :n"), {"n": api.ns}))
    grant = api.running(api.queue())
    attempt_id, token = grant["attempt"]["id"], grant["attempt"]["lease_token"]
    probe = sa.create_engine(engine.url, poolclass=sa.NullPool)
    with engine.connect() as conn:
        trans = conn.begin()
        postgres = engine.dialect.name == "postgresql"
        holder = int(
            conn.exec_driver_sql(
                "SELECT pg_backend_pid()" if postgres else "SELECT CONNECTION_ID()"
            ).scalar_one()
        )
        if first == "subscription":
            subscription, created = results.create_subscription(conn, ns_id, api.ns, "in-flight", None)
            other = threading.Thread(
                target=transact, args=(engine, attempts.complete_attempt, ns_id, attempt_id, token, 1)
            )
        else:
            attempts.complete_attempt(conn, ns_id, attempt_id, token, 1)
            made: list[Any] = []
            other = threading.Thread(
                target=lambda: made.append(
                    transact(engine, results.create_subscription, ns_id, api.ns, "in-flight", None)
                )
            )
        other.start()
        _until(lambda: _waiting_for(probe, holder) > 0, f"the {first} did not make the other wait")
        assert other.is_alive()
        trans.commit()
    other.join(timeout=30)
    probe.dispose()
    assert api.task(grant["task"]["id"])["status"] == "SUCCEEDED"
    with engine.connect() as conn:
        occurred_at = conn.execute(
            sa.select(result_events.c.occurred_at).where(result_events.c.task_id == grant["task"]["id"])
        ).scalar_one()
    if first == "subscription":
        assert occurred_at >= subscription.created_at.replace(tzinfo=None)
        (delivery,) = lease(api, "in-flight")
        assert delivery["event"]["task_id"] == grant["task"]["id"]
    else:
        ((subscription, created),) = made
        assert created and subscription.created_at.replace(tzinfo=None) > occurred_at
        assert lease(api, "in-flight") == []


def test_a_complete_waiting_for_a_subscription_creation_holds_up_no_other_transition(api: Api) -> None:
    """While a ``complete`` waits for the namespace's lock (a subscription being created), another task's
    transition writes its task event at once. (On MariaDB the complete's first statement is an
    ``INSERT ... SELECT``: into ``task_events``, whose ``AUTO_INCREMENT`` key an ``INSERT ... SELECT`` locks for
    the whole table until the statement ends under ``innodb_autoinc_lock_mode`` 1, every task event of the
    server would have waited with it; it writes ``result_events``, which has none.)"""
    engine = api.server.engine
    if engine.dialect.name == "sqlite":
        pytest.skip("SQLite has one writer: the second transaction waits to begin")
    with engine.connect() as conn:
        ns_id = int(conn.scalar(sa.text("SELECT id FROM namespaces WHERE name = :n"), {"n": api.ns}))
    grant = api.running(api.queue())
    queue = api.queue()
    api.submit(queue)
    other = api.lease_one(queue)
    probe = sa.create_engine(engine.url, poolclass=sa.NullPool)
    started: list[Any] = []
    with engine.connect() as conn:
        trans = conn.begin()
        postgres = engine.dialect.name == "postgresql"
        holder = int(
            conn.exec_driver_sql(
                "SELECT pg_backend_pid()" if postgres else "SELECT CONNECTION_ID()"
            ).scalar_one()
        )
        results.create_subscription(conn, ns_id, api.ns, "held", None)
        completing = threading.Thread(
            target=transact,
            args=(
                engine,
                attempts.complete_attempt,
                ns_id,
                grant["attempt"]["id"],
                grant["attempt"]["lease_token"],
                1,
            ),
        )
        completing.start()
        _until(lambda: _waiting_for(probe, holder) > 0, "the complete did not wait for the subscription")
        starting = threading.Thread(
            target=lambda: started.append(
                transact(
                    engine,
                    attempts.start_attempt,
                    ns_id,
                    other["attempt"]["id"],
                    other["attempt"]["lease_token"],
                )
            )
        )
        starting.start()
        starting.join(timeout=15)
        waited = starting.is_alive()
        assert completing.is_alive()
        trans.commit()
    completing.join(timeout=30)
    starting.join(timeout=60)
    probe.dispose()
    assert not waited, "a start waited for a complete that waited for the namespace's lock"
    assert started and started[0].status.value == "RUNNING"
    assert api.task(grant["task"]["id"])["status"] == "SUCCEEDED"
    (delivery,) = lease(api, "held")  # created before the complete's statement read the subscriptions
    assert delivery["event"]["task_id"] == grant["task"]["id"]


# -------------------------------------------------------------- deliveries


def test_an_unacked_delivery_comes_back_after_its_lease_and_ack_is_idempotent(api: Api) -> None:
    admin = client(api, "admin")
    created = admin.create_subscription(api.ns, "redeliver")
    assert created.name == "redeliver" and created.queues is None and created.namespace == api.ns
    assert admin.get_subscription(api.ns, "redeliver") == created
    task_id = cancelled(api, api.queue())
    with client(api) as orbit:
        # 3 s: the lease must still run at the second lease call (0.5 s could pass on a loaded machine).
        (first,) = orbit.lease_deliveries(api.ns, "redeliver", lease_seconds=3)
        assert first.delivery_count == 1 and first.event.task_id == task_id
        assert first.event.status is TaskStatus.CANCELLED and first.event.occurred_at >= created.created_at
        assert first.lease_expires_at > first.event.occurred_at
        assert orbit.lease_deliveries(api.ns, "redeliver") == []  # still leased
        # The lease lapses (database clock) without an ack: the delivery comes back.
        deadline = time.monotonic() + 20
        while not (again := orbit.lease_deliveries(api.ns, "redeliver", lease_seconds=0.2)):
            assert time.monotonic() < deadline, "the unacked delivery never came back"
            time.sleep(0.05)
        (second,) = again
        assert (second.id, second.event) == (first.id, first.event)
        assert second.delivery_count == 2 and second.lease_expires_at > first.lease_expires_at
        assert orbit.ack_delivery(api.ns, "redeliver", second.id) is None
        assert orbit.ack_delivery(api.ns, "redeliver", second.id) is None
        time.sleep(0.3)  # past the lease: an acked delivery never comes back
        assert orbit.lease_deliveries(api.ns, "redeliver") == []
    # Over HTTP: both acks answer 200 with the first ack's time.
    once, twice = ack(api, "redeliver", first.id), ack(api, "redeliver", first.id)
    assert once.status_code == twice.status_code == 200 and once.json() == twice.json()
    assert once.json()["id"] == first.id and once.json()["subscription"] == "redeliver"
    admin.close()


def test_lease_hands_out_at_most_max_oldest_first(api: Api) -> None:
    assert subscribe(api, "batch").status_code == 201
    queue = api.queue()
    ids = [cancelled(api, queue, i=i) for i in range(5)]
    first = lease(api, "batch", max=3)
    rest = lease(api, "batch", max=3)
    assert [d["event"]["task_id"] for d in first + rest] == ids
    _problem(lease_response(api, "batch", max=0), 422, "validation_error")
    _problem(lease_response(api, "batch", max=501), 422, "validation_error")


def test_unknown_deliveries_and_subscriptions_are_404(api: Api) -> None:
    assert subscribe(api, "a").status_code == 201
    assert subscribe(api, "b").status_code == 201
    cancelled(api, api.queue())
    (delivery,) = lease(api, "a")
    _problem(ack(api, "b", delivery["id"]), 404, "delivery_not_found")  # another subscription's
    for bad in ("999999999", "0" + delivery["id"], "abc", "99999999999999999999999"):
        _problem(ack(api, "a", bad), 404, "delivery_not_found")
    _problem(ack(api, "nope", delivery["id"]), 404, "subscription_not_found")
    _problem(lease_response(api, "nope"), 404, "subscription_not_found")
    _problem(
        api.http["read"].get(f"/v1/namespaces/{api.ns}/subscriptions/nope"), 404, "subscription_not_found"
    )
    assert ack(api, "a", delivery["id"]).status_code == 200


def test_concurrent_lessees_never_hold_the_same_delivery(api: Api) -> None:
    assert subscribe(api, "shared").status_code == 201
    queue = api.queue()
    ids = {cancelled(api, queue) for _ in range(40)}
    got: list[list[dict[str, Any]]] = []
    barrier = threading.Barrier(8)

    def consume() -> None:
        mine: list[dict[str, Any]] = []
        with httpx.Client(
            base_url=api.server.base_url, headers={"Authorization": f"Bearer {api.keys['work']}"}, timeout=30
        ) as http:
            barrier.wait()
            while True:
                r = http.post(
                    f"/v1/namespaces/{api.ns}/subscriptions/shared/deliveries/lease",
                    json={"max": 3, "lease_seconds": 60},
                )
                assert r.status_code == 200, r.text
                if not r.json():
                    break
                mine += r.json()
        got.append(mine)

    threads = [threading.Thread(target=consume) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    handed = [d for mine in got for d in mine]
    assert len(got) == 8
    assert len(handed) == len({d["id"] for d in handed}) == 40, "a leased delivery was handed out twice"
    assert {d["event"]["task_id"] for d in handed} == ids
    assert {d["delivery_count"] for d in handed} == {1}


# ------------------------------------------------------- subscriptions, roles


def test_create_subscription_is_idempotent_per_queue_set(api: Api) -> None:
    q1, q2 = api.queue(), api.queue()
    first = subscribe(api, "orders", [q2, q1, q1])
    assert first.status_code == 201, first.text
    body = first.json()
    assert body["queues"] == sorted([q1, q2]) and body["namespace"] == api.ns
    assert first.headers["location"] == f"/v1/namespaces/{api.ns}/subscriptions/orders"
    same = subscribe(api, "orders", [q1, q2])
    assert same.status_code == 200 and same.json() == body
    _problem(subscribe(api, "orders", [q1]), 409, "subscription_exists")
    _problem(subscribe(api, "orders", None), 409, "subscription_exists")
    _problem(subscribe(api, "other", [q1, "no-such-queue"]), 404, "queue_not_found")
    _problem(subscribe(api, "bad name"), 422, "validation_error")
    _problem(subscribe(api, "empty", []), 422, "validation_error")
    got = api.http["read"].get(f"/v1/namespaces/{api.ns}/subscriptions/orders")
    assert got.status_code == 200 and got.json() == body
    everything = subscribe(api, "everything")
    assert everything.status_code == 201 and everything.json()["queues"] is None
    assert subscribe(api, "everything").status_code == 200


def test_roles_and_other_namespaces(api: Api, rserver: RunningServer) -> None:
    for role in ("read", "submit", "work"):
        _problem(subscribe(api, "roles", role=role), 403, "forbidden")
    assert subscribe(api, "roles").status_code == 201
    for role in ("read", "submit", "work", "admin"):
        assert api.http[role].get(f"/v1/namespaces/{api.ns}/subscriptions/roles").status_code == 200
    cancelled(api, api.queue())
    cancelled(api, api.queue())
    for role in ("read", "submit"):
        _problem(lease_response(api, "roles", role=role), 403, "forbidden")
    first = lease_response(api, "roles", max=1, role="work")
    second = lease_response(api, "roles", max=1, role="admin")
    assert first.status_code == second.status_code == 200
    for role in ("read", "submit"):
        _problem(ack(api, "roles", first.json()[0]["id"], role=role), 403, "forbidden")
    assert ack(api, "roles", first.json()[0]["id"], role="work").status_code == 200
    assert ack(api, "roles", second.json()[0]["id"], role="admin").status_code == 200
    with httpx.Client(base_url=rserver.base_url) as anonymous:
        _problem(anonymous.get(f"/v1/namespaces/{api.ns}/subscriptions/roles"), 401, "unauthenticated")

    other = f"ns-{uuid.uuid4().hex[:8]}"
    keys = rserver.add_namespace(other)
    with httpx.Client(
        base_url=rserver.base_url, headers={"Authorization": f"Bearer {keys['admin']}"}
    ) as http:
        mine = f"/v1/namespaces/{api.ns}/subscriptions"
        _problem(http.get(f"{mine}/roles"), 404, "namespace_not_found")
        _problem(http.post(mine, json={"name": "x"}), 404, "namespace_not_found")
        _problem(http.post(f"{mine}/roles/deliveries/lease", json={}), 404, "namespace_not_found")
        _problem(
            http.post(f"{mine}/roles/deliveries/{first.json()[0]['id']}/ack"), 404, "namespace_not_found"
        )
        theirs = f"/v1/namespaces/{other}/subscriptions"
        _problem(http.get(f"{theirs}/roles"), 404, "subscription_not_found")
        _problem(http.post(f"{theirs}/roles/deliveries/lease", json={}), 404, "subscription_not_found")
        # Their subscription of the same name sees none of our events, and cannot ack our deliveries.
        assert http.post(theirs, json={"name": "roles"}).status_code == 201
        assert http.post(f"{theirs}/roles/deliveries/lease", json={}).json() == []
        _problem(
            http.post(f"{theirs}/roles/deliveries/{first.json()[0]['id']}/ack"), 404, "delivery_not_found"
        )


# ------------------------------------------------------------- the invariant


def test_every_result_transition_recorded_has_exactly_one_event(rserver: RunningServer) -> None:
    """Whatever ran before on this database, events and result transitions match one to one."""
    with rserver.engine.connect() as conn:
        moves = set(
            conn.execute(
                sa.select(task_events.c.task_id, task_events.c.state_version, task_events.c.to_status).where(
                    task_events.c.to_status.in_(RESULT_STATES)
                )
            ).all()
        )
        events = conn.execute(
            sa.select(result_events.c.task_id, result_events.c.state_version, result_events.c.status)
        ).all()
    assert moves and len(events) == len(set(events))
    assert set(events) == moves


def test_a_retried_tasks_events_carry_retry_of_and_the_key_of_the_chains_first_task(api: Api) -> None:
    """Regression (issue 9): a manual retry's result event had ``idempotency_key: null`` and no
    ``retry_of``, so a receiver could not find its business record. The chain root's key rides along,
    through the single transition (cancel, complete) and the batched complete."""
    queue = api.queue()
    assert subscribe(api, "chain").status_code == 201
    key = f"order-{uuid.uuid4()}:fulfil"
    r = api.http["submit"].post(f"/v1/namespaces/{api.ns}/tasks", json={"queue": queue, "handler": "h",
                                "params": {"order": 1}}, headers={"Idempotency-Key": key})  # fmt: skip
    assert r.status_code == 201, r.text
    first = r.json()["id"]
    assert api.admin(first, "cancel", reason="test").status_code == 200
    second = api.admin(first, "retry", reason="again").json()["id"]
    assert api.admin(second, "cancel", reason="test").status_code == 200  # single path: apply_transition
    third = api.admin(second, "retry", reason="and again").json()["id"]
    grant = api.lease_one(queue)
    assert grant["task"]["id"] == third
    api.ok(grant, "start")
    attempt = grant["attempt"]
    response = api.http["work"].post(f"/v1/namespaces/{api.ns}/attempts/complete", json={"items": [
        {"attempt_id": attempt["id"], "lease_token": attempt["lease_token"], "result": {"ok": True}}]})  # fmt: skip
    assert response.status_code == 200 and response.json()["items"][0]["status"] == 200, response.text
    events = [d["event"] for d in lease(api, "chain")]
    assert [(e["task_id"], e["status"], e["retry_of"], e["idempotency_key"]) for e in events] == [
        (first, "CANCELLED", None, key),
        (second, "CANCELLED", first, key),
        (third, "SUCCEEDED", second, key),
    ]
