"""``orbit-outbox migrate``, ``relay`` and ``consume``: the commands that set up the tables and the
long-running processes (README "Outbox", "Inbox", "Operations").
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import click
from pydantic import ValidationError
from rich.markup import escape

from orbit_client import OrbitClient, OrbitError, RetryPolicy
from outbox_adapter._consumer import DEFAULT_MAX_DELIVERIES, ResultConsumer, ResultHandler, lease_hint
from outbox_adapter._db import describe_url
from outbox_adapter._exceptions import OutboxUsageError
from outbox_adapter._relay import Relay
from outbox_adapter._settings import OutboxSettings
from outbox_adapter._tables import OutboxTables
from outbox_adapter.cli._common import (
    EXIT_ORBIT,
    EXIT_USAGE,
    _errors,
    _fail,
    _outbox,
    _print_json,
    err,
)
from outbox_adapter.cli._options import (
    _database_options,
    _inbox_table_option,
    _json_option,
    _orbit_options,
    metrics_options,
    setting,
)

__all__ = ["consume", "load_handler", "migrate", "relay"]


@click.command()
@_database_options
@_inbox_table_option
def migrate(database_url: str, table: str, inbox_table: str | None) -> None:
    """Create or upgrade the outbox and inbox tables (Alembic, version table <table>_alembic_version)."""
    with _outbox(database_url, table, inbox_table) as outbox:
        revision = outbox.migrate()
    err.print(
        f"outbox tables in {escape(describe_url(database_url))} at revision {revision}", highlight=False
    )


@click.command()
@_database_options
@_orbit_options("Orbit API key of the rows' namespace (submit role).")
@click.option(
    "--once",
    is_flag=True,
    help="Deliver what is due now, then exit 0 (4 if rows were left unsent because the Orbit server was "
    "unreachable). Without it the relay runs until SIGTERM; either way it exits 4 when the server refuses "
    "the API key (401/403).",
)
@setting(
    "--batch-size",
    "ORBIT_OUTBOX_BATCH_SIZE",
    50,
    click.IntRange(1, 10_000),
    "Rows claimed, and sent in one batch request (at most 500 items each), at once.",
)
@setting(
    "--concurrency",
    "ORBIT_OUTBOX_CONCURRENCY",
    4,
    click.IntRange(1, 256),
    "Batch requests in flight at once.",
)
@setting(
    "--lease-seconds",
    "ORBIT_OUTBOX_LEASE_SECONDS",
    60.0,
    click.FloatRange(min=0, min_open=True),
    "How long a claim is valid, in seconds (database clock).",
)
@setting(
    "--poll-interval",
    "ORBIT_OUTBOX_POLL_INTERVAL",
    1.0,
    click.FloatRange(min=0, min_open=True),
    "Seconds to wait when nothing is due.",
)
@setting(
    "--max-attempts",
    "ORBIT_OUTBOX_MAX_ATTEMPTS",
    5,
    click.IntRange(1, 1000),
    "Budget of sends with an unknown outcome before NEEDS_RECONCILE (rows without their own).",
)
@setting(
    "--backoff-base",
    "ORBIT_OUTBOX_BACKOFF_BASE",
    1.0,
    click.FloatRange(min=0),
    "Upper bound of a row's first backoff, in seconds (doubles per try, full jitter).",
)
@setting(
    "--backoff-cap",
    "ORBIT_OUTBOX_BACKOFF_CAP",
    300.0,
    click.FloatRange(min=0),
    "Ceiling of a row's backoff, in seconds.",
)
@setting(
    "--shutdown-timeout",
    "ORBIT_OUTBOX_SHUTDOWN_TIMEOUT",
    30.0,
    click.FloatRange(min=0),
    "Seconds to finish in-flight sends after SIGTERM.",
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
            try:
                stats = the_relay.run(once=once)
            except OrbitError as exc:  # the key was refused (401/403): a configuration error
                key = settings.api_key.get_secret_value()[:12] if settings.api_key is not None else ""
                _fail(
                    f"the Orbit server at {settings.orbit_url} refused the relay's API key {key}… ({exc}); the "
                    "relay stopped and the rows stay PENDING with their attempts intact; set ORBIT_API_KEY to a "
                    "submit (or admin) key of the rows' namespace (`orbit-server api-key create NAMESPACE --role "
                    'submit`), then start the relay again (README "Outbox")',
                    EXIT_ORBIT,
                )
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


@click.command()
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
@setting(
    "--app-dir",
    "ORBIT_INBOX_APP_DIR",
    ".",
    click.Path(file_okay=False),
    "Directory put first on sys.path before importing --handler.",
)
@click.option("--once", is_flag=True, help="Handle what is due now, then exit 0.")
@setting(
    "--batch-size",
    "ORBIT_INBOX_BATCH_SIZE",
    10,
    click.IntRange(1, 1000),
    "Deliveries leased at once (handled one after another).",
)
@setting(
    "--lease-seconds",
    "ORBIT_INBOX_LEASE_SECONDS",
    30.0,
    click.FloatRange(min=0, min_open=True),
    "Seconds before an unacked delivery is delivered again; must cover a whole batch.",
)
@setting(
    "--poll-interval",
    "ORBIT_INBOX_POLL_INTERVAL",
    1.0,
    click.FloatRange(min=0, min_open=True),
    "Seconds to wait after a lease returned less than a full batch.",
)
@setting(
    "--max-deliveries",
    "ORBIT_INBOX_MAX_DELIVERIES",
    DEFAULT_MAX_DELIVERIES,
    click.IntRange(min=0),
    "Deliveries after which an event whose handler still fails is recorded FAILED and acked (0: never).",
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
                    which = (  # a refused key: say which one (its first characters), never all of it
                        f" (the key {api_key[:12]}…, ORBIT_API_KEY)"
                        if getattr(exc, "status_code", None) in (401, 403)
                        else ""
                    )
                    _fail(f"{exc}{lease_hint(exc)}{which}", EXIT_ORBIT)
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
