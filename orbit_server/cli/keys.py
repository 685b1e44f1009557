"""``orbit-server api-key create | list | revoke``: a namespace's API keys (only a digest is stored)."""

from __future__ import annotations

import click

from orbit_server.cli.options import (
    _actor,
    _actor_option,
    _cell,
    _check_label,
    _database_url_option,
    _engine,
    _json_option,
    _namespace_filter,
    _namespace_id,
    _print_json,
    _table,
)
from orbit_server.tasks import admin, store


@click.group("api-key")
def api_key() -> None:
    """Manage API keys."""


@api_key.command("create")
@click.argument("namespace_name", metavar="NAMESPACE")
@click.option("--role", required=True, type=click.Choice(list(store.ROLES)), help="What the key may do.")
@click.option(
    "--label",
    default=None,
    callback=lambda _ctx, _param, value: _check_label(value),
    help=f"A note to recognise the key by (at most {store.API_KEY_LABEL_MAX_LENGTH} characters).",
)
@_database_url_option
def api_key_create(namespace_name: str, role: str, label: str | None, database_url: str) -> None:
    """Create an API key for NAMESPACE; the key is the last line of stdout.

    Only a hash is stored: copy the key now, it cannot be shown again.
    """
    with _engine(database_url) as engine, engine.begin() as conn:
        key = store.create_api_key(conn, namespace_name, role, label)
    click.echo(
        f"{role} key created for namespace {namespace_name!r}; store it now, it is not shown again", err=True
    )
    click.echo(key)


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
@click.argument("key_id", metavar="ID", type=click.IntRange(1, 2**63 - 1))
@click.option("--reason", default=None, help="Why (logged).")
@_actor_option
@_database_url_option
def api_key_revoke(key_id: int, reason: str | None, actor: str | None, database_url: str) -> None:
    """Revoke API key ID: servers refuse it within ORBIT_API_KEY_CACHE_SECONDS."""
    who = _actor(actor) + (f" ({reason})" if reason else "")
    with _engine(database_url) as engine, engine.begin() as conn:
        before = next((k for k in admin.list_api_keys(conn, None) if k.id == key_id), None)
        key = admin.revoke_api_key(conn, None, key_id, actor=who)
    what = f"API key {key.id} ({key.role}, namespace {key.namespace!r})"
    if before is not None and before.revoked_at is not None:
        click.echo(f"{what} was already revoked at {_cell(key.revoked_at)} UTC; nothing changed", err=True)
        return
    click.echo(f"{what} revoked at {_cell(key.revoked_at)} UTC", err=True)
