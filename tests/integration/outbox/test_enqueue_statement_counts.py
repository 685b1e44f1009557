"""What ``enqueue`` sends in the caller's transaction, on SQLite, MariaDB and PostgreSQL (a regression is a
failure): one ``INSERT`` (two with an ordering key: the key's upsert first), no savepoint, no read, no
commit of its own; and the ``INSERT`` binds only the columns the row has, so the database parses and stores
no ``NULL`` it would write anyway. A change that adds a statement or a column to this path must change this
test and say why (README "Outbox": the price of the hand-off is part of the business transaction)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from outbox_adapter import OutboxTables, enqueue, enqueue_flow
from tests.integration.outbox.conftest import Biz

#: Commands in the business transaction ``INSERT order; enqueue; COMMIT``, by kind of row (every database).
EXPECTED = {
    "plain": 3,  # the order; the outbox row (its id: lastrowid, or RETURNING on PostgreSQL); COMMIT
    "every option": 3,
    "ordering key": 4,  # the order; the key's upsert (the lock); the outbox row numbered from it; COMMIT
    "flow": 3,
}


@contextmanager
def _commands(engine: sa.Engine) -> Iterator[list[str]]:
    """Every statement ``engine`` sends while the block runs, and ``COMMIT``/``ROLLBACK`` for each one."""
    sent: list[str] = []

    def statement(_conn: Any, _cursor: Any, sql: str, *_args: Any) -> None:
        sent.append(sql)

    listeners = {
        "before_cursor_execute": statement,
        "commit": lambda _conn: sent.append("COMMIT"),
        "rollback": lambda _conn: sent.append("ROLLBACK"),
        "savepoint": lambda _conn, _name: sent.append("SAVEPOINT"),
    }
    for name, fn in listeners.items():
        sa.event.listen(engine, name, fn)
    try:
        yield sent
    finally:
        for name, fn in listeners.items():
            sa.event.remove(engine, name, fn)


def _columns(insert: str) -> set[str]:
    found = re.match(r"INSERT INTO \S+ \(([^)]*)\)", insert)
    assert found is not None, insert
    return {c.strip() for c in found.group(1).split(",")}


def test_enqueue_sends_one_insert_of_the_row_s_own_columns(biz: Biz, tables: OutboxTables) -> None:
    orders = sa.Table("orders_" + tables.name, sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True),
                      sa.Column("ref", sa.String(64)))  # fmt: skip
    orders.create(biz.engine)
    later = datetime.now(UTC) + timedelta(hours=1)
    calls = {
        "plain": lambda conn: enqueue(
            conn, namespace="ns", queue="q", handler="h.x", params={"n": 1}, tables=tables
        ),
        "every option": lambda conn: enqueue(
            conn,
            namespace="ns",
            queue="q",
            handler="h.x",
            params={"n": 2},
            tables=tables,
            business_ref="order:2",
            available_at=later,
            max_attempts=3,
            options={"priority": 1},
        ),
        "ordering key": lambda conn: enqueue(
            conn, namespace="ns", queue="q", handler="h.x", params={"n": 3}, tables=tables, ordering_key="c-1"
        ),
        "flow": lambda conn: enqueue_flow(conn, namespace="ns", flow="f", input={"n": 4}, tables=tables),
    }
    sent: dict[str, list[str]] = {}
    try:
        for _warm_and_count in range(2):  # the first call of each kind compiles its statements
            for kind, call in calls.items():
                with _commands(biz.engine) as commands, biz.engine.begin() as conn:
                    conn.execute(orders.insert(), {"ref": kind})
                    call(conn)
                sent[kind] = commands
        for kind, commands in sent.items():
            assert len(commands) == EXPECTED[kind], (kind, commands)
            assert commands[-1] == "COMMIT", (kind, commands)
            outbox = [sql for sql in commands if sql.startswith(f"INSERT INTO {tables.name} ")]
            assert len(outbox) == 1, (kind, commands)
            if kind == "ordering key":
                assert commands[1].startswith(f"INSERT INTO {tables.keys_name} "), commands
        always = {"idempotency_key", "namespace", "queue", "handler", "params", "kind", "state", "attempts",
                  "send_count", "available_at", "created_at", "updated_at"}  # fmt: skip
        inserted = {kind: _columns(next(s for s in sent[kind] if s.startswith(f"INSERT INTO {tables.name} ")))
                    for kind in sent}  # fmt: skip
        assert inserted["plain"] == always
        assert inserted["every option"] == always | {"business_ref", "max_attempts", "options"}
        assert inserted["ordering key"] == always | {"ordering_key", "ordering_seq"}
        assert inserted["flow"] == always | {"flow"}
        # The columns left out hold what the longer INSERT wrote: NULL, and the defaults of a new row.
        o = tables.outbox
        with biz.engine.connect() as conn:
            rows = conn.execute(sa.select(o).order_by(o.c.id)).mappings().all()
        plain = rows[-4]
        assert plain["params"] == {"n": 1} and plain["state"] == "PENDING" and plain["kind"] == "task"
        assert (plain["attempts"], plain["send_count"]) == (0, 0)
        assert all(plain[c] is None for c in ("options", "ordering_key", "business_ref", "max_attempts",
                                               "traceparent", "tracestate", "flow", "ordering_seq"))  # fmt: skip
        assert (
            plain["available_at"] == plain["created_at"]
            or abs((plain["available_at"] - plain["created_at"]).total_seconds()) < 0.01
        )
    finally:
        orders.drop(biz.engine)
