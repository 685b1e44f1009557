"""``orbit-outbox``: migrate, relay, inspect and repair the outbox of a business database,
and consume result events into its inbox.

Every option can also be set through the environment variable shown in ``--help``
(``ORBIT_OUTBOX_DATABASE_URL``, ``ORBIT_URL``, ``ORBIT_API_KEY``, ``ORBIT_NAMESPACE``, ...). On a terminal
the output is rich tables; ``--json`` prints JSON for scripts.

Exit codes:

- ``0``: done.
- ``1``: refused: no such row, or its state does not allow the command (or, for ``resolve
  --delivered-as``, no such task); for ``reconcile``, some rows need a person (``mismatch``,
  ``too_old``: settle them with ``resolve``).
- ``2``: bad usage (an unknown option, a malformed value or URL, a ``--handler`` that cannot be imported).
- ``3``: the business database is unreachable, failed, or has no outbox tables (run ``migrate``).
- ``4``: the Orbit server is unreachable or refused the request (``relay --once`` rows left unsent,
  ``reconcile`` lookups, ``resolve --delivered-as`` task checks, ``consume`` leases).
"""

from __future__ import annotations

import getpass
import importlib
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn, TypeVar

import click
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn
from rich.table import Table

from orbit_client import OrbitClient, OrbitError, RetryPolicy
from outbox_adapter._cli_metrics import metrics_options
from outbox_adapter._consumer import DEFAULT_MAX_DELIVERIES, ResultConsumer, ResultHandler, lease_hint
from outbox_adapter._db import describe_url
from outbox_adapter._exceptions import OutboxDatabaseError, OutboxRowError, OutboxUsageError
from outbox_adapter._logging import configure_logging
from outbox_adapter._manager import Outbox
from outbox_adapter._models import OutboxRow, ReconcileDecision
from outbox_adapter._relay import Relay
from outbox_adapter._settings import OutboxSettings
from outbox_adapter._tables import OutboxState, OutboxTables

__all__ = ["load_handler", "main", "parse_duration"]

EXIT_REFUSED, EXIT_USAGE, EXIT_DATABASE, EXIT_ORBIT = 1, 2, 3, 4
F = TypeVar("F", bound=Callable[..., Any])
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def parse_duration(text: str) -> float:
    """``"7d"`` → ``604800.0``: a number with an optional unit ``s``, ``m``, ``h``, ``d`` or ``w``
    (no unit: seconds).

    Raises:
        OutboxUsageError: not a duration.
    """
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None:
        raise OutboxUsageError(f"{text!r} is not a duration; write e.g. 90s, 30m, 12h, 7d or 2w")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


class _Duration(click.ParamType):  # type: ignore[type-arg]
    name = "DURATION"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, int | float):
            return float(value)
        try:
            return parse_duration(str(value))
        except OutboxUsageError as exc:
            self.fail(str(exc), param, ctx)


def _fail(message: str, code: int) -> NoReturn:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, markup=True)
    sys.exit(code)


@contextmanager
def _errors() -> Iterator[None]:
    """Map the adapter's errors to a message on stderr and the exit code of this module's docstring."""
    try:
        yield
    except OutboxUsageError as exc:
        _fail(str(exc), EXIT_USAGE)
    except OutboxRowError as exc:
        _fail(str(exc), EXIT_REFUSED)
    except OutboxDatabaseError as exc:
        _fail(str(exc), EXIT_DATABASE)
    except OrbitError as exc:
        _fail(str(exc), EXIT_ORBIT)


def _database_options(func: F) -> F:
    func = click.option(
        "--table",
        envvar="ORBIT_OUTBOX_TABLE",
        show_envvar=True,
        default="orbit_outbox",
        show_default=True,
        help="Name of the outbox table (its audit table is <table>_events).",
    )(func)
    return click.option(
        "--database-url",
        envvar="ORBIT_OUTBOX_DATABASE_URL",
        show_envvar=True,
        required=True,
        help="SQLAlchemy URL of the business database, e.g. mysql+pymysql://app:pw@db/shop.",
    )(func)


def _orbit_options(api_key_help: str, *, required: bool = True) -> Callable[[F], F]:
    """``--orbit-url``, ``--api-key`` (``api_key_help`` says which role the command needs) and ``--timeout``."""

    def decorate(func: F) -> F:
        return _orbit_options_on(func, api_key_help, required=required)

    return decorate


