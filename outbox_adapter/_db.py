"""Engines, the database clock and dialect differences of the business database, in one place.

Rules (DESIGN §2):

- Time comes from the **database clock**, in UTC, never from the process clock:
  MySQL/MariaDB ``UTC_TIMESTAMP(6)``, PostgreSQL ``clock_timestamp() AT TIME ZONE 'UTC'``,
  SQLite ``strftime('%Y-%m-%d %H:%M:%f', 'now')``. Timestamps are stored naive, in UTC.
- The relay's own transactions are short. On SQLite they take the write lock when they
  begin (``BEGIN IMMEDIATE``), so the relay is a single writer that never collides at
  commit; on MySQL/MariaDB and PostgreSQL they run at ``READ COMMITTED`` so that
  ``FOR UPDATE SKIP LOCKED`` claims take no gap locks. The relay's own engine is built at
  that level; on an engine the application built, only the relay's own transactions are
  set to it (one ``SET TRANSACTION``, for the next transaction only, when the engine runs
  stricter): its other transactions begin as they always did.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import sqlite3
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, Connection, Engine, RowMapping, make_url

from outbox_adapter._exceptions import OutboxDatabaseError, OutboxSchemaError, OutboxUsageError

_R = TypeVar("_R")
T = TypeVar("T")
log = logging.getLogger("outbox_adapter")

__all__ = [
    "again_on_conflict",
    "aware_utc",
    "create_engine",
    "db_now",
    "describe_url",
    "is_conflict",
    "is_transient_db_error",
    "needs_read_committed",
    "now_sql",
    "pin_connection",
    "record_of",
    "short_transaction",
    "to_aware_utc",
    "to_naive_utc",
    "transaction_on",
    "translate_db_error",
]

#: MySQL/MariaDB error numbers meaning "try again" (README "Outages"), the one list of the relay,
#: the consumer and the reference worker: too many connections (1040), Galera node not ready
#: (1047), shutdown in progress (1053), lock wait timeout (1205), deadlock (1213), read-only
#: (1836 MySQL super_read_only; 1290 below), connection killed (1927), idle connection closed
#: (4031), server gone / lost / refused (2002, 2003, 2006, 2013, 2055).
#: On a Galera cluster also 1180 "Error while appending streaming replication fragment (... Not connected
#: to Primary Component)" at COMMIT (nothing was committed) and 1213 for a certification conflict; README
#: "Scaling out".
_MYSQL_TRANSIENT = {1040, 1047, 1053, 1180, 1205, 1213, 1836, 1927, 4031, 2002, 2003, 2006, 2013, 2055}
#: "The server is running with the --read-only option" (an old primary during a failover) is 1290,
#: which also names other options (--secure-file-priv, ...): transient only when it says read-only.
_MYSQL_OPTION_PREVENTS = 1290
#: PostgreSQL SQLSTATEs meaning "try again": serialization failure, deadlock, admin shutdown,
#: cannot connect now, read-only transaction (a standby after a failover), connection exceptions.
_PG_TRANSIENT = {"40001", "40P01", "57P01", "57P03", "25006", "08000", "08001", "08003", "08006"}
#: MySQL/MariaDB "table doesn't exist".
_MYSQL_NO_TABLE = 1146
_SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now') || '000'"


def now_sql(dialect_name: str) -> sa.ColumnElement[datetime]:
    """The database clock as a SQL expression: naive UTC with microseconds, for use in statements.

    On SQLite the value is text ``YYYY-MM-DD HH:MM:SS.ffffff`` (milliseconds padded
    to six digits), the format SQLAlchemy stores datetimes in, so comparisons hold.

    Raises:
        OutboxUsageError: for a dialect other than mysql, postgresql or sqlite.
    """
    if dialect_name == "sqlite":
        text = _SQLITE_NOW
    elif dialect_name == "mysql":
        text = "UTC_TIMESTAMP(6)"
    elif dialect_name == "postgresql":
        text = "(clock_timestamp() AT TIME ZONE 'UTC')"
    else:
        raise OutboxUsageError(
            f"the outbox supports MySQL/MariaDB, PostgreSQL and SQLite, not the {dialect_name!r} dialect"
        )
    return sa.literal_column(text, type_=sa.DateTime())


def db_now(conn: Connection) -> datetime:
    """Read the database clock: a naive datetime in UTC, with microseconds."""
    value = conn.execute(sa.select(now_sql(conn.dialect.name))).scalar_one()
    if isinstance(value, str):  # SQLite: SQLAlchemy does not type a bare literal column
        return datetime.fromisoformat(value)
    assert isinstance(value, datetime)
    return value.replace(tzinfo=None)


def to_naive_utc(value: datetime) -> datetime:
    """An aware datetime as the naive UTC datetime stored in the database.

    Raises:
        OutboxUsageError: ``value`` has no timezone (it could not be placed in UTC).
    """
    if value.tzinfo is None:
        raise OutboxUsageError("datetimes must carry a timezone, e.g. datetime.now(UTC)")
    return value.astimezone(UTC).replace(tzinfo=None)


def to_aware_utc(value: datetime | None) -> datetime | None:
    """A stored naive-UTC datetime as an aware UTC datetime (``None`` stays ``None``)."""
    if value is None:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def aware_utc(value: datetime) -> datetime:
    """:func:`to_aware_utc` of a value that is never ``None`` (a ``NOT NULL`` column)."""
    aware = to_aware_utc(value)
    assert aware is not None
    return aware


def record_of(cls: type[_R], m: RowMapping) -> _R:
    """``cls`` (a dataclass) built from the same-named columns of ``m``, datetimes as aware UTC."""
    names = _field_names.get(cls)
    if names is None:
        names = _field_names.setdefault(cls, tuple(f.name for f in dataclasses.fields(cls)))  # type: ignore[arg-type]
    return cls(**{name: to_aware_utc(v) if isinstance(v := m[name], datetime) else v for name in names})


#: The field names of each dataclass :func:`record_of` built (a class's fields never change).
_field_names: dict[type[Any], tuple[str, ...]] = {}


def describe_url(url: str | URL) -> str:
    """The URL for messages and logs, with its password hidden."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return "<unparsable database URL>"


