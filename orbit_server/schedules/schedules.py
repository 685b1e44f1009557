"""All of the server's SQL for schedules: their definitions, and the fire transaction (README "Schedules").

A fire (§4, §5 "调度触发" of seed 001) is one transaction per claimed schedule: a conditional
update of the schedule (on ``version``, ``next_fire_at`` and ``paused``, row count checked) moves
its next fire point, and in the same transaction each due fire time writes its occurrence and, if
it is not skipped, its task exactly as an accepted submission (submission key
``schedule:{schedule id}:{fire time RFC 3339}``, the ``WAITING`` task, its ``accepted`` event).
The claim reads due schedules ``FOR UPDATE SKIP LOCKED`` where the dialect has it (SQLite: one
writer, ``BEGIN IMMEDIATE``); correctness rests on the conditional update, not on the lock.

The key has no version in it: a fire time gives exactly one task whatever the updates, and an
update never moves ``next_fire_at`` to or before a fire time already handled.
"""

from __future__ import annotations

import logging
import uuid
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine, RowMapping

from orbit_client import (
    MisfirePolicy,
    OccurrenceStatus,
    OverlapPolicy,
    Schedule,
    ScheduleCreate,
    ScheduleOccurrence,
    ScheduleUpdate,
    SubmitOptions,
    TaskStatus,
    TaskSubmission,
)
from orbit_server import errors
from orbit_server.db.engine import (
    as_db_time,
    db_now,
    db_now_expression,
    insert_unique,
    is_lock_conflict,
    to_naive_utc,
    to_utc,
)
from orbit_server.db.schema import (
    namespaces,
    queues,
    schedule_events,
    schedule_occurrences,
    schedules,
    submission_keys,
    task_events,
    tasks,
)
from orbit_server.schedules.firetimes import Trigger, bad_cron, bad_timezone, format_fire_time
from orbit_server.tasks.store import Principal, accepted_event_row, key_row, request_digest, task_row

__all__ = [
    "InvalidCron",
    "InvalidSchedule",
    "ScheduleNotFound",
    "UnknownTimezone",
    "create_schedule",
    "delete_schedule",
    "fire_due",
    "get_schedule",
    "idempotency_key",
    "list_occurrences",
    "list_schedules",
    "set_paused",
    "update_schedule",
]

log = logging.getLogger("orbit_server.schedules")

#: Task states after which a skip_if_running schedule fires again.
_FINISHED = frozenset({TaskStatus.SUCCEEDED.value, TaskStatus.FAILED.value, TaskStatus.CANCELLED.value})
#: Most on-time fire times one schedule fires in one transaction; the rest wait for the next pass.
MAX_FIRES_PER_PASS = 100


class InvalidCron(errors.OrbitServerError):
    status, code, title = 422, "invalid_cron", "The cron expression is not valid"


class UnknownTimezone(errors.OrbitServerError):
    status, code, title = 422, "unknown_timezone", "Unknown time zone"


class InvalidSchedule(errors.OrbitServerError):
    status, code, title = 422, "invalid_schedule", "The schedule is not valid"


class ScheduleNotFound(errors.OrbitServerError):
    status, code, title = 404, "schedule_not_found", "Schedule not found"


def idempotency_key(schedule_id: str, scheduled_at: datetime) -> str:
    """The submission key of the task of one fire time: ``schedule:{id}:{RFC 3339 UTC}``."""
    return f"schedule:{schedule_id}:{format_fire_time(scheduled_at)}"


def _check_trigger(cron: str | None, timezone: str) -> None:
    if cron is not None and (problem := bad_cron(cron)):
        raise InvalidCron(problem + "; five fields: minute hour day-of-month month day-of-week")
    if problem := bad_timezone(timezone):
        raise UnknownTimezone(problem)


def _trigger(row: RowMapping | dict[str, Any]) -> Trigger:
    return Trigger(
        cron=row["cron"],
        interval_seconds=row["interval_seconds"],
        timezone=row["timezone"],
        start_at=row["start_at"],
        end_at=row["end_at"],
    )


def _queue_id(conn: Connection, principal: Principal, queue: str) -> int:
    queue_id = conn.execute(
        sa.select(queues.c.id).where(queues.c.namespace_id == principal.namespace_id, queues.c.name == queue)
    ).scalar()
    if queue_id is None:
        raise errors.QueueNotFound(
            f"queue {queue!r} does not exist in namespace {principal.namespace!r}; "
            "create it with `orbit-server queue create`"
        )
    return int(queue_id)