def _orbit_options_on(func: F, api_key_help: str, *, required: bool) -> F:
    func = click.option(
        "--timeout",
        "request_timeout",
        envvar="ORBIT_OUTBOX_REQUEST_TIMEOUT",
        show_envvar=True,
        type=click.FloatRange(min=0, min_open=True),
        default=10.0,
        show_default=True,
        help="HTTP timeout per request, in seconds.",
    )(func)
    func = click.option(
        "--api-key",
        envvar="ORBIT_API_KEY",
        show_envvar=True,
        required=required,
        help=api_key_help,
    )(func)
    return click.option(
        "--orbit-url",
        envvar="ORBIT_URL",
        show_envvar=True,
        required=required,
        help="Root URL of the Orbit server, e.g. https://orbit.example.com.",
    )(func)


def _json_option(func: F) -> F:
    return click.option(
        "--json", "as_json", is_flag=True, help="Print JSON (for scripts) instead of tables."
    )(func)


def _actor_option(func: F) -> F:
    return click.option(
        "--actor",
        envvar="ORBIT_OUTBOX_ACTOR",
        show_envvar=True,
        default=None,
        help="Who acts, for the audit trail. Default: operator:<login name>.",
    )(func)


def _actor(actor: str | None) -> str:
    if actor:
        return actor
    try:
        return f"operator:{getpass.getuser()}"
    except (KeyError, OSError):
        return "operator:unknown"


def _inbox_table_option(func: F) -> F:
    return click.option(
        "--inbox-table",
        envvar="ORBIT_INBOX_TABLE",
        show_envvar=True,
        default=None,
        help="Name of the inbox table. Default: the outbox table's name with 'outbox' replaced by 'inbox' "
        "(orbit_inbox), else <table>_inbox.",
    )(func)


@contextmanager
def _outbox(database_url: str, table: str, inbox_table: str | None = None) -> Iterator[Outbox]:
    with _errors():
        outbox = Outbox(
            database_url=database_url, tables=OutboxTables(name=table, inbox_name=inbox_table), pool_size=2
        )
    try:
        with _errors():
            yield outbox
    finally:
        outbox.close()


def _print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, ensure_ascii=False, default=str))


def _cells(*values: str) -> list[str]:
    """Table cells with their ``[`` escaped: user text is never read as rich markup."""
    return [escape(v) for v in values]


def _short(text: str | None, width: int = 60) -> str:
    if not text:
        return ""
    return text if len(text) <= width else text[: width - 1] + "…"


def _rows_table(rows: list[OutboxRow], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in (
        "id",
        "state",
        "key",
        "queue",
        "handler",
        "attempts",
        "available at (UTC)",
        "task",
        "last error",
    ):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(
            *_cells(
                str(row.id),
                row.state,
                row.idempotency_key,
                f"{row.namespace}/flow:{row.flow}" if row.kind == "flow" else f"{row.namespace}/{row.queue}",
                "(flow start)" if row.kind == "flow" else row.handler,
                f"{row.attempts}/{row.max_attempts or '-'}",
                row.available_at.strftime("%Y-%m-%d %H:%M:%S"),
                row.orbit_task_id or "",
                _short(row.last_error),
            )
        )
    return table


def _row_dict(row: OutboxRow, *, with_params: bool) -> dict[str, Any]:
    data = row.to_dict()
    data.pop("lease_token", None)
    if not with_params:
        data.pop("params", None)
    return data


# --- commands ----------------------------------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option(
    "--log-level",
    envvar="ORBIT_OUTBOX_LOG_LEVEL",
    show_envvar=True,
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
)
@click.option(
    "--log-format",
    envvar="ORBIT_OUTBOX_LOG_FORMAT",
    show_envvar=True,
    default="text",
    show_default=True,
    type=click.Choice(["text", "json"]),
    help="Logs on stderr as text lines or JSON objects (row id, key and task id as fields; never params).",
)
@click.version_option("0.1.0", prog_name="orbit-outbox")
def main(log_level: str, log_format: str) -> None:
    """Transactional outbox for Orbit: rows written with the business change, delivered by a relay;
    result events consumed into an inbox, applied once each.

    Exit codes: 0 done, 1 refused (no such row, wrong state, rows needing a person),
    2 bad usage, 3 business database unreachable or not migrated, 4 Orbit server
    unreachable or refusing.
    """
    configure_logging(log_level, log_format)