def create_engine(url: str | URL, *, pool_size: int = 5) -> Engine:
    """Build the relay's (or the CLI's) own engine for the business database.

    Args:
        url: a SQLAlchemy URL, e.g. ``mysql+pymysql://app:pw@db/shop``,
            ``postgresql+psycopg://app@db/shop`` or ``sqlite:///./shop.db``.
        pool_size: connections kept open (MySQL/PostgreSQL); as many again may overflow.

    Returns:
        An engine whose SQLite connections wait up to 30 s for the write lock and begin
        every transaction with ``BEGIN IMMEDIATE`` (a single writer), and whose
        MySQL/MariaDB connections run at ``READ COMMITTED``. The caller disposes of it.

    Raises:
        OutboxUsageError: the URL is malformed, names an unsupported database, an
            in-memory SQLite database (each connection would see its own empty one) or a
            SQLite file in a directory that does not exist, or its driver is not installed.
    """
    try:
        parsed = make_url(url)
    except sa.exc.ArgumentError as exc:
        raise OutboxUsageError(f"the database URL is malformed: {exc}") from None
    backend = parsed.get_backend_name()
    try:
        if backend == "sqlite":
            if parsed.database in (None, "", ":memory:"):
                raise OutboxUsageError(
                    "the outbox needs a SQLite file shared with the application, e.g. sqlite:///./shop.db, "
                    "not an in-memory database"
                )
            folder = os.path.dirname(os.path.abspath(parsed.database))
            if not parsed.database.startswith("file:") and not os.path.isdir(folder):
                # SQLite would answer "unable to open database file", which reads as an outage.
                raise OutboxUsageError(
                    f"the SQLite database {parsed.database!r} is in a directory that does not exist ({folder}); "
                    "check the database URL (--database-url, ORBIT_OUTBOX_DATABASE_URL)"
                )
            engine = sa.create_engine(
                parsed, connect_args={"timeout": 30, "check_same_thread": False}, hide_parameters=True
            )
            _begin_immediate(engine)
            return engine
        if backend not in ("mysql", "postgresql"):
            raise OutboxUsageError(
                f"the outbox supports MySQL/MariaDB, PostgreSQL and SQLite, not {backend!r} ({describe_url(url)})"
            )
        # READ COMMITTED once per connection, at connect (not a SET + COMMIT per checkout and
        # again per checkin); no pre-ping (a connection found dead on its first statement is a
        # transient error the relay and the CLI retry); a rollback on checkin only when the driver
        # says a transaction is still open (every transaction here ends in COMMIT or ROLLBACK).
        kwargs: dict[str, Any] = {
            "pool_size": pool_size,
            "max_overflow": pool_size,
            "isolation_level": "READ COMMITTED",
            "pool_reset_on_return": None,
        }
        # hide_parameters: database errors must not put params into logs.
        engine = sa.create_engine(parsed, pool_recycle=3600, hide_parameters=True, **kwargs)
        _reset_only_open_transactions(engine)
        return engine
    except (ImportError, sa.exc.NoSuchModuleError) as exc:
        raise OutboxUsageError(
            f"no driver for {describe_url(url)}: {exc}; install 'orbit-tasks[mysql]' or 'orbit-tasks[postgres]'"
        ) from None