def _select() -> sa.Select[Any]:
    return sa.select(
        schedules, namespaces.c.name.label("namespace_name"), queues.c.name.label("queue_name")
    ).select_from(
        schedules.join(namespaces, namespaces.c.id == schedules.c.namespace_id).join(
            queues, queues.c.id == schedules.c.queue_id
        )
    )


def _from_row(row: RowMapping) -> Schedule:
    return Schedule(
        id=row["id"],
        namespace=row["namespace_name"],
        name=row["name"],
        queue=row["queue_name"],
        handler=row["handler"],
        params=row["params"],
        cron=row["cron"],
        interval_seconds=row["interval_seconds"],
        timezone=row["timezone"],
        start_at=to_utc(row["start_at"]),
        end_at=to_utc(row["end_at"]),
        next_fire_at=to_utc(row["next_fire_at"]),
        misfire_policy=MisfirePolicy(row["misfire_policy"]),
        catch_up_max=row["catch_up_max"],
        misfire_grace_seconds=row["misfire_grace_seconds"],
        overlap_policy=OverlapPolicy(row["overlap_policy"]),
        paused=bool(row["paused"]),
        options=SubmitOptions.model_validate(row["options"]) if row["options"] is not None else None,
        version=row["version"],
        last_fired_at=to_utc(row["last_fired_at"]),
        created_at=to_utc(row["created_at"]),
        updated_at=to_utc(row["updated_at"]),
    )


def _read(conn: Connection, principal: Principal, name: str, *, lock: bool = False) -> RowMapping:
    where = (schedules.c.namespace_id == principal.namespace_id, schedules.c.name == name)
    if lock:  # lock the schedules row alone (MariaDB has no FOR UPDATE OF)
        conn.execute(sa.select(schedules.c.id).where(*where).with_for_update()).first()
    row = conn.execute(_select().where(*where)).mappings().first()
    if row is None:
        raise ScheduleNotFound(f"schedule {name!r} does not exist in namespace {principal.namespace!r}")
    return row


def _actor(principal: Principal) -> str:
    """Who made a change: the API key, or the ``orbit-server`` command line (key id 0)."""
    return f"api_key:{principal.key_id}" if principal.key_id else "orbit-server cli"


