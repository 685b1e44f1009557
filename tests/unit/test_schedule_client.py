"""The schedule calls of OrbitClient / AsyncOrbitClient, against respx mocks."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
import respx

from orbit_client import (
    AsyncOrbitClient,
    ConflictError,
    MisfirePolicy,
    NotFoundError,
    OccurrenceStatus,
    OrbitClient,
    OrbitUsageError,
    RetryPolicy,
    Schedule,
    ScheduleOccurrence,
    UnprocessableEntityError,
)

BASE = "https://orbit.test"
SCHEDULES = f"{BASE}/v1/namespaces/acme/schedules"


def schedule_json(**changes: Any) -> dict[str, Any]:
    return {
        "id": "5f0c2b8e-1d2a-4b8e-9c1f-0a1b2c3d4e5f",
        "namespace": "acme",
        "name": "nightly",
        "queue": "reports",
        "handler": "reports.nightly",
        "params": {"kind": "daily"},
        "cron": "30 2 * * *",
        "interval_seconds": None,
        "timezone": "Europe/Berlin",
        "start_at": "2026-01-01T00:00:00Z",
        "end_at": None,
        "next_fire_at": "2026-03-29T01:00:00Z",
        "misfire_policy": "run_once",
        "catch_up_max": 10,
        "misfire_grace_seconds": 60,
        "overlap_policy": "allow",
        "paused": False,
        "options": None,
        "version": 1,
        "last_fired_at": None,
        "created_at": "2026-01-01T00:00:00.000000Z",
        "updated_at": "2026-01-01T00:00:00.000000Z",
        **changes,
    }


def occurrence_json(at: str, task_id: str | None = "t-1") -> dict[str, Any]:
    return {
        "schedule": "nightly",
        "scheduled_at": at,
        "task_id": task_id,
        "status": "created" if task_id else "skipped",
        "skip_reason": None if task_id else "overlap: the previous occurrence's task t-0 is not finished",
        "schedule_version": 1,
        "misfired": False,
        "created_at": at,
    }


def problem(status: int, code: str) -> httpx.Response:
    body = {"title": code, "status": status, "code": code}
    return httpx.Response(status, json=body, headers={"content-type": "application/problem+json"})


def client() -> OrbitClient:
    return OrbitClient(BASE, api_key="k", retry=RetryPolicy.no_wait())


@respx.mock
def test_create_schedule_sends_only_what_was_given_and_is_not_retried() -> None:
    route = respx.post(SCHEDULES).mock(side_effect=[problem(503, "unavailable")])
    with client() as orbit, pytest.raises(Exception) as caught:
        orbit.create_schedule(
            "acme", "nightly", queue="reports", handler="reports.nightly", cron="30 2 * * *"
        )
    assert route.call_count == 1 and getattr(caught.value, "status_code", None) == 503
    route.mock(side_effect=None, return_value=httpx.Response(201, json=schedule_json()))
    with client() as orbit:
        created = orbit.create_schedule(
            "acme", "nightly", queue="reports", handler="reports.nightly", params={"kind": "daily"},
            cron="30 2 * * *", timezone="Europe/Berlin", misfire_policy="run_once",
            start_at=datetime(2026, 1, 1, tzinfo=UTC),
        )  # fmt: skip
    assert created == Schedule.model_validate(schedule_json())
    assert created.misfire_policy is MisfirePolicy.RUN_ONCE and created.next_fire_at is not None
    assert json.loads(route.calls.last.request.content) == {
        "name": "nightly",
        "queue": "reports",
        "handler": "reports.nightly",
        "params": {"kind": "daily"},
        "cron": "30 2 * * *",
        "timezone": "Europe/Berlin",
        "misfire_policy": "run_once",
        "start_at": "2026-01-01T00:00:00.000000Z",
    }


@respx.mock
def test_bad_schedule_arguments_send_nothing() -> None:
    route = respx.route(url__startswith=SCHEDULES).respond(201, json=schedule_json())
    with client() as orbit:
        with pytest.raises(OrbitUsageError, match="exactly one of cron and interval_seconds"):
            orbit.create_schedule("acme", "nightly", queue="reports", handler="h")
        with pytest.raises(OrbitUsageError, match="exactly one of cron and interval_seconds"):
            orbit.create_schedule(
                "acme", "nightly", queue="reports", handler="h", cron="* * * * *", interval_seconds=5
            )
        with pytest.raises(OrbitUsageError, match="interval_seconds"):
            orbit.create_schedule("acme", "nightly", queue="reports", handler="h", interval_seconds=0)
        with pytest.raises(OrbitUsageError, match="misfire_policy"):
            orbit.create_schedule(
                "acme", "nightly", queue="q", handler="h", cron="* * * * *", misfire_policy="later"
            )
        with pytest.raises(OrbitUsageError, match="name"):
            orbit.create_schedule("acme", "bad name", queue="q", handler="h", cron="* * * * *")
        with pytest.raises(OrbitUsageError, match="no_such_field"):
            orbit.create_schedule("acme", "n", queue="q", handler="h", cron="* * * * *", no_such_field=1)
        with pytest.raises(OrbitUsageError, match="at least one field"):
            orbit.update_schedule("acme", "nightly")
        with pytest.raises(OrbitUsageError, match="limit"):
            orbit.list_occurrences("acme", "nightly", limit=0)
        with pytest.raises(OrbitUsageError, match="timezone offset"):
            orbit.list_occurrences("acme", "nightly", before=datetime(2026, 1, 1))
    assert route.call_count == 0


@respx.mock
def test_server_refusals_map_to_errors() -> None:
    respx.post(SCHEDULES).mock(side_effect=[problem(422, "invalid_cron"), problem(409, "already_exists")])
    respx.get(f"{SCHEDULES}/gone").mock(return_value=problem(404, "schedule_not_found"))
    with client() as orbit:
        with pytest.raises(UnprocessableEntityError) as invalid:
            orbit.create_schedule("acme", "nightly", queue="q", handler="h", cron="61 * * * *")
        assert invalid.value.code == "invalid_cron"
        with pytest.raises(ConflictError) as taken:
            orbit.create_schedule("acme", "nightly", queue="q", handler="h", cron="* * * * *")
        assert taken.value.code == "already_exists"
        with pytest.raises(NotFoundError) as missing:
            orbit.get_schedule("acme", "gone")
        assert missing.value.code == "schedule_not_found"


@respx.mock
def test_update_sends_a_patch_of_the_changed_fields() -> None:
    route = respx.patch(f"{SCHEDULES}/nightly").respond(json=schedule_json(cron="0 4 * * *", version=2))
    with client() as orbit:
        updated = orbit.update_schedule("acme", "nightly", cron="0 4 * * *", params=None)
    assert updated.version == 2
    assert json.loads(route.calls.last.request.content) == {"cron": "0 4 * * *", "params": None}


@respx.mock
def test_pause_resume_are_retried_and_delete_is_not() -> None:
    pause = respx.post(f"{SCHEDULES}/nightly/pause").mock(
        side_effect=[problem(503, "unavailable"), httpx.Response(200, json=schedule_json(paused=True))]
    )
    resume = respx.post(f"{SCHEDULES}/nightly/resume").respond(json=schedule_json())
    delete = respx.delete(f"{SCHEDULES}/nightly").respond(204)
    with client() as orbit:
        assert orbit.pause_schedule("acme", "nightly").paused
        assert not orbit.resume_schedule("acme", "nightly").paused
        assert orbit.delete_schedule("acme", "nightly") is None
    assert pause.call_count == 2 and resume.call_count == 1 and delete.call_count == 1


@respx.mock
def test_list_schedules_and_occurrences_with_paging() -> None:
    listing = respx.get(SCHEDULES).respond(json=[schedule_json(), schedule_json(name="other")])
    occurrences = respx.get(f"{SCHEDULES}/nightly/occurrences").respond(
        json=[occurrence_json("2026-03-29T01:00:00Z"), occurrence_json("2026-03-28T01:30:00Z", None)]
    )
    with client() as orbit:
        assert [s.name for s in orbit.list_schedules("acme", limit=5, after="a")] == ["nightly", "other"]
        found = orbit.list_occurrences("acme", "nightly", limit=2, before=datetime(2026, 3, 30, tzinfo=UTC))
    assert dict(listing.calls.last.request.url.params) == {"limit": "5", "after": "a"}
    assert dict(occurrences.calls.last.request.url.params) == {"limit": "2", "before": "2026-03-30T00:00:00Z"}
    assert found[0] == ScheduleOccurrence.model_validate(occurrence_json("2026-03-29T01:00:00Z"))
    assert found[1].task_id is None and found[1].status is OccurrenceStatus.SKIPPED


@respx.mock
async def test_async_client_has_the_same_calls() -> None:
    respx.post(SCHEDULES).respond(201, json=schedule_json())
    respx.get(SCHEDULES).respond(json=[schedule_json()])
    respx.get(f"{SCHEDULES}/nightly").respond(json=schedule_json())
    respx.patch(f"{SCHEDULES}/nightly").respond(json=schedule_json(version=2))
    respx.post(f"{SCHEDULES}/nightly/pause").respond(json=schedule_json(paused=True))
    respx.post(f"{SCHEDULES}/nightly/resume").respond(json=schedule_json())
    respx.delete(f"{SCHEDULES}/nightly").respond(204)
    respx.get(f"{SCHEDULES}/nightly/occurrences").respond(json=[occurrence_json("2026-03-29T01:00:00Z")])
    async with AsyncOrbitClient(BASE, api_key="k", retry=RetryPolicy.no_wait()) as orbit:
        created = await orbit.create_schedule(
            "acme", "nightly", queue="reports", handler="h", cron="30 2 * * *"
        )
        assert created.name == "nightly"
        assert [s.name for s in await orbit.list_schedules("acme")] == ["nightly"]
        assert (await orbit.get_schedule("acme", "nightly")).version == 1
        assert (await orbit.update_schedule("acme", "nightly", handler="h2")).version == 2
        assert (await orbit.pause_schedule("acme", "nightly")).paused
        assert not (await orbit.resume_schedule("acme", "nightly")).paused
        assert [o.task_id for o in await orbit.list_occurrences("acme", "nightly")] == ["t-1"]
        await orbit.delete_schedule("acme", "nightly")
        with pytest.raises(OrbitUsageError):
            await orbit.create_schedule("acme", "nightly", queue="reports", handler="h")
