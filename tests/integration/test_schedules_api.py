"""Schedules through the HTTP API and the client, against a real server running its scheduler,
on SQLite and MariaDB."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar
from zoneinfo import ZoneInfo

import httpx
import pytest
import sqlalchemy as sa

from orbit_client import (
    ConflictError,
    NotFoundError,
    OrbitClient,
    OrbitUsageError,
    PermissionDeniedError,
    Schedule,
    UnprocessableEntityError,
)
from orbit_server.db.schema import schedule_events
from orbit_server.db.schema import schedules as schedules_table
from orbit_server.tasks import store
from tests.conftest import DatabaseFactory
from tests.integration.conftest import BACKENDS
from tests.servers import RunningServer, run_server

T = TypeVar("T")
BERLIN = ZoneInfo("Europe/Berlin")
NS = "sched"


@pytest.fixture(scope="module", params=BACKENDS)
def server(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[RunningServer]:
    with run_server(make_database(request.param), scheduler_interval_seconds=0.1) as running:
        running.keys = running.add_namespace(NS)
        yield running


@pytest.fixture
def admin(server: RunningServer) -> Iterator[OrbitClient]:
    with OrbitClient(server.base_url, api_key=server.keys["admin"]) as client:
        yield client


def _name() -> str:
    return f"s-{uuid.uuid4().hex[:8]}"


def _until(probe: Callable[[], T | None], what: str, timeout: float = 10.0) -> T:
    """Poll ``probe`` (a read of the database through the API) until it answers, with a deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _move_back(server: RunningServer, name: str, seconds: int) -> None:
    """Drive the clock: put the schedule's start bound and next fire that far in the past."""
    with server.engine.begin() as conn:
        row = conn.execute(sa.select(schedules_table).where(schedules_table.c.name == name)).mappings().one()
        start = row["start_at"] - timedelta(seconds=seconds)
        conn.execute(
            schedules_table.update()
            .where(schedules_table.c.id == row["id"])
            .values(start_at=start, next_fire_at=start)
        )


def test_an_every_second_schedule_gives_one_task_per_fire_time(
    server: RunningServer, admin: OrbitClient
) -> None:
    name = _name()
    created = admin.create_schedule(
        NS, name, queue="default", handler="tick", params={"n": 1}, interval_seconds=1
    )
    assert (created.version, created.interval_seconds, created.cron, created.paused) == (1, 1, None, False)
    # The first fire time at or after the creation (README "Schedules"): the same instant when the clock read
    # a whole second (SQLite keeps milliseconds: about one creation in a thousand).
    assert created.next_fire_at is not None and created.next_fire_at >= created.created_at

    def three() -> list[Any] | None:
        found = admin.list_occurrences(NS, name)
        return found if len(found) >= 3 else None

    found = _until(three, "three occurrences")
    admin.pause_schedule(NS, name)
    occurrences = admin.list_occurrences(NS, name)
    times = [o.scheduled_at for o in occurrences]
    assert times == sorted(times, reverse=True)  # newest first
    assert [a - b for a, b in itertools.pairwise(times)] == [timedelta(seconds=1)] * (len(times) - 1)
    assert len({o.task_id for o in occurrences}) == len(occurrences) >= len(found)
    for occurrence in occurrences:
        assert occurrence.status == "created" and occurrence.task_id and occurrence.schedule_version == 1
        task = admin.get_task(NS, occurrence.task_id)
        assert (task.queue, task.handler, task.params) == ("default", "tick", {"n": 1})
        key = f"schedule:{created.id}:{occurrence.scheduled_at.strftime('%Y-%m-%dT%H:%M:%SZ')}"
        submitted = admin.find_submission(NS, key)
        assert submitted is not None and submitted.id == occurrence.task_id
    assert admin.list_occurrences(NS, name, limit=2) == occurrences[:2]
    assert admin.list_occurrences(NS, name, before=occurrences[1].scheduled_at) == occurrences[2:]


def test_a_scheduled_task_wakes_a_long_polling_lease(server: RunningServer, admin: OrbitClient) -> None:
    queue = f"q-{uuid.uuid4().hex[:6]}"
    with server.engine.begin() as conn:
        store.create_queue(conn, NS, queue)
    name = _name()
    admin.create_schedule(NS, name, queue=queue, handler="h", interval_seconds=3600, paused=True)
    _move_back(server, name, 1)
    with OrbitClient(server.base_url, api_key=server.keys["work"]) as worker:
        admin.resume_schedule(NS, name)
        started = time.monotonic()
        grants = worker.lease_tasks(NS, queue, worker_id="w", wait_seconds=20)
    assert len(grants) == 1 and time.monotonic() - started < 5


def test_pause_stops_fires_and_resume_catches_up(server: RunningServer, admin: OrbitClient) -> None:
    name = _name()
    admin.create_schedule(NS, name, queue="default", handler="h", interval_seconds=60, paused=True,
                          misfire_policy="catch_up", catch_up_max=3, misfire_grace_seconds=0)  # fmt: skip
    _move_back(server, name, 600)
    # Paused: the fire times of the last ten minutes are due, and nothing fires.
    paused = admin.get_schedule(NS, name)
    assert paused.paused and paused.next_fire_at is not None and paused.next_fire_at < datetime.now(UTC)
    time.sleep(
        0.5
    )  # five scheduler passes (interval 0.1 s) that must not fire: absence has no event to await
    assert admin.list_occurrences(NS, name) == []
    resumed = admin.resume_schedule(NS, name)
    assert not resumed.paused and resumed.version == 1
    occurrences = _until(lambda: admin.list_occurrences(NS, name), "the catch-up")
    assert len(occurrences) == 3 and all(o.misfired and o.task_id for o in occurrences)
    after = admin.get_schedule(NS, name)  # moved past now in the fire's own transaction
    assert after.next_fire_at is not None and after.next_fire_at > occurrences[0].scheduled_at
    assert after.last_fired_at == occurrences[0].scheduled_at
    assert admin.pause_schedule(NS, name).paused and admin.pause_schedule(NS, name).paused  # idempotent


