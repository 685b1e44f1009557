"""``orbit-server retention inventory | runs`` and ``orbit-server purge`` (README "Retention and the key window").

The SQL and the rules are in :mod:`orbit_server.retention.purge`; these commands parse the cut-off,
print rich tables on a terminal (tab-separated lines when piped, JSON with ``--json``) and show
a progress bar while a purge runs on a terminal. Exit codes as for every ``orbit-server``
command: 0 done, 1 refused, 2 bad usage, 3 the database is unreachable.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import click

from orbit_server.cli.options import (
    _DEFAULTS,
    _actor,
    _actor_option,
    _database_url_option,
    _engine,
    _json_option,
    _print_json,
    _Since,
    _table,
)
from orbit_server.db.engine import db_now
from orbit_server.retention import purge as retention

__all__ = ["purge", "retention_group"]

F = TypeVar("F", bound=Callable[..., Any])


def _key_ttl_option(func: F) -> F:
    return click.option(
        "--key-ttl-seconds",
        "key_ttl_seconds",
        envvar="ORBIT_SUBMISSION_KEY_TTL_SECONDS",
        show_envvar=True,
        type=click.IntRange(3600),
        default=_DEFAULTS["submission_key_ttl_seconds"].default,
        show_default=True,
        help="The key window in force (the servers' setting): a key goes only once past its own expiry and "
        "accepted longer ago than this; a purged flow start's tombstone lives this long after it finished.",
    )(func)


def _cutoff(conn: Any, value: datetime | timedelta) -> datetime:
    """An age (measured back from the database clock) or a time, as an aware UTC datetime."""
    if isinstance(value, timedelta):
        return db_now(conn).replace(tzinfo=UTC) - value
    return value.astimezone(UTC)


_INVENTORY_ROWS = (
    ("terminal tasks finished before the cut-off", "terminal_tasks"),
    ("  kept: a result event not yet acked by every subscription", "protected_tasks"),
    ("  kept: part of a retry chain that must stay", "chain_kept_tasks"),
    ("result events still unacked (protected)", "protected_result_events"),
    ("finished flow instances before the cut-off", "finished_flow_instances"),
    ("  kept: a step task unfinished or an event not applied", "protected_flow_instances"),
    ("expired submission keys kept (task unfinished or unacked)", "protected_keys"),
)
_PURGE_ROWS = (
    ("tasks", "tasks"),
    ("their attempts", "task_attempts"),
    ("their events", "task_events"),
    ("their result events (every delivery acked)", "result_events"),
    ("those acked deliveries", "event_deliveries"),
    ("schedule occurrences (of those tasks, or skipped)", "schedule_occurrences"),
    ("flow instances (finished before the cut-off)", "flow_instances"),
    ("their tokens, steps, timers, signals", "flow_parts"),
    ("their events and history", "flow_log"),
    ("expired submission keys", "submission_keys"),
    ("expired flow start tombstones", "flow_start_tombstones"),
)


def _purge_figures(counts: dict[str, int]) -> dict[str, int]:
    """The purge counts with the flow tables summed as the table shows them."""
    parts = ("flow_tokens", "flow_steps", "flow_timers", "flow_signals")
    return counts | {
        "flow_parts": sum(counts.get(k, 0) for k in parts),
        "flow_log": counts.get("flow_events", 0) + counts.get("flow_history", 0),
    }


def _print_inventory(found: retention.Inventory, *, title: str) -> None:
    data = found.as_dict()
    figures = _purge_figures(data["purge"])
    rows: list[list[Any]] = [[label, figures[key]] for label, key in _PURGE_ROWS]
    if found.tasks_before is not None:
        rows += [[label, data[key]] for label, key in _INVENTORY_ROWS]
    else:
        rows.append([_INVENTORY_ROWS[-1][0], found.protected_keys])
    cut = f"tasks finished before {found.tasks_before:%Y-%m-%d %H:%M:%S} UTC, " if found.tasks_before else ""
    _table(
        ["what", "rows"],
        rows,
        title=f"{title} ({cut}keys expired before {found.keys_before:%Y-%m-%d %H:%M:%S} UTC)",
    )


@click.group("retention")
def retention_group() -> None:
    """See what a purge would delete, and the audit of past purges (README "Retention and the key window")."""


@retention_group.command("inventory")
@click.option(
    "--before",
    "before",
    type=_Since(),
    required=True,
    help="Cut-off: a UTC time (2026-11-01T00:00) or an age (30d) back from the database clock.",
)
@_key_ttl_option
@_json_option
@_database_url_option
def inventory(before: datetime | timedelta, key_ttl_seconds: int, as_json: bool, database_url: str) -> None:
    """Count, read-only, what `orbit-server purge --before TIME --keys` would delete and what it keeps."""
    with _engine(database_url) as engine, engine.begin() as conn:
        found = retention.inventory(conn, _cutoff(conn, before), key_ttl=timedelta(seconds=key_ttl_seconds))
    if as_json:
        _print_json(found.as_dict())
    else:
        _print_inventory(found, title="a purge would delete")


@retention_group.command("runs")
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True)
@_json_option
@_database_url_option
def runs(limit: int, as_json: bool, database_url: str) -> None:
    """List purge runs, newest first: who, cut-offs, status and what each deleted."""
    with _engine(database_url) as engine, engine.begin() as conn:
        found = retention.list_purge_runs(conn, limit=limit)
    if as_json:
        _print_json(found)
        return
    _table(
        ["id", "actor", "started (UTC)", "status", "tasks before", "keys before", "tasks", "attempts", "events",
         "result events", "keys"],
        [
            [r.id, r.actor, r.started_at, r.status, r.tasks_before, r.keys_before, r.counts.get("tasks", 0),
             r.counts.get("task_attempts", 0), r.counts.get("task_events", 0), r.counts.get("result_events", 0),
             r.counts.get("submission_keys", 0)]
            for r in found
        ],
    )  # fmt: skip


@click.command("purge")
@click.option(
    "--tasks-older-than",
    "older_than",
    type=_Since(),
    default=None,
    help="Purge terminal tasks finished longer ago than this age (30d, 12h).",
)
@click.option(
    "--before",
    "before",
    type=_Since(),
    default=None,
    help="Or: purge terminal tasks finished before this UTC time (2026-11-01T00:00).",
)
@click.option(
    "--keys", is_flag=True, help="Also purge submission keys past their own expiry (the key window)."
)
@click.option(
    "--batch-size",
    type=click.IntRange(1, 10_000),
    default=retention.DEFAULT_BATCH_SIZE,
    show_default=True,
    help="Tasks (or keys) deleted per transaction.",
)
@click.option("--dry-run", is_flag=True, help="Delete nothing: print the inventory of this purge.")
@_key_ttl_option
@_actor_option
@_json_option
@_database_url_option
def purge(
    older_than: datetime | timedelta | None,
    before: datetime | timedelta | None,
    keys: bool,
    batch_size: int,
    dry_run: bool,
    key_ttl_seconds: int,
    actor: str | None,
    as_json: bool,
    database_url: str,
) -> None:
    """Delete terminal tasks finished before a cut-off with their attempts, events and fully acked
    result events, finished flow instances with everything they own (their start keys kept as
    tombstones), and with --keys expired submission keys and tombstones; in batches, audited
    (README "Retention and the key window").

    Tasks with a result event not yet acked, and retry chains with a task that must stay, are kept.
    Run `orbit-server retention runs` to see past purges.
    """
    if older_than is not None and before is not None:
        raise click.UsageError("give --tasks-older-than or --before, not both")
    if isinstance(older_than, datetime):
        raise click.BadParameter("give an age such as 30d or 12h", param_hint="--tasks-older-than")
    given = older_than if older_than is not None else before
    if given is None and not keys:
        raise click.UsageError("say what to purge: --tasks-older-than AGE, --before TIME, and/or --keys")
    with _engine(database_url) as engine:
        with engine.begin() as conn:
            cutoff = _cutoff(conn, given) if given is not None else None
            now = db_now(conn).replace(tzinfo=UTC)
            if cutoff is not None and cutoff > now:
                raise click.BadParameter(
                    f"{cutoff:%Y-%m-%d %H:%M:%S} UTC is in the future (database clock {now:%H:%M:%S} UTC); "
                    "a purge only deletes what finished in the past",
                    param_hint="--before",
                )
            key_ttl = timedelta(seconds=key_ttl_seconds)
            if dry_run or sys.stderr.isatty():
                found = retention.inventory(conn, cutoff, key_ttl=key_ttl)
        if dry_run:
            if not keys:
                found = _without_keys(found)
            if as_json:
                _print_json({"dry_run": True, **found.as_dict()})
            else:
                _print_inventory(found, title="dry run: a purge would delete")
            # On stderr whatever stdout is (piped, the table has no title): nothing was deleted.
            click.echo("dry run: nothing was deleted; run it again without --dry-run to purge", err=True)
            return
        who = _actor(actor)
        if sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            total = found.purge.tasks + (found.purge.submission_keys if keys else 0)
            with Progress(
                TextColumn("purging"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=_stderr_console(), transient=True,
            ) as bar:  # fmt: skip
                job = bar.add_task("purge", total=total or None)
                run_id, counts = retention.purge(
                    engine, actor=who, tasks_before=cutoff, keys=keys, batch_size=batch_size, key_ttl=key_ttl,
                    on_progress=lambda done: bar.advance(job, done.tasks + done.submission_keys),
                )  # fmt: skip
        else:
            run_id, counts = retention.purge(
                engine, actor=who, tasks_before=cutoff, keys=keys, batch_size=batch_size, key_ttl=key_ttl
            )
    if as_json:
        _print_json({"run_id": run_id, "actor": who, "tasks_before": cutoff, "keys": keys,
                     "deleted": counts.as_dict()})  # fmt: skip
        return
    click.echo(f"purge run {run_id} by {who} finished (see `orbit-server retention runs`)", err=True)
    figures = _purge_figures(counts.as_dict())
    _table(["what", "deleted"], [[label, figures[key]] for label, key in _PURGE_ROWS])


def _without_keys(found: retention.Inventory) -> retention.Inventory:
    from dataclasses import replace

    return replace(
        found, purge=replace(found.purge, submission_keys=0, flow_start_tombstones=0), protected_keys=0
    )


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)
