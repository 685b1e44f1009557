from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import DatabaseFactory
from tests.servers import RunningServer, run_server

BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("mariadb", id="mariadb", marks=pytest.mark.mariadb),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


@pytest.fixture(scope="module", params=BACKENDS)
def server(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[RunningServer]:
    """A real server on a free port over a fresh SQLite file, MariaDB or PostgreSQL database."""
    with run_server(make_database(request.param)) as running:
        yield running
