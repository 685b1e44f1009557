"""Schedule calls of :class:`~orbit_client.OrbitClient` and :class:`~orbit_client.AsyncOrbitClient`:
create, read, list, change, pause, resume and delete schedules, list their occurrences
(README "Schedules").

Each call is one function that builds its :class:`~orbit_client._calls._Call` (no I/O); the two
mixins send it.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ValidationError

from orbit_client._calls import _Call, _check_limit, _many, _nothing, _one, _path, _Sends, _SendsAsync
from orbit_client._exceptions import OrbitUsageError
from orbit_client._schedule_models import Schedule, ScheduleCreate, ScheduleOccurrence, ScheduleUpdate

__all__: list[str] = []


def _schedule_body(model: type[BaseModel], what: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """Validate ``fields`` as ``model``; the JSON body of the fields given. Sends nothing."""
    try:
        value = model(**fields)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}"
            for e in exc.errors(include_url=False, include_input=False)
        )
        raise OrbitUsageError(f"invalid {what}, nothing was sent: {problems}") from None
    except TypeError as exc:
        raise OrbitUsageError(f"invalid {what}, nothing was sent: {exc}") from None
    return value.model_dump(mode="json", exclude_unset=True)


def _create_schedule(namespace: str, name: str, fields: Mapping[str, Any]) -> _Call[Schedule]:
    """``POST .../schedules``: not retried (a second call answers ``409 already_exists``)."""
    path = _path("/v1/namespaces/{}/schedules", namespace)
    body = _schedule_body(ScheduleCreate, "schedule", {"name": name, **fields})
    return _Call("POST", path, _one(Schedule), json=body, retry=False)


def _get_schedule(namespace: str, name: str) -> _Call[Schedule]:
    return _Call("GET", _path("/v1/namespaces/{}/schedules/{}", namespace, name), _one(Schedule))


def _list_schedules(namespace: str, limit: int, after: str | None) -> _Call[list[Schedule]]:
    params = _check_limit(limit)
    if after is not None:
        params["after"] = after
    return _Call("GET", _path("/v1/namespaces/{}/schedules", namespace), _many(Schedule), params=params)


def _update_schedule(namespace: str, name: str, changes: Mapping[str, Any]) -> _Call[Schedule]:
    """``PATCH .../schedules/{name}``: not retried (each call is a new version)."""
    path = _path("/v1/namespaces/{}/schedules/{}", namespace, name)
    body = _schedule_body(ScheduleUpdate, "schedule update", changes)
    return _Call("PATCH", path, _one(Schedule), json=body, retry=False)


def _control_schedule(namespace: str, name: str, action: str) -> _Call[Schedule]:
    """``POST .../schedules/{name}/pause`` or ``/resume``: idempotent, so retried."""
    return _Call("POST", _path("/v1/namespaces/{}/schedules/{}/" + action, namespace, name), _one(Schedule))


def _delete_schedule(namespace: str, name: str) -> _Call[None]:
    """``DELETE .../schedules/{name}``: not retried (a second call answers ``schedule_not_found``)."""
    return _Call("DELETE", _path("/v1/namespaces/{}/schedules/{}", namespace, name), _nothing, retry=False)


def _list_occurrences(
    namespace: str, name: str, limit: int, before: datetime | None
) -> _Call[list[ScheduleOccurrence]]:
    params = _check_limit(limit)
    if before is not None:
        if before.tzinfo is None:
            raise OrbitUsageError("before must carry a timezone offset (e.g. datetime.now(UTC))")
        params["before"] = before.astimezone(UTC).isoformat().replace("+00:00", "Z")
    path = _path("/v1/namespaces/{}/schedules/{}/occurrences", namespace, name)
    return _Call("GET", path, _many(ScheduleOccurrence), params=params)


class ScheduleCallsMixin(_Sends):
    """The schedule calls of :class:`~orbit_client.OrbitClient`."""

    def create_schedule(self, namespace: str, name: str, **fields: Any) -> Schedule:
        """Create a schedule (``admin`` key): ``POST /v1/namespaces/{ns}/schedules``.

        Args:
            name: unique in the namespace (pattern of queue names).
            fields: those of :class:`ScheduleCreate`: ``queue``, ``handler``, ``params``, exactly
                one of ``cron`` (five fields, in ``timezone``, default ``"UTC"``) and
                ``interval_seconds``, and optionally ``start_at``/``end_at`` (aware datetimes),
                ``misfire_policy`` (``skip``, ``run_once``, ``catch_up``), ``catch_up_max``,
                ``misfire_grace_seconds``, ``overlap_policy`` (``allow``, ``skip_if_running``),
                ``paused``, ``options`` (a :class:`SubmitOptions` or mapping).

        Not retried: if an answer is lost, a second call answers ``409 already_exists``; then
        :meth:`get_schedule` shows it.

        Raises:
            OrbitUsageError: invalid fields (e.g. both or neither of cron and interval); nothing sent.
            UnprocessableEntityError: ``invalid_cron`` or ``unknown_timezone``.
            NotFoundError: ``queue_not_found``. ConflictError: ``already_exists``.
            OrbitError: as for every call.
        """
        return self._send(_create_schedule(namespace, name, fields))

    def get_schedule(self, namespace: str, name: str) -> Schedule:
        """Fetch a schedule (``GET .../schedules/{name}``); ``NotFoundError`` ``schedule_not_found``."""
        return self._send(_get_schedule(namespace, name))

    def list_schedules(self, namespace: str, *, limit: int = 100, after: str | None = None) -> list[Schedule]:
        """The namespace's schedules by name, up to ``limit`` (1-1000), those named after ``after``."""
        return self._send(_list_schedules(namespace, limit, after))

    def update_schedule(self, namespace: str, name: str, **changes: Any) -> Schedule:
        """Change the given fields of a schedule (``admin`` key): ``PATCH .../schedules/{name}``.

        ``changes`` are fields of :class:`ScheduleUpdate`; the schedule gets a new ``version``. A
        changed ``cron``/``interval_seconds``/``timezone``/bound recomputes ``next_fire_at``;
        fire times already handled never fire again. Not retried (each call is a new version).

        Raises:
            OrbitUsageError: invalid or no fields; nothing was sent.
            NotFoundError: ``schedule_not_found``, ``queue_not_found``.
            UnprocessableEntityError: ``invalid_cron``, ``unknown_timezone``, ``invalid_schedule``.
            OrbitError: as for every call.
        """
        return self._send(_update_schedule(namespace, name, changes))

    def pause_schedule(self, namespace: str, name: str) -> Schedule:
        """Stop a schedule firing (``admin`` key; idempotent, retried)."""
        return self._send(_control_schedule(namespace, name, "pause"))

    def resume_schedule(self, namespace: str, name: str) -> Schedule:
        """Let a paused schedule fire again (``admin`` key; idempotent, retried). Fire times
        passed while it was paused follow its misfire policy."""
        return self._send(_control_schedule(namespace, name, "resume"))

    def delete_schedule(self, namespace: str, name: str) -> None:
        """Delete a schedule and its occurrences (``admin`` key); the tasks it created stay.

        Not retried: a lost answer makes a second call answer ``NotFoundError``
        ``schedule_not_found``, which then means it is gone.
        """
        return self._send(_delete_schedule(namespace, name))

    def list_occurrences(
        self, namespace: str, name: str, *, limit: int = 100, before: datetime | None = None
    ) -> list[ScheduleOccurrence]:
        """A schedule's occurrences, newest fire time first (``GET .../schedules/{name}/occurrences``).

        Each has ``scheduled_at`` (UTC), ``task_id`` (``None`` when skipped), ``status`` and
        ``skip_reason``. ``limit`` 1-1000; ``before`` (aware datetime) pages to older ones.
        """
        return self._send(_list_occurrences(namespace, name, limit, before))


