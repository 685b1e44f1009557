"""``orbit-outbox retry``, ``reconcile``, ``resolve``, ``abandon`` and ``purge``: an operator's repairs,
each audited (README "Operations", "Reconcile", "Ordering keys").
"""

from __future__ import annotations

import sys

import click
from rich.markup import escape

from orbit_client import OrbitClient, RetryPolicy
from outbox_adapter._models import ReconcileDecision
from outbox_adapter._tables import OutboxState
from outbox_adapter.cli._common import (
    EXIT_ORBIT,
    EXIT_REFUSED,
    _errors,
    _outbox,
    _piped,
    _print_json,
    _print_table,
    _progress,
    _row_dict,
    err,
    out,
)
from outbox_adapter.cli._options import (
    ROW_ID,
    _actor,
    _actor_option,
    _database_options,
    _Duration,
    _json_option,
    _orbit_options,
)

__all__ = ["abandon", "purge", "reconcile", "resolve", "retry"]


@click.command()
@_database_options
@click.argument("row_id", type=ROW_ID, required=False)
@click.option("--all-dead", is_flag=True, help="Retry every DEAD row.")
@click.option(
    "--reason", default="retried by an operator", show_default=True, help="Why, for the audit trail."
)
@_actor_option
@_json_option
def retry(
    database_url: str,
    table: str,
    row_id: int | None,
    all_dead: bool,
    reason: str,
    actor: str | None,
    as_json: bool,
) -> None:
    """Send a DEAD row again with the same key (DEAD → PENDING, audited). Fix the cause first."""
    if (row_id is None) == (not all_dead):
        raise click.UsageError("give a ROW_ID or --all-dead (not both)")
    with _outbox(database_url, table) as outbox:
        if row_id is not None:
            ids = [outbox.retry(row_id, actor=_actor(actor), reason=reason).id]
        else:
            ids = outbox.retry_all_dead(actor=_actor(actor), reason=reason)
    if as_json:
        _print_json({"retried": ids})
    else:
        out.print(f"retried {len(ids)} row(s): {', '.join(map(str, ids)) or '-'}", highlight=False)


@click.command()
@_database_options
@_orbit_options("Orbit API key of the rows' namespace (read role).")
@click.option("--dry-run", is_flag=True, help="Look up and decide, change nothing.")
@click.option(
    "--key-window",
    type=_Duration(),
    default=None,
    envvar="ORBIT_OUTBOX_KEY_WINDOW",
    show_envvar=True,
    help="How long the server remembers idempotency keys; older rows are not re-sent. "
    "[default: the server's, from GET /v1/settings, less a margin of a tenth (at most 1 h)]",
)
@_actor_option
@_json_option
def reconcile(
    database_url: str,
    table: str,
    orbit_url: str,
    api_key: str,
    request_timeout: float,
    dry_run: bool,
    key_window: float | None,
    actor: str | None,
    as_json: bool,
) -> None:
    """Settle NEEDS_RECONCILE rows by their original key: found → DELIVERED, not found → PENDING.
    Rows it cannot decide (mismatch, too_old) stay for a person: see `resolve`."""
    with _errors():
        client = OrbitClient(
            orbit_url, api_key=api_key, timeout=request_timeout, retry=RetryPolicy(max_attempts=3)
        )
    decisions: list[ReconcileDecision] = []
    try:
        with _outbox(database_url, table) as outbox, _progress("reconciling") as advance:
            decisions = outbox.reconcile(
                client,
                actor=_actor(actor),
                dry_run=dry_run,
                key_window_seconds=key_window,
                on_decision=lambda d: advance(1),
            )
    finally:
        client.close()
    if as_json:
        _print_json([d.to_dict() for d in decisions])
    else:
        summary = _reconcile_summary(decisions, dry_run=dry_run)
        _print_table(
            ("id", "key", "decision", "applied", "task", "detail"),
            [
                [str(d.row_id), d.idempotency_key, d.decision, "yes" if d.applied else "no", d.orbit_task_id or "",
                 d.detail]
                for d in decisions
            ],
            title=summary,
        )  # fmt: skip
        if _piped():  # stdout is the header and the rows alone: the summary goes with the hints, on stderr
            err.print(summary, highlight=False, markup=False)
    kinds = {d.decision for d in decisions}
    if kinds & {"mismatch", "too_old"} and not as_json:
        err.print(
            "rows left for a person stay NEEDS_RECONCILE: settle each with `orbit-outbox resolve ID --delivered-as "
            "TASK_ID --reason TEXT` or `orbit-outbox resolve ID --abandon --reason TEXT`",
            highlight=False,
            markup=False,
        )
    if "error" in kinds:
        sys.exit(EXIT_ORBIT)
    if kinds & {"mismatch", "too_old"}:
        sys.exit(EXIT_REFUSED)


def _reconcile_summary(decisions: list[ReconcileDecision], *, dry_run: bool) -> str:
    """``"3 row(s) looked up: 1 decided, 1 left for a person, 1 lookup(s) failed"``: only what is true."""
    decidable = sum(d.decision in ("delivered", "pending") for d in decisions)
    decided = sum(d.applied for d in decisions)
    left = sum(d.decision in ("mismatch", "too_old") for d in decisions)
    failed = sum(d.decision == "error" for d in decisions)
    if dry_run:
        head = f"{len(decisions)} row(s) looked up (dry run, nothing changed): {decidable} would be decided"
    else:
        head = f"{len(decisions)} row(s) looked up: {decided} decided"
        if decidable > decided:
            head += f", {decidable - decided} decided first by another process"
    return f"{head}, {left} left for a person, {failed} lookup(s) failed"


