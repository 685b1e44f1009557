"""Wire models of schedules (``/v1/namespaces/{ns}/schedules``), shared by client and server.

A schedule creates a task at each of its fire times: from a cron expression evaluated in an
IANA time zone, or every ``interval_seconds`` (UTC) from its start bound. Every fire time
gives exactly one task, whose idempotency key is ``schedule:{schedule id}:{fire time}``.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Self

from pydantic import ConfigDict, Field, StrictBool, StrictInt, model_validator

from ._models import NAME_PATTERN, JsonData, UTCDateTime, _Wire
from ._task_models import SubmitOptions

__all__ = [
    "MisfirePolicy",
    "OccurrenceStatus",
    "OverlapPolicy",
    "Schedule",
    "ScheduleCreate",
    "ScheduleOccurrence",
    "ScheduleUpdate",
]


class MisfirePolicy(enum.StrEnum):
    """What to do with fire times missed by more than ``misfire_grace_seconds`` (servers down, paused).

    ``skip``: none of them; the next fire is the next future one. ``run_once``: one task, for the
    latest missed time. ``catch_up``: one task for each of the latest ``catch_up_max`` missed times.
    """

    SKIP = "skip"
    RUN_ONCE = "run_once"
    CATCH_UP = "catch_up"


class OverlapPolicy(enum.StrEnum):
    """``allow``: fire whatever the previous task does. ``skip_if_running``: while the previous
    occurrence's task is not finished (``SUCCEEDED``, ``FAILED``, ``CANCELLED``), record the fire
    time as ``skipped`` without a task."""

    ALLOW = "allow"
    SKIP_IF_RUNNING = "skip_if_running"


class OccurrenceStatus(enum.StrEnum):
    """``created``: the fire time created its task. ``skipped``: it did not (see ``skip_reason``)."""

    CREATED = "created"
    SKIPPED = "skipped"


_HANDLER = r"^[\x21-\x7e]+$"
#: Longest accepted interval: 366 days, in seconds.
MAX_INTERVAL_SECONDS = 366 * 86400


class ScheduleCreate(_Wire):
    """Body of ``POST /v1/namespaces/{ns}/schedules``.

    Exactly one of ``cron`` (five fields: minute hour day-of-month month day-of-week, evaluated
    in ``timezone``) and ``interval_seconds`` (every N seconds of UTC from ``start_at``, or from
    the creation time) must be given. ``start_at``/``end_at`` bound the fire times (inclusive,
    UTC). ``misfire_grace_seconds``: a fire time found due later than this is missed and handled
    by ``misfire_policy``. ``params`` (default ``{}``, as for a submission) and ``options`` are
    those of every task the schedule creates.
    """

    name: str = Field(pattern=NAME_PATTERN)
    queue: str = Field(pattern=NAME_PATTERN)
    handler: str = Field(min_length=1, max_length=255, pattern=_HANDLER)
    params: JsonData = Field(default_factory=dict)
    cron: str | None = Field(default=None, min_length=1, max_length=255)
    interval_seconds: StrictInt | None = Field(default=None, ge=1, le=MAX_INTERVAL_SECONDS)
    timezone: str = Field(default="UTC", min_length=1, max_length=64)
    start_at: UTCDateTime | None = None
    end_at: UTCDateTime | None = None
    misfire_policy: MisfirePolicy = MisfirePolicy.SKIP
    catch_up_max: StrictInt = Field(default=10, ge=1, le=1000)
    misfire_grace_seconds: StrictInt = Field(default=60, ge=0, le=86400)
    overlap_policy: OverlapPolicy = OverlapPolicy.ALLOW
    paused: StrictBool = False
    options: SubmitOptions | None = None

    @model_validator(mode="after")
    def _one_trigger(self) -> Self:
        if (self.cron is None) == (self.interval_seconds is None):
            raise ValueError("give exactly one of cron and interval_seconds")
        if self.start_at is not None and self.end_at is not None and self.end_at < self.start_at:
            raise ValueError("end_at is before start_at")
        return self


class ScheduleUpdate(_Wire):
    """Body of ``PATCH /v1/namespaces/{ns}/schedules/{name}``: the fields to change (others kept).

    Giving ``cron`` drops ``interval_seconds`` and the reverse; giving both is an error. Any
    change makes a new ``version``; a changed trigger, time zone or bound recomputes
    ``next_fire_at`` from now (fire times already past are not fired again). ``null`` clears a
    field a schedule may be without (``params``, ``cron`` or ``interval_seconds``, ``start_at``,
    ``end_at``, ``options``); for any other field it is refused (422 ``invalid_schedule``).
    """

    queue: str | None = Field(default=None, pattern=NAME_PATTERN)
    handler: str | None = Field(default=None, min_length=1, max_length=255, pattern=_HANDLER)
    params: JsonData = None
    cron: str | None = Field(default=None, min_length=1, max_length=255)
    interval_seconds: StrictInt | None = Field(default=None, ge=1, le=MAX_INTERVAL_SECONDS)
    timezone: str | None = Field(default=None, min_length=1, max_length=64)
    start_at: UTCDateTime | None = None
    end_at: UTCDateTime | None = None
    misfire_policy: MisfirePolicy | None = None
    catch_up_max: StrictInt | None = Field(default=None, ge=1, le=1000)
    misfire_grace_seconds: StrictInt | None = Field(default=None, ge=0, le=86400)
    overlap_policy: OverlapPolicy | None = None
    options: SubmitOptions | None = None

    @model_validator(mode="after")
    def _at_most_one_trigger(self) -> Self:
        if self.cron is not None and self.interval_seconds is not None:
            raise ValueError("give at most one of cron and interval_seconds")
        if not self.model_fields_set:
            raise ValueError("give at least one field to change")
        return self


class Schedule(_Wire):
    """A schedule as the server reports it. ``next_fire_at`` is ``None`` once ``end_at`` is passed."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str
    namespace: str
    name: str
    queue: str
    handler: str
    params: JsonData = None
    cron: str | None = None
    interval_seconds: int | None = None
    timezone: str
    start_at: datetime | None = None
    end_at: datetime | None = None
    next_fire_at: datetime | None = None
    misfire_policy: MisfirePolicy
    catch_up_max: int
    misfire_grace_seconds: int
    overlap_policy: OverlapPolicy
    paused: bool
    options: SubmitOptions | None = None
    version: int
    last_fired_at: datetime | None = None
    created_at: datetime
    updated_at: datetime


class ScheduleOccurrence(_Wire):
    """One fire time of a schedule and what it did: the task it created, or why it was skipped."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    schedule: str
    scheduled_at: datetime
    task_id: str | None = None
    status: OccurrenceStatus
    skip_reason: str | None = None
    schedule_version: int
    #: ``True`` when the fire time was handled later than ``misfire_grace_seconds``.
    misfired: bool = False
    created_at: datetime
