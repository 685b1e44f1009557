"""The key window after a TTL raise, on SQLite and MariaDB (issue 20 #8): a key made under a shorter
``ORBIT_SUBMISSION_KEY_TTL_SECONDS`` (or by a server configured otherwise) is past its own ``expires_at``
long before the window the relay is now told; ``purge --keys`` keeps it until it is also older than the
window in force, so an old unknown-outcome row resent inside that window still finds its task."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from orbit_server.db import migrate as _migrate
from orbit_server.db.engine import create_engine, db_now
from orbit_server.db.schema import submission_keys
from orbit_server.retention import purge as retention
from orbit_server.tasks import store
from tests.conftest import DatabaseFactory
from tests.integration.conftest import BACKENDS


@pytest.fixture(params=BACKENDS)
def engine(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[Engine]:
    engine = create_engine(make_database(request.param), pool_size=2)
    _migrate.upgrade(engine)
    yield engine
    engine.dispose()


def _key(engine: Engine, *, age: timedelta, ttl: timedelta) -> str:
    """A key accepted ``age`` ago under a TTL of ``ttl`` (its task gone: purged or never kept)."""
    key = f"k-{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        ns = f"ns-{uuid.uuid4().hex[:8]}"
        ns_id = store.create_namespace(conn, ns)
        born = db_now(conn) - age
        conn.execute(
            submission_keys.insert().values(
                namespace_id=ns_id, idempotency_key=key, request_digest="d", task_id=str(uuid.uuid4()),
                created_at=born, expires_at=born + ttl,
            )
        )  # fmt: skip
    return key


def _left(engine: Engine, key: str) -> bool:
    with engine.connect() as conn:
        found = conn.execute(sa.select(submission_keys.c.id).where(submission_keys.c.idempotency_key == key))
        return found.first() is not None


def test_a_key_made_under_a_shorter_ttl_stays_for_the_window_in_force(engine: Engine) -> None:
    hour, day = timedelta(hours=1), timedelta(days=1)
    young = _key(engine, age=2 * hour, ttl=hour)  # expired an hour ago, made 2 h ago; the TTL is now 1 day
    old = _key(engine, age=2 * day, ttl=hour)  # older than the window in force too
    with engine.connect() as conn:
        found = retention.inventory(conn, None, key_ttl=day)
    assert found.purge.submission_keys == 1 and found.protected_keys == 0
    _, deleted = retention.purge(engine, actor="test", tasks_before=None, keys=True, key_ttl=day)
    assert deleted.submission_keys == 1
    assert _left(engine, young) and not _left(engine, old)
    # Once it is older than the window in force, it goes.
    retention.purge(engine, actor="test", tasks_before=None, keys=True, key_ttl=hour)
    assert not _left(engine, young)
