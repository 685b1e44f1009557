"""Statements run through the driver (orbit_server/db/driver_sql.py) write and change exactly what
``Connection.execute`` of the same statement writes and changes, on SQLite, MariaDB and PostgreSQL: typed values
(JSON, timestamps, booleans), many rows at once, values given when the statement was built (a fixed ``IN`` list,
a literal ``SET``); and a statement it cannot run, or a call without a value, is refused before anything runs."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from orbit_server.db.driver_sql import DriverSQL, insert_of
from tests.conftest import DatabaseFactory
from tests.integration.conftest import BACKENDS

metadata = sa.MetaData()
things = sa.Table(
    "driver_sql_things",
    metadata,
    sa.Column("id", sa.String(36), primary_key=True),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("doc", sa.JSON, nullable=True),
    sa.Column("at", sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql"), nullable=True),
    sa.Column("flag", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("n", sa.Integer, nullable=False, server_default="0"),
    sa.Column("loose", sa.JSON, nullable=True),  # none_as_null=False: None is stored as JSON null
)
_COLUMNS = ("id", "kind", "doc", "at", "flag", "n", "loose")
_AT = datetime(2026, 12, 5, 21, 4, 5, 123456)


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[sa.Engine]:
    engine = sa.create_engine(make_database(request.param))
    metadata.create_all(engine)
    yield engine
    engine.dispose()


def _rows(conn: sa.Connection, prefix: str) -> list[dict[str, Any]]:
    """The rows of ``prefix`` (ids without it), and whether each JSON column holds SQL NULL (``<column>_is_null``):
    reading a JSON ``null`` and a SQL ``NULL`` both give ``None``."""
    nulls = [things.c[name].is_(None).label(f"{name}_is_null") for name in ("doc", "loose")]
    rows = conn.execute(
        sa.select(things, *nulls).where(things.c.id.like(f"{prefix}%")).order_by(things.c.id)
    ).mappings()
    return [{**row, "id": row["id"][len(prefix) :]} for row in rows]


def _samples() -> list[dict[str, Any]]:
    return [
        {
            "id": "1",
            "kind": "A",
            "doc": {"k": [1, 2.5, "ü", None]},
            "at": _AT,
            "flag": True,
            "n": 7,
            "loose": None,
        },
        {"id": "2", "kind": "B", "doc": None, "at": None, "flag": False, "n": -1, "loose": {"a": 1}},
        {
            "id": "3",
            "kind": "C",
            "doc": [{"deep": {"er": True}}],
            "at": _AT,
            "flag": True,
            "n": 0,
            "loose": None,
        },
    ]


def _prefixed(prefix: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**row, "id": prefix + row["id"]} for row in rows]


def test_an_insert_writes_the_rows_execute_writes_one_or_many(engine: sa.Engine) -> None:
    insert = insert_of(things, _COLUMNS)
    with engine.begin() as conn:
        conn.execute(things.insert(), _prefixed("core-", _samples()))
        insert.execute(conn, _prefixed("many-", _samples()))  # executemany
        for row in _prefixed("one-", _samples()):
            assert insert.execute(conn, row).rowcount == 1
    with engine.connect() as conn:
        expected = _rows(conn, "core-")
        assert expected[0]["doc"] == {"k": [1, 2.5, "ü", None]} and expected[0]["at"] == _AT
        assert _rows(conn, "many-") == expected
        assert _rows(conn, "one-") == expected


def test_an_update_with_values_fixed_when_built_changes_what_execute_changes(engine: sa.Engine) -> None:
    def update(prefix: str) -> sa.Update:
        return (
            things.update()
            .where(
                things.c.id.like(f"{prefix}%"),
                things.c.kind.in_(["A", "C"]),
                things.c.n >= sa.bindparam("least"),
            )
            .values(flag=False, n=things.c.n + 1, doc=sa.bindparam("new_doc", type_=things.c.doc.type))
        )

    with engine.begin() as conn:
        conn.execute(things.insert(), _prefixed("u-core-", _samples()) + _prefixed("u-drv-", _samples()))
    with engine.begin() as conn:
        core = conn.execute(update("u-core-"), {"least": 0, "new_doc": {"x": 1}})
        driver = DriverSQL(update("u-drv-")).execute(conn, {"least": 0, "new_doc": {"x": 1}})
        assert core.rowcount == driver.rowcount == 2
    with engine.connect() as conn:
        changed = _rows(conn, "u-drv-")
        assert changed == _rows(conn, "u-core-")
        assert [(row["flag"], row["n"], row["doc"]) for row in changed] == [
            (False, 8, {"x": 1}), (False, -1, None), (False, 1, {"x": 1}),
        ]  # fmt: skip


def test_a_read_answers_the_driver_values(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(things.insert(), _prefixed("r-", _samples()))
    read = DriverSQL(sa.select(things.c.kind, things.c.n).where(things.c.id == sa.bindparam("id")))
    count = DriverSQL(sa.select(sa.func.count()).select_from(things).where(things.c.id.like("r-%")))
    with engine.connect() as conn:
        assert read.execute(conn, {"id": "r-1"}).one() == ("A", 7)
        assert read.execute(conn, {"id": "r-9"}).first() is None
        assert count.execute(conn, {}).scalar_one() == 3


def test_one_statement_has_a_form_per_dialect(engine: sa.Engine) -> None:
    statement = DriverSQL(sa.select(things.c.id).where(things.c.id == sa.bindparam("id")))
    other = sa.create_engine("sqlite://")
    try:
        here, there = statement.compiled(engine.dialect), statement.compiled(other.dialect)
        assert statement.compiled(engine.dialect) is here
        assert there.sql.endswith("= ?")
        with other.connect() as conn:
            assert statement.execute(conn, {"id": "x"}).first() is None  # no table there: the sqlite form ran
    except sa.exc.OperationalError as exc:
        assert "no such table: driver_sql_things" in str(exc)
    finally:
        other.dispose()
    form = DriverSQL.of(statement.statement).compiled(engine.dialect)  # one form per statement and dialect
    assert DriverSQL.of(statement.statement).compiled(engine.dialect) is form


def test_what_it_cannot_run_is_refused_before_anything_runs(engine: sa.Engine) -> None:
    expanding = DriverSQL(sa.select(things.c.id).where(things.c.id.in_(sa.bindparam("ids", expanding=True))))
    missing = insert_of(things, ("id", "kind"))
    with engine.begin() as conn:
        with pytest.raises(TypeError, match="expanding"):
            expanding.execute(conn, {"ids": ["a"]})
        with pytest.raises(KeyError, match="'kind'"):
            missing.execute(conn, {"id": "refused"})
        assert _rows(conn, "refused") == []