@main.command()
@_database_options
@_inbox_table_option
def migrate(database_url: str, table: str, inbox_table: str | None) -> None:
    """Create or upgrade the outbox and inbox tables (Alembic, version table <table>_alembic_version)."""
    with _outbox(database_url, table, inbox_table) as outbox:
        revision = outbox.migrate()
    err.print(
        f"outbox tables in {escape(describe_url(database_url))} at revision {revision}", highlight=False
    )


@main.command()
@_database_options
@_orbit_options("Orbit API key of the rows' namespace (submit role).")
@click.option(
    "--once",
    is_flag=True,
    help="Deliver what is due now, then exit 0 (4 if rows were left unsent because the Orbit server was "
    "unreachable or refused the key).",
)
@click.option(
    "--batch-size",
    envvar="ORBIT_OUTBOX_BATCH_SIZE",
    show_envvar=True,
    default=50,
    show_default=True,
    type=click.IntRange(1, 10_000),
    help="Rows claimed, and sent in one batch request (at most 500 items each), at once.",
)
@click.option(
    "--concurrency",
    envvar="ORBIT_OUTBOX_CONCURRENCY",
    show_envvar=True,
    default=4,
    show_default=True,
    type=click.IntRange(1, 256),
    help="Batch requests in flight at once.",
)
@click.option(
    "--lease-seconds",
    envvar="ORBIT_OUTBOX_LEASE_SECONDS",
    show_envvar=True,
    default=60.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="How long a claim is valid, in seconds (database clock).",
)
@click.option(
    "--poll-interval",
    envvar="ORBIT_OUTBOX_POLL_INTERVAL",
    show_envvar=True,
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds to wait when nothing is due.",
)
@click.option(
    "--max-attempts",
    envvar="ORBIT_OUTBOX_MAX_ATTEMPTS",
    show_envvar=True,
    default=5,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="Budget of sends with an unknown outcome before NEEDS_RECONCILE (rows without their own).",
)
@click.option(
    "--backoff-base",
    envvar="ORBIT_OUTBOX_BACKOFF_BASE",
    show_envvar=True,
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Upper bound of a row's first backoff, in seconds (doubles per try, full jitter).",
)
@click.option(
    "--backoff-cap",
    envvar="ORBIT_OUTBOX_BACKOFF_CAP",
    show_envvar=True,
    default=300.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Ceiling of a row's backoff, in seconds.",
)
@click.option(
    "--shutdown-timeout",
    envvar="ORBIT_OUTBOX_SHUTDOWN_TIMEOUT",
    show_envvar=True,
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Seconds to finish in-flight sends after SIGTERM.",
)
@metrics_options("ORBIT_OUTBOX", sampled=True)
@_json_option
def relay(as_json: bool, once: bool, **options: Any) -> None:
    """Deliver outbox rows to Orbit until SIGTERM (or, with --once, until nothing is due)."""
    try:
        settings = OutboxSettings(**options)
    except ValidationError as exc:
        _fail(f"invalid settings: {exc.errors(include_url=False, include_input=False)}", EXIT_USAGE)
    with _errors():
        the_relay = Relay.from_settings(settings, install_signal_handlers=True)
    try:
        with _errors():
            stats = the_relay.run(once=once)
    finally:
        the_relay.close()
    if as_json:
        _print_json(stats.to_dict())
    elif once:
        err.print(
            f"delivered {stats.delivered} ({stats.replayed} replayed), retried {stats.retried}, dead {stats.dead}, "
            f"needs reconcile {stats.needs_reconcile}, lost leases {stats.lost_leases}",
            highlight=False,
        )
    if once and stats.orbit_unavailable:
        _fail(
            f"{stats.orbit_unavailable} due row(s) were not delivered: the Orbit server at {settings.orbit_url} was "
            "unreachable or refused the API key (see the log lines above); they stay PENDING with the same key; "
            "check ORBIT_URL and ORBIT_API_KEY (submit role), then run again",
            EXIT_ORBIT,
        )