def _audit(
    conn: Connection, principal: Principal, row: RowMapping | dict[str, Any], event: str, version: int,
    now: datetime, data: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    conn.execute(
        schedule_events.insert().values(
            namespace_id=principal.namespace_id,
            schedule_id=row["id"],
            schedule_name=row["name"],
            event=event,
            version=version,
            actor=_actor(principal),
            data=data,
            created_at=now,
        )
    )


def _first_fire(trigger: Trigger, now: datetime, after: datetime | None) -> datetime | None:
    """The first fire time at or after now (and strictly after ``after``, the last one handled)."""
    lo = now if after is None else max(now, after + timedelta(microseconds=1))
    return next(iter(trigger.fires_from(lo)), None)


# ------------------------------------------------------------------- definitions


def create_schedule(conn: Connection, principal: Principal, body: ScheduleCreate) -> Schedule:
    """Insert a schedule (version 1); its first fire is the first fire time at or after now.

    Raises:
        InvalidCron, UnknownTimezone: 422.
        errors.QueueNotFound: 404. errors.NameTaken: 409, the name is taken in the namespace.
    """
    _check_trigger(body.cron, body.timezone)
    queue_id = _queue_id(conn, principal, body.queue)
    taken = conn.execute(
        sa.select(schedules.c.id).where(
            schedules.c.namespace_id == principal.namespace_id, schedules.c.name == body.name
        )
    ).first()
    name_taken = errors.NameTaken(
        f"schedule {body.name!r} already exists in namespace {principal.namespace!r}"
    )
    if taken:
        raise name_taken
    now = db_now(conn)
    start_at = to_naive_utc(body.start_at) or now.replace(microsecond=0)
    values: dict[str, Any] = {
        "id": str(uuid.uuid4()),
        "namespace_id": principal.namespace_id,
        "name": body.name,
        "queue_id": queue_id,
        "handler": body.handler,
        "params": body.params,
        "options": body.options.model_dump(mode="json", exclude_none=True) if body.options else None,
        "cron": body.cron,
        "interval_seconds": body.interval_seconds,
        "timezone": body.timezone,
        "start_at": start_at,
        "end_at": to_naive_utc(body.end_at),
        "misfire_policy": body.misfire_policy.value,
        "catch_up_max": body.catch_up_max,
        "misfire_grace_seconds": body.misfire_grace_seconds,
        "overlap_policy": body.overlap_policy.value,
        "paused": body.paused,
        "version": 1,
        "last_fired_at": None,
        "last_task_id": None,
        "created_at": now,
        "updated_at": now,
    }
    values["next_fire_at"] = _first_fire(_trigger(values), now, None)
    # A concurrent create of the name (every app instance's start-up "make sure my schedule exists")
    # loses on the unique index: 409 like any taken name, never a 500 (README "Schedules").
    insert_unique(conn, schedules.insert().values(values), name_taken)
    _audit(conn, principal, values, "created", 1, now)
    return _from_row(_read(conn, principal, body.name))


def get_schedule(conn: Connection, principal: Principal, name: str) -> Schedule:
    """One schedule; raises :class:`ScheduleNotFound` (404)."""
    return _from_row(_read(conn, principal, name))


def list_schedules(
    conn: Connection, principal: Principal, *, limit: int = 100, after: str | None = None
) -> list[Schedule]:
    """Up to ``limit`` schedules of the namespace by name, those after the name ``after`` (paging)."""
    query = _select().where(schedules.c.namespace_id == principal.namespace_id)
    if after is not None:
        query = query.where(schedules.c.name > after)
    rows = conn.execute(query.order_by(schedules.c.name).limit(limit)).mappings()
    return [_from_row(row) for row in rows]


_TRIGGER_FIELDS = frozenset({"cron", "interval_seconds", "timezone", "start_at", "end_at"})


def update_schedule(conn: Connection, principal: Principal, name: str, body: ScheduleUpdate) -> Schedule:
    """Change the fields given in ``body``: a new ``version``. A changed trigger, time zone or bound
    recomputes ``next_fire_at`` (at or after now, after the last fire time handled).

    Raises:
        ScheduleNotFound, errors.QueueNotFound: 404. InvalidCron, UnknownTimezone: 422.
    """
    row = _read(conn, principal, name, lock=True)
    given = body.model_fields_set
    values: dict[str, Any] = {}
    for field in ("handler", "params", "timezone", "cron", "interval_seconds", "catch_up_max",
                  "misfire_grace_seconds"):  # fmt: skip
        if field in given:
            values[field] = getattr(body, field)
    # null clears what a schedule may be without (params, cron or interval, bounds, options); a field
    # it cannot be without refuses null, the same for each (leaving the field out keeps it).
    for field in ("queue", "handler", "timezone", "misfire_policy", "overlap_policy", "catch_up_max",
                  "misfire_grace_seconds"):  # fmt: skip
        if field in given and getattr(body, field) is None:
            raise InvalidSchedule(f"{field} cannot be null; leave it out to keep it")
    for field in ("misfire_policy", "overlap_policy"):
        if field in given:
            values[field] = getattr(body, field).value
    if "cron" in given and body.cron is not None:
        values["interval_seconds"] = None
    if "interval_seconds" in given and body.interval_seconds is not None:
        values["cron"] = None
    for field in ("start_at", "end_at"):
        if field in given:
            values[field] = to_naive_utc(getattr(body, field))
    if "options" in given:
        values["options"] = body.options.model_dump(mode="json", exclude_none=True) if body.options else None
    if "queue" in given and body.queue is not None:
        values["queue_id"] = _queue_id(conn, principal, body.queue)
    merged = dict(row) | values
    if merged["cron"] is None and merged["interval_seconds"] is None:
        raise InvalidSchedule("a schedule needs a cron expression or interval_seconds; it would have neither")
    now = db_now(conn)
    if merged["start_at"] is None:
        merged["start_at"] = values["start_at"] = row["created_at"].replace(microsecond=0)
    if merged["end_at"] is not None and merged["end_at"] < merged["start_at"]:
        raise InvalidSchedule("end_at is before start_at")
    _check_trigger(merged["cron"], merged["timezone"])
    if _TRIGGER_FIELDS & given:
        values["next_fire_at"] = _first_fire(_trigger(merged), now, row["last_fired_at"])
    version = row["version"] + 1
    values.update(version=version, updated_at=now)
    changed = conn.execute(
        schedules.update()
        .where(schedules.c.id == row["id"], schedules.c.version == row["version"])
        .values(values)
    ).rowcount
    if changed != 1:
        raise errors.ConcurrentUpdate("the schedule changed while the request ran; retry")
    _audit(conn, principal, row, "updated", version, now, {"fields": sorted(given)})
    return _from_row(_read(conn, principal, name))


def set_paused(conn: Connection, principal: Principal, name: str, paused: bool) -> Schedule:
    """Pause or resume a schedule (idempotent; a change is audited). ``version`` is kept.

    A resumed schedule keeps its ``next_fire_at``: the fire times passed while paused are
    handled by its misfire policy. Raises :class:`ScheduleNotFound` (404).
    """
    row = _read(conn, principal, name, lock=True)
    if bool(row["paused"]) != paused:
        now = db_now(conn)
        changed = conn.execute(
            schedules.update()
            .where(schedules.c.id == row["id"], schedules.c.paused == (not paused))
            .values(paused=paused, updated_at=now)
        ).rowcount
        if changed != 1:
            raise errors.ConcurrentUpdate("the schedule changed while the request ran; retry")
        _audit(conn, principal, row, "paused" if paused else "resumed", row["version"], now)
    return _from_row(_read(conn, principal, name))


def delete_schedule(conn: Connection, principal: Principal, name: str) -> None:
    """Delete a schedule and its occurrences (audited); the tasks it created and their
    submission keys stay. Raises :class:`ScheduleNotFound` (404)."""
    row = _read(conn, principal, name, lock=True)
    conn.execute(schedule_occurrences.delete().where(schedule_occurrences.c.schedule_id == row["id"]))
    conn.execute(schedules.delete().where(schedules.c.id == row["id"]))
    _audit(conn, principal, row, "deleted", row["version"], db_now(conn))


def list_occurrences(
    conn: Connection, principal: Principal, name: str, *, limit: int = 100, before: datetime | None = None
) -> list[ScheduleOccurrence]:
    """A schedule's occurrences, newest fire time first; those before ``before`` (UTC) for paging."""
    row = _read(conn, principal, name)
    query = sa.select(schedule_occurrences).where(schedule_occurrences.c.schedule_id == row["id"])
    if before is not None:
        cut = before if before.tzinfo is None else to_naive_utc(before)  # naive: already UTC
        query = query.where(schedule_occurrences.c.scheduled_at < cut)
    found = conn.execute(query.order_by(schedule_occurrences.c.scheduled_at.desc()).limit(limit)).mappings()
    return [
        ScheduleOccurrence(
            schedule=name,
            scheduled_at=to_utc(o["scheduled_at"]),
            task_id=o["task_id"],
            status=OccurrenceStatus(o["status"]),
            skip_reason=o["skip_reason"],
            schedule_version=o["schedule_version"],
            misfired=bool(o["misfired"]),
            created_at=to_utc(o["created_at"]),
        )
        for o in found
    ]


# ------------------------------------------------------------------------ fires


def plan_fires(
    trigger: Trigger,
    next_fire_at: datetime,
    now: datetime,
    *,
    policy: MisfirePolicy,
    catch_up_max: int,
    grace_seconds: int,
    limit: int = MAX_FIRES_PER_PASS,
) -> tuple[list[tuple[datetime, bool]], datetime | None]:
    """The fire times a pass handles, and the schedule's next fire point.

    Fire times in ``[next_fire_at, now]`` no older than ``grace_seconds`` are on time and all
    fire (the earliest ``limit`` of them in one pass). Older ones are missed: ``skip`` fires none,
    ``run_once`` the latest one (only when no fire time is on time), ``catch_up`` the latest
    ``catch_up_max``. Returns ``([(fire time, misfired), ...] ascending, next fire point)``.
    """
    cutoff = now - timedelta(seconds=grace_seconds)
    on_time = trigger.first_fires(max(next_fire_at, cutoff), now, limit)
    missed_hi = cutoff - timedelta(microseconds=1)
    missed: list[datetime] = []
    if policy is MisfirePolicy.CATCH_UP:
        missed = trigger.latest(next_fire_at, missed_hi, catch_up_max)
    elif policy is MisfirePolicy.RUN_ONCE and not on_time:
        missed = trigger.latest(next_fire_at, missed_hi, 1)
    fires = [(t, True) for t in missed] + [(t, False) for t in on_time]
    # More on-time fire times than one pass takes: continue after the last one taken.
    following = trigger.next_fire(on_time[-1] if len(on_time) == limit else now)
    return fires, following


_CLAIM_LIMIT = 20


def fire_due(engine: Engine, *, default_max_attempts: int, key_ttl: timedelta) -> int:
    """Fire every due schedule once (one pass, several short transactions); return tasks created.

    A lock conflict or lost connection ends the pass quietly: the next pass retries.
    """
    created = 0
    while True:
        try:
            with engine.begin() as conn:
                done, made = _fire_batch(conn, default_max_attempts=default_max_attempts, key_ttl=key_ttl)
        except sa.exc.DBAPIError as exc:
            if not (exc.connection_invalidated or is_lock_conflict(exc)):
                raise
            log.debug("lock conflict while firing schedules; the next pass retries")
            return created
        created += made
        if done < _CLAIM_LIMIT:
            return created


def _fire_batch(conn: Connection, *, default_max_attempts: int, key_ttl: timedelta) -> tuple[int, int]:
    """Claim up to ``_CLAIM_LIMIT`` due schedules and fire each; ``(claimed, tasks created)``."""
    # One statement when nothing is due (the idle case): the database clock is read in the claim.
    # Lock only schedules rows (no join: MariaDB has no FOR UPDATE OF, and locking namespace or
    # queue rows would make concurrent passes skip each other's schedules).
    clock = db_now_expression(conn.dialect)
    locked = (
        conn.execute(
            sa.select(schedules, clock.label("db_now"))
            .where(schedules.c.paused == sa.false(), schedules.c.next_fire_at <= clock)
            .order_by(schedules.c.next_fire_at)
            .limit(_CLAIM_LIMIT)
            .with_for_update(skip_locked=True)
        )
        .mappings()
        .all()
    )
    if not locked:
        return 0, 0
    now = as_db_time(locked[0]["db_now"])
    names = {
        (r.ns_id, r.q_id): (r.ns_name, r.q_name)
        for r in conn.execute(
            sa.select(
                namespaces.c.id.label("ns_id"),
                namespaces.c.name.label("ns_name"),
                queues.c.id.label("q_id"),
                queues.c.name.label("q_name"),
            )
            .join(namespaces, namespaces.c.id == queues.c.namespace_id)
            .where(queues.c.id.in_({r["queue_id"] for r in locked}))
        )
    }
    claimed = []
    for r in locked:
        ns_name, q_name = names[(r["namespace_id"], r["queue_id"])]
        claimed.append(
            {k: v for k, v in r.items() if k != "db_now"} | {"namespace_name": ns_name, "queue_name": q_name}
        )
    made = 0
    for row in claimed:
        # A savepoint each: a schedule that cannot fire (a bug, bad stored data, a constraint its
        # writes break) rolls back its own savepoint and leaves the others firing.
        try:
            with conn.begin_nested():
                made += _fire_one(conn, row, now, default_max_attempts=default_max_attempts, key_ttl=key_ttl)
        except sa.exc.DBAPIError as exc:
            if exc.connection_invalidated or is_lock_conflict(exc):
                raise  # the transaction itself is gone (lock conflict, lost connection): the pass ends
            log.exception(
                "schedule %r of namespace %r could not fire (database error); "
                "it is tried again in the next pass",
                row["name"],
                row["namespace_name"],
            )
        except Exception:
            log.exception(
                "schedule %r of namespace %r could not fire; it is tried again in the next pass",
                row["name"],
                row["namespace_name"],
            )
    return len(claimed), made


def _fire_one(
    conn: Connection, row: dict[str, Any], now: datetime, *, default_max_attempts: int, key_ttl: timedelta
) -> int:
    """The writes of one schedule's fire; 0 tasks if another process fired it first."""
    due_from = row["next_fire_at"]
    if row["last_fired_at"] is not None:  # never a fire time already handled, whatever next_fire_at says
        due_from = max(due_from, row["last_fired_at"] + timedelta(microseconds=1))
    fires, following = plan_fires(
        _trigger(row),
        due_from,
        now,
        policy=MisfirePolicy(row["misfire_policy"]),
        catch_up_max=row["catch_up_max"],
        grace_seconds=row["misfire_grace_seconds"],
    )
    principal = Principal(
        key_id=0, namespace_id=row["namespace_id"], namespace=row["namespace_name"], role="admin"
    )
    options = SubmitOptions.model_validate(row["options"]) if row["options"] is not None else None
    submission = TaskSubmission(
        queue=row["queue_name"], handler=row["handler"], params=row["params"], options=options
    )
    digest = request_digest(submission)
    last_task_id: str | None = row["last_task_id"]
    running = last_task_id is not None and row["overlap_policy"] == OverlapPolicy.SKIP_IF_RUNNING.value
    if running:
        status = conn.execute(sa.select(tasks.c.status).where(tasks.c.id == last_task_id)).scalar()
        running = status is not None and status not in _FINISHED
    keys = [idempotency_key(row["id"], at) for at, _ in fires]
    known = dict(
        conn.execute(
            sa.select(submission_keys.c.idempotency_key, submission_keys.c.task_id).where(
                submission_keys.c.namespace_id == row["namespace_id"],
                submission_keys.c.idempotency_key.in_(keys),
            )
        ).all()
    ) if keys else {}  # fmt: skip

    occurrences: list[dict[str, Any]] = []
    new_tasks: list[tuple[str, str, datetime]] = []  # (key, task id, fire time)
    for (at, misfired), key in zip(fires, keys, strict=True):
        occurrence: dict[str, Any] = {
            "schedule_id": row["id"],
            "scheduled_at": at,
            "schedule_version": row["version"],
            "misfired": misfired,
            "created_at": now,
            "task_id": None,
            "skip_reason": None,
            "status": OccurrenceStatus.CREATED.value,
        }
        if key in known:  # a task with this key exists already (submitted by hand): it is the fire's
            occurrence["task_id"] = last_task_id = known[key]
            running = row["overlap_policy"] == OverlapPolicy.SKIP_IF_RUNNING.value
        elif running:
            occurrence["status"] = OccurrenceStatus.SKIPPED.value
            occurrence["skip_reason"] = (
                f"overlap: the previous occurrence's task {last_task_id} is not finished"
            )
        else:
            task_id = str(uuid.uuid4())
            occurrence["task_id"] = last_task_id = task_id
            new_tasks.append((key, task_id, at))
            running = row["overlap_policy"] == OverlapPolicy.SKIP_IF_RUNNING.value
        occurrences.append(occurrence)

    # The claim: conditional on what was read, row count checked (SKIP LOCKED is only an optimisation).
    claim = conn.execute(
        schedules.update()
        .where(
            schedules.c.id == row["id"],
            schedules.c.version == row["version"],
            schedules.c.next_fire_at == row["next_fire_at"],
            schedules.c.paused == sa.false(),
        )
        .values(
            next_fire_at=following,
            last_fired_at=fires[-1][0] if fires else row["last_fired_at"],
            last_task_id=last_task_id,
        )
    )
    if claim.rowcount != 1:
        log.debug("schedule %s was fired or changed by another process; skipped", row["id"])
        return 0
    if occurrences:
        conn.execute(schedule_occurrences.insert(), occurrences)
    if new_tasks:
        conn.execute(
            submission_keys.insert(),
            [key_row(principal, key, digest, task_id, now, key_ttl) for key, task_id, _ in new_tasks],
        )
        conn.execute(
            tasks.insert(),
            [task_row(principal, submission, task_id, row["queue_id"], now, default_max_attempts)
             for _, task_id, _ in new_tasks],
        )  # fmt: skip
        conn.execute(
            task_events.insert(),
            [
                accepted_event_row(principal, task_id, now)
                | {"actor": f"schedule:{row['name']}", "data": _fire_data(row, at)}
                for _, task_id, at in new_tasks
            ],
        )
    for occurrence in occurrences:
        log.info(
            "schedule fired schedule=%s namespace=%s scheduled_at=%s task_id=%s status=%s",
            row["name"],
            row["namespace_name"],
            format_fire_time(occurrence["scheduled_at"]),
            occurrence["task_id"],
            occurrence["status"],
        )
    return len(new_tasks)


def _fire_data(row: dict[str, Any], at: datetime) -> dict[str, Any]:
    """``data`` of the ``accepted`` event of a scheduled task: which schedule and fire time."""
    return {
        "schedule_id": row["id"],
        "scheduled_at": format_fire_time(at),
        "schedule_version": row["version"],
    }
