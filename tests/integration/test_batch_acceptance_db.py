"""Batch acceptance against MariaDB and PostgreSQL when another request wins a key mid-transaction (DESIGN §3).

Deterministic versions of the races the concurrent HTTP test provokes at random: a key
committed by another request between the batch's lookup and its insert, and a key held
by a transaction that does not end.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine

from orbit_client import TaskSubmission
from orbit_server import errors
from orbit_server.db import migrate
from orbit_server.db.engine import create_engine, db_now
from orbit_server.db.schema import submission_keys, tasks
from orbit_server.tasks import acceptance_batch, store
from orbit_server.tasks.acceptance_batch import Accepted, Pending, submit_batch
from tests.conftest import DatabaseFactory

SUBMISSION = TaskSubmission(queue="default", handler="orders.fulfil", params={"order_id": 1})
KEY_TTL = timedelta(days=7)


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("mariadb", marks=pytest.mark.mariadb),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
def database(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> URL:
    url = make_database(request.param)
    engine = create_engine(url)
    migrate.upgrade(engine)
    engine.dispose()
    return url


@pytest.fixture
def engine(database: URL) -> Iterator[Engine]:
    """The server's engine, with a 1 s lock wait so a held key times out quickly."""
    the_engine = create_engine(database, pool_size=4)

    @sa.event.listens_for(the_engine, "connect")
    def _short_lock_wait(dbapi_connection: Any, _record: object) -> None:
        with dbapi_connection.cursor() as cursor:
            if the_engine.dialect.name == "postgresql":
                cursor.execute("SET lock_timeout = '1s'")  # 55P03 when it runs out
                dbapi_connection.commit()  # kept even if the connection's first transaction rolls back
            else:
                cursor.execute("SET SESSION innodb_lock_wait_timeout = 1")

    yield the_engine
    the_engine.dispose()


@pytest.fixture
def principal(engine: Engine) -> store.Principal:
    name = f"ns-{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        store.create_namespace(conn, name)
        store.create_queue(conn, name, "default")
        key = store.create_api_key(conn, name, "submit")
        found = store.authenticate(conn, key)
    assert found is not None
    return found


def _accept(engine: Engine, principal: store.Principal, keys: list[str]) -> list[Any]:
    return submit_batch(
        engine,
        principal,
        [Pending.of(key, SUBMISSION) for key in keys],
        default_max_attempts=3,
        key_ttl=KEY_TTL,
    )


def _task_ids(engine: Engine, keys: list[str]) -> dict[str, str]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(submission_keys.c.idempotency_key, submission_keys.c.task_id).where(
                submission_keys.c.idempotency_key.in_(keys)
            )
        ).all()
    assert len(rows) == len({key for key, _ in rows})
    return dict(rows)


def test_a_key_committed_mid_batch_is_replayed(engine: Engine, principal: store.Principal):
    """Another request commits a key after the batch looked keys up: the batch reruns and replays it."""
    raced, fresh = f"raced-{uuid.uuid4()}", f"fresh-{uuid.uuid4()}"
    other = create_engine(engine.url, pool_size=1)
    won: list[str] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def _race(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.startswith("INSERT INTO submission_keys") and not won:
            task, _ = store.submit_task(
                other, principal, SUBMISSION, raced, default_max_attempts=3, key_ttl=KEY_TTL
            )
            won.append(task.id)

    try:
        answers = _accept(engine, principal, [fresh, raced])
    finally:
        sa.event.remove(engine, "before_cursor_execute", _race)
        other.dispose()
    assert [type(a) for a in answers] == [Accepted, Accepted]
    assert [a.outcome for a in answers] == ["created", "replayed"]
    assert answers[1].task.id == won[0]
    assert _task_ids(engine, [fresh, raced]) == {fresh: answers[0].task.id, raced: won[0]}


def test_a_key_held_by_an_unfinished_request_is_409_for_that_item_only(
    engine: Engine, principal: store.Principal, monkeypatch: pytest.MonkeyPatch
):
    """Lock wait timeouts are retried; after the retries only the item whose key is held answers 409."""
    monkeypatch.setattr(acceptance_batch, "TRIES", 2)
    held, free, free_again = (f"{name}-{uuid.uuid4()}" for name in ("held", "free", "again"))
    with engine.connect() as holder:
        holder.begin()
        now = db_now(holder)
        holder.execute(
            submission_keys.insert().values(
                store.key_row(principal, held, "0" * 64, str(uuid.uuid4()), now, KEY_TTL)
            )
        )
        answers = _accept(engine, principal, [free, held, free_again, free])
        holder.rollback()
    assert isinstance(answers[1], errors.RequestInProgress)
    assert [a.outcome for a in answers if isinstance(a, Accepted)] == ["created", "created", "replayed"]
    assert answers[3].task == answers[0].task
    # Once the other request is gone, the same batch creates the held key's task and replays the rest.
    again = _accept(engine, principal, [free, held, free_again, free])
    assert [a.outcome for a in again] == ["replayed", "created", "replayed", "replayed"]
    ids = _task_ids(engine, [free, held, free_again])
    assert ids == {free: again[0].task.id, held: again[1].task.id, free_again: again[2].task.id}
    with engine.connect() as conn:
        assert (
            conn.scalar(sa.select(sa.func.count()).select_from(tasks).where(tasks.c.id.in_(ids.values())))
            == 3
        )
