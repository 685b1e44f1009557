"""The fire transaction at the SQL level, on SQLite and MariaDB: misfire and overlap policies,
pause, and concurrent passes racing (the clock is driven by putting next_fire_at in the past)."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from orbit_client import ScheduleCreate, ScheduleUpdate
from orbit_server.db import migrate as _migrate
from orbit_server.db.engine import create_engine, db_now
from orbit_server.db.schema import schedule_occurrences, submission_keys, task_events, tasks
from orbit_server.db.schema import schedules as schedules_table
from orbit_server.schedules import schedules
from orbit_server.tasks import store
from tests.conftest import DatabaseFactory
from tests.integration.conftest import BACKENDS

KEY_TTL = timedelta(days=7)


class Db:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.ns = f"ns-{uuid.uuid4().hex[:8]}"
        with engine.begin() as conn:
            ns_id = store.create_namespace(conn, self.ns)
            store.create_queue(conn, self.ns, "q")
        self.principal = store.Principal(key_id=7, namespace_id=ns_id, namespace=self.ns, role="admin")

    def now(self) -> datetime:
        with self.engine.begin() as conn:
            return db_now(conn)

    def create(self, *, past_seconds: int = 0, **fields: Any) -> str:
        """Create a schedule; with ``past_seconds``, its start bound and next fire lie that far back."""
        name = f"s-{uuid.uuid4().hex[:8]}"
        body = ScheduleCreate.model_validate({"name": name, "queue": "q", "handler": "h", **fields})
        with self.engine.begin() as conn:
            created = schedules.create_schedule(conn, self.principal, body)
            if past_seconds:
                start = db_now(conn).replace(microsecond=0) - timedelta(seconds=past_seconds)
                conn.execute(
                    schedules_table.update()
                    .where(schedules_table.c.id == created.id)
                    .values(start_at=start, next_fire_at=start)
                )
        return name

    def fire(self) -> int:
        return schedules.fire_due(self.engine, default_max_attempts=3, key_ttl=KEY_TTL)

    def schedule(self, name: str) -> dict[str, Any]:
        with self.engine.begin() as conn:
            row = (
                conn.execute(sa.select(schedules_table).where(schedules_table.c.name == name))
                .mappings()
                .one()
            )
            return dict(row)

    def occurrences(self, name: str) -> list[dict[str, Any]]:
        sid = self.schedule(name)["id"]
        with self.engine.begin() as conn:
            rows = conn.execute(
                sa.select(schedule_occurrences)
                .where(schedule_occurrences.c.schedule_id == sid)
                .order_by(schedule_occurrences.c.scheduled_at)
            ).mappings()
            return [dict(r) for r in rows]


@pytest.fixture(scope="module", params=BACKENDS)
def db(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[Db]:
    engine = create_engine(make_database(request.param), pool_size=20)
    _migrate.upgrade(engine)
    yield Db(engine)
    engine.dispose()


@pytest.fixture(autouse=True)
def _quiet(db: Db) -> Iterator[None]:
    """Each test counts the tasks of its own schedules only: pause every schedule afterwards."""
    yield
    with db.engine.begin() as conn:
        conn.execute(schedules_table.update().values(paused=True))


def test_a_fire_writes_occurrence_task_key_and_event_in_one_go(db: Db) -> None:
    name = db.create(interval_seconds=60, past_seconds=30, params={"report": "daily"})
    assert db.fire() == 1
    [occurrence] = db.occurrences(name)
    schedule = db.schedule(name)
    assert occurrence["status"] == "created" and not occurrence["misfired"]
    assert occurrence["scheduled_at"] == schedule["start_at"] == schedule["last_fired_at"]
    assert schedule["next_fire_at"] == schedule["start_at"] + timedelta(seconds=60)
    assert schedule["last_task_id"] == occurrence["task_id"]
    key = schedules.idempotency_key(schedule["id"], occurrence["scheduled_at"])
    with db.engine.begin() as conn:
        task = store.find_submission(conn, db.principal.namespace_id, key)
        [event] = conn.execute(
            sa.select(task_events).where(task_events.c.task_id == occurrence["task_id"])
        ).mappings()
    assert task is not None and task.id == occurrence["task_id"]
    assert (task.queue, task.handler, task.params, task.status.value) == (
        "q",
        "h",
        {"report": "daily"},
        "WAITING",
    )
    assert event["event"] == "accepted" and event["actor"] == f"schedule:{name}"
    assert event["data"]["schedule_id"] == schedule["id"]
    assert db.fire() == 0  # nothing due any more


def test_a_schedules_tasks_get_its_priority(db: Db) -> None:
    """``options.priority`` of a schedule is every fired task's (README "Task priority"); none means 0."""
    made = {db.create(interval_seconds=3600, past_seconds=30, options=options): want
            for options, want in (({"priority": 42}, 42), ({"priority": -7}, -7), (None, 0))}  # fmt: skip
    assert db.fire() == 3
    for name, want in made.items():
        [occurrence] = db.occurrences(name)
        with db.engine.begin() as conn:
            priority = conn.execute(sa.select(tasks.c.priority).where(tasks.c.id == occurrence["task_id"]))
            assert priority.scalar_one() == want, name


