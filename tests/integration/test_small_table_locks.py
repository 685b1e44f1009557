"""A set-based batch on a new server's small tables locks its own tasks and attempts only (MariaDB).

On tables of a few rows MariaDB's optimizer prefers reading every attempt through a join buffer to a look-up by
key, and under ``FOR UPDATE`` it then locks every attempt it reads: every batch of a young deployment would wait
for every other. The batch's locking read finds its attempts by primary key whatever the tables' size
(``orbit_server/tasks/attempt_sets._lock_statement``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from orbit_server.db.schema import task_attempts
from orbit_server.tasks import attempt_sets
from tests.conftest import DatabaseFactory
from tests.integration.test_attempt_batches import leased
from tests.integration.test_execution_api import Api
from tests.servers import RunningServer, run_server

pytestmark = pytest.mark.mariadb


@pytest.fixture(scope="module")
def api(make_database: DatabaseFactory) -> Iterator[Api]:
    with (
        run_server(make_database("mariadb"), sweep_interval_seconds=0) as server,
        Api.in_new_namespace(server) as helper,
    ):
        yield helper


def test_a_batch_on_small_tables_leaves_other_attempts_unlocked(api: Api) -> None:
    server: RunningServer = api.server
    grants = leased(api, api.queue(), 3)
    assert server.engine.dialect.name == "mysql"
    with server.engine.connect() as conn:
        ns_id = conn.scalar(sa.text("SELECT id FROM namespaces WHERE name = :n"), {"n": api.ns})
        assert conn.scalar(sa.select(sa.func.count()).select_from(task_attempts)) == 3  # a small table
    batch, other = grants[:2], grants[2]
    with server.engine.connect() as conn, conn.begin():
        _, attempts = attempt_sets._lock_tasks(
            conn, ns_id, [g["attempt"]["id"] for g in batch], [g["task"]["id"] for g in batch]
        )
        assert sorted(attempts) == sorted(g["attempt"]["id"] for g in batch)
        with server.engine.connect() as probe, probe.begin():
            unlocked = probe.execute(
                sa.select(task_attempts.c.id)
                .where(task_attempts.c.id == other["attempt"]["id"])
                .with_for_update(nowait=True)
            ).scalar_one()  # raises (lock wait refused) when the batch's read locked it
            assert unlocked == other["attempt"]["id"]
            with pytest.raises(sa.exc.OperationalError):  # the batch's own attempts: locked
                probe.execute(
                    sa.select(task_attempts.c.id)
                    .where(task_attempts.c.id == batch[0]["attempt"]["id"])
                    .with_for_update(nowait=True)
                ).all()
