"""The server's Alembic history on every database: from an empty database, and from each earlier
revision holding rows, up to the newest; the result is exactly the schema module.

A revision that moves existing rows (0005 gives every queue its gate) runs with a namespace and a
queue present, so its data step is tried on each database (0005 gave a boolean column the integer
``0``, which PostgreSQL refuses).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import URL, Engine

from orbit_server.db import migrate, schema
from orbit_server.db.engine import create_engine
from orbit_server.db.migrate import VERSION_TABLE
from tests.conftest import DatabaseFactory
from tests.integration.conftest import BACKENDS

#: Every revision but the newest, oldest first.
EARLIER = [
    script.revision
    for script in reversed(list(ScriptDirectory(str(migrate.migrations_dir())).walk_revisions()))
][:-1]


@pytest.fixture(scope="module", params=BACKENDS)
def database(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[Engine]:
    url: URL = make_database(request.param)
    engine = create_engine(url, pool_size=1)
    yield engine
    engine.dispose()


@pytest.fixture
def engine(database: Engine) -> Engine:
    """The module's database, emptied (a new database per test costs seconds on PostgreSQL)."""
    with database.begin() as conn:
        tables = sa.MetaData()
        tables.reflect(conn)
        tables.drop_all(conn)
    return database


def _schema_differences(engine: Engine) -> list[object]:
    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn, opts={"compare_type": True, "version_table": VERSION_TABLE}
        )
        return list(compare_metadata(context, schema.metadata))


def test_an_empty_database_migrates_to_exactly_the_schema_module(engine: Engine) -> None:
    migrate.upgrade(engine)
    assert migrate.current_revision(engine) == migrate.head_revision()
    assert _schema_differences(engine) == []


@pytest.mark.parametrize("start", EARLIER)
def test_a_database_at_an_earlier_revision_with_rows_migrates_to_the_newest(
    engine: Engine, start: str
) -> None:
    migrate.upgrade(engine, start)
    with engine.begin() as conn:
        tables = sa.MetaData()
        tables.reflect(conn, only=["namespaces", "queues"])
        now = sa.text("CURRENT_TIMESTAMP")
        ns_id = conn.execute(
            tables.tables["namespaces"].insert().values(name="ns", created_at=now)
        ).inserted_primary_key[0]
        conn.execute(tables.tables["queues"].insert().values(namespace_id=ns_id, name="q", created_at=now))
    migrate.upgrade(engine)
    assert migrate.current_revision(engine) == migrate.head_revision()
    assert _schema_differences(engine) == []
    with engine.connect() as conn:
        gates = conn.execute(
            sa.select(schema.queue_gates.c.paused, schema.queue_gates.c.control_version)
        ).all()
    if start < "0005":  # 0005 gave the existing queue its open gate (later, creating a queue does)
        assert [tuple(gate) for gate in gates] == [(False, 1)]