@pytest.mark.parametrize(("policy", "expected"), [("skip", 0), ("run_once", 1), ("catch_up", 3)])
def test_misfire_policies(db: Db, policy: str, expected: int) -> None:
    """Ten minutes of missed minutely fire times (grace 0: all of them are missed)."""
    name = db.create(interval_seconds=60, past_seconds=600, misfire_policy=policy, catch_up_max=3,
                     misfire_grace_seconds=0)  # fmt: skip
    assert db.fire() == expected
    found = db.occurrences(name)
    assert len(found) == expected and all(o["misfired"] and o["task_id"] for o in found)
    schedule = db.schedule(name)
    if found:  # the latest missed ones, one minute apart
        assert [o["scheduled_at"] for o in found] == [
            schedule["next_fire_at"] - timedelta(seconds=60 * n) for n in range(expected, 0, -1)
        ]
    assert schedule["next_fire_at"] > db.now() - timedelta(seconds=1)
    assert db.fire() == 0


def test_on_time_fire_times_fire_whatever_the_policy(db: Db) -> None:
    name = db.create(interval_seconds=1, past_seconds=3, misfire_policy="skip", misfire_grace_seconds=60)
    assert db.fire() >= 4  # -3 s, -2 s, -1 s, now (and perhaps one more second)
    times = [o["scheduled_at"] for o in db.occurrences(name)]
    assert times == [times[0] + timedelta(seconds=n) for n in range(len(times))]


def test_a_paused_schedule_does_not_fire_and_resumes_per_its_misfire_policy(db: Db) -> None:
    name = db.create(
        interval_seconds=60, past_seconds=300, misfire_policy="run_once", misfire_grace_seconds=0
    )
    with db.engine.begin() as conn:
        schedules.set_paused(conn, db.principal, name, True)
    assert db.fire() == 0 and db.occurrences(name) == []
    with db.engine.begin() as conn:
        schedules.set_paused(conn, db.principal, name, False)
    assert db.fire() == 1
    [occurrence] = db.occurrences(name)
    assert occurrence["misfired"]


def test_skip_if_running_records_skipped_occurrences_until_the_task_finishes(db: Db) -> None:
    name = db.create(interval_seconds=1, past_seconds=2, overlap_policy="skip_if_running",
                     misfire_policy="catch_up", catch_up_max=5, misfire_grace_seconds=0)  # fmt: skip
    assert db.fire() == 1
    first, *skipped = db.occurrences(name)
    assert first["status"] == "created" and len(skipped) >= 2
    assert all(o["status"] == "skipped" and o["task_id"] is None for o in skipped)
    assert all(first["task_id"] in o["skip_reason"] and "not finished" in o["skip_reason"] for o in skipped)
    # The task finishes; the next fire time creates a task again.
    with db.engine.begin() as conn:
        conn.execute(tasks.update().where(tasks.c.id == first["task_id"]).values(status="SUCCEEDED"))
    seen = len(db.occurrences(name))
    due = db.schedule(name)["next_fire_at"]
    while db.now() < due:  # the database clock reaches the next fire time (at most 1 s)
        time.sleep(0.02)
    assert db.fire() == 1
    assert db.occurrences(name)[seen]["status"] == "created"


