"""``orbit-server``: run the API and administer namespaces, queues and API keys.

Every option can also be set through the environment variable shown in
``--help``. Exit codes: 0 success, 1 the request was refused (e.g. a name that
exists, a namespace that does not), 2 bad usage, 3 the database is unreachable.


The root group and ``serve``/``migrate`` are here; each command group is its own module, registered
below, and the options they share are in :mod:`orbit_server.cli.options`, which imports no command.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from typing import Any

import click

from orbit_server.cli.lazy import LazyGroup
from orbit_server.cli.options import _DEFAULTS, _database_url_option, _engine
from orbit_server.settings import ServerSettings

__all__ = ["main"]


#: The command groups, imported when one runs (``orbit-server --help`` imports none): README "Admin commands".
_GROUPS = {
    "api-key": ("orbit_server.cli.keys", "api_key", "Manage API keys."),
    "flow": (
        "orbit_server.cli.flows",
        "flow",
        'Publish flows and run, signal, pause, resume and cancel their instances (README "Flows").',
    ),
    "namespace": ("orbit_server.cli.namespaces", "namespace", "Manage namespaces."),
    "purge": (
        "orbit_server.cli.retention",
        "purge",
        "Delete terminal tasks finished before a cut-off with their attempts, events and fully acked result "
        "events, finished flow instances with everything they own (their start keys kept as tombstones), and "
        'with --keys expired submission keys and tombstones; in batches, audited (README "Retention and the '
        'key window").',
    ),
    "queue": ("orbit_server.cli.queues", "queue", "Manage queues."),
    "retention": (
        "orbit_server.cli.retention",
        "retention_group",
        'See what a purge would delete, and the audit of past purges (README "Retention and the key window").',
    ),
    "schedule": (
        "orbit_server.cli.schedules",
        "schedule",
        "Manage schedules (tasks created at cron or interval fire times).",
    ),
    "subscription": ("orbit_server.cli.subscriptions", "subscription", "Manage result-event subscriptions."),
    "task": ("orbit_server.cli.tasks", "task", "See and settle tasks: list, show, cancel, review, retry."),
}


@click.group(
    cls=LazyGroup,
    lazy=_GROUPS,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
)
@click.option(
    "--log-level",
    envvar="ORBIT_LOG_LEVEL",
    show_envvar=True,
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
)
@click.option(
    "--log-format",
    envvar="ORBIT_LOG_FORMAT",
    show_envvar=True,
    default="text",
    show_default=True,
    type=click.Choice(["text", "json"], case_sensitive=False),
    help='json: one JSON object per line, with trace_id and span_id inside a trace (README "Tracing").',
)
@click.version_option("0.1.0", prog_name="orbit-server")
def main(log_level: str, log_format: str) -> None:
    """Orbit task platform: idempotent task acceptance over HTTP."""
    if log_format.lower() == "json":
        from orbit_client._logs import JsonFormatter

        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
        logging.basicConfig(level=log_level.upper(), handlers=[handler])
    else:
        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if log_level.lower() != "debug":
        logging.getLogger("alembic").setLevel(logging.WARNING)


@main.command()
@_database_url_option
@click.option("--host", envvar="ORBIT_HOST", show_envvar=True, default="127.0.0.1", show_default=True)
@click.option("--port", envvar="ORBIT_PORT", show_envvar=True, default=8080, show_default=True, type=int)
@click.option(
    "--max-body-bytes",
    envvar="ORBIT_MAX_BODY_BYTES",
    show_envvar=True,
    default=_DEFAULTS["max_body_bytes"].default,
    show_default=True,
    type=click.IntRange(min=1024),
    help="Largest request body accepted, in bytes.",
)
@click.option(
    "--workers",
    envvar="ORBIT_WORKERS",
    show_envvar=True,
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help=(
        "Server processes sharing the port (one Python process is CPU-bound on one core: use about one per "
        "core). Leases are coordinated by the database, so any number may run. A submission wakes the "
        "long-polling lease calls of its own process at once; those waiting in another process find it "
        "within ORBIT_LEASE_POLL_INTERVAL_SECONDS (default 0.5 s), or at once on PostgreSQL (ORBIT_NOTIFY)."
    ),
)
@click.option(
    "--wait-for-database",
    "database_wait",
    envvar="ORBIT_DATABASE_WAIT_SECONDS",
    show_envvar=True,
    default=0.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help=(
        "Seconds to keep trying a database that cannot be used at start (a restarting node, a cluster "
        "node out of its primary component) before exiting 3; 0 exits at once."
    ),
)
def serve(
    database_url: str, host: str, port: int, max_body_bytes: int, workers: int, database_wait: float
) -> None:
    """Serve the HTTP API. A SQLite database is migrated at start; others need `migrate`."""
    import uvicorn

    from orbit_server.api._http import uvicorn_options
    from orbit_server.api.app import create_app

    settings = ServerSettings(database_url=database_url, host=host, port=port, max_body_bytes=max_body_bytes)
    _wait_for_database(database_url, database_wait)
    try:  # say plainly when the port is taken (uvicorn would exit 3, our "database unreachable")
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        click.echo(f"error: cannot listen on {host}:{port}: {exc.strerror}; choose another --port", err=True)
        sys.exit(1)
    log_level = logging.getLevelName(logging.getLogger().level).lower()
    log_config = _uvicorn_log_config(log_level, click.get_current_context().find_root().params["log_format"])
    if workers == 1:
        uvicorn.run(
            create_app(settings),
            host=host,
            port=port,
            log_level=log_level,
            log_config=log_config,
            **uvicorn_options(settings),
        )
        return
    # Each worker process builds its own app (and engine) from ORBIT_* variables: pass the flags on.
    os.environ.update(
        ORBIT_DATABASE_URL=database_url, ORBIT_HOST=host, ORBIT_PORT=str(port),
        ORBIT_MAX_BODY_BYTES=str(max_body_bytes),
    )  # fmt: skip
    uvicorn.run("orbit_server.api.app:create_app", factory=True, workers=workers, host=host, port=port,
                log_level=log_level, http="orbit_server.api._http:HeaderTimeoutProtocol",
                access_log=False, log_config=log_config)  # fmt: skip


def _wait_for_database(database_url: str, seconds: float) -> None:
    """Check the database (and its schema) as every command does, trying again every second for up to
    ``seconds`` while it cannot be used; then exit 3 as :func:`_engine` does."""
    import sqlalchemy as sa

    deadline = time.monotonic() + seconds
    while True:
        try:
            with _engine(database_url, raise_unreachable=time.monotonic() < deadline, create_sqlite=True):
                return
        except sa.exc.OperationalError as exc:
            logging.getLogger("orbit_server").warning(
                "cannot use the database yet (%s); trying again for %.0f s more",
                exc.orig,
                max(0.0, deadline - time.monotonic()),
                extra={"event": "database_wait"},
            )
            time.sleep(1.0)


def _uvicorn_log_config(log_level: str, log_format: str) -> dict[str, Any]:
    """uvicorn's logging: its own text lines (``None``: uvicorn's default) or, for ``json``, every logger
    (uvicorn's too, in every worker process) as :class:`~orbit_client._logs.JsonFormatter` lines on stderr."""
    if log_format.lower() != "json":
        import uvicorn.config

        return uvicorn.config.LOGGING_CONFIG
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": "orbit_client._logs.JsonFormatter"}},
        "handlers": {
            "json": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
        },
        "root": {"handlers": ["json"], "level": log_level.upper()},
        "loggers": {
            name: {"handlers": [], "propagate": True}
            for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
        },
    }


@main.command()
@_database_url_option
def migrate(database_url: str) -> None:
    """Upgrade the database schema to the newest revision (Alembic)."""
    from orbit_server.db import migrate as _migrate

    with _engine(database_url, ensure_schema=False) as engine:
        _migrate.upgrade(engine)
        click.echo(f"schema at revision {_migrate.current_revision(engine)}", err=True)
