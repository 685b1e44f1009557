"""Apply the server's Alembic history (``migrations/server``) programmatically."""

from __future__ import annotations

import contextlib
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

from orbit_server.db.cluster import is_galera

__all__ = ["current_revision", "head_revision", "migrations_dir", "upgrade"]

VERSION_TABLE = "orbit_server_alembic_version"


def migrations_dir() -> Path:
    """Where the server's migrations live: inside the wheel, or the source checkout."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "_migrations", package.parent / "migrations" / "server"):
        if (candidate / "env.py").is_file():
            return candidate
    raise RuntimeError(f"the server's Alembic migrations were not found next to {package}")


def _config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Upgrade the database behind ``engine`` to ``revision`` (default: the newest).

    On a Galera node every read of the migration (the version table, "does this table exist?")
    first waits until the node has applied what the cluster committed before it
    (``wsrep_sync_wait``): a node a moment behind another that just migrated would otherwise find
    no table and create it again (1050 "already exists"; README "Scaling out")."""
    cfg = _config()
    with engine.begin() as conn:
        galera = is_galera(conn)
        if galera:  # not causal_reads (1: a transaction's first read only): every statement kind, each time
            conn.exec_driver_sql("SET SESSION wsrep_sync_wait = 15")
        cfg.attributes["connection"] = conn
        try:
            command.upgrade(cfg, revision)
        finally:
            if galera:  # the pooled connection must not keep waiting on every read
                with contextlib.suppress(sa.exc.DBAPIError):
                    conn.exec_driver_sql("SET SESSION wsrep_sync_wait = 0")


def head_revision() -> str | None:
    return ScriptDirectory.from_config(_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()
