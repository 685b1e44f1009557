"""``orbit-server schedule ...``: create, list, show, pause, resume and delete schedules and list
their occurrences, on the database directly (like the other admin commands; README "Schedules").

Changes are audited in ``schedule_events`` with the actor ``orbit-server cli``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import click
from pydantic import BaseModel, ValidationError

from orbit_client import MisfirePolicy, OverlapPolicy, Schedule, ScheduleCreate
from orbit_client._problems import readable_errors
from orbit_server.cli.options import _database_url_option, _engine, _table
from orbit_server.schedules import schedules
from orbit_server.tasks import store

__all__ = ["schedule"]


def _principal(conn: Any, namespace: str) -> store.Principal:
    return store.Principal(
        key_id=0, namespace_id=store.get_namespace_id(conn, namespace), namespace=namespace, role="admin"
    )


def _emit(value: BaseModel | Sequence[BaseModel], as_json: bool, text: str) -> None:
    if as_json:
        data = (
            [v.model_dump(mode="json") for v in value]
            if isinstance(value, Sequence)
            else value.model_dump(mode="json")
        )
        click.echo(json.dumps(data, indent=2, ensure_ascii=False))
    else:
        click.echo(text)


def _trigger(s: Schedule) -> str:
    return f"cron {s.cron!r} in {s.timezone}" if s.cron else f"every {s.interval_seconds} s (UTC)"


def _describe(s: Schedule) -> str:
    trigger = _trigger(s)
    state = "paused" if s.paused else "active"
    next_fire = s.next_fire_at.isoformat().replace("+00:00", "Z") if s.next_fire_at else "none (ended)"
    return (
        f"{s.name}: {state}, {trigger}, queue {s.queue!r}, handler {s.handler!r}, next fire {next_fire}, "
        f"misfire {s.misfire_policy.value}, overlap {s.overlap_policy.value}, version {s.version}"
    )


_json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")


@click.group()
def schedule() -> None:
    """Manage schedules (tasks created at cron or interval fire times)."""


@schedule.command("create")
@click.argument("namespace")
@click.argument("name")
@click.option("--queue", required=True, help="Queue of the tasks it creates.")
@click.option("--handler", required=True, help="Handler name of the tasks it creates.")
@click.option("--params", default="{}", show_default=True, help="Task params, as JSON.")
@click.option("--cron", default=None, help="Five-field cron expression, evaluated in --timezone.")
@click.option("--interval", "interval_seconds", type=click.IntRange(min=1), default=None,
              help="Fire every N seconds (UTC) from --start-at instead of a cron expression.")  # fmt: skip
@click.option("--timezone", default="UTC", show_default=True, help="IANA time zone of --cron.")
@click.option("--start-at", type=click.DateTime(["%Y-%m-%dT%H:%M:%S%z", "%Y-%m-%dT%H:%M:%S"]), default=None,
              help="First possible fire time (UTC if no offset is given).")  # fmt: skip
@click.option("--end-at", type=click.DateTime(["%Y-%m-%dT%H:%M:%S%z", "%Y-%m-%dT%H:%M:%S"]), default=None,
              help="Last possible fire time (UTC if no offset is given).")  # fmt: skip
@click.option("--misfire-policy", type=click.Choice([p.value for p in MisfirePolicy]), default="skip",
              show_default=True)  # fmt: skip
@click.option("--catch-up-max", type=click.IntRange(1, 1000), default=10, show_default=True)
@click.option("--misfire-grace-seconds", type=click.IntRange(0, 86400), default=60, show_default=True)
@click.option("--overlap-policy", type=click.Choice([p.value for p in OverlapPolicy]), default="allow",
              show_default=True)  # fmt: skip
@click.option("--paused", is_flag=True, help="Create it paused.")
@_json_option
@_database_url_option
def schedule_create(namespace: str, name: str, params: str, start_at: datetime | None,
                    end_at: datetime | None, as_json: bool, database_url: str, **fields: Any) -> None:  # fmt: skip
    """Create schedule NAME in NAMESPACE."""
    try:
        fields["params"] = json.loads(params)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--params") from None
    for key, value in (("start_at", start_at), ("end_at", end_at)):
        if value is not None:
            fields[key] = value if value.tzinfo else value.replace(tzinfo=UTC)
    try:
        body = ScheduleCreate(name=name, **fields)
    except ValidationError as exc:
        problems = "; ".join(  # the option's name, and the message without pydantic's "Value error, "
            (f"--{'-'.join(map(str, e['loc'])).replace('_', '-')}: " if e["loc"] else "") + e["msg"]
            for e in readable_errors(exc.errors())
        )
        raise click.UsageError(problems) from None
    with _engine(database_url) as engine, engine.begin() as conn:
        created = schedules.create_schedule(conn, _principal(conn, namespace), body)
    _emit(created, as_json, _describe(created))


@schedule.command("list")
@click.argument("namespace")
@click.option("--limit", type=click.IntRange(1, 1000), default=100, show_default=True)
@_json_option
@_database_url_option
def schedule_list(namespace: str, limit: int, as_json: bool, database_url: str) -> None:
    """List the schedules of NAMESPACE, by name."""
    with _engine(database_url) as engine, engine.begin() as conn:
        found = schedules.list_schedules(conn, _principal(conn, namespace), limit=limit)
    if as_json:
        _emit(found, as_json, "")
        return
    _table(
        ["name", "state", "trigger", "queue", "handler", "next fire (UTC)", "misfire", "overlap", "version"],
        [
            [s.name, "paused" if s.paused else "active", _trigger(s), s.queue, s.handler, s.next_fire_at,
             s.misfire_policy.value, s.overlap_policy.value, s.version]
            for s in found
        ],
    )  # fmt: skip


@schedule.command("show")
@click.argument("namespace")
@click.argument("name")
@_json_option
@_database_url_option
def schedule_show(namespace: str, name: str, as_json: bool, database_url: str) -> None:
    """Show schedule NAME of NAMESPACE."""
    with _engine(database_url) as engine, engine.begin() as conn:
        found = schedules.get_schedule(conn, _principal(conn, namespace), name)
    _emit(found, as_json, _describe(found))


def _set_paused(namespace: str, name: str, paused: bool, as_json: bool, database_url: str) -> None:
    with _engine(database_url) as engine, engine.begin() as conn:
        changed = schedules.set_paused(conn, _principal(conn, namespace), name, paused)
    _emit(changed, as_json, _describe(changed))


@schedule.command("pause")
@click.argument("namespace")
@click.argument("name")
@_json_option
@_database_url_option
def schedule_pause(namespace: str, name: str, as_json: bool, database_url: str) -> None:
    """Pause schedule NAME (idempotent)."""
    _set_paused(namespace, name, True, as_json, database_url)


@schedule.command("resume")
@click.argument("namespace")
@click.argument("name")
@_json_option
@_database_url_option
def schedule_resume(namespace: str, name: str, as_json: bool, database_url: str) -> None:
    """Resume schedule NAME (idempotent); missed fire times follow its misfire policy."""
    _set_paused(namespace, name, False, as_json, database_url)


@schedule.command("delete")
@click.argument("namespace")
@click.argument("name")
@_database_url_option
def schedule_delete(namespace: str, name: str, database_url: str) -> None:
    """Delete schedule NAME and its occurrences; the tasks it created stay."""
    with _engine(database_url) as engine, engine.begin() as conn:
        schedules.delete_schedule(conn, _principal(conn, namespace), name)
    click.echo(f"schedule {name!r} deleted from namespace {namespace!r}", err=True)


@schedule.command("occurrences")
@click.argument("namespace")
@click.argument("name")
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True)
@_json_option
@_database_url_option
def schedule_occurrences(namespace: str, name: str, limit: int, as_json: bool, database_url: str) -> None:
    """List the occurrences of schedule NAME, newest fire time first, with their task."""
    with _engine(database_url) as engine, engine.begin() as conn:
        found = schedules.list_occurrences(conn, _principal(conn, namespace), name, limit=limit)
    lines = [
        f"{o.scheduled_at.isoformat().replace('+00:00', 'Z')}  {o.status.value:8}  "
        f"{o.task_id or '-'}  {o.skip_reason or ''}".rstrip()
        for o in found
    ]
    _emit(found, as_json, "\n".join(lines) or "no occurrences")
