"""``enqueue``'s compiled driver path writes exactly the row ``Connection.execute`` writes (the
``outbox_adapter._enqueue`` docstring), on SQLite, MariaDB and PostgreSQL, for plain rows, rows
with every optional column set and rows with an ordering key."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from outbox_adapter import OutboxTables, enqueue
from tests.integration.outbox.conftest import Biz

#: Columns that differ between two rows by construction (ids, keys, the clock).
_OWN = {"id", "idempotency_key", "created_at", "updated_at", "available_at"}


def _rows(biz: Biz, tables: OutboxTables, keys: list[str]) -> list[dict[str, Any]]:
    o = tables.outbox
    with biz.engine.connect() as conn:
        rows = conn.execute(sa.select(o).where(o.c.idempotency_key.in_(keys))).mappings().all()
    by_key = {row["idempotency_key"]: dict(row) for row in rows}
    return [by_key[key] for key in keys]


def _enqueue_both(biz: Biz, tables: OutboxTables, name: str, **kwargs: Any) -> list[dict[str, Any]]:
    keys = [f"{name}-driver", f"{name}-core"]
    with biz.engine.begin() as conn:
        entry = enqueue(conn, idempotency_key=keys[0], tables=tables, **kwargs)
    # A schema_translate_map (here one that maps nothing) takes the Connection.execute path.
    translated = biz.engine.execution_options(schema_translate_map={"no_such_schema": None})
    with translated.begin() as conn:
        core = enqueue(conn, idempotency_key=keys[1], tables=tables, **kwargs)
    rows = _rows(biz, tables, keys)
    assert [row["id"] for row in rows] == [entry.id, core.id]
    return rows


def test_the_driver_path_writes_the_row_connection_execute_writes(biz: Biz, tables: OutboxTables) -> None:
    later = datetime.now(UTC) + timedelta(hours=1)
    cases: dict[str, dict[str, Any]] = {
        "plain": {"params": {"n": 1, "text": "grüße", "nested": [1, [2.5, None]]}},
        "full": {
            "params": [1, "two", {"three": True}],
            "business_ref": "order:42",
            "available_at": later,
            "max_attempts": 7,
            "options": {"max_attempts": 3, "retry_safe": True},
        },
        "keyed": {"params": None, "ordering_key": "customer-1"},
    }
    for name, kwargs in cases.items():
        driver, core = _enqueue_both(biz, tables, name, namespace="ns", queue="q", handler="h.x", **kwargs)
        assert {k: v for k, v in driver.items() if k not in _OWN | {"ordering_seq"}} == {
            k: v for k, v in core.items() if k not in _OWN | {"ordering_seq"}
        }, name
        if name == "full":
            assert driver["available_at"] == core["available_at"]
        if name == "keyed":  # numbered in commit order of the key: 1, then 2
            assert (driver["ordering_seq"], core["ordering_seq"]) == (1, 2)
        else:
            assert driver["ordering_seq"] is None and core["ordering_seq"] is None