def test_an_update_never_fires_a_handled_fire_time_again(db: Db) -> None:
    name = db.create(interval_seconds=60, past_seconds=1)
    assert db.fire() == 1
    fired = db.occurrences(name)[0]["scheduled_at"]
    # Same interval, start bound moved so that the handled time is again a fire time, in the past.
    with db.engine.begin() as conn:
        updated = schedules.update_schedule(
            conn, db.principal, name, ScheduleUpdate(interval_seconds=1, start_at=fired.replace(tzinfo=UTC))
        )
    assert updated.version == 2
    assert updated.next_fire_at is not None and updated.next_fire_at.replace(tzinfo=None) > fired
    db.fire()
    times = [o["scheduled_at"] for o in db.occurrences(name)]
    assert Counter(times).most_common(1)[0][1] == 1


def test_concurrent_passes_give_one_task_per_fire_time(db: Db) -> None:
    """Eight passes at once over six due schedules, repeatedly: never a duplicate, never an error."""
    names = [
        db.create(
            interval_seconds=10,
            past_seconds=50,
            misfire_policy="catch_up",
            catch_up_max=10,
            misfire_grace_seconds=0,
        )
        for _ in range(6)
    ]
    failures: list[BaseException] = []
    created: list[int] = []
    barrier = threading.Barrier(8)

    def run() -> None:
        barrier.wait()
        try:
            created.append(db.fire())
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    db.fire()  # whatever a pass left to the next (lock conflicts end a pass quietly)
    ids = [db.schedule(n)["id"] for n in names]
    with db.engine.begin() as conn:
        occurrences = conn.execute(
            sa.select(schedule_occurrences.c.schedule_id, schedule_occurrences.c.scheduled_at,
                      schedule_occurrences.c.task_id)
            .where(schedule_occurrences.c.schedule_id.in_(ids))
        ).all()  # fmt: skip
        keys = conn.execute(
            sa.select(sa.func.count()).where(submission_keys.c.task_id.in_([o.task_id for o in occurrences]))
        ).scalar_one()
    per_schedule = Counter(o.schedule_id for o in occurrences)
    assert set(per_schedule.values()) == {6}  # -50 s ... 0 s, every 10 s
    assert len({(o.schedule_id, o.scheduled_at) for o in occurrences}) == 36
    assert len({o.task_id for o in occurrences}) == 36 == keys
    assert sum(created) <= 36


def test_a_schedule_that_cannot_fire_leaves_the_others_firing(
    db: Db, caplog: pytest.LogCaptureFixture
) -> None:
    broken = db.create(interval_seconds=60, past_seconds=30)
    healthy = db.create(interval_seconds=60, past_seconds=20)
    with db.engine.begin() as conn:  # stored data no task can be built from (not reachable through the API)
        conn.execute(schedules_table.update().where(schedules_table.c.name == broken).values(handler=""))
    assert db.fire() == 1
    assert db.occurrences(broken) == [] and len(db.occurrences(healthy)) == 1
    assert f"schedule {broken!r}" in caplog.text and "could not fire" in caplog.text
    assert db.schedule(broken)["next_fire_at"] < db.now()  # still due: tried again in the next pass


