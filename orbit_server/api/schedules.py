"""Schedule routes: ``/v1/namespaces/{ns}/schedules`` (README "Schedules").

Create, update, pause, resume and delete need an ``admin`` key and are audited
(``schedule_events``); reads need any key of the namespace.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Response

from orbit_client import (
    NAME_PATTERN,
    Problem,
    Schedule,
    ScheduleCreate,
    ScheduleOccurrence,
    ScheduleUpdate,
    UTCDateTime,
)
from orbit_server.api.auth import Caller, authorize
from orbit_server.api.deps import STRICT_QUERY, EngineDep
from orbit_server.db.transact import transact
from orbit_server.schedules import schedules

__all__ = ["router"]

NamespaceName = Annotated[str, Path(pattern=NAME_PATTERN, description="Namespace name.")]
ScheduleName = Annotated[str, Path(pattern=NAME_PATTERN, description="Schedule name.")]
_PROBLEM: dict[str, Any] = {"model": Problem, "content": {"application/problem+json": {}}}
_ERRORS: dict[int | str, dict[str, Any]] = {status: _PROBLEM for status in (401, 403, 404, 422)}
_WRITE_ERRORS: dict[int | str, dict[str, Any]] = {**_ERRORS, 409: _PROBLEM}


router = APIRouter(prefix="/v1/namespaces/{namespace}/schedules", tags=["schedules"])


@router.post("", response_model=Schedule, status_code=201, responses=_WRITE_ERRORS)
def create_schedule(
    engine: EngineDep, namespace: NamespaceName, body: ScheduleCreate, caller: Caller
) -> Schedule:
    """Create a schedule (``admin`` key). Its first fire is its first fire time at or after now.

    ``422 invalid_cron`` / ``unknown_timezone`` / ``validation_error`` (both or neither of
    ``cron`` and ``interval_seconds``); ``404 queue_not_found``; ``409 already_exists``.
    """
    authorize(caller, namespace, "admin")
    return transact(engine, schedules.create_schedule, caller, body)


@router.get("", response_model=list[Schedule], responses=_ERRORS, dependencies=STRICT_QUERY)
def list_schedules(
    engine: EngineDep,
    namespace: NamespaceName,
    caller: Caller,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    after: Annotated[
        str | None, Query(pattern=NAME_PATTERN, description="Only schedules named after this (paging).")
    ] = None,
) -> list[Schedule]:
    """The namespace's schedules, by name."""
    authorize(caller, namespace, "read")
    return transact(engine, schedules.list_schedules, caller, limit=limit, after=after)


@router.get("/{name}", response_model=Schedule, responses=_ERRORS)
def get_schedule(engine: EngineDep, namespace: NamespaceName, name: ScheduleName, caller: Caller) -> Schedule:
    """One schedule; ``404 schedule_not_found``."""
    authorize(caller, namespace, "read")
    return transact(engine, schedules.get_schedule, caller, name)


@router.patch("/{name}", response_model=Schedule, responses=_WRITE_ERRORS)
def update_schedule(
    engine: EngineDep, namespace: NamespaceName, name: ScheduleName, body: ScheduleUpdate, caller: Caller
) -> Schedule:
    """Change the fields given (``admin`` key): a new ``version``. A changed trigger, time zone or
    bound recomputes ``next_fire_at``; fire times already handled never fire again."""
    authorize(caller, namespace, "admin")
    return transact(engine, schedules.update_schedule, caller, name, body)


@router.post("/{name}/pause", response_model=Schedule, responses=_WRITE_ERRORS)
def pause_schedule(
    engine: EngineDep, namespace: NamespaceName, name: ScheduleName, caller: Caller
) -> Schedule:
    """Stop firing (``admin`` key; idempotent)."""
    authorize(caller, namespace, "admin")
    return transact(engine, schedules.set_paused, caller, name, True)


@router.post("/{name}/resume", response_model=Schedule, responses=_WRITE_ERRORS)
def resume_schedule(
    engine: EngineDep, namespace: NamespaceName, name: ScheduleName, caller: Caller
) -> Schedule:
    """Fire again (``admin`` key; idempotent); fire times passed while paused follow the
    schedule's misfire policy."""
    authorize(caller, namespace, "admin")
    return transact(engine, schedules.set_paused, caller, name, False)


@router.delete("/{name}", status_code=204, response_class=Response, responses=_WRITE_ERRORS)
def delete_schedule(
    engine: EngineDep, namespace: NamespaceName, name: ScheduleName, caller: Caller
) -> Response:
    """Delete a schedule and its occurrences (``admin`` key); its tasks stay."""
    authorize(caller, namespace, "admin")
    transact(engine, schedules.delete_schedule, caller, name)
    return Response(status_code=204)


@router.get(
    "/{name}/occurrences",
    response_model=list[ScheduleOccurrence],
    responses=_ERRORS,
    dependencies=STRICT_QUERY,
)
def list_occurrences(
    engine: EngineDep,
    namespace: NamespaceName,
    name: ScheduleName,
    caller: Caller,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    before: Annotated[
        UTCDateTime | None,
        Query(
            description="Only fire times before this (RFC 3339 with an offset, e.g. 2026-01-01T00:00:00Z; paging)."
        ),
    ] = None,
) -> list[ScheduleOccurrence]:
    """The schedule's occurrences, newest fire time first: ``scheduled_at``, ``task_id``
    (``null`` when skipped), ``status`` and ``skip_reason``."""
    authorize(caller, namespace, "read")
    return transact(engine, schedules.list_occurrences, caller, name, limit=limit, before=before)