_OPEN = "outbox_transaction_open"


def _reset_only_open_transactions(engine: Engine) -> None:
    """On checkin, roll back only a connection that may still be inside a transaction.

    The pool's default reset sends a ROLLBACK on every checkin: after a committed
    transaction that is a round trip that buys nothing. Here a connection is marked open
    when it is checked out and when SQLAlchemy begins a transaction on it, and closed when
    SQLAlchemy commits or rolls back; only one still marked open is rolled back at checkin
    (a raw DBAPI connection, an error path), and one being discarded is left to close.
    """

    @event.listens_for(engine, "checkout")
    def _on_checkout(_dbapi: Any, record: Any, _proxy: Any) -> None:
        record.info[_OPEN] = True

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        if not conn.invalidated:  # an invalidated connection is discarded, never reset
            conn.connection.info[_OPEN] = True

    @event.listens_for(engine, "commit")
    @event.listens_for(engine, "rollback")
    def _on_end(conn: Connection) -> None:
        if not conn.invalidated:
            conn.connection.info[_OPEN] = False

    @event.listens_for(engine, "reset")
    def _on_reset(dbapi_connection: Any, record: Any, reset_state: Any) -> None:
        if reset_state.terminate_only or reset_state.transaction_was_reset:
            return
        if record.info.get(_OPEN, True):
            dbapi_connection.rollback()


