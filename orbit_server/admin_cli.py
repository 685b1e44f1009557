"""``orbit-server`` admin commands: see and fix tasks, keys, subscriptions, namespaces and queues.

Registered onto the ``orbit-server`` group by :mod:`orbit_server.cli`. Each listing prints a
rich table on a terminal, tab-separated lines when piped (one row a line, ids never wrapped),
and JSON with ``--json``. Task actions run the same audited functions as the API and the web
console, with actor ``cli:<login name>`` unless ``--actor`` says otherwise. Exit codes as
for every ``orbit-server`` command: 0 done, 1 refused (unknown id, a state that does not
allow it), 2 bad usage, 3 the database is unreachable.
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import re
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import click

from orbit_client import TaskStatus

from . import admin, execution, results
from ._db import db_now
from .cli import _database_url_option, _engine, api_key, main, namespace, queue

__all__: list[str] = []

F = TypeVar("F", bound=Callable[..., Any])


# ------------------------------------------------------------------ output


def _json_option(func: F) -> F:
    return click.option(
        "--json", "as_json", is_flag=True, help="Print JSON (for scripts) instead of a table."
    )(func)


def _actor_option(func: F) -> F:
    return click.option(
        "--actor",
        envvar="ORBIT_ADMIN_ACTOR",
        show_envvar=True,
        default=None,
        help="Who acts, for the task's history. Default: cli:<login name>.",
    )(func)


def _actor(actor: str | None) -> str:
    if actor:
        return actor
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):
        return "cli:unknown"


def _plain(value: Any) -> Any:
    """A value as JSON holds it: datetimes in ISO 8601 UTC, dataclasses and models as objects."""
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "value") and isinstance(value.value, str):  # enums
        return value.value
    return value


def _print_json(data: Any) -> None:
    click.echo(json.dumps(_plain(data), indent=2, ensure_ascii=False))


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
    if hasattr(value, "value") and isinstance(value.value, str):
        return str(value.value)
    if isinstance(value, float):
        return f"{value:.0f}"
    return str(value)


def _table(columns: Sequence[str], rows: Sequence[Sequence[Any]], *, title: str | None = None) -> None:
    """Rows as a rich table on a terminal, else as tab-separated lines under a header line."""
    cells = [[_cell(v) for v in row] for row in rows]
    if not sys.stdout.isatty():
        click.echo("\t".join(columns))
        for row in cells:
            click.echo("\t".join(c.replace("\t", " ").replace("\n", " ") for c in row))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in columns:
        is_id = column in ("id", "task", "retry of") or column.endswith(" id")
        table.add_column(column, no_wrap=is_id, overflow="ignore" if is_id else "fold")
    for row in cells:
        table.add_row(*(escape(c) for c in row))
    Console(soft_wrap=True).print(table)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return ""
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    if seconds < 172800:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"


_RELATIVE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


class _Since(click.ParamType):  # type: ignore[type-arg]
    name = "TIME"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> datetime | timedelta:
        """An aware time, or an age (a timedelta, measured back from the database clock)."""
        if isinstance(value, datetime | timedelta):
            return value
        text = str(value).strip()
        relative = _RELATIVE.fullmatch(text)
        if relative:
            return timedelta(**{_UNITS[relative.group(2)]: float(relative.group(1))})
        try:
            parsed = datetime.fromisoformat(text)
        except ValueError:
            self.fail(f"{text!r}: give an age such as 30m, 2h, 1d or a time such as 2026-12-01T09:30 (UTC)")
        return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _namespace_id(conn: Any, name: str | None) -> int | None:
    if name is None:
        return None
    from . import store

    return store.get_namespace_id(conn, name)


def _namespace_filter(func: F) -> F:
    return click.option("--namespace", "namespace_name", default=None, help="Only this namespace.")(func)


# ------------------------------------------------------------------- tasks


@main.group()
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
    as_json: bool,
    database_url: str,
) -> None:
    """List tasks, newest first."""
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
            conn, _namespace_id(conn, namespace_name), filters, limit=limit, cursor=cursor
        )
    if as_json:
        _print_json({"items": page.items, "next_cursor": page.next_cursor})
        return
    _table(
        ["id", "namespace", "queue", "handler", "status", "attempts", "created (UTC)", "retry of"],
        [
            [
                t.id,
                t.namespace,
                t.queue,
                t.handler,
                t.status,
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


def _reason_option(func: F) -> F:
    return click.option("--reason", required=True, help="Why: kept in the task's history.")(func)


def _act(
    database_url: str, task_id: str, work: Callable[..., Any], as_json: bool, done: str, **kwargs: Any
) -> None:
    with _engine(database_url) as engine:
        with engine.begin() as conn:
            namespace_id = admin.task_namespace_id(conn, task_id)
        result = execution.transact(engine, work, namespace_id, task_id, **kwargs)
    if as_json:
        _print_json(result)
    else:
        click.echo(f"{done}: task {result.id} is {result.status.value}", err=True)
        click.echo(result.id)


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
        execution.cancel_task,
        as_json,
        "cancel recorded",
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
    _act(
        database_url,
        task_id,
        execution.review_task,
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
        execution.retry_task,
        as_json,
        "retried as a new task",
        reason=reason,
        actor=_actor(actor),
    )


# ---------------------------------------------------------------- API keys


@api_key.command("list")
@_namespace_filter
@_json_option
@_database_url_option
def api_key_list(namespace_name: str | None, as_json: bool, database_url: str) -> None:
    """List API keys (never the keys themselves: their first characters)."""
    with _engine(database_url) as engine, engine.begin() as conn:
        keys = admin.list_api_keys(conn, _namespace_id(conn, namespace_name))
    if as_json:
        _print_json(keys)
        return
    _table(
        ["id", "namespace", "role", "prefix", "label", "created (UTC)", "revoked (UTC)"],
        [[k.id, k.namespace, k.role, k.prefix, k.label, k.created_at, k.revoked_at] for k in keys],
    )


@api_key.command("revoke")
@click.argument("key_id", metavar="ID", type=int)
@click.option("--reason", default=None, help="Why (logged).")
@_actor_option
@_database_url_option
def api_key_revoke(key_id: int, reason: str | None, actor: str | None, database_url: str) -> None:
    """Revoke API key ID: servers refuse it within ORBIT_API_KEY_CACHE_SECONDS."""
    who = _actor(actor) + (f" ({reason})" if reason else "")
    with _engine(database_url) as engine, engine.begin() as conn:
        key = admin.revoke_api_key(conn, None, key_id, actor=who)
    click.echo(
        f"API key {key.id} ({key.role}, namespace {key.namespace!r}) revoked at {_cell(key.revoked_at)} UTC",
        err=True,
    )


# ---------------------------------------------------------- subscriptions


@main.group()
def subscription() -> None:
    """Manage result-event subscriptions."""


def _subscription_rows(stats: Sequence[admin.SubscriptionStats]) -> None:
    _table(
        ["namespace", "name", "queues", "undelivered", "unacked", "oldest pending", "acked", "created (UTC)"],
        [
            [
                s.namespace,
                s.name,
                ",".join(s.queues) if s.queues else "*",
                s.undelivered,
                s.unacked,
                _age(s.oldest_pending_seconds),
                s.acked,
                s.created_at,
            ]
            for s in stats
        ],
    )


@subscription.command("create")
@click.argument("namespace_name", metavar="NAMESPACE")
@click.argument("name")
@click.option(
    "--queue", "queue_names", multiple=True, help="A queue it receives events of (repeat); default all."
)
@_database_url_option
def subscription_create(
    namespace_name: str, name: str, queue_names: tuple[str, ...], database_url: str
) -> None:
    """Create subscription NAME in NAMESPACE; it receives the result events from now on."""
    from .cli import _check_name

    _check_name("NAME", name)
    with _engine(database_url) as engine:
        with engine.begin() as conn:
            namespace_id = _namespace_id(conn, namespace_name)
        assert namespace_id is not None
        _, is_new = execution.transact(
            engine, results.create_subscription, namespace_id, namespace_name, name, list(queue_names) or None
        )
    state = "created" if is_new else "exists already with these queues"
    click.echo(f"subscription {name!r} in namespace {namespace_name!r} {state}", err=True)


@subscription.command("list")
@_namespace_filter
@_json_option
@_database_url_option
def subscription_list(namespace_name: str | None, as_json: bool, database_url: str) -> None:
    """List subscriptions with their backlog (undelivered, unacked, oldest pending)."""
    with _engine(database_url) as engine, engine.begin() as conn:
        stats = admin.subscription_stats(conn, _namespace_id(conn, namespace_name))
    if as_json:
        _print_json(stats)
    else:
        _subscription_rows(stats)


@subscription.command("show")
@click.argument("namespace_name", metavar="NAMESPACE")
@click.argument("name")
@_json_option
@_database_url_option
def subscription_show(namespace_name: str, name: str, as_json: bool, database_url: str) -> None:
    """Show subscription NAME of NAMESPACE with its backlog."""
    from . import errors

    with _engine(database_url) as engine, engine.begin() as conn:
        stats = admin.subscription_stats(conn, _namespace_id(conn, namespace_name), name=name)
        if not stats:
            raise errors.SubscriptionNotFound(f"no subscription {name!r} in namespace {namespace_name!r}")
    if as_json:
        _print_json(stats[0])
    else:
        _subscription_rows(stats)


# ------------------------------------------------------- namespaces, queues


@namespace.command("list")
@_json_option
@_database_url_option
def namespace_list(as_json: bool, database_url: str) -> None:
    """List namespaces with their numbers of queues, tasks and active API keys."""
    with _engine(database_url) as engine, engine.begin() as conn:
        found = admin.list_namespaces(conn)
    if as_json:
        _print_json(found)
        return
    _table(
        ["name", "queues", "tasks", "active keys", "created (UTC)"],
        [[n.name, n.queues, n.tasks, n.api_keys, n.created_at] for n in found],
    )


@queue.command("list")
@_namespace_filter
@_json_option
@_database_url_option
def queue_list(namespace_name: str | None, as_json: bool, database_url: str) -> None:
    """List queues with their tasks per status, oldest due WAITING age and last hour's outcomes."""
    with _engine(database_url) as engine, engine.begin() as conn:
        found = admin.queue_stats(conn, _namespace_id(conn, namespace_name))
    if as_json:
        _print_json([{**_plain(q), "total": q.total} for q in found])
        return
    statuses = [s.value for s in TaskStatus]
    _table(
        ["namespace", "queue", *statuses, "oldest waiting", "succeeded 1h", "failed 1h"],
        [
            [
                q.namespace,
                q.name,
                *(q.counts.get(s, 0) for s in statuses),
                _age(q.oldest_waiting_seconds),
                q.succeeded_last_hour,
                q.failed_last_hour,
            ]
            for q in found
        ],
    )
