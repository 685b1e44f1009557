"""The server's connection pool: no round trip that buys nothing, and no transaction outlives a checkout."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from orbit_server.db.engine import as_db_time, create_engine, db_now, db_now_expression
from orbit_server.tasks import transitions
from tests.conftest import DatabaseFactory

KINDS = [
    pytest.param("mariadb", marks=pytest.mark.mariadb),
    pytest.param("postgres", marks=pytest.mark.postgres),
]


@pytest.fixture(scope="module", params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def engine(make_database: DatabaseFactory, kind: str) -> Iterator[Engine]:
    engine = create_engine(make_database(kind), pool_size=1)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE t (id INT PRIMARY KEY)" + (" ENGINE=InnoDB" if kind == "mariadb" else "")
        )
    yield engine
    engine.dispose()


def _statements(engine: Engine, work: Any) -> list[str]:
    """What ``work()`` sent on the wire besides its own statements: pings and rollbacks."""
    sent: list[str] = []
    pool_dbapi = engine.pool

    def on_checkout(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
        real_rollback = dbapi_connection.rollback
        if hasattr(dbapi_connection, "ping"):  # PyMySQL
            real_ping = dbapi_connection.ping

            def ping(*args: Any) -> Any:
                sent.append("PING")
                return real_ping(*args)

            dbapi_connection.ping = ping
        else:  # psycopg: SQLAlchemy pings with a cursor's SELECT 1, the only cursor made before checkout ends
            real_cursor = dbapi_connection.cursor

            def cursor(*args: Any, **kwargs: Any) -> Any:
                sent.append("PING")
                return real_cursor(*args, **kwargs)

            dbapi_connection.cursor = cursor
            unpatch.append(lambda: setattr(dbapi_connection, "cursor", real_cursor))

        def rollback() -> Any:
            sent.append("ROLLBACK")
            return real_rollback()

        dbapi_connection.rollback = rollback

    unpatch: list[Any] = []

    def after_checkout(*_args: Any) -> None:  # the checkout's pings are done: its statements are no ping
        while unpatch:
            unpatch.pop()()

    sa.event.listen(pool_dbapi, "checkout", on_checkout, insert=True)
    sa.event.listen(pool_dbapi, "checkout", after_checkout)
    try:
        work()
    finally:
        sa.event.remove(pool_dbapi, "checkout", on_checkout)
        sa.event.remove(pool_dbapi, "checkout", after_checkout)
    return sent


def test_a_committed_transaction_costs_no_ping_and_no_rollback(engine: Engine) -> None:
    def work() -> None:
        for n in range(3):
            with engine.begin() as conn:
                conn.exec_driver_sql("INSERT INTO t VALUES (%s)", (n + 100,))

    assert _statements(engine, work) == []


def test_a_connection_returned_inside_a_transaction_is_rolled_back(engine: Engine) -> None:
    raw = engine.raw_connection()  # bypasses Connection, as a careless caller could
    cursor = raw.cursor()
    cursor.execute("INSERT INTO t VALUES (1)")
    cursor.close()
    raw.close()  # back to the pool with the insert (and its row lock) uncommitted
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT COUNT(*) FROM t WHERE id = 1").scalar_one() == 0


def test_a_failed_statement_leaves_no_open_transaction(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO t VALUES (2)")
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO t VALUES (3)")
        conn.exec_driver_sql("INSERT INTO t VALUES (2)")
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT COUNT(*) FROM t WHERE id = 3").scalar_one() == 0


def _kill(engine: Engine, connection_id: int) -> None:
    """The database drops connection ``connection_id``, as a crash or a cut proxy does."""
    with sa.create_engine(engine.url, poolclass=sa.pool.NullPool).connect() as admin:
        if engine.dialect.name == "postgresql":
            admin.exec_driver_sql(f"SELECT pg_terminate_backend({connection_id})")
        else:
            admin.exec_driver_sql(f"KILL {connection_id}")


def test_an_idle_connection_is_pinged_and_a_dropped_one_replaced(
    make_database: DatabaseFactory, kind: str
) -> None:
    # ping_idle_seconds=0: every reused connection counts as idle (SQLAlchemy's pool_pre_ping).
    engine = create_engine(make_database(kind), pool_size=1, ping_idle_seconds=0)
    try:
        first_id = _connection_id(engine)
        _kill(engine, first_id)  # the server drops the pooled connection
        ids: list[int] = []
        sent = _statements(engine, lambda: ids.append(_connection_id(engine)))
        assert sent[:1] == ["PING"]
        assert ids[0] != first_id  # a new connection, and no error for the caller
    finally:
        engine.dispose()


def _connection_id(engine: Engine) -> int:
    with engine.begin() as conn:
        return _id(conn)


def _id(conn: sa.Connection) -> int:
    pid = "pg_backend_pid()" if conn.dialect.name == "postgresql" else "CONNECTION_ID()"
    return int(conn.exec_driver_sql(f"SELECT {pid}").scalar_one())


def test_a_connection_lost_mid_transaction_raises_the_database_error(
    make_database: DatabaseFactory, kind: str
) -> None:
    """Regression (bench.chaos, issue 9): when the database dropped a connection inside a transaction,
    the rollback listener of ``_reset_only_open_transactions`` touched the invalidated connection and
    raised ``PendingRollbackError`` in place of the ``OperationalError``. The callers that retry a lost
    connection (task acceptance: ``exc.connection_invalidated``) then answered 500 instead of retrying."""
    engine = create_engine(make_database(kind), pool_size=1)
    try:
        with pytest.raises(sa.exc.OperationalError) as raised, engine.begin() as conn:
            connection_id = _id(conn)
            _kill(engine, connection_id)  # as a crash or a cut proxy does
            conn.exec_driver_sql("SELECT 1")
        assert raised.value.connection_invalidated
        assert _connection_id(engine) != connection_id  # and the pool carries on with a new one
    finally:
        engine.dispose()


def test_the_database_clock_is_the_statement_s_not_the_transaction_s(engine: Engine) -> None:
    """Leases are judged by the database clock inside long-ish transactions: on PostgreSQL ``now()`` is the
    transaction's start, so a lease judged late in a transaction would look younger than it is. Every way
    the server reads the clock (``db_now``, ``db_now_expression``, the transitions' ``_clock``) moves within
    one transaction, in microseconds, as UTC."""
    sleep = "SELECT pg_sleep(0.05)" if engine.dialect.name == "postgresql" else "SELECT SLEEP(0.05)"
    with engine.begin() as conn:
        readings = []
        for read in (
            lambda: db_now(conn),
            lambda: as_db_time(conn.execute(sa.select(db_now_expression(conn.dialect))).scalar_one()),
            lambda: transitions._naive(conn.execute(sa.select(transitions._clock(conn))).scalar_one()),
        ):
            first = read()
            conn.exec_driver_sql(sleep)
            readings.append((first, read()))
        utc = conn.exec_driver_sql(
            "SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS float)"
            if engine.dialect.name == "postgresql"
            else "SELECT UNIX_TIMESTAMP(NOW(6))"
        ).scalar_one()
    for first, second in readings:
        assert first.tzinfo is None and second - first >= timedelta(milliseconds=50), (first, second)
    assert {first.microsecond for first, _ in readings} != {0}  # microseconds, not seconds
    assert (
        abs(readings[0][1].replace(tzinfo=UTC).timestamp() - float(utc)) < 5
    )  # UTC, whatever the session zone
