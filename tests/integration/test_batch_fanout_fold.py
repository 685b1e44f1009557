"""A set-based ``complete`` batch's result-event fan-out against a subscription being created and transactions
holding one of the batch's tasks: exactly one delivery per event and matching subscription that existed when the
event was written; no deadlock, no retried transaction. A batch takes the fan-out's shared locks (namespace,
queues) only once it holds every one of its tasks: folded into the statement that locks them (a subquery per row,
4b73b72), they were held while the later tasks' locks were waited for, a three-way deadlock with a subscription's
creation queued on the namespace and the holder of such a task asking for the same shared lock (the first test)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import sqlalchemy as sa

from orbit_server.db.schema import event_deliveries, result_events, subscriptions
from orbit_server.db.transact import transact
from orbit_server.results import deliveries as results
from orbit_server.tasks import attempt_sets
from tests.integration.test_attempt_batches import leased, ok_batch, quiet_server  # noqa: F401
from tests.integration.test_batch_lock_races import (
    _lock_task,
    _named,
    _ns_id,
    _occurred,
    _session_id,
    _waited,
)
from tests.integration.test_execution_api import Api
from tests.integration.test_flows_break import _lock_waits
from tests.integration.test_result_events import _until
from tests.servers import RunningServer


@pytest.fixture(scope="module")
def api(quiet_server: RunningServer) -> Iterator[Api]:  # noqa: F811
    with Api.in_new_namespace(quiet_server) as helper:
        if quiet_server.engine.dialect.name == "mysql":
            # attempts enough that MariaDB reads a batch's attempts by key, each after its task (as in
            # production), not all tasks first then the attempts through a join buffer (its plan for a few rows)
            leased(helper, helper.queue(), 40)
            with quiet_server.engine.connect() as conn:
                conn.exec_driver_sql("ANALYZE TABLE tasks, task_attempts").all()
        yield helper


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many times each transaction's work began (a retry after a deadlock begins it again): ``complete_all``
    (the server runs in this process) and the test's own subscription creations."""
    seen = {"complete_all": 0, "create_subscription": 0}
    original = attempt_sets.complete_all

    def counted(*args: Any, **kwargs: Any) -> Any:
        seen["complete_all"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(attempt_sets, "complete_all", counted)
    return seen


def _row_locks(api: Api) -> None:
    if api.server.engine.dialect.name == "sqlite":
        pytest.skip("SQLite has one writer at a time: no transaction waits inside a statement for a row")


def _running(api: Api, queues: list[str], per_queue: int) -> list[dict[str, Any]]:
    """Running attempts, in the order the batch locks their tasks (by task id)."""
    grants = [g for q in queues for g in leased(api, q, per_queue)]
    ok_batch(api, "start", [_named(g) for g in grants])
    return sorted(grants, key=lambda g: g["task"]["id"])


def _share_namespace(conn: sa.Connection, ns_id: int) -> None:
    """The namespace's shared lock, as every other terminal transition's fan-out takes it after its task's lock
    (a single complete or fail, a cancel, a review, the expiry sweep, a flow's cancel)."""
    share = "FOR SHARE" if conn.dialect.name == "postgresql" else "LOCK IN SHARE MODE"
    conn.exec_driver_sql(f"SELECT id FROM namespaces WHERE id = {int(ns_id)} {share}").all()


def _create(api: Api, calls: dict[str, int], name: str, queues: list[str] | None) -> Callable[[], Any]:
    ns_id = _ns_id(api)

    def work(conn: sa.Connection) -> Any:
        calls["create_subscription"] += 1
        return results.create_subscription(conn, ns_id, api.ns, name, queues)

    return lambda: transact(api.server.engine, work)


def _fan_out(api: Api, task_ids: list[str]) -> dict[str, list[tuple[str, int]]]:
    """Per task: its result events' ``(subscription name, deliveries)``; and the check that each event went to
    exactly the namespace's subscriptions matching its queue and created at or before it, once each."""
    with api.server.engine.connect() as conn:
        events = conn.execute(
            sa.select(result_events.c.id, result_events.c.task_id, result_events.c.occurred_at,
                      result_events.c.queue_id)
            .where(result_events.c.task_id.in_(task_ids))
        ).all()  # fmt: skip
        subs = conn.execute(
            sa.select(subscriptions.c.id, subscriptions.c.name, subscriptions.c.queues, subscriptions.c.created_at)
            .where(subscriptions.c.namespace_id == _ns_id(api))
        ).all()  # fmt: skip
        queue_names = dict(conn.execute(sa.text("SELECT id, name FROM queues")).all())
        delivered = conn.execute(
            sa.select(event_deliveries.c.event_id, event_deliveries.c.subscription_id, sa.func.count())
            .where(event_deliveries.c.event_id.in_([e.id for e in events]))
            .group_by(event_deliveries.c.event_id, event_deliveries.c.subscription_id)
        ).all()  # fmt: skip
    assert sorted(e.task_id for e in events) == sorted(task_ids), "one result event per task"
    counts = {(event_id, sub_id): n for event_id, sub_id, n in delivered}
    out: dict[str, list[tuple[str, int]]] = {}
    for event in events:
        expected = {
            s.id for s in subs
            if s.created_at <= event.occurred_at and (s.queues is None or queue_names[event.queue_id] in s.queues)
        }  # fmt: skip
        got = {sub_id: n for (event_id, sub_id), n in counts.items() if event_id == event.id}
        assert got == dict.fromkeys(expected, 1), (event.task_id, got, expected)
        out[event.task_id] = sorted((s.name, got.get(s.id, 0)) for s in subs)
    return out


def _complete(api: Api, grants: list[dict[str, Any]]) -> Callable[[], list[dict[str, Any]]]:
    return lambda: ok_batch(api, "complete", [_named(g, result=i) for i, g in enumerate(grants)])


def _wait_until_blocked(api: Api, probe: sa.Engine, session: int, future: Future[Any], what: str) -> None:
    _until(lambda: future.done() or _waited(api, probe, session), f"{what} never waited")
    assert not future.done(), f"{what} did not wait: {future.result()}"


@contextlib.contextmanager
def _batch_waiting_then_creation(
    api: Api, grants: list[dict[str, Any]], calls: dict[str, int], name: str, queues: list[str] | None
) -> Iterator[tuple[sa.Connection, sa.RootTransaction, Future[Any], Future[Any]]]:
    """A transaction holds the batch's last task (``holder``, its transaction ``held``); the batch is sent and
    waits for it; then a subscription ``name`` is created: it waits (for a lock) or is done. Yields ``(holder,
    held, the batch's answer, the creation's answer)``; the caller ends ``held``."""
    probe = sa.create_engine(api.server.engine.url, poolclass=sa.NullPool)
    calls["complete_all"] = 0
    try:
        with api.server.engine.connect() as holder, ThreadPoolExecutor(max_workers=2) as pool:
            held = holder.begin()
            session = _session_id(holder)
            _lock_task(holder, grants[-1]["task"]["id"])
            sent = pool.submit(_complete(api, grants))
            _wait_until_blocked(api, probe, session, sent, "the batch")
            creating = pool.submit(_create(api, calls, name, queues))
            _until(
                lambda: creating.done() or _lock_waits(probe, reads_only=False) >= 2,
                "the creation neither waited nor ended",
            )
            yield holder, held, sent, creating
    finally:
        probe.dispose()


def test_a_batch_waiting_for_a_task_lock_then_a_creation_then_the_holder_s_fan_out_do_not_deadlock(
    api: Api, calls: dict[str, int]
) -> None:
    """A transaction holds the lock of the batch's second task (a cancel, a fail, the sweep, a single complete of
    it: each then takes the namespace's shared lock for its result event). The batch waits for it; a subscription
    is then being created (the namespace's exclusive lock); then the holder takes the namespace's shared lock.

    With the fan-out's shared locks taken after all of the batch's task locks, the batch holds none of them while it
    waits: the creation goes ahead, the holder's shared lock waits for it at most. Folded into the per-row subquery
    of the locking statement (MySQL/MariaDB, 4b73b72), the batch holds the namespace's shared lock (taken with the
    first task's) while it waits for the second task: the creation waits for the batch, the holder's shared lock
    queues behind the waiting exclusive one (InnoDB grants no lock ahead of a waiting conflicting one), and the
    batch waits for the holder: a deadlock, one of the three rolled back."""
    _row_locks(api)
    queue = api.queue()
    grants = _running(api, [queue], 3)
    ids = [g["task"]["id"] for g in grants]
    ns_id = _ns_id(api)
    name = f"mid-{uuid.uuid4().hex[:6]}"
    holder_error: BaseException | None = None
    # the creation either waits (for the batch's shared lock, when the batch holds one) or is done
    with _batch_waiting_then_creation(api, grants, calls, name, None) as (holder, held, sent, creating):
        try:
            _share_namespace(holder, ns_id)
        except sa.exc.OperationalError as exc:  # the holder chosen as the deadlock's victim
            holder_error = exc
            held.rollback()
        else:
            held.commit()
        answers = sent.result(timeout=60)
        subscription, created = creating.result(timeout=60)
    assert holder_error is None, f"the holder's shared lock met a deadlock: {holder_error}"
    assert calls == {"complete_all": 1, "create_subscription": 1}, f"a transaction was retried: {calls}"
    assert [a["status"] for a in answers] == [200] * 3, answers
    assert created
    fanned = _fan_out(api, ids)
    assert all(dict(per)[name] == 0 for per in fanned.values()), fanned  # created after the events
    assert all(subscription.created_at.replace(tzinfo=None) > at for at in _occurred(api, ids))


def _over_two_queues(api: Api) -> tuple[list[dict[str, Any]], list[str], str, str]:
    """Four running tasks over two new queues: their grants, their ids, the first task's queue (locked first) and
    the other queue."""
    _row_locks(api)
    q1, q2 = api.queue(), api.queue()
    grants = _running(api, [q1, q2], 2)
    first_queue = grants[0]["task"]["queue"]
    return grants, [g["task"]["id"] for g in grants], first_queue, q2 if first_queue == q1 else q1


@pytest.mark.parametrize("queues", ["all", "first", "second"])
def test_a_creation_while_a_complete_batch_waits_for_its_second_task(
    api: Api, calls: dict[str, int], queues: str
) -> None:
    """The batch (over two queues) waits for its second task's lock, held by a transaction that takes no fan-out
    lock (a heartbeat); a subscription is created meanwhile. It is newer than the batch's events (their time is
    the locking statement's, read before the creation): it gets none of them, and every older matching
    subscription gets each of its events once. No deadlock, nothing retried."""
    grants, ids, first_queue, second_queue = _over_two_queues(api)
    old = f"old-{uuid.uuid4().hex[:6]}"
    assert api.http["admin"].post(f"/v1/namespaces/{api.ns}/subscriptions",
                                  json={"name": old, "queues": [first_queue, second_queue]}).status_code == 201  # fmt: skip
    wanted = {"all": None, "first": [first_queue], "second": [second_queue]}[queues]
    name = f"new-{uuid.uuid4().hex[:6]}"
    with _batch_waiting_then_creation(api, grants, calls, name, wanted) as (_, held, sent, creating):
        held.commit()
        answers = sent.result(timeout=60)
        subscription, created = creating.result(timeout=60)
    assert calls == {"complete_all": 1, "create_subscription": 1}, f"a transaction was retried: {calls}"
    assert [a["status"] for a in answers] == [200] * 4, answers
    assert created
    fanned = _fan_out(api, ids)
    assert all(dict(per)[old] == 1 and dict(per)[name] == 0 for per in fanned.values()), fanned
    assert all(subscription.created_at.replace(tzinfo=None) > at for at in _occurred(api, ids))


@pytest.mark.parametrize("queues", ["all", "first", "second"])
def test_a_creation_holding_the_namespace_while_a_complete_batch_waits_for_its_second_task(
    api: Api, calls: dict[str, int], queues: str
) -> None:
    """The other order: a subscription is being created (the namespace's exclusive lock held, not committed) and
    a transaction holds the batch's second task when the batch comes. The batch waits (for the task, and on
    MySQL/MariaDB first for the namespace's shared lock, with its first task's lock); the creation commits, then
    the holder. The subscription is older than the events: each matching event is delivered to it, once."""
    grants, ids, first_queue, second_queue = _over_two_queues(api)
    wanted = {"all": None, "first": [first_queue], "second": [second_queue]}[queues]
    name = f"new-{uuid.uuid4().hex[:6]}"
    ns_id = _ns_id(api)
    probe = sa.create_engine(api.server.engine.url, poolclass=sa.NullPool)
    calls["complete_all"] = 0
    try:
        with (
            api.server.engine.connect() as creator,
            api.server.engine.connect() as holder,
            ThreadPoolExecutor(max_workers=1) as pool,
        ):
            creation = creator.begin()
            creator_session = _session_id(creator)
            subscription, created = results.create_subscription(creator, ns_id, api.ns, name, wanted)
            held = holder.begin()
            holder_session = _session_id(holder)
            _lock_task(holder, ids[-1])
            sent = pool.submit(_complete(api, grants))
            _until(lambda: sent.done() or _waited(api, probe, creator_session) or _waited(api, probe, holder_session),
                   "the batch never waited")  # fmt: skip
            assert not sent.done(), sent.result()
            creation.commit()
            # the batch now waits for the holder (MySQL/MariaDB: with the namespace's shared lock)
            _wait_until_blocked(api, probe, holder_session, sent, "the batch")
            held.commit()
            answers = sent.result(timeout=60)
    finally:
        probe.dispose()
    assert calls["complete_all"] == 1, f"the batch was retried: {calls}"
    assert [a["status"] for a in answers] == [200] * 4, answers
    assert created
    at = _occurred(api, ids)
    assert all(subscription.created_at.replace(tzinfo=None) <= when for when in at), (subscription, at)
    fanned = _fan_out(api, ids)
    expect = [int(wanted is None or g["task"]["queue"] in wanted) for g in grants]
    assert [dict(fanned[t])[name] for t in ids] == expect, fanned
