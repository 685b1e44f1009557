"""Apply the server's Alembic history (``migrations/server``) programmatically."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

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
    """Upgrade the database behind ``engine`` to ``revision`` (default: the newest)."""
    cfg = _config()
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def head_revision() -> str | None:
    return ScriptDirectory.from_config(_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()
