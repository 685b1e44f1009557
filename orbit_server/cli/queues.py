"""``orbit-server queue create | list | show | update | pause | resume``: a queue's concurrency limits and gate.

Each change runs the same
audited function as the API (:mod:`orbit_server.tasks.permits`), with actor ``cli:<login name>``
unless ``--actor`` (or ``ORBIT_ADMIN_ACTOR``) says otherwise. ``--json`` prints the queue as
the API answers it. Exit codes: 0 done, 1 refused (unknown namespace or queue), 2 bad usage,
3 the database is unreachable. README "Concurrency limits and pausing a queue".
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from orbit_client import MAX_CONCURRENCY_LIMIT, Queue, TaskStatus
from orbit_server import errors
from orbit_server.cli.options import (
    _actor,
    _actor_option,
    _age,
    _check_name,
    _database_url_option,
    _engine,
    _json_option,
    _namespace_filter,
    _namespace_id,
    _plain,
    _print_json,
    _table,
)
from orbit_server.db.transact import transact
from orbit_server.tasks import admin, permits, store

__all__ = ["cli_actor"]


@click.group()
def queue() -> None:
    """Manage queues."""


@queue.command("create")
@click.argument("namespace_name", metavar="NAMESPACE")
@click.argument("name", metavar="QUEUE")
@click.option(
    "--max-concurrency-per-key",
    type=click.IntRange(1, 1_000_000),
    default=None,
    help="Live attempts allowed per task concurrency_key (README: Concurrency limits). Default: no limit.",
)
@click.option(
    "--max-concurrency",
    type=click.IntRange(1, 1_000_000),
    default=None,
    help="Live attempts allowed in the whole queue. Default: no limit.",
)
@_database_url_option
def queue_create(
    namespace_name: str, name: str, max_concurrency_per_key: int | None, max_concurrency: int | None,
    database_url: str,
) -> None:  # fmt: skip
    """Create queue QUEUE in NAMESPACE, optionally with concurrency limits."""
    _check_name("QUEUE", name)
    with _engine(database_url) as engine, engine.begin() as conn:
        store.create_queue(
            conn, namespace_name, name, max_concurrency_per_key=max_concurrency_per_key,
            max_concurrency=max_concurrency, actor=cli_actor(None),
        )  # fmt: skip
    click.echo(f"queue {name!r} created in namespace {namespace_name!r}", err=True)


@queue.command("list")
@_namespace_filter
@_json_option
@_database_url_option
def queue_list(namespace_name: str | None, as_json: bool, database_url: str) -> None:
    """List queues: paused or not, tasks per status, oldest due WAITING age and last hour's outcomes."""
    with _engine(database_url) as engine, engine.begin() as conn:
        found = admin.queue_stats(conn, _namespace_id(conn, namespace_name))
    if as_json:
        _print_json([{**_plain(q), "total": q.total} for q in found])
        return
    statuses = [s.value for s in TaskStatus]
    _table(
        ["namespace", "queue", "paused", *statuses, "oldest waiting", "succeeded 1h", "failed 1h"],
        [
            [
                q.namespace,
                q.name,
                "yes" if q.paused else "no",
                *(q.counts.get(s, 0) for s in statuses),
                _age(q.oldest_waiting_seconds),
                q.succeeded_last_hour,
                q.failed_last_hour,
            ]
            for q in found
        ],
    )


def cli_actor(actor: str | None) -> str:
    """Who acts from the command line: ``actor``, else ``cli:<login name>``."""
    return _actor(actor)


_UNSET: Any = object()


class _Limit(click.ParamType):  # type: ignore[type-arg]
    """A limit: an integer 1-1,000,000, or ``none`` to remove it."""

    name = "N|none"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | None:
        if value is None or value is _UNSET or isinstance(value, int):
            return value
        text = str(value).strip().lower()
        if text == "none":
            return None
        try:
            number = int(text)
        except ValueError:
            number = 0
        if not 1 <= number <= MAX_CONCURRENCY_LIMIT:
            self.fail(
                f"{value!r}: give a whole number from 1 to {MAX_CONCURRENCY_LIMIT:,}, or 'none' for no limit"
            )
        return number


def _namespace(conn: Any, name: str) -> int:
    return store.get_namespace_id(conn, name)