@click.command()
@_database_options
@_orbit_options(
    "Orbit API key of the row's namespace (read role); needed only with --delivered-as.", required=False
)
@click.argument("row_id", type=ROW_ID)
@click.option(
    "--delivered-as",
    metavar="TASK_ID",
    default=None,
    help="The Orbit task the row was delivered as: NEEDS_RECONCILE → DELIVERED (the task must exist).",
)
@click.option(
    "--abandon",
    is_flag=True,
    help="Give the row up: NEEDS_RECONCILE → ABANDONED (never sent; releases its ordering key).",
)
@click.option("--reason", required=True, help="Why, for the audit trail.")
@_actor_option
@_json_option
def resolve(
    database_url: str,
    table: str,
    orbit_url: str | None,
    api_key: str | None,
    request_timeout: float,
    row_id: int,
    delivered_as: str | None,
    abandon: bool,
    reason: str,
    actor: str | None,
    as_json: bool,
) -> None:
    """Settle a NEEDS_RECONCILE row that reconcile left to a person (key of a different submission, or
    older than the key window): --delivered-as TASK_ID → DELIVERED, or --abandon → ABANDONED. Audited."""
    if (delivered_as is None) == (not abandon):
        raise click.UsageError("give --delivered-as TASK_ID or --abandon (not both)")
    if not reason.strip():
        raise click.UsageError("--reason must say why, for the audit trail")
    client: OrbitClient | None = None
    if delivered_as is not None:
        if not orbit_url or not api_key:
            raise click.UsageError(
                "--delivered-as needs --orbit-url and --api-key (ORBIT_URL, ORBIT_API_KEY; read role) to check "
                "that the task exists"
            )
        with _errors():
            client = OrbitClient(
                orbit_url, api_key=api_key, timeout=request_timeout, retry=RetryPolicy(max_attempts=3)
            )
    try:
        with _outbox(database_url, table) as outbox:
            row = outbox.resolve(
                row_id,
                actor=_actor(actor),
                reason=reason,
                delivered_as=delivered_as,
                abandon=abandon,
                client=client,
            )
    finally:
        if client is not None:
            client.close()
    if as_json:
        _print_json(_row_dict(row, with_params=False))
    elif row.state == OutboxState.DELIVERED:
        out.print(escape(f"row {row.id} resolved: DELIVERED as task {row.orbit_task_id}"), highlight=False)
    else:
        out.print(escape(f"row {row.id} resolved: {row.state} ({row.last_error})"), highlight=False)


@click.command()
@_database_options
@click.option(
    "--delivered-older-than",
    type=_Duration(),
    default=None,
    help="Delete DELIVERED rows delivered longer ago than this, e.g. 7d.",
)
@click.option(
    "--dead-older-than",
    type=_Duration(),
    default=None,
    help="Delete DEAD rows that went DEAD longer ago than this, e.g. 1h or 0s (needs --reason; audited).",
)
@click.option(
    "--row",
    "rows",
    type=ROW_ID,
    multiple=True,
    help="With --dead-older-than: only this DEAD row (repeatable), e.g. --dead-older-than 0s --row 42.",
)
@click.option("--reason", default=None, help="Why DEAD rows are deleted, for the audit trail.")
@_actor_option
@click.option(
    "--batch-size",
    type=click.IntRange(1, 100_000),
    default=1000,
    show_default=True,
    help="Rows deleted per transaction.",
)
@_json_option
def purge(
    database_url: str,
    table: str,
    delivered_older_than: float | None,
    dead_older_than: float | None,
    rows: tuple[int, ...],
    reason: str | None,
    actor: str | None,
    batch_size: int,
    as_json: bool,
) -> None:
    """Delete old DELIVERED rows and their events, or DEAD rows that must not be sent (each keeps its
    audit trail plus a DEAD → PURGED event with actor and reason), in batches. Never touches another state."""
    if delivered_older_than is None and dead_older_than is None:
        raise click.UsageError(
            "give --delivered-older-than AGE, --dead-older-than AGE --reason TEXT, or both"
        )
    if dead_older_than is not None and not (reason or "").strip():
        raise click.UsageError("--dead-older-than deletes rows that were never sent: --reason must say why")
    if rows and dead_older_than is None:
        raise click.UsageError(
            "--row picks DEAD rows to delete: give --dead-older-than too (0s: whatever their age)"
        )
    delivered, dead = 0, []
    with _outbox(database_url, table) as outbox, _progress("purging") as advance:
        if delivered_older_than is not None:
            delivered = outbox.purge_delivered(
                older_than_seconds=delivered_older_than, batch_size=batch_size, on_batch=advance
            )
        if dead_older_than is not None:
            dead = outbox.purge_dead(
                older_than_seconds=dead_older_than, actor=_actor(actor), reason=str(reason),
                row_ids=rows or None, batch_size=batch_size, on_batch=advance,
            )  # fmt: skip
    if as_json:
        _print_json(
            {"deleted": delivered + len(dead), **({"dead": dead} if dead_older_than is not None else {})}
        )
        return
    if delivered_older_than is not None:
        out.print(f"deleted {delivered} delivered row(s)", highlight=False)
    if dead_older_than is not None:
        out.print(f"deleted {len(dead)} DEAD row(s): {', '.join(map(str, dead)) or '-'}", highlight=False)


@click.command()
@_database_options
@click.argument("row_id", type=ROW_ID)
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
