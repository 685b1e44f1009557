"""``orbit-outbox status``, ``list`` and ``show``: read the outbox, change nothing (README "Operations",
"Ordering keys").
"""

from __future__ import annotations

import json

import click
from rich.markup import escape

from outbox_adapter._ordering import BlockedKey
from outbox_adapter._tables import OutboxState
from outbox_adapter.cli._common import (
    _gap,
    _outbox,
    _print_json,
    _print_rows,
    _print_table,
    _row_dict,
    out,
)
from outbox_adapter.cli._options import (
    ROW_ID,
    _database_options,
    _json_option,
)

__all__ = ["list_command", "print_blocked_keys", "show", "status", "way_out"]


@click.command()
@_database_options
@_json_option
def status(database_url: str, table: str, as_json: bool) -> None:
    """Rows per state, leased rows, the oldest pending row's age (s), the next due time (UTC), and the
    ordering keys blocked by a DEAD or NEEDS_RECONCILE row (with that row)."""
    with _outbox(database_url, table) as outbox:
        summary = outbox.status()
        blocked = outbox.blocked_keys()
    if as_json:
        _print_json({**summary.to_dict(), "blocked_keys": [key.to_dict() for key in blocked]})
        return
    _print_table(
        ("state", "rows"),
        [
            *([state, str(count)] for state, count in summary.counts.items()),
            ["(leased now)", str(summary.leased)],
        ],
        title=f"outbox {table}",
        right=("rows",),
    )
    _gap()
    age = summary.oldest_pending_age_seconds
    out.print(f"oldest pending: {f'{age:.1f} s' if age is not None else '-'}", highlight=False)
    due = summary.next_due_at
    out.print(f"next due: {due.isoformat().replace('+00:00', 'Z') if due else '-'}", highlight=False)
    _gap()
    if blocked:
        print_blocked_keys(blocked)
        _gap()
        for key in blocked:
            out.print(escape(way_out(key)), highlight=False)
    else:
        out.print("blocked ordering keys: none", highlight=False)


@click.command(name="list")
@_database_options
@click.option(
    "--state",
    type=click.Choice([s.value for s in OutboxState], case_sensitive=False),
    default=None,
    help="Only rows in this state, in any case (default: every state).",
)
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True)
@click.option(
    "--after-id", type=click.IntRange(0, 2**63 - 1), default=0, help="Only rows with a larger id (paging)."
)
@_json_option
def list_command(
    database_url: str, table: str, state: str | None, limit: int, after_id: int, as_json: bool
) -> None:
    """List rows by id (params are never shown here)."""
    with _outbox(database_url, table) as outbox:
        rows = outbox.list_rows(state=state, limit=limit, after_id=after_id)
    if as_json:
        _print_json([_row_dict(r, with_params=False) for r in rows])
        return
    _print_rows(rows, f"{len(rows)} rows" + (f" in {state}" if state else ""))


@click.command()
@_database_options
@click.argument("row_id", type=ROW_ID)
@click.option("--params", "with_params", is_flag=True, help="Also print the row's params.")
@_json_option
def show(database_url: str, table: str, row_id: int, with_params: bool, as_json: bool) -> None:
    """One row and its audit trail."""
    with _outbox(database_url, table) as outbox:
        row = outbox.get(row_id)
        events = outbox.events(row_id)
    if as_json:
        _print_json({"row": _row_dict(row, with_params=with_params), "events": [e.to_dict() for e in events]})
        return
    _print_table(
        ("field", "value"),
        [
            [key, "" if value is None else json.dumps(value) if key in ("params", "options") else str(value)]
            for key, value in _row_dict(row, with_params=with_params).items()
        ],
        title=f"row {row_id}",
        header=False,
    )
    _gap()
    _print_table(
        ("at (UTC)", "from", "to", "actor", "task", "reason"),
        [
            [e.at.strftime("%Y-%m-%d %H:%M:%S"), e.from_state or "", e.to_state, e.actor, e.orbit_task_id or "",
             e.reason]
            for e in events
        ],
        title="events",
    )  # fmt: skip


def print_blocked_keys(keys: list[BlockedKey]) -> None:
    """The keys held back by a row that needs a person: key, row, its state, rows waiting behind it."""
    _print_table(
        ("ordering key", "blocked by row", "state", "waiting", "last error"),
        [
            [key.ordering_key, str(key.row_id), key.state, str(key.waiting), key.last_error or ""]
            for key in keys
        ],
        title="blocked ordering keys",
        short={"last error": 40},
    )


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