def _show(found: Queue, as_json: bool) -> None:
    if as_json:
        _print_json(found)
        return

    def limit(n: int | None) -> str:
        return "none" if n is None else str(n)

    _table(
        ["namespace", "queue", "paused", "max per key", "max in queue", "control version", "created (UTC)"],
        [[found.namespace, found.name, "yes" if found.paused else "no", limit(found.max_concurrency_per_key),
          limit(found.max_concurrency), found.control_version, found.created_at]],
    )  # fmt: skip


@queue.command("show")
@click.argument("namespace_name", metavar="NAMESPACE")
@click.argument("name", metavar="QUEUE")
@_json_option
@_database_url_option
def queue_show(namespace_name: str, name: str, as_json: bool, database_url: str) -> None:
    """Show QUEUE's gate (paused or not) and its concurrency limits."""

    with _engine(database_url) as engine, engine.begin() as conn:
        found = store.get_queue(conn, namespace_name, _namespace(conn, namespace_name), name)
        if found is None:
            raise errors.QueueNotFound(f"queue {name!r} does not exist in namespace {namespace_name!r}")
    _show(found, as_json)


@queue.command("update")
@click.argument("namespace_name", metavar="NAMESPACE")
@click.argument("name", metavar="QUEUE")
@click.option(
    "--max-concurrency-per-key", type=_Limit(), default=_UNSET,
    help="Live attempts allowed per task concurrency_key; 'none' removes the limit.",
)  # fmt: skip
@click.option(
    "--max-concurrency", type=_Limit(), default=_UNSET,
    help="Live attempts allowed in the whole queue; 'none' removes the limit.",
)  # fmt: skip
@click.option("--reason", default=None, help="Why (audited).")
@_actor_option
@_json_option
@_database_url_option
def queue_update(
    namespace_name: str, name: str, max_concurrency_per_key: Any, max_concurrency: Any, reason: str | None,
    actor: str | None, as_json: bool, database_url: str,
) -> None:  # fmt: skip
    """Change QUEUE's concurrency limits (audited). Attempts in flight are never taken back."""
    changes = {
        field: value
        for field, value in (
            ("max_concurrency_per_key", max_concurrency_per_key),
            ("max_concurrency", max_concurrency),
        )
        if value is not _UNSET
    }
    if not changes:
        raise click.UsageError("give --max-concurrency-per-key and/or --max-concurrency (a number or 'none')")
    with _engine(database_url) as engine:
        with engine.begin() as conn:
            namespace_id = _namespace(conn, namespace_name)
        with _named(namespace_name):
            found = transact(
                engine, permits.set_limits, namespace_id, name, changes, actor=_actor(actor), reason=reason
            )
    if as_json:
        _show(found, True)
        return
    click.echo(f"queue {name!r} limits: per key {found.max_concurrency_per_key or 'none'}, "
               f"in queue {found.max_concurrency or 'none'}", err=True)  # fmt: skip


@contextmanager
def _named(namespace_name: str) -> Iterator[None]:
    """Name the namespace in a missing queue's error (the API's says "this namespace": its caller knows it)."""
    try:
        yield
    except errors.QueueNotFound as exc:
        raise errors.QueueNotFound(
            str(exc).replace("in this namespace", f"in namespace {namespace_name!r}")
            + f"; see `orbit-server queue list --namespace {namespace_name}`"
        ) from None


def _gate_command(paused: bool) -> Any:
    verb = "pause" if paused else "resume"

    @queue.command(verb)
    @click.argument("namespace_name", metavar="NAMESPACE")
    @click.argument("name", metavar="QUEUE")
    @click.option("--reason", default=None, help="Why (audited).")
    @_actor_option
    @_json_option
    @_database_url_option
    def command(
        namespace_name: str,
        name: str,
        reason: str | None,
        actor: str | None,
        as_json: bool,
        database_url: str,
    ) -> None:
        with _engine(database_url) as engine:
            with engine.begin() as conn:
                namespace_id = _namespace(conn, namespace_name)
            with _named(namespace_name):
                found = transact(
                    engine,
                    permits.set_paused,
                    namespace_id,
                    name,
                    paused=paused,
                    actor=_actor(actor),
                    reason=reason,
                )
        if as_json:
            _show(found, True)
            return
        click.echo(
            f"queue {name!r} in namespace {namespace_name!r} is {'paused' if paused else 'open'}", err=True
        )

    command.__doc__ = (
        "Pause QUEUE: no new leases or starts; attempts in flight still heartbeat, complete and fail (audited)."
        if paused
        else "Resume QUEUE: leases and starts go on (audited)."
    )
    command.help = command.__doc__
    return command


queue_pause = _gate_command(True)
queue_resume = _gate_command(False)
