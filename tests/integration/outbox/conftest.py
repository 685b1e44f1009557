"""Fixtures of the outbox integration tests: a real Orbit server on a free port, and a business
database of each kind (SQLite, MariaDB, PostgreSQL) with fresh outbox tables per test."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine

from orbit_client import OrbitClient, RetryPolicy
from outbox_adapter import Backoff, Outbox, OutboxTables, Relay
from tests.conftest import DatabaseFactory
from tests.servers import RunningServer, run_server

KINDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("mariadb", id="mariadb", marks=pytest.mark.mariadb),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


@dataclass
class Biz:
    """A business database: its kind, URL and an engine built the way an application builds one."""

    kind: str
    url: URL
    engine: Engine


@dataclass
class Namespace:
    name: str
    keys: dict[str, str]


@pytest.fixture(scope="module")
def orbit(make_database: DatabaseFactory) -> Iterator[RunningServer]:
    """A real Orbit server (its own SQLite database) on a free port."""
    with run_server(make_database("sqlite")) as running:
        yield running


@pytest.fixture(scope="module", params=KINDS)
def biz(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[Biz]:
    url = make_database(request.param)
    engine = sa.create_engine(url)  # a plain application engine: the adapter must not need more
    yield Biz(request.param, url, engine)
    engine.dispose()


@pytest.fixture
def tables(biz: Biz) -> OutboxTables:
    """Fresh outbox tables, created by the Alembic history, so tests never see each other's rows."""
    tables = OutboxTables(name=f"ob_{uuid.uuid4().hex[:10]}")
    Outbox(biz.engine, tables=tables).migrate()
    return tables


@pytest.fixture
def ns(orbit: RunningServer) -> Namespace:
    name = f"ns-{uuid.uuid4().hex[:8]}"
    return Namespace(name, orbit.add_namespace(name, ("default", "other")))


@pytest.fixture
def outbox(biz: Biz, tables: OutboxTables) -> Outbox:
    return Outbox(biz.engine, tables=tables)


RelayFactory = Callable[..., Relay]


@pytest.fixture
def make_relay(orbit: RunningServer, ns: Namespace, biz: Biz, tables: OutboxTables) -> Iterator[RelayFactory]:
    """``make_relay(base_url=None, timeout=5, **relay_options)``: a relay on the test's tables with
    a zero backoff (the test switch), closed at the end."""
    made: list[tuple[Relay, OrbitClient]] = []

    def make(*, base_url: str | None = None, timeout: float = 5.0, **options: Any) -> Relay:
        client = OrbitClient(
            base_url or orbit.base_url,
            api_key=ns.keys["submit"],
            timeout=timeout,
            retry=RetryPolicy(max_attempts=1),
        )
        options.setdefault("backoff", Backoff.no_wait())
        options.setdefault("poll_interval", 0.05)
        relay = Relay(client=client, engine=biz.engine, tables=tables, **options)
        made.append((relay, client))
        return relay

    yield make
    for relay, client in made:
        relay.close()
        client.close()