def test_a_database_error_of_one_schedule_rolls_back_its_savepoint_and_the_pass_goes_on(
    db: Db, caplog: pytest.LogCaptureFixture
) -> None:
    """A schedule whose fire breaks the unique occurrence index (as a fire time before its
    next_fire_at did on a fall-back night) no longer fails the pass of every other schedule."""
    broken = db.create(interval_seconds=60, past_seconds=30)
    healthy = db.create(interval_seconds=60, past_seconds=20)
    row = db.schedule(broken)
    with db.engine.begin() as conn:  # an occurrence already written for the fire time it is about to fire
        conn.execute(
            schedule_occurrences.insert().values(
                schedule_id=row["id"], scheduled_at=row["next_fire_at"], schedule_version=row["version"],
                misfired=False, created_at=row["created_at"], task_id=None, skip_reason=None,
                status="created",
            )
        )  # fmt: skip
    assert db.fire() == 1
    assert len(db.occurrences(healthy)) == 1
    assert len(db.occurrences(broken)) == 1  # only the one written above: its savepoint rolled back
    assert f"schedule {broken!r}" in caplog.text and "database error" in caplog.text
    assert db.schedule(broken)["next_fire_at"] == row["next_fire_at"]  # still due: tried again next pass
    assert db.fire() == 0  # and again the pass does not fail


def test_a_schedule_created_in_the_repeated_hour_of_a_fall_back_night_starts_after_it(db: Db) -> None:
    """Created at 01:10 UTC on 25 October 2026 (02:10 CET, second pass), ``30 2 * * *`` Berlin
    gets the next day's 02:30 CET, never the first pass's 00:30 UTC before its start."""
    trigger = schedules._trigger(
        {"cron": "30 2 * * *", "interval_seconds": None, "timezone": "Europe/Berlin",
         "start_at": datetime(2026, 10, 25, 1, 10), "end_at": None}
    )  # fmt: skip
    first = schedules._first_fire(trigger, datetime(2026, 10, 25, 1, 10), None)
    assert first == datetime(2026, 10, 26, 1, 30)


def _race(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, module: Any, between: str, racers: int, create: Any
) -> list[str]:
    """Run ``create(conn)`` in ``racers`` threads at once, each in its own transaction, lined up on a
    barrier inside ``module.between`` (called between the name check and the insert); the outcomes."""
    from orbit_server import errors

    barrier = threading.Barrier(racers)
    real = getattr(module, between)

    def lined_up(*args: Any) -> Any:
        # SQLite: BEGIN IMMEDIATE serialises the creates, so there is no race to line up.
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=3)
        return real(*args)

    monkeypatch.setattr(module, between, lined_up)
    outcomes: list[str] = []

    def run() -> None:
        try:
            with engine.begin() as conn:
                create(conn)
            outcomes.append("created")
        except errors.NameTaken:
            outcomes.append("taken")
        except Exception as exc:
            outcomes.append(f"error {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run) for _ in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(outcomes)


def test_concurrent_creates_of_one_name_give_one_schedule_and_409s(
    db: Db, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (issue 20 #6): eight simultaneous creates of one name (every app instance's start-up
    "make sure my schedule exists") gave one 201 and several 500s (IntegrityError 1062 on
    uq_schedules_namespace_name). Each loser now gets NameTaken (409 already_exists)."""
    body = ScheduleCreate.model_validate(
        {"name": f"race-{uuid.uuid4().hex[:8]}", "queue": "q", "handler": "h", "interval_seconds": 60}
    )
    outcomes = _race(
        db.engine, monkeypatch, schedules, "_first_fire", 8,
        lambda conn: schedules.create_schedule(conn, db.principal, body),
    )  # fmt: skip
    assert outcomes == ["created"] + ["taken"] * 7


@pytest.mark.parametrize("what", ["queue", "namespace"])
def test_concurrent_creates_of_one_queue_or_namespace_name_give_409s(
    db: Db, monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    """The same check-then-insert shape as schedules (issue 20 #6): the losers get NameTaken, never a 500."""
    name = f"race-{uuid.uuid4().hex[:8]}"

    def create(conn: Any) -> None:
        if what == "queue":
            store.create_queue(conn, db.ns, name)
        else:
            store.create_namespace(conn, name)

    assert _race(db.engine, monkeypatch, store, "db_now", 6, create) == ["created"] + ["taken"] * 5
