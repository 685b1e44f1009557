"""``orbit-server namespace create | list``."""

from __future__ import annotations

import click

from orbit_server.cli.options import (
    _check_name,
    _database_url_option,
    _engine,
    _json_option,
    _print_json,
    _table,
)
from orbit_server.tasks import admin, store


@click.group()
def namespace() -> None:
    """Manage namespaces."""


@namespace.command("create")
@click.argument("name")
@_database_url_option
def namespace_create(name: str, database_url: str) -> None:
    """Create namespace NAME."""
    _check_name("NAME", name)
    with _engine(database_url) as engine, engine.begin() as conn:
        store.create_namespace(conn, name)
    click.echo(f"namespace {name!r} created", err=True)


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
