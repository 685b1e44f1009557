"""``enqueue`` writes through the caller's connection, in the caller's transaction (DESIGN §5),
on SQLite, MariaDB and PostgreSQL, with a real relay and a real server behind it."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox_adapter import (
    Outbox,
    OutboxDatabaseError,
    OutboxTables,
    OutboxUsageError,
    ParamsTooLargeError,
    enqueue,
    enqueue_async,
)
from tests.integration.outbox.conftest import Biz, Namespace, RelayFactory
from tests.outbox_support import task_count
from tests.servers import RunningServer


def _orders(biz: Biz) -> sa.Table:
    table = sa.Table(
        f"orders_{uuid.uuid4().hex[:8]}",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("status", sa.String(20), nullable=False),
    )
    table.create(biz.engine)
    return table


def _count(biz: Biz, table: sa.Table) -> int:
    with biz.engine.connect() as conn:
        return int(conn.scalar(sa.select(sa.func.count()).select_from(table)))


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


class Boom(Exception):
    pass


def test_rollback_sends_nothing_and_commit_makes_exactly_one_task(
    biz: Biz, tables: OutboxTables, ns: Namespace, orbit: RunningServer, make_relay: RelayFactory
) -> None:
    orders = _orders(biz)
    listeners = (len(biz.engine.dispatch.begin), len(biz.engine.pool.dispatch.connect))
    with pytest.raises(Boom), biz.engine.begin() as conn:
        conn.execute(orders.insert().values(id=1, status="PENDING"))
        enqueue(conn, namespace=ns.name, queue="default", handler="orders.fulfil", params={"order_id": 1},
                tables=tables)  # fmt: skip
        raise Boom  # the business transaction fails after the enqueue
    assert _count(biz, orders) == 0 and _count(biz, tables.outbox) == 0

    with biz.engine.begin() as conn:
        conn.execute(orders.insert().values(id=2, status="PENDING"))
        entry = enqueue(conn, namespace=ns.name, queue="default", handler="orders.fulfil", params={"order_id": 2},
                        business_ref="order:2", tables=tables)  # fmt: skip
    uuid.UUID(entry.idempotency_key)  # the default key is a UUID
    assert entry.business_ref == "order:2"

    stats = make_relay().run_once()
    assert (stats.claimed, stats.delivered) == (1, 1)
    assert make_relay().run_once().claimed == 0  # nothing left: the row is delivered once
    assert task_count(orbit, ns.name) == 1
    row = Outbox(biz.engine, tables=tables).get(entry.id)
    assert row.state == "DELIVERED" and row.orbit_task_id and row.idempotency_key == entry.idempotency_key
    assert row.attempts == 1 and row.last_status_code == 201 and row.delivered_at is not None
    # The caller's engine still begins transactions its own way: the relay added no listener to it.
    assert (len(biz.engine.dispatch.begin), len(biz.engine.pool.dispatch.connect)) == listeners


def test_enqueue_through_an_orm_session(
    biz: Biz, tables: OutboxTables, ns: Namespace, orbit: RunningServer, make_relay: RelayFactory
) -> None:
    orders = _orders(biz)
    with Session(biz.engine) as session:
        with session.begin():
            session.execute(orders.insert().values(id=1, status="PENDING"))
            enqueue(session, namespace=ns.name, queue="default", handler="orders.fulfil", params={"order_id": 1},
                    tables=tables)  # fmt: skip
            session.rollback()
        with session.begin():
            session.execute(orders.insert().values(id=2, status="PENDING"))
            enqueue(session, namespace=ns.name, queue="default", handler="orders.fulfil", params={"order_id": 2},
                    tables=tables)  # fmt: skip
    assert _count(biz, orders) == 1 and _count(biz, tables.outbox) == 1
    assert make_relay().run_once().delivered == 1
    assert task_count(orbit, ns.name) == 1


def test_oversized_or_invalid_params_are_refused_before_anything_is_written(
    biz: Biz, tables: OutboxTables
) -> None:
    orders = _orders(biz)
    with biz.engine.begin() as conn:
        with pytest.raises(ParamsTooLargeError) as caught:
            enqueue(
                conn,
                namespace="shop",
                queue="default",
                handler="h",
                params={"blob": "x" * 70_000},
                tables=tables,
            )
        assert caught.value.limit == 64 * 1024 and caught.value.size > caught.value.limit
        # One body limit story (issue 23): the error names enqueue's limit and the server's, and why they differ.
        assert "65536" in str(caught.value) and "ORBIT_MAX_BODY_BYTES" in str(caught.value)
        assert "262144" in str(caught.value)
        assert "70000" not in str(caught.value) and "xxxx" not in str(caught.value)  # never echoes params
        with pytest.raises(OutboxUsageError, match="JSON"):
            enqueue(
                conn,
                namespace="shop",
                queue="default",
                handler="h",
                params={"x": float("nan")},
                tables=tables,
            )
        with pytest.raises(OutboxUsageError, match="queue"):
            enqueue(conn, namespace="shop", queue="no spaces", handler="h", params={}, tables=tables)
        with pytest.raises(OutboxUsageError, match="timezone"):
            enqueue(conn, namespace="shop", queue="q", handler="h", params={}, tables=tables,
                    available_at=datetime(2030, 1, 1))  # fmt: skip
        # The caller's transaction is untouched and goes on.
        conn.execute(orders.insert().values(id=1, status="PENDING"))
    assert _count(biz, tables.outbox) == 0 and _count(biz, orders) == 1


@pytest.mark.parametrize(
    ("params", "limit"),
    [
        pytest.param(_nested(31), "30 levels", id="nesting"),
        pytest.param({"n": 10**4300}, "4300 digits", id="integer"),
        pytest.param(["\ud800"], "Unicode", id="surrogate"),
        pytest.param({"x": float("inf")}, "infinite", id="infinity"),
    ],
)
def test_params_the_server_cannot_hold_are_refused_naming_the_limit(
    biz: Biz, tables: OutboxTables, params: object, limit: str
) -> None:
    """Issue 9: MariaDB failed the business transaction with a CHECK message, PostgreSQL and SQLite
    wrote a row that went DEAD later. Now every database refuses it up front, the same way."""
    with biz.engine.begin() as conn:
        with pytest.raises(OutboxUsageError, match=limit) as caught:
            enqueue(conn, namespace="shop", queue="default", handler="h", params=params, tables=tables)
        assert "nothing was written" in str(caught.value)
    assert _count(biz, tables.outbox) == 0
    with biz.engine.begin() as conn:  # at the limit it is accepted
        enqueue(conn, namespace="shop", queue="default", handler="h", params=_nested(30), tables=tables)
    assert _count(biz, tables.outbox) == 1


def test_a_business_key_is_fixed_and_unique(biz: Biz, tables: OutboxTables) -> None:
    later = datetime.now(UTC) + timedelta(hours=1)
    with biz.engine.begin() as conn:
        entry = enqueue(conn, namespace="shop", queue="default", handler="h", params=[1, "é", None],
                        idempotency_key="order-7-fulfil", ordering_key="customer-1", available_at=later,
                        max_attempts=3, options={"retry_safe": True}, tables=tables)  # fmt: skip
    assert entry.idempotency_key == "order-7-fulfil"
    with pytest.raises(OutboxDatabaseError) as caught, biz.engine.begin() as conn:
        enqueue(conn, namespace="shop", queue="default", handler="h", params={}, idempotency_key="order-7-fulfil",
                tables=tables)  # fmt: skip
    assert isinstance(caught.value.__cause__, sa.exc.IntegrityError)
    message = str(caught.value)  # says what happened, not "check the database"
    assert "'order-7-fulfil' already exists in the outbox" in message and "already recorded" in message
    assert "check the database" not in message
    row = Outbox(biz.engine, tables=tables).get(entry.id)
    assert row.params == [1, "é", None] and row.options == {"retry_safe": True}
    assert row.max_attempts == 3 and row.ordering_key == "customer-1" and row.state == "PENDING"
    assert abs((row.available_at - later).total_seconds()) < 0.01


_ASYNC = {"sqlite": "sqlite+aiosqlite", "mariadb": "mysql+aiomysql", "postgres": "postgresql+psycopg"}


async def test_async_enqueue_commits_and_rolls_back_with_the_caller(biz: Biz, tables: OutboxTables) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    engine = create_async_engine(biz.url.set(drivername=_ASYNC[biz.kind]))
    try:
        async with engine.connect() as conn:
            await enqueue_async(
                conn, namespace="shop", queue="default", handler="h", params={"n": 1}, tables=tables
            )
            await conn.rollback()
        async with engine.begin() as conn:
            first = await enqueue_async(conn, namespace="shop", queue="default", handler="h", params={"n": 2},
                                        tables=tables)  # fmt: skip
        async with AsyncSession(engine) as session, session.begin():
            second = await enqueue_async(session, namespace="shop", queue="default", handler="h", params={"n": 3},
                                         tables=tables)  # fmt: skip
    finally:
        await engine.dispose()
    rows = Outbox(biz.engine, tables=tables).list_rows()
    assert [(r.id, r.params) for r in rows] == [(first.id, {"n": 2}), (second.id, {"n": 3})]