def test_update_makes_a_new_version_and_recomputes_the_next_fire(
    server: RunningServer, admin: OrbitClient
) -> None:
    name = _name()
    created = admin.create_schedule(
        NS, name, queue="default", handler="h", cron="0 3 * * *", timezone="Europe/Berlin"
    )
    assert created.next_fire_at is not None
    assert created.next_fire_at.astimezone(BERLIN).hour == 3
    moved = admin.update_schedule(NS, name, cron="30 4 * * *")
    assert moved.version == 2 and moved.cron == "30 4 * * *" and moved.next_fire_at is not None
    assert moved.next_fire_at.astimezone(BERLIN).strftime("%H:%M") == "04:30"
    renamed = admin.update_schedule(NS, name, handler="h2", params={"x": [1]})
    assert (renamed.version, renamed.handler, renamed.params, renamed.next_fire_at) == (
        3,
        "h2",
        {"x": [1]},
        moved.next_fire_at,
    )
    to_interval = admin.update_schedule(NS, name, interval_seconds=300)
    assert (to_interval.cron, to_interval.interval_seconds, to_interval.version) == (None, 300, 4)
    with pytest.raises(UnprocessableEntityError) as bad:
        admin.update_schedule(NS, name, cron="not cron")
    assert bad.value.code == "invalid_cron"
    with pytest.raises(OrbitUsageError):
        admin.update_schedule(NS, name)  # nothing to change
    with server.engine.begin() as conn:
        events = conn.execute(
            sa.select(schedule_events.c.event, schedule_events.c.version, schedule_events.c.actor)
            .where(schedule_events.c.schedule_id == created.id)
            .order_by(schedule_events.c.id)
        ).all()
    actor = events[0].actor
    assert actor.startswith("api_key:")
    assert [(e.event, e.version) for e in events] == [
        ("created", 1),
        ("updated", 2),
        ("updated", 3),
        ("updated", 4),
    ]


def test_delete_keeps_the_tasks(server: RunningServer, admin: OrbitClient) -> None:
    name = _name()
    admin.create_schedule(NS, name, queue="default", handler="h", interval_seconds=3600)
    _move_back(server, name, 1)
    [occurrence] = _until(lambda: admin.list_occurrences(NS, name), "the fire")
    admin.delete_schedule(NS, name)
    with pytest.raises(NotFoundError) as gone:
        admin.get_schedule(NS, name)
    assert gone.value.code == "schedule_not_found"
    with pytest.raises(NotFoundError):
        admin.list_occurrences(NS, name)
    assert occurrence.task_id is not None and admin.get_task(NS, occurrence.task_id).handler == "h"
    assert name not in {s.name for s in admin.list_schedules(NS, limit=1000)}
    # The name is free again, and the new schedule is a new one (its own id, its own keys).
    again = admin.create_schedule(NS, name, queue="default", handler="h", interval_seconds=3600)
    assert again.version == 1


def test_errors_are_problems_with_stable_codes(server: RunningServer, admin: OrbitClient) -> None:
    name = _name()

    def code(**fields: Any) -> tuple[int, str]:
        body = {"name": name, "queue": "default", "handler": "h", **fields}
        response = httpx.post(f"{server.base_url}/v1/namespaces/{NS}/schedules", json=body,
                              headers={"Authorization": f"Bearer {server.keys['admin']}"})  # fmt: skip
        assert response.headers["content-type"] == "application/problem+json"
        return response.status_code, response.json()["code"]

    assert code(cron="61 * * * *") == (422, "invalid_cron")
    assert code(cron="* * * * *", timezone="Mars/Olympus") == (422, "unknown_timezone")
    assert code() == (422, "validation_error")  # neither cron nor interval
    assert code(cron="* * * * *", interval_seconds=5) == (422, "validation_error")  # both
    assert code(cron="* * * * *", queue="nope") == (404, "queue_not_found")
    admin.create_schedule(NS, name, queue="default", handler="h", cron="* * * * *")
    assert code(cron="* * * * *") == (409, "already_exists")
    with pytest.raises(ConflictError):
        admin.create_schedule(NS, name, queue="default", handler="h", cron="* * * * *")
    with pytest.raises(OrbitUsageError):
        admin.create_schedule(NS, _name(), queue="default", handler="h")  # checked before sending
    with OrbitClient(server.base_url, api_key=server.keys["read"]) as reader:
        assert reader.get_schedule(NS, name).name == name
        assert name in {s.name for s in reader.list_schedules(NS, limit=1000)}
        with pytest.raises(PermissionDeniedError):
            reader.pause_schedule(NS, name)
        with pytest.raises(PermissionDeniedError):
            reader.create_schedule(NS, _name(), queue="default", handler="h", cron="* * * * *")


def test_list_pages_by_name(server: RunningServer, admin: OrbitClient) -> None:
    prefix = f"page-{uuid.uuid4().hex[:4]}"
    for n in range(3):
        admin.create_schedule(NS, f"{prefix}-{n}", queue="default", handler="h", cron="0 0 1 1 *")
    mine = [s for s in admin.list_schedules(NS, limit=1000) if s.name.startswith(prefix)]
    assert [s.name for s in mine] == [f"{prefix}-{n}" for n in range(3)]
    first: list[Schedule] = admin.list_schedules(NS, limit=1, after=f"{prefix}-0")
    assert [s.name for s in first] == [f"{prefix}-1"]