def load_handler(spec: str) -> ResultHandler:
    """Import ``module:function`` (``package.module:object.attr`` works too) and return the callable.

    Raises:
        OutboxUsageError: ``spec`` is malformed, the module cannot be imported, it has no such
            attribute, or the attribute is not callable; the message names the fix.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise OutboxUsageError(
            f"--handler {spec!r} must be module:function, e.g. --handler shop.results:apply_result"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise OutboxUsageError(
            f"--handler {spec!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); run from "
            "the directory that contains it, pass --app-dir, or add it to PYTHONPATH"
        ) from None
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise OutboxUsageError(
                f"--handler {spec!r}: module {module_name!r} has no attribute {attr!r}; check the name after "
                "the colon"
            ) from None
    if not callable(target):
        raise OutboxUsageError(
            f"--handler {spec!r} is a {type(target).__name__}, not a function; it must be callable as "
            "handler(conn, event)"
        )
    handler: ResultHandler = target
    return handler


@main.command()
@_database_options
@_inbox_table_option
@_orbit_options("Orbit API key of the subscription's namespace (work role).")
@click.option(
    "--namespace",
    envvar="ORBIT_NAMESPACE",
    show_envvar=True,
    required=True,
    help="Orbit namespace of the subscription (the API key's namespace).",
)
@click.option(
    "--subscription",
    envvar="ORBIT_INBOX_SUBSCRIPTION",
    show_envvar=True,
    required=True,
    help="Name of the subscription whose result events to consume (create it first, admin role).",
)
@click.option(
    "--handler",
    "handler_spec",
    envvar="ORBIT_INBOX_HANDLER",
    show_envvar=True,
    required=True,
    metavar="MODULE:FUNCTION",
    help="handler(conn, event), called in the transaction that records the event in the inbox.",
)
@click.option(
    "--app-dir",
    envvar="ORBIT_INBOX_APP_DIR",
    show_envvar=True,
    default=".",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Directory put first on sys.path before importing --handler.",
)
@click.option("--once", is_flag=True, help="Handle what is due now, then exit 0.")
@click.option(
    "--batch-size",
    envvar="ORBIT_INBOX_BATCH_SIZE",
    show_envvar=True,
    default=10,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="Deliveries leased at once (handled one after another).",
)
@click.option(
    "--lease-seconds",
    envvar="ORBIT_INBOX_LEASE_SECONDS",
    show_envvar=True,
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds before an unacked delivery is delivered again; must cover a whole batch.",
)
@click.option(
    "--poll-interval",
    envvar="ORBIT_INBOX_POLL_INTERVAL",
    show_envvar=True,
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds to wait after a lease returned less than a full batch.",
)
@click.option(
    "--max-deliveries",
    envvar="ORBIT_INBOX_MAX_DELIVERIES",
    show_envvar=True,
    default=DEFAULT_MAX_DELIVERIES,
    show_default=True,
    type=click.IntRange(min=0),
    help="Deliveries after which an event whose handler still fails is recorded FAILED and acked (0: never).",
)
@metrics_options("ORBIT_INBOX", sampled=False)
@_json_option
def consume(
    database_url: str,
    table: str,
    inbox_table: str | None,
    orbit_url: str,
    api_key: str,
    request_timeout: float,
    namespace: str,
    subscription: str,
    handler_spec: str,
    app_dir: str,
    once: bool,
    batch_size: int,
    lease_seconds: float,
    poll_interval: float,
    max_deliveries: int,
    metrics_port: int | None,
    metrics_host: str,
    as_json: bool,
) -> None:
    """Apply the result events of a subscription to the business database, once each (inbox),
    until SIGTERM (or, with --once, until nothing is due). Acks only after the commit."""
    path = os.path.abspath(app_dir)
    if path not in sys.path:
        sys.path.insert(0, path)
    with _errors():
        handler = load_handler(handler_spec)
        client = OrbitClient(
            orbit_url, api_key=api_key, timeout=request_timeout, retry=RetryPolicy(max_attempts=3)
        )
    try:
        with _errors():
            consumer = ResultConsumer(
                database_url,
                client,
                namespace,
                subscription,
                handler,
                tables=OutboxTables(name=table, inbox_name=inbox_table),
                batch_size=batch_size,
                lease_seconds=lease_seconds,
                poll_interval=poll_interval,
                max_deliveries=max_deliveries or None,
                install_signal_handlers=True,
                metrics_port=metrics_port,
                metrics_host=metrics_host,
            )
        try:
            with _errors():
                try:
                    stats = consumer.run(once=once)
                except OrbitError as exc:
                    _fail(f"{exc}{lease_hint(exc)}", EXIT_ORBIT)
        finally:
            consumer.close()
    finally:
        client.close()
    if as_json:
        _print_json(stats.to_dict())
    elif once:
        err.print(
            f"applied {stats.applied}, duplicates {stats.duplicates}, failed {stats.failed}, parked {stats.parked}, "
            f"acked {stats.acked}, ack failures {stats.ack_failures}",
            highlight=False,
        )


@main.command()
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
    grid = Table(title=escape(f"outbox {table}"), title_justify="left", show_header=True)
    grid.add_column("state")
    grid.add_column("rows", justify="right")
    for state, count in summary.counts.items():
        grid.add_row(state, str(count))
    grid.add_row("(leased now)", str(summary.leased))
    out.print(grid)
    age = summary.oldest_pending_age_seconds
    out.print(f"oldest pending: {f'{age:.1f} s' if age is not None else '-'}", highlight=False)
    due = summary.next_due_at
    out.print(f"next due: {due.isoformat().replace('+00:00', 'Z') if due else '-'}", highlight=False)
    if blocked:
        from outbox_adapter.cli_keys import blocked_keys_table, way_out

        out.print(blocked_keys_table(blocked))
        for key in blocked:
            out.print(escape(way_out(key)), highlight=False)
    else:
        out.print("blocked ordering keys: none", highlight=False)


@main.command(name="list")
@_database_options
@click.option(
    "--state",
    type=click.Choice([s.value for s in OutboxState], case_sensitive=False),
    default=None,
    help="Only rows in this state, in any case (default: every state).",
)
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True)
@click.option(
    "--after-id", type=click.IntRange(min=0), default=0, help="Only rows with a larger id (paging)."
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
    out.print(_rows_table(rows, f"{len(rows)} rows" + (f" in {state}" if state else "")))


@main.command()
@_database_options
@click.argument("row_id", type=int)
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
    details = Table(title=f"row {row_id}", title_justify="left", show_header=False)
    details.add_column("field", style="bold")
    details.add_column("value", overflow="fold")
    for key, value in _row_dict(row, with_params=with_params).items():
        details.add_row(
            *_cells(
                key,
                "" if value is None else json.dumps(value) if key in ("params", "options") else str(value),
            )
        )
    out.print(details)
    trail = Table(title="events", title_justify="left")
    for column in ("at (UTC)", "from", "to", "actor", "task", "reason"):
        trail.add_column(column, overflow="fold")
    for e in events:
        trail.add_row(
            *_cells(
                e.at.strftime("%Y-%m-%d %H:%M:%S"),
                e.from_state or "",
                e.to_state,
                e.actor,
                e.orbit_task_id or "",
                e.reason,
            )
        )
    out.print(trail)


@main.command()
@_database_options
@click.argument("row_id", type=int, required=False)
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


@main.command()
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
        grid = Table(title=_reconcile_summary(decisions, dry_run=dry_run), title_justify="left")
        for column in ("id", "key", "decision", "applied", "task", "detail"):
            grid.add_column(column, overflow="fold")
        for d in decisions:
            grid.add_row(
                *_cells(
                    str(d.row_id),
                    d.idempotency_key,
                    d.decision,
                    "yes" if d.applied else "no",
                    d.orbit_task_id or "",
                    d.detail,
                )
            )
        out.print(grid)
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
    return escape(f"{head}, {left} left for a person, {failed} lookup(s) failed")


@main.command()
@_database_options
@_orbit_options(
    "Orbit API key of the row's namespace (read role); needed only with --delivered-as.", required=False
)
@click.argument("row_id", type=int)
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


@main.command()
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
    type=int,
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


@contextmanager
def _progress(what: str) -> Iterator[Callable[[int], None]]:
    """A spinner with a count on a terminal (stderr); nothing otherwise."""
    with Progress(
        SpinnerColumn(),
        TextColumn(f"{what}: {{task.completed}} rows"),
        console=err,
        disable=not err.is_terminal,
        transient=True,
    ) as progress:
        task = progress.add_task(what, total=None)
        yield lambda n: progress.advance(task, n)


if __name__ == "__main__":  # python -m outbox_adapter.cli
    main()


# Commands kept in modules of their own register themselves on ``main`` when imported.
from outbox_adapter import cli_keys as _cli_keys  # noqa: E402, F401