class AsyncScheduleCallsMixin(_SendsAsync):
    """The schedule calls of :class:`~orbit_client.AsyncOrbitClient` (async twins)."""

    async def create_schedule(self, namespace: str, name: str, **fields: Any) -> Schedule:
        """Async twin of :meth:`OrbitClient.create_schedule` (not retried)."""
        return await self._send(_create_schedule(namespace, name, fields))

    async def get_schedule(self, namespace: str, name: str) -> Schedule:
        """Async twin of :meth:`OrbitClient.get_schedule`."""
        return await self._send(_get_schedule(namespace, name))

    async def list_schedules(
        self, namespace: str, *, limit: int = 100, after: str | None = None
    ) -> list[Schedule]:
        """Async twin of :meth:`OrbitClient.list_schedules`."""
        return await self._send(_list_schedules(namespace, limit, after))

    async def update_schedule(self, namespace: str, name: str, **changes: Any) -> Schedule:
        """Async twin of :meth:`OrbitClient.update_schedule` (not retried)."""
        return await self._send(_update_schedule(namespace, name, changes))

    async def pause_schedule(self, namespace: str, name: str) -> Schedule:
        """Async twin of :meth:`OrbitClient.pause_schedule`."""
        return await self._send(_control_schedule(namespace, name, "pause"))

    async def resume_schedule(self, namespace: str, name: str) -> Schedule:
        """Async twin of :meth:`OrbitClient.resume_schedule`."""
        return await self._send(_control_schedule(namespace, name, "resume"))

    async def delete_schedule(self, namespace: str, name: str) -> None:
        """Async twin of :meth:`OrbitClient.delete_schedule` (not retried)."""
        return await self._send(_delete_schedule(namespace, name))

    async def list_occurrences(
        self, namespace: str, name: str, *, limit: int = 100, before: datetime | None = None
    ) -> list[ScheduleOccurrence]:
        """Async twin of :meth:`OrbitClient.list_occurrences`."""
        return await self._send(_list_occurrences(namespace, name, limit, before))
