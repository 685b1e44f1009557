"""``bench.compare --server-db postgres`` puts Orbit and the peer on one PostgreSQL instance: each side's
database CPU must count the backends of its own databases and not the other side's (issue 32)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from bench._compare import PG_DATABASES, database_cpu
from tests.conftest import DatabaseFactory

pytestmark = pytest.mark.postgres

#: A query that keeps its backend busy for a fraction of a second.
BUSY = "SELECT sum(g::bigint * g) FROM generate_series(1, 3000000) AS g"


def test_each_side_counts_the_backends_of_its_own_database_only(
    make_database: DatabaseFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = make_database("postgres")
    assert url.database is not None
    monkeypatch.setitem(PG_DATABASES, "orbit", {url.database})
    monkeypatch.setitem(PG_DATABASES, "peer", {"orbit_cmp_peer_absent"})
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")  # the backend exists before the sampling starts
            with database_cpu("orbit") as orbit, database_cpu("peer") as peer:
                conn.exec_driver_sql(BUSY).scalar_one()
    finally:
        engine.dispose()
    assert orbit.seconds >= 0.05, orbit.seconds  # the busy backend is Orbit's
    assert peer.seconds < orbit.seconds / 4, (peer.seconds, orbit.seconds)  # the instance's writers at most
