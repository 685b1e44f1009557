"""Engines, database time and dialect differences, in one place.

Rules (DESIGN §2): time comes from the database clock, never the process clock;
SQLite is a single writer (every transaction starts with ``BEGIN IMMEDIATE``);
MySQL/MariaDB run at READ COMMITTED so claims with ``SKIP LOCKED`` take no gap locks.

The pool spends no round trip that buys nothing (:func:`create_engine`): a connection is
pinged only when it has sat idle in the pool, and rolled back on return only when it may hold
an open transaction.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, Connection, Engine, make_url

from orbit_server.db import faults as _faults
from orbit_server.db.cluster import reset_on_return

__all__ = [
    "BIGINT_MAX",
    "INTEGER_MAX",
    "as_db_time",
    "by_primary_key",
    "check_supported",
    "create_engine",
    "db_now",
    "db_now_expression",
    "dispose_when_returned",
    "insert_unique",
    "is_lock_conflict",
    "is_sqlite",
    "is_unavailable",
    "is_unique_violation",
    "note_autocommitted_write",
    "nothing_committed",
    "request_writes_tracked",
    "to_utc",
]

#: The largest id or integer a column holds (signed 64-bit) on every database; SQLite's driver cannot
#: even send a larger one (OverflowError), so an id above it is answered "not found" before a query.
BIGINT_MAX = 2**63 - 1
#: The largest value of an ``INTEGER`` column (signed 32-bit; a flow version): PostgreSQL refuses a larger
#: parameter for it (``integer out of range``), so such a value is answered "not found" before a query.
INTEGER_MAX = 2**31 - 1

#: MySQL/MariaDB error numbers meaning "another transaction got in the way; try again": lock wait
#: timeout, deadlock (on a Galera cluster also a certification conflict at COMMIT, or a brute-force
#: abort by a write replicated from another node).
_MYSQL_RETRYABLE = {1205, 1213}
#: PostgreSQL SQLSTATEs meaning the same: serialization failure, deadlock, lock not available.
_POSTGRES_RETRYABLE = {"40001", "40P01", "55P03"}
#: MySQL/MariaDB error numbers meaning "the database did nothing and cannot serve right now": cannot
#: connect (2002, 2003), a Galera node outside its cluster's primary component (1047 "WSREP has not yet
#: prepared node for application use", on any statement that touches a table). A connection lost
#: mid-way (2006, 2013) is not among them: its COMMIT may have happened (:func:`nothing_committed`
#: decides those by what the request had committed).
_MYSQL_UNAVAILABLE = {1047, 2002, 2003}

#: PostgreSQL SQLSTATEs meaning the same: cannot connect (08001, 08006), the server is starting or shutting
#: down (57P03), it has no connection slot left (53300).
_POSTGRES_UNAVAILABLE = {"08001", "08006", "57P03", "53300"}

#: Per HTTP request (:func:`request_writes_tracked`): ``[wrote, committed_a_write]``: a statement
#: that may write was sent, and a COMMIT was sent after one. ``None`` outside a request.
_REQUEST_WRITES: ContextVar[list[bool] | None] = ContextVar("orbit_request_writes", default=None)
#: Statements that write nothing (the rest count as writes: a wrong guess only costs a 500 for a 503).
_READ_ONLY_HEADS = (
    "SELECT",
    "(SELECT",
    "SET ",
    "SHOW ",
    "BEGIN",
    "SAVEPOINT",
    "RELEASE",
    "ROLLBACK",
    "EXPLAIN",
)


_S = TypeVar("_S", sa.Update, sa.Select[Any])


def by_primary_key(statement: _S, table: sa.Table | None = None) -> _S:
    """``statement`` made to find its rows of ``table`` through the primary key on MySQL/MariaDB
    (``FORCE INDEX (PRIMARY)``): an ``UPDATE`` of many rows chosen by key (``(id, fence) IN (...)``),
    or a ``SELECT ... FOR UPDATE`` of ``table``'s rows by key (``table`` names it in a join or a
    subquery).

    Such a statement also tests a status or namespace column, and where few rows have that value
    the optimizer reads them through that column's index instead: it then locks every row with
    that value, not only the batch's, and two batches of different workers deadlock (seen: one in
    thirteen complete batches of four worker processes met a deadlock, and some answered 409 after
    five). Other databases are left to their planner (PostgreSQL and SQLite lock only the rows they
    return or update).

    A row-constructor ``(id, fence) IN (...)`` needs a plain ``id IN (...)`` beside it: MariaDB plans
    a one-tuple row ``IN`` as no range, so with the hint it reads the whole primary key (every task
    the retention window keeps) for a one-item batch; with the plain ``IN`` it reads one range per
    item, for one item as for a hundred."""
    hint = "FORCE INDEX (PRIMARY)"
    for dialect in ("mysql", "mariadb"):
        if isinstance(statement, sa.Update):
            statement = statement.with_hint(hint, dialect_name=dialect)
        else:
            assert table is not None, "a SELECT names the table whose primary key it reads"
            statement = statement.with_hint(table, hint, dialect_name=dialect)
    return statement


#: The databases and drivers the server runs on (README "Operations"), by SQLAlchemy backend name.
_SUPPORTED = {
    "sqlite": ("pysqlite",),
    "mysql": ("pymysql", "mysqldb"),
    "postgresql": ("psycopg",),
}
_URL_FORMS = (
    "sqlite:///./orbit.db, mysql+pymysql://user:pw@host/orbit (MariaDB 10.6+ or MySQL 8) or "
    "postgresql+psycopg://user:pw@host/orbit (PostgreSQL 15+)"
)


def check_supported(url: str | URL) -> URL:
    """``url`` parsed, if the server runs on its database and driver.

    Raises:
        ValueError: another database (e.g. ``oracle://``, ``mariadb://``: use ``mysql+pymysql://``),
            another driver (``postgresql+asyncpg://``, ``postgresql+psycopg2://``), or the driver's package
            is not installed; the message says which URL forms work and what to install, in one line.
    """
    url = make_url(url)
    backend, driver = url.get_backend_name(), url.get_driver_name()
    drivers = _SUPPORTED.get(backend)
    if drivers is None:
        raise ValueError(f"{url.drivername}:// is not a database the server runs on; use {_URL_FORMS}")
    if driver not in drivers:
        raise ValueError(
            f"{url.drivername}://: the server does not run on the {driver} driver; use "
            + " or ".join(f"{backend}+{name}://" for name in drivers)
        )
    package = {"pymysql": "pymysql", "mysqldb": "MySQLdb", "psycopg": "psycopg"}.get(driver)
    if package is not None:
        try:
            __import__(package)
        except ImportError:
            extra = {"pymysql": "mysql", "mysqldb": "mysqlclient", "psycopg": "postgres"}[driver]
            raise ValueError(
                f"{url.drivername}:// needs the {package} package: pip install 'orbit-tasks[server,{extra}]'"
            ) from None
    return url


def dispose_when_returned(engine: Engine, timeout: float = 10.0) -> None:
    """``engine.dispose()`` once every connection checked out of its pool has been returned (work still
    running in a thread, e.g. a background loop's transaction cancelled at shutdown), waiting up to
    ``timeout`` seconds (then it disposes anyway). A connection returned to a pool after ``dispose()``
    stays open in the discarded pool until the garbage collector closes it (psycopg warns then)."""
    pool = engine.pool
    checked_out = getattr(pool, "checkedout", None)
    deadline = time.monotonic() + timeout
    while checked_out is not None and checked_out() > 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.dispose()


def is_sqlite(url: str | URL) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


#: Compiled statements an engine keeps (SQLAlchemy's default: 500). The worker calls' statements are built once per
#: batch size or number of grants (``tasks/attempt_sets.py``, ``tasks/leases.py``: up to 128 sizes each, six kinds),
#: and each size is compiled once: a cache smaller than what a busy server's sizes need would compile them again.
_QUERY_CACHE_SIZE = 2000


def create_engine(
    url: str | URL, *, pool_size: int = 20, echo: bool = False, ping_idle_seconds: float = 10.0
) -> Engine:
    """Build an engine for the server's database.

    Args:
        url: a SQLAlchemy URL, e.g. ``sqlite:///./orbit.db`` or
            ``mysql+pymysql://user:pw@host/orbit`` (or ``mysql+mysqldb://``, the C driver
            of the ``mysqlclient`` extra), or ``postgresql+psycopg://user:pw@host/orbit``
            (psycopg 3, the ``postgres`` extra).
        pool_size: connections kept open (MySQL/PostgreSQL); as many again may
            overflow under load.
        ping_idle_seconds: a pooled connection idle for longer than this is pinged before
            use, and replaced if the database dropped it (a restart, ``wait_timeout``, a
            proxy's idle cut-off); a busy connection is not (``0``: ping at every checkout,
            SQLAlchemy's ``pool_pre_ping``). A connection lost while in use fails that
            statement; the pool then replaces every connection older than the failure, and
            task acceptance retries it (safe: the idempotency key makes a retry a replay).

    Raises:
        ValueError: for an in-memory SQLite URL (each connection would see its own
            empty database), or a database or driver the server does not run on
            (:func:`check_supported`).
    """
    url = check_supported(url)
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
            query_cache_size=_QUERY_CACHE_SIZE,
        )
        _make_sqlite_single_writer(engine)
        return engine
    # preserve_rowcount: psycopg forgets an INSERT's row count once SQLAlchemy closes its cursor (-1 for an
    # INSERT ... SELECT whose count decides, e.g. result_events.record_result_event); kept for every statement.
    kwargs: dict[str, Any] = {
        "pool_size": pool_size,
        "max_overflow": pool_size,
        "execution_options": {"preserve_rowcount": True},
        "query_cache_size": _QUERY_CACHE_SIZE,
    }
    if backend == "mysql":
        kwargs["isolation_level"] = "READ COMMITTED"
    # hide_parameters: a database error must not write params or results into the log (DESIGN §8).
    # LIFO: under light load the same few connections stay warm (no idle ping) and the rest age out.
    engine = sa.create_engine(url, echo=echo, pool_recycle=3600, hide_parameters=True, pool_use_lifo=True,
                              pool_reset_on_return=None, **kwargs)  # fmt: skip
    if backend == "postgresql":
        # A multi-row INSERT (a batch's keys, tasks and events) as one statement per page of at most 1,000
        # rows and 32,700 parameters (SQLAlchemy's "insertmanyvalues"; PostgreSQL takes 65,535 at most),
        # not one INSERT per row: psycopg's executemany would pipeline N statements. PyMySQL's
        # executemany already sends one multi-row INSERT.
        engine.dialect.use_insertmanyvalues_wo_returning = True
    _ping_when_idle(engine, ping_idle_seconds)
    _reset_only_open_transactions(engine)
    _note_request_writes(engine)
    if backend == "mysql":
        reset_on_return(engine)  # a causal read ended by an error (Galera; README "Scaling out")
    _faults.install(engine)  # test-only hooks; nothing unless ORBIT_SERVER_FAULT is set
    return engine


def _ping_when_idle(engine: Engine, idle_seconds: float) -> None:
    """Ping a connection at checkout only if it sat in the pool longer than ``idle_seconds``.

    ``pool_pre_ping`` costs a round trip per checkout, i.e. per transaction; a connection
    used a moment ago is alive as surely as a ping would say. A failed ping raises
    ``DisconnectionError``, on which the pool opens a new connection instead.
    """

    @event.listens_for(engine, "checkin")
    def _on_checkin(_dbapi_connection: Any, record: Any) -> None:
        record.info["orbit_idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        idle_since = record.info.get("orbit_idle_since")
        if idle_since is None:
            return  # a new connection
        if idle_seconds > 0 and time.monotonic() - idle_since <= idle_seconds:
            return  # in use moments ago
        try:
            engine.dialect.do_ping(dbapi_connection)
        except engine.dialect.loaded_dbapi.Error as exc:
            if engine.dialect.is_disconnect(exc, dbapi_connection, None):
                raise sa.exc.DisconnectionError() from exc
            raise


def _note_request_writes(engine: Engine) -> None:
    """Keep :data:`_REQUEST_WRITES` of the current request (if any) up to date: a statement that may
    write marks it written; a COMMIT after that marks a write committed (SQLAlchemy's ``commit``
    event fires just before the DBAPI commit, so a COMMIT whose answer was lost counts as done)."""

    @event.listens_for(engine, "before_cursor_execute")
    def _on_execute(_conn: Connection, _cursor: Any, statement: str, *_args: Any) -> None:
        box = _REQUEST_WRITES.get()
        if (
            box is not None
            and not box[0]
            and not statement[:16].lstrip().upper().startswith(_READ_ONLY_HEADS)
        ):
            box[0] = True

    @event.listens_for(engine, "commit")
    def _on_commit(_conn: Connection) -> None:
        box = _REQUEST_WRITES.get()
        if box is not None and box[0]:
            box[1] = True


@contextlib.contextmanager
def request_writes_tracked() -> Iterator[list[bool]]:
    """Within this block (one HTTP request; thread-pool calls inherit it), record whether a write
    was committed; yields the record, for :func:`nothing_committed` after the block."""
    record = [False, False]
    token = _REQUEST_WRITES.set(record)
    try:
        yield record
    finally:
        _REQUEST_WRITES.reset(token)


def note_autocommitted_write() -> None:
    """Record in the current request (:func:`request_writes_tracked`) that a write is about to be sent in
    autocommit mode: it commits with its own statement, with no ``COMMIT`` to mark it, so from here on a
    lost connection leaves its outcome unknown (:func:`nothing_committed` is ``False``: a 500, not a 503).
    Nothing outside a request."""
    box = _REQUEST_WRITES.get()
    if box is not None:
        box[0] = box[1] = True


def nothing_committed(exc: BaseException, record: list[bool] | None = None) -> bool:
    """``True`` when ``exc`` ended a request that changed nothing: the database was unavailable
    (:func:`is_unavailable`), or the connection was lost in use (SQLAlchemy's
    ``connection_invalidated``: a crash, a cut, a ``KILL``), and no COMMIT of a write had been sent in
    the request, so the database rolled back whatever the request wrote. The server answers such a
    request 503 with ``Retry-After`` (README "Scaling out"); once the COMMIT of a write was sent the
    outcome is unknown (500).

    ``record``: the one :func:`request_writes_tracked` yielded (default: the current block's);
    outside any block this is ``False``: nothing is known of the writes."""
    record = record if record is not None else _REQUEST_WRITES.get()
    if record is None or record[1] or not isinstance(exc, sa.exc.DBAPIError):
        return False
    return exc.connection_invalidated or is_unavailable(exc)


def _reset_only_open_transactions(engine: Engine) -> None:
    """Roll a returned connection back only when it may hold an open transaction.

    SQLAlchemy's default reset sends a ``ROLLBACK`` on every return, even after a ``COMMIT``
    (``engine.begin()`` ends that way): a round trip per transaction that changes nothing. Here
    a connection is dirty from its checkout on, clean once its ``Connection`` committed or
    rolled back, and dirty again at its next statement or error; only a connection returned
    dirty is rolled back (e.g. one used through ``raw_connection()``), so no transaction or
    lock ever outlives its checkout.
    """
    key = "orbit_clean"

    @event.listens_for(engine, "checkout")
    def _on_checkout(_dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        record.info[key] = False

    def _info(conn: Connection) -> dict[Any, Any]:
        return conn.connection.info

    @event.listens_for(engine, "before_cursor_execute")
    def _on_execute(conn: Connection, *_args: Any) -> None:
        _info(conn)[key] = False

    @event.listens_for(engine, "handle_error")
    def _on_error(context: sa.engine.ExceptionContext) -> None:
        if context.connection is not None and not context.connection.invalidated:
            with contextlib.suppress(sa.exc.SQLAlchemyError):
                _info(context.connection)[key] = False

    @event.listens_for(engine, "commit")
    @event.listens_for(engine, "rollback")
    def _on_end(conn: Connection) -> None:
        # Fired just before the DBAPI commit/rollback; if that fails, handle_error marks it dirty.
        if conn.invalidated:
            # The database dropped the connection (crash, cut, KILL): the pool discards it. Touching
            # it here would raise PendingRollbackError in place of the caller's OperationalError.
            return
        _info(conn)[key] = True

    @event.listens_for(engine, "reset")
    def _on_reset(dbapi_connection: Any, record: Any, state: Any) -> None:
        if state.terminate_only:
            return  # the connection is being closed: the server ends its transaction
        if state.transaction_was_reset or record.info.get(key):
            return
        dbapi_connection.rollback()
        record.info[key] = True


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


def db_now_expression(dialect: sa.Dialect) -> sa.ColumnElement[Any]:
    """The database clock as a SQL expression, to read it within another statement (no extra
    round trip); pass what it returns through :func:`as_db_time`."""
    if dialect.name == "sqlite":
        return sa.func.strftime("%Y-%m-%d %H:%M:%f", "now", type_=sa.String)
    if dialect.name == "mysql":
        return sa.func.utc_timestamp(6, type_=sa.DateTime)
    if dialect.name == "postgresql":
        return sa.func.timezone("UTC", sa.func.clock_timestamp(), type_=sa.DateTime)
    raise RuntimeError(f"unsupported database dialect {dialect.name!r}")  # pragma: no cover


def as_db_time(value: datetime | str) -> datetime:
    """A value of :func:`db_now_expression` as a naive UTC datetime (like :func:`db_now`)."""
    if isinstance(value, str):
        return datetime.fromisoformat(value)
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


def is_unique_violation(exc: sa.exc.DBAPIError) -> bool:
    """``True`` when ``exc`` is a duplicate key on a unique index (MySQL/MariaDB 1062, PostgreSQL
    23505, SQLite "UNIQUE constraint failed")."""
    orig = exc.orig
    args = getattr(orig, "args", ())
    if args and args[0] == 1062:
        return True
    if getattr(orig, "sqlstate", None) == "23505":
        return True
    return isinstance(orig, sqlite3.IntegrityError) and "UNIQUE constraint failed" in str(orig)


def insert_unique(conn: Connection, statement: sa.Insert, taken: Exception) -> sa.CursorResult[Any]:
    """Run the insert ``statement`` in a savepoint; a duplicate key raises ``taken`` instead.

    The check-then-insert of a create (is the name free?) races with a concurrent create of the same
    name: both see it free, one insert wins, the other meets the unique index (on MariaDB it waits
    for the winner's commit). That loser answers what a create of a taken name answers (``409
    already_exists``), never a 500; the savepoint keeps the caller's transaction usable (PostgreSQL).
    """
    try:
        with conn.begin_nested():
            return conn.execute(statement)
    except sa.exc.IntegrityError as exc:
        if is_unique_violation(exc):
            raise taken from None
        raise


def is_lock_conflict(exc: sa.exc.DBAPIError) -> bool:
    """``True`` when ``exc`` is a deadlock or lock wait timeout worth retrying: MySQL/MariaDB 1205, 1213;
    PostgreSQL 40001 (serialization failure), 40P01 (deadlock), 55P03 (lock not available: a
    ``lock_timeout`` ran out); SQLite "database is locked"."""
    orig = exc.orig
    args = getattr(orig, "args", ())
    if args and isinstance(args[0], int) and args[0] in _MYSQL_RETRYABLE:
        return True
    sqlstate = getattr(orig, "sqlstate", None)
    if sqlstate in _POSTGRES_RETRYABLE:
        return True
    return isinstance(orig, sqlite3.OperationalError) and "locked" in str(orig)


def is_unavailable(exc: BaseException) -> bool:
    """``True`` when ``exc`` proves the database did nothing and cannot serve right now (the server
    answers 503 with ``Retry-After``, README "Scaling out"): it could not be reached, or a Galera
    node is outside the primary component (1047 on a statement; at ``COMMIT``, 1180 naming the
    primary component: nothing was replicated, so nothing committed); on PostgreSQL, a connection
    that could not be made, a server starting or shutting down, or no connection slot left."""
    if not isinstance(exc, sa.exc.DBAPIError):
        return False
    args = getattr(exc.orig, "args", ())
    code = args[0] if args and isinstance(args[0], int) else None
    if code in _MYSQL_UNAVAILABLE:
        return True
    if code == 1180 and "Primary Component" in str(args[1:]):
        return True
    sqlstate = getattr(exc.orig, "sqlstate", None)
    if sqlstate is None and str(exc.orig).startswith("connection failed"):
        return True  # psycopg: no connection was made (refused, unknown host, rejected at login)
    return sqlstate in _POSTGRES_UNAVAILABLE
