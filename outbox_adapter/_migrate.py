"""Apply the outbox's Alembic history (``migrations/outbox``) programmatically.

The history has its own version table, ``<table>_alembic_version`` (default
``orbit_outbox_alembic_version``), so it lives beside the application's own Alembic
history and the server's without touching them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

from outbox_adapter._db import translate_db_error
from outbox_adapter._tables import DEFAULT_TABLE_NAME, OutboxTables

__all__ = ["current_revision", "head_revision", "migrations_dir", "upgrade", "version_table"]


def version_table(table_name: str = DEFAULT_TABLE_NAME) -> str:
    """The Alembic version table of the outbox named ``table_name``."""
    return f"{table_name}_alembic_version"


def migrations_dir() -> Path:
    """Where the outbox migrations live: inside the wheel (``_migrations``), or the source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_migrations", here.parent / "migrations" / "outbox"):
        if (candidate / "env.py").is_file():
            return candidate
    raise RuntimeError(f"the outbox's Alembic migrations were not found next to {here}")


def _config(tables: OutboxTables) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.attributes["outbox_table"] = tables.name
    cfg.attributes["outbox_events_table"] = tables.events_name
    cfg.attributes["inbox_table"] = tables.inbox_name
    cfg.attributes["outbox_keys_table"] = tables.keys_name
    return cfg


def upgrade(engine: Engine, *, tables: OutboxTables | None = None, revision: str = "head") -> str | None:
    """Create or upgrade the outbox tables behind ``engine`` to ``revision`` (default: the newest).

    Args:
        engine: the business database; not disposed of.
        tables: whose names to use; ``None`` means ``OutboxTables()``.
        revision: an Alembic revision id, or ``"head"``.

    Returns:
        The revision the database is at afterwards.

    Raises:
        OutboxDatabaseError: the database failed or is unreachable.
    """
    tables = tables or OutboxTables()
    cfg = _config(tables)
    try:
        with engine.begin() as conn:
            galera = _wait_for_the_cluster(conn)
            cfg.attributes["connection"] = conn
            try:
                command.upgrade(cfg, revision)
            finally:
                if galera:  # the pooled connection must not keep waiting on every read
                    with contextlib.suppress(sa.exc.DBAPIError):
                        conn.exec_driver_sql("SET SESSION wsrep_sync_wait = 0")
        return current_revision(engine, tables=tables)
    except sa.exc.SQLAlchemyError as exc:
        raise translate_db_error(exc, "migrate the outbox tables") from exc


def _wait_for_the_cluster(conn: sa.Connection) -> bool:
    """On a MariaDB Galera node, make the migration's reads wait until the node has applied what the
    cluster committed before them (``wsrep_sync_wait``): a node a moment behind another that just
    migrated would find no table and create it again (1050). Whether it is one."""
    if conn.dialect.name != "mysql":
        return False
    try:
        on = conn.exec_driver_sql("SELECT @@wsrep_on").scalar()
    except sa.exc.DBAPIError:  # MySQL: no such variable (1193); the transaction goes on
        return False
    if str(on).upper() not in ("1", "ON"):
        return False
    conn.exec_driver_sql("SET SESSION wsrep_sync_wait = 15")
    return True


def head_revision() -> str | None:
    """The newest revision of the outbox history."""
    return ScriptDirectory.from_config(_config(OutboxTables())).get_current_head()


def current_revision(engine: Engine, *, tables: OutboxTables | None = None) -> str | None:
    """The revision the database is at; ``None`` when the outbox was never migrated there."""
    name = (tables or OutboxTables()).name
    with engine.connect() as conn:
        return MigrationContext.configure(
            conn, opts={"version_table": version_table(name)}
        ).get_current_revision()
