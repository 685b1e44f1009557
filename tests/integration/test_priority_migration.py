"""Revision 0013 on a database with tasks, on SQLite and MariaDB: existing tasks get priority 0 (their lease
order unchanged), ``ix_tasks_claim`` gives way to ``ix_tasks_claim_order``, and the downgrade restores both."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa
from alembic import command
from sqlalchemy.engine import Engine

from orbit_server.db import migrate as _migrate
from orbit_server.db.engine import create_engine, db_now
from orbit_server.tasks import leases, store
from tests.conftest import DatabaseFactory
from tests.integration.conftest import BACKENDS


@pytest.fixture(params=BACKENDS)
def engine(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[Engine]:
    made = create_engine(make_database(request.param), pool_size=2)
    yield made
    made.dispose()


def _indexes(engine: Engine) -> set[str]:
    return {str(index["name"]) for index in sa.inspect(engine).get_indexes("tasks")}


def test_0013_gives_existing_tasks_priority_0_and_swaps_the_claim_index(engine: Engine) -> None:
    _migrate.upgrade(engine, "0012")
    assert "ix_tasks_claim" in _indexes(engine) and "priority" not in {
        c["name"] for c in sa.inspect(engine).get_columns("tasks")
    }
    with engine.begin() as conn:
        namespace_id = store.create_namespace(conn, "m")
        conn.execute(sa.text("INSERT INTO queues (namespace_id, name, created_at) VALUES (:ns, 'q', :now)"),
                     {"ns": namespace_id, "now": db_now(conn)})  # fmt: skip
        queue_id = conn.execute(
            sa.text("SELECT id FROM queues WHERE namespace_id = :ns AND name = 'q'"), {"ns": namespace_id}
        ).scalar_one()  # (no lastrowid on PostgreSQL)
        now = db_now(conn)
        ids = [str(uuid.uuid4()) for _ in range(3)]
        for n, task_id in enumerate(ids):  # the columns of revision 0012, due a second apart
            conn.execute(
                sa.text(
                    "INSERT INTO tasks (id, namespace_id, queue_id, handler, status, state_version, max_attempts,"
                    " available_at, created_at, updated_at) VALUES (:id, :ns, :q, 'h', 'WAITING', 1, 3, :due, :now,"
                    " :now)"
                ),
                {
                    "id": task_id,
                    "ns": namespace_id,
                    "q": queue_id,
                    "due": now - timedelta(seconds=10 - n),
                    "now": now,
                },
            )
    _migrate.upgrade(engine)
    assert {"ix_tasks_claim_order"} <= _indexes(engine) and "ix_tasks_claim" not in _indexes(engine)
    with engine.begin() as conn:
        assert set(conn.execute(sa.text("SELECT priority FROM tasks")).scalars()) == {0}
        grants = leases.lease_tasks(conn, namespace_id, "q", worker_id="w", max_tasks=3, lease_seconds=30)
        assert [g.task.id for g in grants] == ids  # oldest due first, as before the revision
        conn.rollback()
    config = _migrate._config()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "0012")
    assert "ix_tasks_claim" in _indexes(engine) and "ix_tasks_claim_order" not in _indexes(engine)
    assert "priority" not in {c["name"] for c in sa.inspect(engine).get_columns("tasks")}
