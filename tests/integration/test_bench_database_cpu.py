"""``bench.compare``'s fairness between the two sides' databases: with ``--server-db postgres`` Orbit and the peer
share one PostgreSQL instance, and each side's database CPU must count the backends of its own databases and not
the other side's (issue 32); each side's PostgreSQL database is vacuumed before a drain (its settings,
"maintenance")."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from bench._compare import PG_DATABASES, database_cpu, orbit_vacuum, peer_vacuum
from tests.conftest import DatabaseFactory

#: A query that keeps its backend busy for a fraction of a second.
BUSY = "SELECT sum(g::bigint * g) FROM generate_series(1, 3000000) AS g"


@pytest.mark.postgres
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


def _dead_rows(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.exec_driver_sql(
                "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'jobs'"
            ).scalar_one()
        )


@pytest.mark.postgres
def test_each_sides_postgresql_database_is_vacuumed_before_a_drain(make_database: DatabaseFactory) -> None:
    """A drain's dead rows slowed the next one by half until autovacuum came (bench.compare's settings,
    "maintenance"): the vacuum each side's PostgreSQL database gets before a drain leaves none, and it runs
    outside a transaction (``VACUUM`` refuses one)."""
    url = make_database("postgres")
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        for vacuum in (orbit_vacuum, lambda _engine: peer_vacuum(_conninfo(url))):
            with engine.begin() as conn:
                conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS jobs (id int PRIMARY KEY, status text)")
                conn.exec_driver_sql("DELETE FROM jobs")
                conn.exec_driver_sql("INSERT INTO jobs SELECT g, 'todo' FROM generate_series(1, 500) AS g")
            for status in ("doing", "succeeded"):  # each job written three times, as the peer's are
                with engine.begin() as conn:
                    conn.exec_driver_sql(f"UPDATE jobs SET status = '{status}'")
            with engine.connect() as conn:
                conn.exec_driver_sql("SELECT pg_stat_force_next_flush()")
            vacuum(engine)
            assert _dead_rows(engine) == 0
    finally:
        engine.dispose()


@pytest.mark.mariadb
def test_orbit_on_mariadb_needs_no_vacuum(make_database: DatabaseFactory) -> None:
    """InnoDB purges old row versions by itself: nothing is sent to MariaDB."""
    engine = sa.create_engine(make_database("mariadb"), poolclass=sa.pool.NullPool)
    sent: list[str] = []
    sa.event.listen(engine, "before_cursor_execute", lambda _c, _k, statement, *_a: sent.append(statement))
    try:
        orbit_vacuum(engine)
    finally:
        engine.dispose()
    assert sent == []


def _conninfo(url: sa.URL) -> str:
    """``url`` as a libpq conninfo string (the peer's settings are one)."""
    return f"host={url.host} port={url.port or 5432} user={url.username} dbname={url.database}"
