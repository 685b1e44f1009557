"""Where statements run through the driver (orbit_server/db/driver_sql.py) part from what ``Connection.execute``
of the same statement did (review of 958b8e7): a JSON ``None`` written as SQL ``NULL`` where the type writes JSON
``null``; the forms :meth:`DriverSQL.of` keeps for a statement outliving the statement; many rows sent to
PostgreSQL one ``INSERT`` each (and with a ``RETURNING`` nobody reads) where the server's engine sends them as
multi-row ``INSERT`` statements (orbit_server/db/engine.py: ``use_insertmanyvalues_wo_returning``)."""

from __future__ import annotations

import gc
import re
import weakref
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa

from orbit_server.db.driver_sql import DriverSQL, insert_of
from orbit_server.db.engine import create_engine
from orbit_server.tasks import transitions
from tests.conftest import DatabaseFactory
from tests.integration.conftest import BACKENDS

metadata = sa.MetaData()
docs = sa.Table(
    "driver_sql_docs",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("kind", sa.String(16), nullable=False),
    # SQLAlchemy's default: Python None is the JSON document null, not SQL NULL
    sa.Column("doc", sa.JSON, nullable=True),
    sa.Column("at", sa.DateTime, nullable=True),
)
_AT = datetime(2026, 12, 5, 21, 4, 5, 123456)


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[sa.Engine]:
    engine = create_engine(make_database(request.param))  # the server's engine, with its settings
    metadata.create_all(engine)
    yield engine
    engine.dispose()


def _sql_nulls(conn: sa.Connection, kind: str) -> int:
    return conn.execute(
        sa.select(sa.func.count()).select_from(docs).where(docs.c.kind == kind, docs.c.doc.is_(None))
    ).scalar_one()


def test_none_for_a_json_column_is_stored_as_execute_stores_it(engine: sa.Engine) -> None:
    """``JSON`` (``none_as_null=False``) binds Python ``None`` as the JSON text ``'null'``: ``Connection.execute``
    calls the bind processor for ``None`` too; the driver's form must store the same, not SQL ``NULL``."""
    insert = insert_of(docs, ("kind", "doc"))
    with engine.begin() as conn:
        conn.execute(docs.insert(), [{"kind": "core-one", "doc": None}])
        conn.execute(docs.insert(), [{"kind": "core-many", "doc": None}, {"kind": "core-many", "doc": None}])
        insert.execute(conn, {"kind": "drv-one", "doc": None})
        insert.execute(conn, [{"kind": "drv-many", "doc": None}, {"kind": "drv-many", "doc": None}])
    with engine.connect() as conn:
        assert _sql_nulls(conn, "core-one") == _sql_nulls(conn, "core-many") == 0  # JSON null, as documented
        assert _sql_nulls(conn, "drv-one") == 0
        assert _sql_nulls(conn, "drv-many") == 0


def test_of_forgets_the_forms_of_a_statement_with_it(engine: sa.Engine) -> None:
    """``DriverSQL.of`` keeps a statement's forms "forgotten with it": a statement built by size (an
    ``lru_cache`` that evicts) must not be kept alive by them, or every rebuilt statement stays for ever."""
    statement = sa.select(docs.c.kind).where(docs.c.id == sa.bindparam("id"))
    with engine.connect() as conn:
        assert DriverSQL.of(statement).execute(conn, {"id": -1}).first() is None
    before = len(DriverSQL._OF)
    gone = weakref.ref(statement)
    del statement
    gc.collect()
    assert gone() is None, "DriverSQL.of keeps the statement alive"
    assert len(DriverSQL._OF) == before - 1


def _inserts(engine: sa.Engine, table: str, run: Any) -> list[tuple[str, bool]]:
    sent: list[tuple[str, bool]] = []

    def note(_c: Any, _cursor: Any, statement: str, _p: Any, _ctx: Any, many: bool) -> None:
        if statement.startswith(f"INSERT INTO {table}"):
            sent.append((statement, many))

    sa.event.listen(engine, "before_cursor_execute", note)
    try:
        with engine.begin() as conn:
            run(conn)
    finally:
        sa.event.remove(engine, "before_cursor_execute", note)
    return sent


def _rows_per_statement(statement: str) -> int:
    return len(re.findall(r"\)\s*,\s*\(", statement)) + 1


def test_many_rows_go_as_execute_sends_them(engine: sa.Engine) -> None:
    """A list of rows is sent as ``Connection.execute(table.insert(), rows)`` sends it on the server's engine:
    on PostgreSQL as multi-row ``INSERT`` statements (``use_insertmanyvalues_wo_returning``), not one statement
    per row pipelined by psycopg's ``executemany``; and without a ``RETURNING`` of the keys nobody reads."""
    rows = [{"kind": "many-rows", "doc": {"i": i}, "at": _AT} for i in range(5)]
    core = _inserts(engine, docs.name, lambda conn: conn.execute(docs.insert(), rows))
    driver = _inserts(
        engine, docs.name, lambda conn: insert_of(docs, ("kind", "doc", "at")).execute(conn, rows)
    )
    assert [_rows_per_statement(sql) for sql, _ in driver] == [_rows_per_statement(sql) for sql, _ in core]
    assert not any("RETURNING" in sql for sql, _ in driver)
    with engine.connect() as conn:
        written = conn.execute(sa.select(docs.c.doc).where(docs.c.kind == "many-rows")).scalars().all()
    assert sorted(doc["i"] for doc in written) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_a_task_events_batch_goes_as_task_events_insert_sent_it(engine: sa.Engine) -> None:
    """The task events of a lease or a set-based start/complete (``transitions.APPEND_EVENTS``, many rows) go as
    ``task_events.insert()`` sent them before 958b8e7: one multi-row ``INSERT`` on PostgreSQL. Only the form sent
    is compared (this module's database has no ``task_events``: both fail once sent)."""
    rows = [
        {"task_id": f"t{i}", "state_version": 1, "event": "leased", "from_status": "WAITING", "to_status": "LEASED",
         "actor": "worker:w", "reason": None, "data": {"i": i}, "created_at": _AT}
        for i in range(3)
    ]  # fmt: skip

    def sent(run: Any) -> list[int]:
        def failing(conn: sa.Connection) -> None:
            with pytest.raises(sa.exc.DBAPIError):
                run(conn)

        return [_rows_per_statement(sql) for sql, _ in _inserts(engine, "task_events", failing)]

    assert sent(lambda conn: transitions.APPEND_EVENTS.execute(conn, rows)) == sent(
        lambda conn: conn.execute(transitions.task_events.insert(), rows)
    )
