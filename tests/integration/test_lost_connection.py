"""A database connection lost in use (a crash, a cut, a ``KILL``): the server answers 503 with
``Retry-After`` ("nothing was done, retry") when no write of the request was committed, and 500
("outcome unknown") once the COMMIT of a write was sent (README "Scaling out").

Real MariaDB and PostgreSQL behind a TCP proxy whose connections are cut; a real server process on a
real port for the HTTP answer."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine

from orbit_server.db.engine import (
    create_engine,
    note_autocommitted_write,
    nothing_committed,
    request_writes_tracked,
)
from tests.conftest import DatabaseFactory
from tests.outbox_support import TcpProxy
from tests.server_processes import ServerProcess, prepare

KINDS = [
    pytest.param("mariadb", marks=pytest.mark.mariadb),
    pytest.param("postgres", marks=pytest.mark.postgres),
]


@pytest.fixture(params=KINDS)
def behind_proxy(
    request: pytest.FixtureRequest, make_database: DatabaseFactory
) -> Iterator[tuple[URL, URL, TcpProxy]]:
    """(direct URL, URL through the proxy, the proxy) of a new database. PostgreSQL too: the verdict
    rests on SQLAlchemy's ``connection_invalidated``, not on MariaDB's error numbers."""
    url = make_database(request.param)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or (3306 if request.param == "mariadb" else 5432))
    proxy.up()
    try:
        yield url, url.set(host="127.0.0.1", port=proxy.port), proxy
    finally:
        proxy.down()


def _cut(proxy: TcpProxy) -> None:
    """Cut every open connection; new ones are accepted again at once."""
    proxy.down()
    proxy.up()


def _nothing_committed(engine: Engine, proxy: TcpProxy, before: str | None, during: list[str]) -> bool:
    """In one request: run ``before`` in a committed transaction, then ``during`` in another, cutting
    the connections before its last statement; :func:`nothing_committed` of the error that ends it."""
    with request_writes_tracked():
        if before is not None:
            with engine.begin() as conn:
                conn.exec_driver_sql(before)
        with pytest.raises(sa.exc.DBAPIError) as lost, engine.begin() as conn:
            for n, statement in enumerate(during):
                if n == len(during) - 1:
                    _cut(proxy)
                conn.exec_driver_sql(statement)
        assert lost.value.connection_invalidated, lost.value
        return nothing_committed(lost.value)


def test_a_lost_connection_is_judged_by_what_the_request_committed(
    behind_proxy: tuple[URL, URL, TcpProxy],
) -> None:
    direct_url, proxied_url, proxy = behind_proxy
    direct = sa.create_engine(direct_url)
    engine = create_engine(proxied_url, pool_size=2, ping_idle_seconds=3600)
    try:
        with direct.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE t (id INTEGER PRIMARY KEY)")
        # A read at the start of the request: nothing was done.
        assert _nothing_committed(engine, proxy, None, ["SELECT 1"])
        # A write, then the connection lost before COMMIT: the database rolled it back.
        assert _nothing_committed(engine, proxy, None, ["INSERT INTO t VALUES (1)", "SELECT 1"])
        # A committed read-only transaction before: still nothing done.
        assert _nothing_committed(engine, proxy, "SELECT 1", ["SELECT 1"])
        # A committed write before: the request did something (500, outcome unknown).
        assert not _nothing_committed(engine, proxy, "INSERT INTO t VALUES (2)", ["SELECT 1"])
        with direct.connect() as conn:
            assert conn.exec_driver_sql("SELECT id FROM t ORDER BY id").scalars().all() == [2]

        # The COMMIT of a write lost: unknown, whatever reached the database.
        with request_writes_tracked():
            conn = engine.connect()
            try:
                conn.exec_driver_sql("INSERT INTO t VALUES (3)")
                _cut(proxy)
                with pytest.raises(sa.exc.DBAPIError) as lost:
                    conn.commit()
                assert lost.value.connection_invalidated
                assert not nothing_committed(lost.value)
            finally:
                conn.close()
        # A write sent autocommitted (PostgreSQL's lease, leases.lease): it commits with its own statement,
        # so a connection lost while it ran leaves the outcome unknown, with no COMMIT to mark it.
        with request_writes_tracked():
            with pytest.raises(sa.exc.DBAPIError) as lost, engine.connect() as conn:
                conn.execution_options(isolation_level="AUTOCOMMIT")
                _cut(proxy)
                note_autocommitted_write()
                conn.exec_driver_sql("INSERT INTO t VALUES (4)")
            assert lost.value.connection_invalidated
            assert not nothing_committed(lost.value)
        # Outside a request nothing is claimed either way.
        with pytest.raises(sa.exc.DBAPIError) as outside, engine.connect() as conn:
            _cut(proxy)
            conn.exec_driver_sql("SELECT 1")
        assert not nothing_committed(outside.value)
    finally:
        engine.dispose()
        direct.dispose()


@pytest.mark.parametrize("kind", KINDS)
def test_a_read_on_a_connection_lost_in_the_pool_answers_503_then_recovers(
    make_database: DatabaseFactory, tmp_path: Path, kind: str
) -> None:
    direct_url = make_database(kind)  # the server's networked databases (SQLite: never lost)
    proxy = TcpProxy(direct_url.host or "127.0.0.1", direct_url.port or (3306 if kind == "mariadb" else 5432))
    proxy.up()
    proxied_url = direct_url.set(host="127.0.0.1", port=proxy.port)
    keys = prepare(direct_url, "lost", ("default",))
    server = ServerProcess(
        proxied_url, tmp_path / "server.log",
        # No background loop and no ping of a pooled connection: the next request meets the cut one. (A
        # loop that met it first made the pool replace its connections, and the request answered 200: on
        # a loaded machine, where more time passes between the cut and the request, once in a full run.)
        ORBIT_SWEEP_INTERVAL_SECONDS="0", ORBIT_SCHEDULER_INTERVAL_SECONDS="0", ORBIT_FLOW_INTERVAL_SECONDS="0",
        ORBIT_METRICS_SAMPLE_INTERVAL_SECONDS="0", ORBIT_DB_PING_IDLE_SECONDS="3600",
    )  # fmt: skip
    try:
        with httpx.Client(
            base_url=server.base_url, headers={"Authorization": f"Bearer {keys['admin']}"}
        ) as http:
            made = http.post(
                "/v1/namespaces/lost/tasks", headers={"Idempotency-Key": uuid.uuid4().hex},
                json={"queue": "default", "handler": "h", "params": {}},
            )  # fmt: skip
            assert made.status_code == 201, made.text
            path = f"/v1/namespaces/lost/tasks/{made.json()['id']}"
            assert http.get(path).status_code == 200
            _cut(proxy)
            lost = http.get(path)
            assert lost.status_code == 503, lost.text
            assert lost.headers["Retry-After"] == "1"
            assert lost.json()["code"] == "database_unavailable"
            assert http.get(path).status_code == 200  # the pool replaced the cut connections
    finally:
        server.stop()
        proxy.down()
