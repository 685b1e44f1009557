"""PostgreSQL's autocommitted lease (``orbit_server.tasks.leases.lease``, issue 28).

A plain queue's lease is a probe (one ``SELECT``) and, when tasks are due, one statement that claims them
and writes their attempts and events (data-modifying ``WITH`` queries), each its own transaction. These
tests check that the grants write exactly what the transactional lease writes, and that the claim decides
again, in its own statement, the gate the probe read: a pause or a limit that came in between is honoured
(no grant; a grant with its permit from the gate's path). A lease lapsed before the probe is swept first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from orbit_server import errors
from orbit_server.db import migrate as _migrate
from orbit_server.db.engine import create_engine, to_utc
from orbit_server.db.schema import concurrency_permits, task_attempts, tasks
from orbit_server.tasks import leases, permits, postgres_leases
from tests.conftest import DatabaseFactory
from tests.integration.test_execution_db import Db


@pytest.fixture(scope="module", params=[pytest.param("postgres", marks=pytest.mark.postgres)])
def db(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[Db]:
    engine = create_engine(make_database(request.param), pool_size=4)
    _migrate.upgrade(engine)
    yield Db(engine)
    engine.dispose()


def _lease(db: Db, queue: str, n: int = 5, *, start: bool = False) -> list[Any]:
    return leases.lease(
        db.engine, db.principal.namespace_id, queue, worker_id="w", max_tasks=n, lease_seconds=30, start=start
    )


@pytest.mark.parametrize("start", [False, True], ids=["lease", "lease-and-start"])
def test_the_grants_write_the_task_its_attempt_and_its_events(db: Db, start: bool) -> None:
    queue = db.new_queue()
    submitted = [db.submit(queue, retry_safe=n % 2 == 0) for n in range(3)]
    versions = {task_id: db.task(task_id)["state_version"] for task_id in submitted}
    grants = _lease(db, queue, start=start)
    assert [g.task.id for g in grants] == submitted  # lease order: the oldest due first
    for grant in grants:
        task, attempt = db.task(grant.task.id), db.attempt(grant.attempt.id)
        started = start and task["retry_safe"]
        status = "RUNNING" if started else "LEASED"
        assert task["status"] == attempt["status"] == grant.task.status == status
        assert task["state_version"] == grant.task.state_version == versions[grant.task.id] + 1 + started
        assert task["attempt_count"] == attempt["generation"] == grant.attempt.generation == 1
        assert task["current_attempt_id"] == grant.task.current_attempt_id == grant.attempt.id
        assert attempt["lease_token_hash"] == hashlib.sha256(grant.attempt.lease_token.encode()).hexdigest()
        assert (
            attempt["worker_id"] == "w" and attempt["lease_seconds"] == 30 and attempt["started_at"] is None
        )
        assert attempt["lease_expires_at"] - attempt["leased_at"] == timedelta(seconds=30)
        assert to_utc(attempt["lease_expires_at"]) == grant.attempt.lease_expires_at
        assert task["updated_at"] == attempt["leased_at"]
        events = [
            (
                e["event"],
                e["from_status"],
                e["to_status"],
                e["state_version"],
                e["actor"],
                e["reason"],
                e["data"],
            )
            for e in db.events(grant.task.id)
            if e["event"] in ("leased", "started")
        ]
        leased = ("leased", "WAITING", "LEASED", versions[grant.task.id] + 1, "worker:w", None,
                  {"attempt_id": grant.attempt.id, "generation": 1})  # fmt: skip
        assert events == [leased] + (
            [("started", "LEASED", "RUNNING", task["state_version"], "worker:w", "lease-and-start",
              {"attempt_id": grant.attempt.id})]
            if started else []
        )  # fmt: skip
        assert {e["created_at"] for e in db.events(grant.task.id)[-len(events) :]} == {attempt["leased_at"]}


def test_the_grants_are_the_due_tasks_in_lease_order_across_priorities(db: Db) -> None:
    """The probe counts and the claim picks a queue's due tasks priority by priority (issue 28): the
    grants are still the first due tasks in lease order (the highest priority first, then the oldest due),
    over priorities with tasks not yet due only, with due and not yet due ones, and with a cancel asked
    for; a lease for 7 takes its tasks from three priorities, the next the rest."""
    queue = db.new_queue()
    later = datetime.now(UTC) + timedelta(hours=1)
    due: dict[int, list[str]] = {5: [], 0: [], -2: []}
    for n in range(4):
        for priority in (7, 5, 3, 0):
            db.submit(queue, priority=priority, available_at=later)  # not yet due
        for priority, count in ((5, 2), (0, 4), (-2, 3)):
            if n < count:
                due[priority].append(db.submit(queue, priority=priority))
    cancelled = db.submit(queue, priority=5)
    with db.engine.begin() as conn:
        conn.execute(tasks.update().where(tasks.c.id == cancelled).values(cancel_requested=True))
    order = due[5] + due[0] + due[-2]
    assert [g.task.id for g in _lease(db, queue, 7)] == order[:7]
    assert [g.task.id for g in _lease(db, queue, 7)] == order[7:]
    assert _lease(db, queue, 7) == []


def test_a_lease_of_no_queue_is_refused(db: Db) -> None:
    with pytest.raises(errors.QueueNotFound):
        _lease(db, "no-such-queue")


def _between_probe_and_claim(monkeypatch: pytest.MonkeyPatch, change: Callable[[], None]) -> None:
    """Make ``change`` (committed) after the probe read the queue, before the claim statement runs."""
    real = postgres_leases._pg_claim_statement

    def claim_after_the_change(start: bool, slots: int) -> sa.TextClause:
        change()
        return real(start, slots)

    monkeypatch.setattr(postgres_leases, "_pg_claim_statement", claim_after_the_change)


def test_a_pause_after_the_probe_grants_nothing(db: Db, monkeypatch: pytest.MonkeyPatch) -> None:
    queue = db.new_queue()
    task_id = db.submit(queue)

    def pause() -> None:
        with db.engine.begin() as conn:
            permits.set_paused(conn, db.principal.namespace_id, queue, paused=True, actor="test")

    _between_probe_and_claim(monkeypatch, pause)
    assert _lease(db, queue) == []
    assert db.task(task_id)["status"] == "WAITING" and db.task(task_id)["attempt_count"] == 0


def test_a_limit_set_after_the_probe_takes_the_gates_path(db: Db, monkeypatch: pytest.MonkeyPatch) -> None:
    queue = db.new_queue()
    first, second = db.submit(queue, concurrency_key="k"), db.submit(queue, concurrency_key="k")

    def limit() -> None:
        with db.engine.begin() as conn:
            permits.set_limits(
                conn, db.principal.namespace_id, queue, {"max_concurrency_per_key": 1}, actor="test"
            )

    _between_probe_and_claim(monkeypatch, limit)
    (grant,) = _lease(db, queue)  # one of key k, with its permit
    assert (
        grant.task.id == first and db.task(first)["holds_permit"] and db.task(second)["status"] == "WAITING"
    )
    with db.engine.connect() as conn:
        held = conn.execute(
            sa.select(concurrency_permits.c.attempt_id).where(concurrency_permits.c.task_id == first)
        ).scalars()
        assert list(held) == [grant.attempt.id]


def test_a_lapsed_lease_is_swept_before_the_grants(db: Db) -> None:
    queue = db.new_queue()
    lapsing = db.submit(queue)
    (old,) = _lease(db, queue)
    waiting = db.submit(queue)
    db.set_expiry(old.attempt.id, -1)
    grants = _lease(db, queue)  # the probe saw the sweep due: the transaction's path sweeps, then grants
    assert db.attempt(old.attempt.id)["status"] == "EXPIRED"
    assert {g.task.id for g in grants} == {lapsing, waiting}
    assert {g.attempt.generation for g in grants if g.task.id == lapsing} == {2}
    with db.engine.connect() as conn:
        generations = conn.execute(
            sa.select(task_attempts.c.generation).where(task_attempts.c.task_id == lapsing)
        ).scalars()
        assert sorted(generations) == [1, 2]


def test_a_lease_lapsed_after_the_probe_is_the_next_leases_to_sweep(
    db: Db, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim does not ask again whether a sweep is due (the probe found none a moment before): it
    grants what is due, and the next lease sweeps the lapsed one (as it would one lapsed just after)."""
    queue = db.new_queue()
    lapsing = db.submit(queue)
    (old,) = _lease(db, queue)
    waiting = db.submit(queue)
    with monkeypatch.context() as patched:
        _between_probe_and_claim(patched, lambda: db.set_expiry(old.attempt.id, -1))
        assert [g.task.id for g in _lease(db, queue)] == [waiting]
    assert db.attempt(old.attempt.id)["status"] == "LEASED"
    (again,) = _lease(db, queue)
    assert again.task.id == lapsing and again.attempt.generation == 2
    assert db.attempt(old.attempt.id)["status"] == "EXPIRED"
