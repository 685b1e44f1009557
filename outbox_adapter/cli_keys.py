"""``orbit-outbox abandon`` and the blocked ordering keys of ``orbit-outbox status`` (README "Ordering keys").

Kept apart from ``cli`` (already large); importing ``outbox_adapter.cli`` registers the command.
"""

from __future__ import annotations

import click
from rich.markup import escape
from rich.table import Table

from outbox_adapter._ordering import BlockedKey
from outbox_adapter.cli import (
    _actor,
    _actor_option,
    _database_options,
    _json_option,
    _outbox,
    _print_json,
    _row_dict,
    _short,
    main,
    out,
)

__all__ = ["abandon", "blocked_keys_table", "way_out"]


def blocked_keys_table(keys: list[BlockedKey]) -> Table:
    """The keys held back by a row that needs a person: key, row, its state, rows waiting behind it."""
    table = Table(title="blocked ordering keys", title_justify="left")
    for column in ("ordering key", "blocked by row", "state", "waiting", "last error"):
        table.add_column(column, overflow="fold")
    for key in keys:
        table.add_row(
            escape(key.ordering_key),
            str(key.row_id),
            key.state,
            str(key.waiting),
            escape(_short(key.last_error, 40)),
        )
    return table


def way_out(key: BlockedKey) -> str:
    """What an operator can do about one blocked key (README "Ordering keys")."""
    if key.state == "DEAD":
        return (
            f"row {key.row_id}: fix the cause and `orbit-outbox retry {key.row_id}`, or give it up: "
            f"`orbit-outbox abandon {key.row_id} --reason TEXT` (releases {key.ordering_key!r})"
        )
    return (
        f"row {key.row_id}: `orbit-outbox reconcile`, or `orbit-outbox resolve {key.row_id} --delivered-as TASK_ID "
        f"| --abandon --reason TEXT` (releases {key.ordering_key!r})"
    )


@main.command()
@_database_options
@click.argument("row_id", type=int)
@click.option("--reason", required=True, help="Why the row must never be sent, for the audit trail.")
@_actor_option
@_json_option
def abandon(
    database_url: str, table: str, row_id: int, reason: str, actor: str | None, as_json: bool
) -> None:
    """Give up a DEAD or NEEDS_RECONCILE row for good: → ABANDONED (never sent), audited.

    An ABANDONED row no longer holds back later rows of its ordering key. A NEEDS_RECONCILE
    row's task may exist: look it up first (`reconcile`, `resolve --delivered-as`).
    """
    if not reason.strip():
        raise click.UsageError("--reason must say why, for the audit trail")
    with _outbox(database_url, table) as outbox:
        row = outbox.abandon(row_id, actor=_actor(actor), reason=reason)
    if as_json:
        _print_json(_row_dict(row, with_params=False))
        return
    released = f"; ordering key {row.ordering_key!r} released" if row.ordering_key is not None else ""
    out.print(escape(f"row {row.id} abandoned: ABANDONED ({row.last_error}){released}"), highlight=False)
