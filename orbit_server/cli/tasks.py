"""``orbit-server`` admin commands: see and fix tasks (``task list | show | cancel | review | retry``).

Each listing prints a
rich table on a terminal, tab-separated lines when piped (one row a line, ids never wrapped),
and JSON with ``--json``. Task actions run the same audited functions as the API and the web
console, with actor ``cli:<login name>`` unless ``--actor`` says otherwise. Exit codes as
for every ``orbit-server`` command: 0 done, 1 refused (unknown id, a state that does not
allow it), 2 bad usage, 3 the database is unreachable.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import click
from pydantic import ValidationError

from orbit_client import ReviewRequest, TaskStatus
from orbit_server.cli.options import (
    F,
    _actor,
    _actor_option,
    _cell,
    _database_url_option,
    _engine,
    _json_option,
    _namespace_filter,
    _namespace_id,
    _print_json,
    _Since,
    _table,
)
from orbit_server.db.engine import db_now
from orbit_server.db.transact import transact
from orbit_server.tasks import admin, operations

# ------------------------------------------------------------------- tasks


@click.group()
def task() -> None:
    """See and settle tasks: list, show, cancel, review, retry."""


@task.command("list")
@_namespace_filter
@click.option(
    "--status", type=click.Choice([s.value for s in TaskStatus], case_sensitive=False), default=None
)
@click.option("--queue", "queue_name", default=None, help="Only this queue.")
@click.option("--handler", default=None, help="Only this handler.")
@click.option("--idempotency-key", default=None, help="Only the task this key created.")
@click.option(
    "--since", type=_Since(), default=None, help="Created since: an age (30m, 2h, 1d) or a UTC time."
)
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
@click.option("--cursor", default=None, help="The cursor printed under the previous page.")
@click.option(
    "--order",
    type=click.Choice(["newest", "lease"]),
    default="newest",
    show_default=True,
    help="newest: by creation, newest first; lease: the highest priority first, then the oldest due (with "
    "--queue Q --status WAITING: the order the queue's leases take).",
)
@_json_option
@_database_url_option
def task_list(
    namespace_name: str | None,
    status: str | None,
    queue_name: str | None,
    handler: str | None,
    idempotency_key: str | None,
    since: datetime | timedelta | None,
    limit: int,
    cursor: str | None,
    order: str,
    as_json: bool,
    database_url: str,
) -> None:
    """List tasks, newest first, or in lease order (--order lease)."""
    with _engine(database_url) as engine, engine.begin() as conn:
        created_since = since if not isinstance(since, timedelta) else admin.aware(db_now(conn)) - since
        filters = admin.TaskFilter(
            status=TaskStatus(status.upper()) if status else None,
            queue=queue_name,
            handler=handler,
            idempotency_key=idempotency_key,
            created_since=created_since,
        )
        page = admin.list_tasks(
            conn, _namespace_id(conn, namespace_name), filters, limit=limit, cursor=cursor, order=order
        )
    if as_json:
        _print_json({"items": page.items, "next_cursor": page.next_cursor})
        return
    _table(
        [
            "id",
            "namespace",
            "queue",
            "handler",
            "status",
            "priority",
            "attempts",
            "created (UTC)",
            "retry of",
        ],
        [
            [
                t.id,
                t.namespace,
                t.queue,
                t.handler,
                t.status,
                t.priority,
                f"{t.attempt_count}/{t.max_attempts}",
                t.created_at,
                t.retry_of,
            ]
            for t in page.items
        ],
    )
    if page.next_cursor:
        click.echo(f"more: --cursor {page.next_cursor}", err=True)


def _detail(conn: Any, task_id: str) -> admin.TaskDetail:
    return admin.get_task_detail(conn, admin.task_namespace_id(conn, task_id), task_id)


def _error_line(error: Any) -> str:
    if isinstance(error, dict):
        return f"{error.get('type', '')}: {error.get('message', '')}"
    return "" if error is None else str(error)


def _show(detail: admin.TaskDetail) -> None:
    t = detail.task
    facts = [
        ("id", t.id),
        ("namespace", t.namespace),
        ("queue", t.queue),
        ("handler", t.handler),
        ("status", _cell(t.status) + (" (cancel requested)" if t.cancel_requested else "")),
        ("idempotency key", detail.idempotency_key),
        ("priority", str(t.priority)),
        ("attempts", f"{t.attempt_count}/{t.max_attempts}" + (", retry-safe" if t.retry_safe else "")),
        ("created", _cell(t.created_at)),
        ("finished", _cell(t.finished_at)),
        ("retry of", " <- ".join(p.id for p in detail.predecessors)),
        ("retried as", " -> ".join(s.id for s in detail.successors)),
    ]
    for name, value in facts:
        if value:
            click.echo(f"{name}:\t{value}")
    click.echo("params:")
    click.echo(json.dumps(t.params, indent=2, ensure_ascii=False))
    if t.result is not None:
        click.echo("result:")
        click.echo(json.dumps(t.result, indent=2, ensure_ascii=False))
    error = t.error if isinstance(t.error, dict) else ({"message": str(t.error)} if t.error else None)
    if error:
        click.echo(f"error:\t{error.get('type', 'error')}: {error.get('message', '')}")
        if error.get("traceback"):
            click.echo(str(error["traceback"]).rstrip())
    click.echo("")
    _table(
        ["generation", "worker", "outcome", "leased", "started", "finished", "error"],
        [
            [
                a.generation,
                a.worker_id,
                a.status,
                a.leased_at,
                a.started_at,
                a.finished_at,
                _error_line(a.error),
            ]
            for a in detail.attempts
        ],
        title="attempts",
    )
    click.echo("")
    _table(
        ["at (UTC)", "event", "from", "to", "actor", "reason"],
        [[e.created_at, e.event, e.from_status, e.to_status, e.actor, e.reason] for e in detail.events],
        title="events",
    )
    if detail.deliveries:
        click.echo("")
        _table(
            ["subscription", "event id", "state", "handed out", "acked"],
            [[d.subscription, d.event_id, d.state, d.delivery_count, d.acked_at] for d in detail.deliveries],
            title="result-event deliveries",
        )


@task.command("show")
@click.argument("task_id", metavar="ID")
@_json_option
@_database_url_option
def task_show(task_id: str, as_json: bool, database_url: str) -> None:
    """Show task ID: params, result or error with its traceback, attempts, events, retry chain, deliveries."""
    with _engine(database_url) as engine, engine.begin() as conn:
        detail = _detail(conn, task_id)
    if as_json:
        _print_json(
            {
                "task": detail.task,
                "idempotency_key": detail.idempotency_key,
                "attempts": detail.attempts,
                "events": detail.events,
                "retry_of_chain": [p.id for p in detail.predecessors],
                "successors": [s.id for s in detail.successors],
                "deliveries": detail.deliveries,
            }
        )
        return
    _show(detail)


#: The API's longest reason (``CancelRequest``, ``ReviewRequest``, ``RetryRequest``).
_MAX_REASON = 2000


def _checked_reason(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    """The API's rule for a reason (1-2,000 characters), so the CLI records nothing the API would refuse."""
    if not 1 <= len(value) <= _MAX_REASON:
        raise click.BadParameter(f"give 1 to {_MAX_REASON} characters (got {len(value)})")
    return value


