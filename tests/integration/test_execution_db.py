"""Task execution at the SQL level, on SQLite and MariaDB: schema parity, the transition table, races.

The races run the functions of ``orbit_server.tasks`` (leases, attempts, operations) from threads on a real database,
the way concurrent HTTP requests and the sweep run them in the server.
"""

from __future__ import annotations

import random
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import partial
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy.engine import Engine

from orbit_client import AttemptError, AttemptStatus, LeaseGrant, TaskStatus, TaskSubmission
from orbit_server import errors
from orbit_server.db import migrate as _migrate
from orbit_server.db import schema
from orbit_server.db.engine import create_engine, db_now
from orbit_server.db.schema import task_attempts, task_events, tasks
from orbit_server.db.transact import transact
from orbit_server.tasks import attempts, leases, operations, store, transitions
from orbit_server.tasks.transitions import TRANSITIONS
from tests.conftest import DatabaseFactory
from tests.execution_support import check_attempt_history
from tests.integration.conftest import BACKENDS
from tests.integration.test_result_events import _until, _waiting_for

#: The arrows of the state diagram in §2 of seed 001, copied by hand.
SEED_ARROWS = {
    ("WAITING", "LEASED"),
    ("LEASED", "RUNNING"),
    ("LEASED", "WAITING"),
    ("LEASED", "FAILED"),
    ("WAITING", "CANCELLED"),
    ("LEASED", "CANCELLED"),
    ("WAITING", "FAILED"),
    ("RUNNING", "SUCCEEDED"),
    ("RUNNING", "WAITING"),
    ("RUNNING", "FAILED"),
    ("RUNNING", "NEEDS_REVIEW"),
    ("RUNNING", "CANCELLED"),
    ("NEEDS_REVIEW", "SUCCEEDED"),
    ("NEEDS_REVIEW", "FAILED"),
}

RACE_REPETITIONS = 40


class Db:
    """One migrated database with a namespace, a queue and a principal to act as."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.ns = f"ns-{uuid.uuid4().hex[:8]}"
        self.queue = "q"
        with engine.begin() as conn:
            ns_id = store.create_namespace(conn, self.ns)
            store.create_queue(conn, self.ns, self.queue)
        self.principal = store.Principal(key_id=0, namespace_id=ns_id, namespace=self.ns, role="admin")

    def new_queue(self) -> str:
        name = f"q-{uuid.uuid4().hex[:10]}"
        with self.engine.begin() as conn:
            store.create_queue(conn, self.ns, name)
        return name

    def submit(self, queue: str | None = None, **options: Any) -> str:
        submission = TaskSubmission.model_validate(
            {"queue": queue or self.queue, "handler": "h", "params": None, "options": options}
        )
        task, _ = store.submit_task(
            self.engine,
            self.principal,
            submission,
            str(uuid.uuid4()),
            default_max_attempts=3,
            key_ttl=timedelta(days=1),
        )
        return task.id

    def lease(self, queue: str | None = None, n: int = 1, lease_seconds: float = 60) -> list[LeaseGrant]:
        """A lease call's grants, as the server makes them (``leases.lease``: on PostgreSQL autocommitted)."""
        return leases.lease(
            self.engine,
            self.principal.namespace_id,
            queue or self.queue,
            worker_id="w",
            max_tasks=n,
            lease_seconds=lease_seconds,
        )

    def running(self, **options: Any) -> LeaseGrant:
        """A new task, leased and started, alone in a queue of its own."""
        queue = self.new_queue()
        self.submit(queue, **options)
        (grant,) = self.lease(queue)
        transact(
            self.engine,
            attempts.start_attempt,
            self.principal.namespace_id,
            grant.attempt.id,
            grant.attempt.lease_token,
        )
        return grant

    def set_expiry(self, attempt_id: str, seconds_from_now: float) -> None:
        """Move a lease's expiry next to the database's present (to race at the edge)."""
        with self.engine.begin() as conn:
            when = db_now(conn) + timedelta(seconds=seconds_from_now)
            conn.execute(
                task_attempts.update().where(task_attempts.c.id == attempt_id).values(lease_expires_at=when)
            )

    def task(self, task_id: str) -> dict[str, Any]:
        with self.engine.connect() as conn:
            return dict(conn.execute(sa.select(tasks).where(tasks.c.id == task_id)).mappings().one())

    def attempt(self, attempt_id: str) -> dict[str, Any]:
        with self.engine.connect() as conn:
            return dict(
                conn.execute(sa.select(task_attempts).where(task_attempts.c.id == attempt_id))
                .mappings()
                .one()
            )

    def events(self, task_id: str) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(task_events).where(task_events.c.task_id == task_id).order_by(task_events.c.id)
            )
            return [dict(r) for r in rows.mappings()]


