"""``orbit-server``: run the API and administer namespaces, queues and API keys.

Every option can also be set through the environment variable shown in
``--help``. Exit codes: 0 success, 1 the request was refused (e.g. a name that
exists, a namespace that does not), 2 bad usage, 3 the database is unreachable.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from orbit_client._logs import JsonFormatter

from . import _migrate, errors, store
from ._db import create_engine, is_sqlite
from .settings import ServerSettings

__all__ = ["main"]

F = TypeVar("F", bound=Callable[..., Any])
_DEFAULTS = ServerSettings.model_fields


def _database_url_option(func: F) -> F:
    return click.option(
        "--database-url",
        envvar="ORBIT_DATABASE_URL",
        show_envvar=True,
        default=_DEFAULTS["database_url"].default,
        show_default=True,
        help="SQLAlchemy URL of the server database.",
    )(func)


@contextmanager
def _engine(url: str, *, ensure_schema: bool = True) -> Iterator[Engine]:
    """An engine for one command.

    With ``ensure_schema``, SQLite is migrated first (so a fresh file just works) and any
    other database must already be at the newest revision, or the command stops with
    exit code 1 and says to run ``orbit-server migrate``.
    """
    try:
        engine = create_engine(url, pool_size=2)
    except (ValueError, sa.exc.ArgumentError, ImportError) as exc:
        raise click.UsageError(f"--database-url: {exc}") from exc
    try:
        if ensure_schema and is_sqlite(url):
            _migrate.upgrade(engine)
        elif ensure_schema:
            current, head = _migrate.current_revision(engine), _migrate.head_revision()
            if current != head:
                click.echo(
                    f"error: the database schema is at revision {current or 'none'}, the newest is {head}; "
                    f"run `orbit-server migrate --database-url ...` first",
                    err=True,
                )
                sys.exit(1)
        yield engine
    except errors.OrbitServerError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except sa.exc.OperationalError as exc:
        click.echo(
            f"error: cannot use the database at {sa.make_url(url).render_as_string()}: {exc.orig}", err=True
        )
        sys.exit(3)
    finally:
        engine.dispose()


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

    from ._http import uvicorn_options
    from .app import create_app

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
    uvicorn.run("orbit_server.app:create_app", factory=True, workers=workers, host=host, port=port,
                log_level=log_level, http="orbit_server._http:HeaderTimeoutProtocol",
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


@main.group()
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


@main.group()
def queue() -> None:
    """Manage queues."""


@queue.command("create")
@click.argument("namespace_name", metavar="NAMESPACE")
@click.argument("name", metavar="QUEUE")
@click.option(
    "--max-concurrency-per-key",
    type=click.IntRange(1, 1_000_000),
    default=None,
    help="Live attempts allowed per task concurrency_key (README: Concurrency limits). Default: no limit.",
)
@click.option(
    "--max-concurrency",
    type=click.IntRange(1, 1_000_000),
    default=None,
    help="Live attempts allowed in the whole queue. Default: no limit.",
)
@_database_url_option
def queue_create(
    namespace_name: str, name: str, max_concurrency_per_key: int | None, max_concurrency: int | None,
    database_url: str,
) -> None:  # fmt: skip
    """Create queue QUEUE in NAMESPACE, optionally with concurrency limits."""
    _check_name("QUEUE", name)
    from .queue_cli import cli_actor

    with _engine(database_url) as engine, engine.begin() as conn:
        store.create_queue(
            conn, namespace_name, name, max_concurrency_per_key=max_concurrency_per_key,
            max_concurrency=max_concurrency, actor=cli_actor(None),
        )  # fmt: skip
    click.echo(f"queue {name!r} created in namespace {namespace_name!r}", err=True)


@main.group("api-key")
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


def _check_label(label: str | None) -> str | None:
    if label is not None and len(label) > store.API_KEY_LABEL_MAX_LENGTH:
        raise click.BadParameter(
            f"the label has {len(label)} characters; the limit is {store.API_KEY_LABEL_MAX_LENGTH}: "
            "shorten it (nothing was written)",
            param_hint="'--label'",
        )
    return label


def _check_name(what: str, name: str) -> None:
    import re

    from orbit_client import NAME_PATTERN

    if not re.fullmatch(NAME_PATTERN, name):
        raise click.BadParameter(
            "use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit", param_hint=what
        )


# The admin commands (task, subscription, and the list/revoke commands of the groups above) live in
# admin_cli.py; importing it registers them on `main`.
from . import admin_cli as _admin_cli  # noqa: E402, F401
from . import queue_cli as _queue_cli  # noqa: E402, F401 - queue show/update/pause/resume
from .retention_cli import purge, retention_group  # noqa: E402 - it uses the helpers above
from .schedule_cli import schedule  # noqa: E402 - it uses the helpers above

main.add_command(schedule)
main.add_command(retention_group)
main.add_command(purge)
from . import flow_cli as _flow_cli  # noqa: E402, F401 - flow publish/list/versions/start/instances/show/...