def _reason_option(func: F) -> F:
    return click.option(
        "--reason",
        required=True,
        callback=_checked_reason,
        help="Why: kept in the task's history (1-2,000 characters).",
    )(func)


def _act(
    database_url: str,
    task_id: str,
    work: Callable[..., Any],
    as_json: bool,
    done: str,
    *,
    unchanged: Callable[[Any], str | None] | None = None,
    **kwargs: Any,
) -> None:
    """Run ``work`` on the task; ``unchanged(task before)`` names why it changed nothing (then said instead
    of ``done``), or ``None``."""
    with _engine(database_url) as engine:
        with engine.begin() as conn:
            namespace_id = admin.task_namespace_id(conn, task_id)
            before = admin.get_task_detail(conn, namespace_id, task_id).task if unchanged else None
        result = transact(engine, work, namespace_id, task_id, **kwargs)
    if as_json:
        _print_json(result)
    else:
        said = (unchanged(before) if unchanged else None) or done
        click.echo(f"{said}: task {result.id} is {result.status.value}", err=True)
        click.echo(result.id)


def _cancel_unchanged(task: Any) -> str | None:
    """A cancel of a task already cancelled, or whose cancel was already asked for, records nothing new."""
    if task.status is TaskStatus.CANCELLED:
        return "already cancelled, nothing changed"
    if task.cancel_requested:
        return "cancel already requested, nothing changed (it is cancelled when its worker stops)"
    return None


@task.command("cancel")
@click.argument("task_id", metavar="ID")
@_reason_option
@_actor_option
@_json_option
@_database_url_option
def task_cancel(task_id: str, reason: str, actor: str | None, as_json: bool, database_url: str) -> None:
    """Cancel task ID (WAITING/LEASED at once; RUNNING when its worker stops)."""
    _act(
        database_url,
        task_id,
        operations.cancel_task,
        as_json,
        "cancel recorded",
        unchanged=_cancel_unchanged,
        reason=reason,
        actor=_actor(actor),
    )


@task.command("review")
@click.argument("task_id", metavar="ID")
@click.option("--outcome", required=True, type=click.Choice(["succeeded", "failed"]), help="What happened.")
@_reason_option
@click.option("--evidence-ref", required=True, help="Where the proof is: a ticket, log link, payment id.")
@click.option("--result", "result_json", default=None, help="The result as JSON (with --outcome succeeded).")
@_actor_option
@_json_option
@_database_url_option
def task_review(
    task_id: str,
    outcome: str,
    reason: str,
    evidence_ref: str,
    result_json: str | None,
    actor: str | None,
    as_json: bool,
    database_url: str,
) -> None:
    """Settle NEEDS_REVIEW task ID as succeeded or failed, with a reason and an evidence reference."""
    result: Any = None
    if result_json is not None:
        if outcome != "succeeded":
            raise click.BadParameter("only a succeeded review carries a result", param_hint="--result")
        try:
            result = json.loads(result_json)
        except json.JSONDecodeError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint="--result") from None
    try:  # the API's rules for a review (JSON data Orbit stores unchanged; field lengths)
        ReviewRequest(outcome=outcome, reason=reason, evidence_ref=evidence_ref, result=result)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else "result"
        raise click.BadParameter(
            str(error["msg"]).removeprefix("Value error, "), param_hint=f"--{field.replace('_', '-')}"
        ) from None
    _act(
        database_url,
        task_id,
        operations.review_task,
        as_json,
        "review recorded",
        outcome=outcome,
        reason=reason,
        evidence_ref=evidence_ref,
        result=result,
        actor=_actor(actor),
    )


@task.command("retry")
@click.argument("task_id", metavar="ID")
@_reason_option
@_actor_option
@_json_option
@_database_url_option
def task_retry(task_id: str, reason: str, actor: str | None, as_json: bool, database_url: str) -> None:
    """Retry FAILED or CANCELLED task ID as a new task (retry_of); prints the new task's id."""
    _act(
        database_url,
        task_id,
        operations.retry_task,
        as_json,
        "retried as a new task",
        reason=reason,
        actor=_actor(actor),
    )