def _begin_immediate(engine: Engine) -> None:
    """Let SQLAlchemy, not pysqlite, open transactions on this engine, and open them ``IMMEDIATE``."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: sqlite3.Connection, _record: object) -> None:
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


#: Per engine: does a transaction need ``SET TRANSACTION ISOLATION LEVEL READ COMMITTED`` first
#: (the engine's connections run at a stricter level)? Asked once per engine.
_needs_read_committed: weakref.WeakKeyDictionary[Engine, bool] = weakref.WeakKeyDictionary()
_WEAK_ENOUGH = ("READ COMMITTED", "READ UNCOMMITTED", "AUTOCOMMIT")


@contextmanager
def short_transaction(engine: Engine, *, read_committed: bool = True) -> Iterator[Connection]:
    """One short read-write transaction of the relay or an operator command; commits on success.

    On SQLite it holds the write lock from its first statement (``BEGIN IMMEDIATE``,
    unless the engine's own ``begin`` hook already opened the transaction); on
    MySQL/MariaDB and PostgreSQL it runs at ``READ COMMITTED``, unless ``read_committed``
    is ``False`` (the result consumer's business transaction keeps the engine's own
    isolation level). An engine built by :func:`create_engine` already runs at that level,
    so nothing is sent for it; an application's engine at a stricter level (MySQL's
    default ``REPEATABLE READ``) gets one ``SET TRANSACTION ISOLATION LEVEL READ
    COMMITTED`` for this transaction only (its session keeps its own level). The engine's
    level is read once. SQLAlchemy errors pass through untranslated: callers use
    :func:`translate_db_error`.
    """
    with engine.connect() as conn:
        set_level = read_committed and needs_read_committed(conn)
        with transaction_on(conn, set_read_committed=set_level) as inner:
            yield inner


def needs_read_committed(conn: Connection) -> bool:
    """Whether transactions on ``conn``'s engine run stricter than ``READ COMMITTED`` (MySQL/MariaDB,
    PostgreSQL; read from the database once per engine)."""
    if conn.dialect.name not in ("mysql", "postgresql"):
        return False
    engine = conn.engine
    needed = _needs_read_committed.get(engine)
    if needed is None:
        needed = _needs_read_committed[engine] = _isolation_of(conn) not in _WEAK_ENOUGH
    return needed


@contextmanager
def transaction_on(conn: Connection, *, set_read_committed: bool = False) -> Iterator[Connection]:
    """One transaction on ``conn``, committed on success: SQLite ``BEGIN IMMEDIATE`` (unless the
    engine's ``begin`` hook opened it), or first ``SET TRANSACTION ISOLATION LEVEL READ COMMITTED``
    when ``set_read_committed``."""
    with conn.begin():
        if set_read_committed:
            conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        elif conn.dialect.name == "sqlite":
            raw = conn.connection.driver_connection
            if isinstance(raw, sqlite3.Connection) and not raw.in_transaction:
                conn.exec_driver_sql("BEGIN IMMEDIATE")
        yield conn


def pin_connection(engine: Engine) -> Connection:
    """A connection of ``engine`` for a run of short transactions (:func:`transaction_on`): at
    ``READ COMMITTED`` for its session while it is checked out (the pool restores the engine's
    level when it is closed), so those transactions need no ``SET`` and no checkout or checkin
    (the pool's reset ``ROLLBACK``, an application's pre-ping) each. Driver errors while setting
    the level are wrapped as a ``DBAPIError`` marked ``connection_invalidated`` (transient).
    """
    conn = engine.connect()
    try:
        if needs_read_committed(conn):
            dbapi_error = conn.dialect.loaded_dbapi.Error
            try:
                conn.execution_options(isolation_level="READ COMMITTED")
            except dbapi_error as exc:
                conn.invalidate()
                raise sa.exc.DBAPIError.instance(
                    "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED", None, exc, dbapi_error,
                    connection_invalidated=True, dialect=conn.dialect,
                ) from exc  # fmt: skip
    except BaseException:
        conn.close()
        raise
    return conn


def _isolation_of(conn: Connection) -> str:
    """The isolation level of ``conn``, with driver errors wrapped as SQLAlchemy's.

    SQLAlchemy asks the driver directly, so a connection lost at that moment would raise
    the driver's own exception, which nothing above expects (it killed a relay thread
    during a database outage). It becomes a ``DBAPIError`` marked ``connection_invalidated``,
    which callers treat as transient.
    """
    dbapi_error = conn.dialect.loaded_dbapi.Error
    try:
        return str(conn.get_isolation_level()).upper()
    except dbapi_error as exc:
        conn.invalidate()
        raise sa.exc.DBAPIError.instance(
            "read the transaction isolation level", None, exc, dbapi_error,
            connection_invalidated=True, dialect=conn.dialect,
        ) from exc  # fmt: skip


def is_transient_db_error(exc: BaseException) -> bool:
    """``True`` when ``exc`` is a database failure that heals by itself and is waited out (README
    "Outages"): a lost or refused connection, a deadlock or lock wait timeout, a server shutting
    down, a read-only server (an old primary during a failover: MySQL/MariaDB 1290 and 1836,
    PostgreSQL 25006), SQLite's "database is locked". The one list of the relay, the consumer and
    the reference service's worker (which reports such a failure as retryable).

    Args:
        exc: any exception; a SQLAlchemy ``DBAPIError`` (or an :class:`OutboxDatabaseError`, by
            its ``retryable``) is judged, anything else is ``False``.
    """
    if isinstance(exc, OutboxDatabaseError):
        return exc.retryable
    return isinstance(exc, sa.exc.DBAPIError) and _is_transient(exc)


def _is_transient(exc: sa.exc.DBAPIError) -> bool:
    if exc.connection_invalidated or isinstance(exc, sa.exc.InterfaceError | sa.exc.DisconnectionError):
        return True
    orig = exc.orig
    args = getattr(orig, "args", ())
    if args and isinstance(args[0], int):
        if args[0] in _MYSQL_TRANSIENT:
            return True
        if args[0] == _MYSQL_OPTION_PREVENTS and "read-only" in str(args[1:]).replace(
            "read_only", "read-only"
        ):
            return True
    if getattr(orig, "sqlstate", None) in _PG_TRANSIENT:
        return True
    if isinstance(orig, sqlite3.OperationalError):
        text = str(orig)
        return "locked" in text or "busy" in text or "unable to open" in text
    # psycopg: a failed connection attempt is an OperationalError without a sqlstate.
    return (
        isinstance(exc, sa.exc.OperationalError)
        and type(orig).__module__.startswith("psycopg")
        and getattr(orig, "sqlstate", None) is None
    )


def _is_missing_table(exc: sa.exc.DBAPIError) -> bool:
    orig = exc.orig
    args = getattr(orig, "args", ())
    if args and args[0] == _MYSQL_NO_TABLE:
        return True
    if getattr(orig, "sqlstate", None) == "42P01":
        return True
    return isinstance(orig, sqlite3.OperationalError) and "no such table" in str(orig)


def translate_db_error(
    exc: sa.exc.SQLAlchemyError, what: str, *, row_id: int | None = None, state: str | None = None
) -> OutboxDatabaseError:
    """Turn a SQLAlchemy error into an :class:`OutboxDatabaseError` (not raised; ``raise ... from exc``).

    Args:
        exc: the SQLAlchemy error.
        what: what was being done, e.g. ``"claim a batch"``; starts the message.
        row_id, state: the row concerned, if any.

    Returns:
        :class:`OutboxSchemaError` when a table is missing, else :class:`OutboxDatabaseError`
        whose ``retryable`` tells whether the failure looks transient.
    """
    if isinstance(exc, sa.exc.DBAPIError):
        cause = f"{type(exc.orig).__name__}: {exc.orig}"
        if _is_missing_table(exc):
            return OutboxSchemaError(
                f"cannot {what}: the outbox tables do not exist ({cause}); run "
                "`orbit-outbox migrate --database-url URL` (or add OutboxTables to your own Alembic metadata)",
                row_id=row_id,
                state=state,
            )
        transient = _is_transient(exc)
        hint = "the database may be down or busy; try again" if transient else "check the database"
        return OutboxDatabaseError(
            f"cannot {what}: {cause}; {hint}", retryable=transient, row_id=row_id, state=state
        )
    return OutboxDatabaseError(f"cannot {what}: {type(exc).__name__}: {exc}", row_id=row_id, state=state)


#: MySQL/MariaDB: lock wait timeout, deadlock (on a Galera cluster also a certification conflict at
#: COMMIT with a write made on another node, or a brute-force abort by one).
_MYSQL_CONFLICT = {1205, 1213}
#: Seconds: before try *n* (n >= 1) a conflicting transaction waits up to ``_CONFLICT_PAUSE * 2**n``.
_CONFLICT_PAUSE = 0.005


def is_conflict(exc: BaseException) -> bool:
    """Whether ``exc`` (a SQLAlchemy error, or an :class:`OutboxDatabaseError` raised from one) is a
    lock conflict that a new transaction may well not meet: deadlock or lock wait timeout (MySQL,
    MariaDB, a Galera certification conflict), serialization failure or deadlock (PostgreSQL)."""
    cause = exc.__cause__ if isinstance(exc, OutboxDatabaseError) else exc
    if not isinstance(cause, sa.exc.DBAPIError):
        return False
    args = getattr(cause.orig, "args", ())
    if args and isinstance(args[0], int) and args[0] in _MYSQL_CONFLICT:
        return True
    return getattr(cause.orig, "sqlstate", None) in ("40001", "40P01")


def again_on_conflict(run: Callable[[], T], *, tries: int = 4) -> T:
    """``run()``, run again (up to ``tries`` times in all, after a short random pause) while it fails
    with a lock conflict (:func:`is_conflict`): on a Galera cluster two relays or consumers on two
    nodes meet at COMMIT, and a conflict is not an outage to back off from (README "Scaling out").
    ``run`` must be one whole transaction that leaves nothing behind when it fails.

    Raises:
        OutboxDatabaseError: ``run``'s error, when it is not a conflict or the conflicts went on.
    """
    for attempt in range(tries):
        if attempt:
            time.sleep(random.uniform(0, _CONFLICT_PAUSE * 2**attempt))
        try:
            return run()
        except OutboxDatabaseError as exc:
            if attempt == tries - 1 or not is_conflict(exc):
                raise
            log.debug("lock conflict (%s); running the transaction again", exc)
    raise AssertionError("unreachable")  # pragma: no cover
