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
from typing import Any

import click

from orbit_client._logs import JsonFormatter
from orbit_server.cli import flows, keys, namespaces, queues, retention, schedules, subscriptions, tasks
from orbit_server.cli.options import _DEFAULTS, _database_url_option, _engine
from orbit_server.db import migrate as _migrate
from orbit_server.settings import ServerSettings

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
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
        "within ORBIT_LEASE_POLL_INTERVAL_SECONDS (default 0.5 s)."
    ),
)
def serve(database_url: str, host: str, port: int, max_body_bytes: int, workers: int) -> None:
    """Serve the HTTP API. A SQLite database is migrated at start; others need `migrate`."""
    import uvicorn

    from orbit_server.api._http import uvicorn_options
    from orbit_server.api.app import create_app

    settings = ServerSettings(database_url=database_url, host=host, port=port, max_body_bytes=max_body_bytes)
    with _engine(database_url):
        pass
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
    with _engine(database_url, ensure_schema=False) as engine:
        _migrate.upgrade(engine)
        click.echo(f"schema at revision {_migrate.current_revision(engine)}", err=True)


for group in (
    namespaces.namespace,
    queues.queue,
    keys.api_key,
    tasks.task,
    subscriptions.subscription,
    schedules.schedule,
    retention.retention_group,
    retention.purge,
    flows.flow,
):
    main.add_command(group)
