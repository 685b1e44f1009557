"""The business database goes away under a running relay: it backs off, logs once per backoff,
and recovers by itself (MariaDB and PostgreSQL behind a TCP proxy that is taken down)."""

from __future__ import annotations

import logging
import threading
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from orbit_client import OrbitClient, RetryPolicy
from outbox_adapter import Backoff, Outbox, Relay, enqueue
from tests.conftest import DatabaseFactory
from tests.outbox_support import TcpProxy
from tests.servers import RunningServer


class _Events(logging.Handler):
    """Collects the relay's ``event`` log fields; sets a flag when one arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict[str, Any]] = []
        self.changed = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self.changed:
            self.events.append({"event": getattr(record, "event", None), "message": record.getMessage()})
            self.changed.notify_all()

    def wait_for(self, event: str, count: int = 1, timeout: float = 30) -> None:
        with self.changed:
            ok = self.changed.wait_for(lambda: self.count(event) >= count, timeout)
        assert ok, f"no {count} x {event} in {[e['event'] for e in self.events]}"

    def count(self, event: str) -> int:
        return sum(1 for e in self.events if e["event"] == event)


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("mariadb", marks=pytest.mark.mariadb),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
def test_the_relay_waits_out_a_database_outage_and_recovers(
    kind: str, make_database: DatabaseFactory, orbit: RunningServer
) -> None:
    url = make_database(kind)
    direct = sa.create_engine(url)
    Outbox(direct).migrate()
    keys = orbit.add_namespace(f"outage-{kind}", ("default",))
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or (3306 if kind == "mariadb" else 5432))
    proxy.up()
    handler = _Events()
    adapter_log = logging.getLogger("outbox_adapter")
    adapter_log.addHandler(handler)
    level = adapter_log.level
    adapter_log.setLevel(
        logging.INFO
    )  # setLevel, not .level =: it also clears the logger's enabled-for cache
    client = OrbitClient(orbit.base_url, api_key=keys["submit"], retry=RetryPolicy(max_attempts=1))
    relay = Relay(
        client=client,
        database_url=url.set(host="127.0.0.1", port=proxy.port),
        backoff=Backoff.no_wait(),
        db_backoff=Backoff(base=0.1, cap=0.2, random=lambda: 1.0),
        poll_interval=0.05,
    )
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        with direct.begin() as conn:
            enqueue(conn, namespace=f"outage-{kind}", queue="default", handler="h", params={"n": 0})
        handler.wait_for("delivered")  # logged after the commit

        proxy.down()
        handler.wait_for("database_unavailable", count=3)
        with direct.begin() as conn:  # the application goes on writing meanwhile
            for n in range(1, 4):
                enqueue(conn, namespace=f"outage-{kind}", queue="default", handler="h", params={"n": n})
        proxy.up()
        handler.wait_for("delivered", count=4)
        handler.wait_for("database_recovered")
    finally:
        relay.stop()
        thread.join(20)
        relay.close()
        client.close()
        proxy.down()
        adapter_log.removeHandler(handler)
        adapter_log.setLevel(level)
    assert not thread.is_alive()
    assert {r.state for r in Outbox(direct).list_rows()} == {"DELIVERED"}
    # One warning per backoff, each naming its failure number; one recovery line.
    failures = [e["message"] for e in handler.events if e["event"] == "database_unavailable"]
    assert [f"(failure {i})" in m for i, m in enumerate(failures, 1)] == [True] * len(failures)
    assert handler.count("database_recovered") == 1
    direct.dispose()


@pytest.mark.mariadb
def test_a_connection_lost_while_reading_the_isolation_level_is_a_transient_database_error(
    make_database: DatabaseFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (CI run): the driver's own error escaped here and killed a relay thread mid-outage."""
    import pymysql

    from outbox_adapter import OutboxDatabaseError

    engine = sa.create_engine(make_database("mariadb"))
    outbox = Outbox(engine)

    def lost(dbapi_connection: Any) -> str:
        raise pymysql.err.OperationalError(2013, "Lost connection to MySQL server during query")

    # The relay reads an application engine's level once, to know whether its transactions need a
    # SET TRANSACTION ISOLATION LEVEL READ COMMITTED.
    monkeypatch.setattr(engine.dialect, "get_isolation_level", lost)
    with pytest.raises(OutboxDatabaseError) as caught, outbox.transaction("claim a batch of outbox rows"):
        pass
    assert caught.value.retryable is True
    assert isinstance(caught.value.__cause__, sa.exc.OperationalError)
    engine.dispose()


def test_rows_go_out_as_soon_as_the_orbit_server_answers_again(
    make_database: DatabaseFactory, orbit: RunningServer
) -> None:
    """The Orbit server down is one condition of the relay (issue 30): logged once, probed, and every
    waiting row goes out as soon as it answers. The relay used to log a warning per row per retry and
    spread the rows over their own backoff (a minute here), so they went out long after the server
    was back."""
    engine = sa.create_engine(make_database("sqlite"))
    Outbox(engine).migrate()
    keys = orbit.add_namespace("orbit-outage", ("default",))
    server = httpx.URL(orbit.base_url)
    proxy = TcpProxy(server.host, server.port or 80)  # not up yet: connections are refused
    handler = _Events()
    adapter_log = logging.getLogger("outbox_adapter")
    adapter_log.addHandler(handler)
    level = adapter_log.level
    adapter_log.setLevel(logging.INFO)
    client = OrbitClient(f"http://127.0.0.1:{proxy.port}", api_key=keys["submit"], timeout=5,
                         retry=RetryPolicy(max_attempts=1))  # fmt: skip
    relay = Relay(
        client=client,
        engine=engine,
        batch_size=1,
        concurrency=1,
        backoff=Backoff(base=60.0, cap=60.0, random=lambda: 1.0),  # a row's own backoff: a minute
        orbit_backoff=Backoff(base=0.1, cap=0.2, random=lambda: 1.0),
        poll_interval=0.05,
    )
    with engine.begin() as conn:
        for n in range(3):
            enqueue(conn, namespace="orbit-outage", queue="default", handler="h", params={"n": n})
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        handler.wait_for("orbit_unavailable")
        proxy.up()
        handler.wait_for("delivered", count=3, timeout=20)  # well inside the rows' own minute of backoff
        handler.wait_for("orbit_recovered")
    finally:
        relay.stop()
        thread.join(20)
        relay.close()
        client.close()
        proxy.down()
        adapter_log.removeHandler(handler)
        adapter_log.setLevel(level)
    assert not thread.is_alive()
    rows = Outbox(engine).list_rows()
    # Each row counts one send: the refused ones were given back.
    assert [(r.state, r.attempts) for r in rows] == [("DELIVERED", 1)] * 3
    assert handler.count("orbit_unavailable") == 1 and handler.count("orbit_recovered") == 1
    assert handler.count("retry") == 0  # no warning per row
    engine.dispose()
