"""``orbit-server subscription create | list | show``: result subscriptions and their delivery backlog."""

from __future__ import annotations

from collections.abc import Sequence

import click

from orbit_server import errors
from orbit_server.cli.options import (
    _age,
    _check_name,
    _database_url_option,
    _engine,
    _json_option,
    _namespace_filter,
    _namespace_id,
    _print_json,
    _table,
)
from orbit_server.db.transact import transact
from orbit_server.results import deliveries as results
from orbit_server.tasks import admin

# ---------------------------------------------------------- subscriptions


@click.group()
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

    _check_name("NAME", name)
    with _engine(database_url) as engine:
        with engine.begin() as conn:
            namespace_id = _namespace_id(conn, namespace_name)
        assert namespace_id is not None
        _, is_new = transact(
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

    with _engine(database_url) as engine, engine.begin() as conn:
        stats = admin.subscription_stats(conn, _namespace_id(conn, namespace_name), name=name)
        if not stats:
            raise errors.SubscriptionNotFound(f"no subscription {name!r} in namespace {namespace_name!r}")
    if as_json:
        _print_json(stats[0])
    else:
        _subscription_rows(stats)