@pytest.fixture(scope="module", params=BACKENDS)
def db(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[Db]:
    engine = create_engine(make_database(request.param), pool_size=10)
    _migrate.upgrade(engine)
    yield Db(engine)
    engine.dispose()


def _together(*calls: Callable[[], Any]) -> list[Any]:
    """Run ``calls`` in threads released at the same moment; return each result or exception."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)

    def run(i: int, call: Callable[[], Any]) -> None:
        barrier.wait()
        try:
            results[i] = call()
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def _sweep_repeatedly(engine: Engine, times: int) -> list[int]:
    return [transact(engine, leases.expire_leases) for _ in range(times)]


def _versions_are_consecutive(db: Db, task_id: str) -> None:
    versions = [e["state_version"] for e in db.events(task_id) if e["to_status"] is not None]
    assert versions == list(range(1, len(versions) + 1)), versions
    assert db.task(task_id)["state_version"] == versions[-1]


# ------------------------------------------------------------------- schema


def test_migrations_create_exactly_the_schema_module(db: Db) -> None:
    with db.engine.connect() as conn:
        context = MigrationContext.configure(
            conn, opts={"compare_type": True, "version_table": _migrate.VERSION_TABLE}
        )
        assert compare_metadata(context, schema.metadata) == []


# -------------------------------------------------------------- transitions


def test_the_transition_table_is_the_seed_diagram() -> None:
    assert {(a.value, b.value) for a, b in TRANSITIONS} == SEED_ARROWS


@pytest.mark.parametrize("source", list(TaskStatus), ids=lambda s: s.value)
def test_apply_transition_allows_exactly_the_table(db: Db, source: TaskStatus) -> None:
    for target in TaskStatus:
        task_id = db.submit()
        with db.engine.begin() as conn:
            conn.execute(
                tasks.update().where(tasks.c.id == task_id).values(status=source.value, state_version=7)
            )
        before = len(db.events(task_id))
        try:
            with db.engine.begin() as conn:
                row = dict(conn.execute(sa.select(tasks).where(tasks.c.id == task_id)).mappings().one())
                transitions.apply_transition(conn, row, target, event="test", now=db_now(conn), actor="test")
        except errors.InvalidTransition:
            assert (source, target) not in TRANSITIONS
            assert db.task(task_id)["status"] == source.value and db.task(task_id)["state_version"] == 7
            assert len(db.events(task_id)) == before
        else:
            assert (source, target) in TRANSITIONS
            after = db.task(task_id)
            assert after["status"] == target.value and after["state_version"] == 8
            event = db.events(task_id)[-1]
            assert (event["from_status"], event["to_status"], event["state_version"]) == (
                source.value,
                target.value,
                8,
            )
            assert (after["finished_at"] is not None) == target.is_terminal


def test_apply_transition_refuses_a_stale_version(db: Db) -> None:
    task_id = db.submit()
    with pytest.raises(errors.ConcurrentUpdate), db.engine.begin() as conn:
        row = dict(conn.execute(sa.select(tasks).where(tasks.c.id == task_id)).mappings().one())
        row["state_version"] = 0
        transitions.apply_transition(conn, row, TaskStatus.CANCELLED, event="test", now=db_now(conn))
    assert db.task(task_id)["status"] == "WAITING" and len(db.events(task_id)) == 1


# -------------------------------------------------------------------- races


def test_completion_racing_the_sweep_at_the_lease_edge_is_never_reverted(db: Db) -> None:
    ns_id = db.principal.namespace_id
    outcomes: Counter[str] = Counter()
    for _ in range(RACE_REPETITIONS):
        grant = db.running()
        attempt = grant.attempt
        db.set_expiry(attempt.id, random.uniform(-0.02, 0.08))
        complete, _sweeps = _together(
            partial(
                transact,
                db.engine,
                attempts.complete_attempt,
                ns_id,
                attempt.id,
                attempt.lease_token,
                {"r": 1},
            ),
            partial(_sweep_repeatedly, db.engine, 4),
        )
        task, row = db.task(grant.task.id), db.attempt(attempt.id)
        if isinstance(complete, errors.LeaseLost):
            outcomes["expired first"] += 1
            assert row["status"] == AttemptStatus.EXPIRED.value
            assert row["late_report"] == {"outcome": "succeeded", "result": {"r": 1}}
            assert task["status"] == TaskStatus.NEEDS_REVIEW.value and task["result"] is None
        else:
            assert not isinstance(complete, Exception), complete
            outcomes["completed first"] += 1
            assert complete.status is AttemptStatus.SUCCEEDED
            assert row["status"] == AttemptStatus.SUCCEEDED.value and row["late_report"] is None
            assert task["status"] == TaskStatus.SUCCEEDED.value and task["result"] == {"r": 1}
            assert "lease_expired" not in [e["event"] for e in db.events(grant.task.id)]
        _versions_are_consecutive(db, grant.task.id)
    check_attempt_history(db.engine)
    # Both orders happened, so the edge was really raced.
    print(f"completion vs sweep: {dict(outcomes)}")
    assert outcomes["expired first"] and outcomes["completed first"], outcomes


def test_cancel_racing_complete_never_overwrites_a_success(db: Db) -> None:
    ns_id = db.principal.namespace_id
    outcomes: Counter[str] = Counter()
    for _ in range(RACE_REPETITIONS // 2):
        grant = db.running()
        attempt = grant.attempt
        complete, cancel = _together(
            partial(
                transact, db.engine, attempts.complete_attempt, ns_id, attempt.id, attempt.lease_token, "ok"
            ),
            partial(
                transact, db.engine, operations.cancel_task, ns_id, grant.task.id, reason="race", actor="t"
            ),
        )
        assert not isinstance(complete, Exception), complete
        task = db.task(grant.task.id)
        assert task["status"] == TaskStatus.SUCCEEDED.value and task["result"] == "ok"
        if isinstance(cancel, errors.InvalidTransition):
            outcomes["complete first"] += 1
        else:
            assert not isinstance(cancel, Exception), cancel
            outcomes["cancel first"] += 1
            assert cancel.status is TaskStatus.RUNNING and cancel.cancel_requested
        _versions_are_consecutive(db, grant.task.id)
    print(f"cancel vs complete: {dict(outcomes)}")
    assert sum(outcomes.values()) == RACE_REPETITIONS // 2


def test_a_complete_that_waits_for_a_cancel_request_answers_it(db: Db) -> None:
    """A ``complete`` reads the task it locks as the newest row, not as it was when its statement began: a
    cancel request committed while the complete waited for the task's lock is in its answer (on MariaDB the
    plain path reads the task again in its first statement's ``RETURNING``, with locking reads)."""
    if db.engine.dialect.name == "sqlite":
        pytest.skip("SQLite has one writer: the complete waits to begin, and then reads the newest row")
    ns_id = db.principal.namespace_id
    grant = db.running()
    probe = sa.create_engine(db.engine.url, poolclass=sa.NullPool)
    answers: list[Any] = []
    with db.engine.connect() as conn:
        trans = conn.begin()
        holder = int(
            conn.exec_driver_sql(
                "SELECT pg_backend_pid()"
                if db.engine.dialect.name == "postgresql"
                else "SELECT CONNECTION_ID()"
            ).scalar_one()
        )
        cancelled = operations.cancel_task(conn, ns_id, grant.task.id, reason="stop", actor="t")
        assert cancelled.status is TaskStatus.RUNNING and cancelled.cancel_requested
        completing = threading.Thread(
            target=lambda: answers.append(
                transact(
                    db.engine,
                    attempts.complete_attempt,
                    ns_id,
                    grant.attempt.id,
                    grant.attempt.lease_token,
                    1,
                )
            )
        )
        completing.start()
        _until(lambda: _waiting_for(probe, holder) > 0, "the complete did not wait for the cancel request")
        trans.commit()
    completing.join(timeout=30)
    probe.dispose()
    (answer,) = answers
    assert answer.status is AttemptStatus.SUCCEEDED and answer.task_status is TaskStatus.SUCCEEDED
    assert answer.cancel_requested  # the success wins over the cancel request, and the answer says it came
    assert db.task(grant.task.id)["status"] == TaskStatus.SUCCEEDED.value
    _versions_are_consecutive(db, grant.task.id)


def test_cancel_racing_start(db: Db) -> None:
    ns_id = db.principal.namespace_id
    for _ in range(RACE_REPETITIONS // 2):
        queue = db.new_queue()
        db.submit(queue)
        (grant,) = db.lease(queue)
        attempt = grant.attempt
        start, cancel = _together(
            partial(transact, db.engine, attempts.start_attempt, ns_id, attempt.id, attempt.lease_token),
            partial(
                transact, db.engine, operations.cancel_task, ns_id, grant.task.id, reason="race", actor="t"
            ),
        )
        assert not isinstance(cancel, Exception), cancel
        task = db.task(grant.task.id)
        if isinstance(start, errors.LeaseLost):  # the cancel came first: the task never started
            assert task["status"] == TaskStatus.CANCELLED.value
            assert db.attempt(attempt.id)["status"] == AttemptStatus.CANCELLED.value
        else:
            assert not isinstance(start, Exception), start
            assert task["status"] == TaskStatus.RUNNING.value and task["cancel_requested"]
            # The worker stops, and reports so.
            transact(
                db.engine,
                attempts.fail_attempt,
                ns_id,
                attempt.id,
                attempt.lease_token,
                AttemptError(type="cancelled", message="stopped"),
            )
            assert db.task(grant.task.id)["status"] == TaskStatus.CANCELLED.value
        _versions_are_consecutive(db, grant.task.id)


def test_concurrent_leases_never_grant_a_task_twice(db: Db) -> None:
    queue = db.new_queue()
    ids = {db.submit(queue) for _ in range(30)}
    results = _together(*[lambda: db.lease(queue, n=4) for _ in range(8)])
    granted = [g.task.id for result in results if not isinstance(result, Exception) for g in result]
    assert not [r for r in results if isinstance(r, Exception)], results
    assert len(granted) == len(set(granted)) and set(granted) <= ids
    check_attempt_history(db.engine, ids)
