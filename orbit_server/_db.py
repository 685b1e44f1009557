"""Engines, database time and dialect differences, in one place.

Rules (DESIGN §2): time comes from the database clock, never the process clock;
SQLite is a single writer (every transaction starts with ``BEGIN IMMEDIATE``);
MySQL/MariaDB run at READ COMMITTED so claims with ``SKIP LOCKED`` take no gap locks.
"""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, Connection, Engine, make_url

__all__ = ["create_engine", "db_now", "is_lock_conflict", "is_sqlite", "to_utc"]

#: MySQL/MariaDB error numbers meaning "another transaction got in the way; try again".
_MYSQL_RETRYABLE = {1205, 1213}  # lock wait timeout, deadlock


def is_sqlite(url: str | URL) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def create_engine(url: str | URL, *, pool_size: int = 20, echo: bool = False) -> Engine:
    """Build an engine for the server's database.

    Args:
        url: a SQLAlchemy URL, e.g. ``sqlite:///./orbit.db`` or
            ``mysql+pymysql://user:pw@host/orbit``.
        pool_size: connections kept open (MySQL/PostgreSQL); as many again may
            overflow under load.

    Raises:
        ValueError: for an in-memory SQLite URL (each connection would see its own
            empty database).
    """
    url = make_url(url)
    backend = url.get_backend_name()
    if backend == "sqlite":
        if url.database in (None, "", ":memory:"):
            raise ValueError(
                "the server needs a SQLite file, e.g. sqlite:///./orbit.db, not an in-memory database"
            )
        engine = sa.create_engine(
            url,
            echo=echo,
            hide_parameters=True,
            connect_args={"check_same_thread": False, "timeout": 30},
            pool_size=pool_size,
            max_overflow=pool_size,
        )
        _make_sqlite_single_writer(engine)
        return engine
    kwargs: dict[str, Any] = {"pool_size": pool_size, "max_overflow": pool_size, "pool_pre_ping": True}
    if backend == "mysql":
        kwargs["isolation_level"] = "READ COMMITTED"
    # hide_parameters: a database error must not write params or results into the log (DESIGN §8).
    return sa.create_engine(url, echo=echo, pool_recycle=3600, hide_parameters=True, **kwargs)


def _make_sqlite_single_writer(engine: Engine) -> None:
    """Let SQLAlchemy, not pysqlite, open transactions, and open them ``IMMEDIATE``.

    With ``BEGIN IMMEDIATE`` a transaction takes the write lock when it starts, so
    two writers never both read and then collide on commit; the loser waits up to
    the busy timeout (30 s). WAL lets readers proceed beside the one writer.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: sqlite3.Connection, _record: object) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def db_now(conn: Connection) -> datetime:
    """The database clock, as a naive UTC datetime (how every timestamp is stored)."""
    name = conn.dialect.name
    if name == "sqlite":
        value = conn.exec_driver_sql("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')").scalar_one()
        return datetime.fromisoformat(value)
    if name == "mysql":
        value = conn.exec_driver_sql("SELECT UTC_TIMESTAMP(6)").scalar_one()
    elif name == "postgresql":
        value = conn.exec_driver_sql("SELECT clock_timestamp() AT TIME ZONE 'UTC'").scalar_one()
    else:  # pragma: no cover - other dialects are not supported
        raise RuntimeError(f"unsupported database dialect {name!r}")
    assert isinstance(value, datetime)
    return value.replace(tzinfo=None)


def to_utc(value: datetime | None) -> datetime | None:
    """A stored naive-UTC datetime as an aware UTC datetime (``None`` stays ``None``)."""
    if value is None:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def to_naive_utc(value: datetime | None) -> datetime | None:
    """An aware datetime as the naive UTC datetime the database stores."""
    if value is None:
        return None
    return value.astimezone(UTC).replace(tzinfo=None)


def is_lock_conflict(exc: sa.exc.DBAPIError) -> bool:
    """``True`` when ``exc`` is a deadlock or lock wait timeout worth retrying."""
    orig = exc.orig
    args = getattr(orig, "args", ())
    if args and isinstance(args[0], int) and args[0] in _MYSQL_RETRYABLE:
        return True
    sqlstate = getattr(orig, "sqlstate", None)
    if sqlstate in ("40001", "40P01"):  # PostgreSQL serialization failure / deadlock
        return True
    return isinstance(orig, sqlite3.OperationalError) and "locked" in str(orig)
