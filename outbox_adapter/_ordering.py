"""Ordering keys in commit order, and the keys an unsendable row blocks (README "Ordering keys").

**Commit order.** Ids are handed out when a row is inserted, not when its transaction commits:
T1 inserts row 1 with key K and stays open, T2 inserts row 2 with K and commits, and a relay that
compared ids would send row 2 while row 1 is invisible to it. So ``enqueue`` with an ordering key
first upserts the key's row in ``<table>_keys`` (``last_seq + 1``), in the caller's transaction:
that row stays locked until the caller commits or rolls back, so a second enqueue of K waits for
the first transaction to end, and each row gets the next ``ordering_seq`` of its key. One key's
rows are therefore numbered in commit order, and the relay sends a row only when no row of its key
with a lower ``ordering_seq`` is unsent. A rollback rolls the number back with the row. Rows without
an ordering key take neither the lock nor the extra statement.

**Blocked keys.** A key is blocked when its first unsent row needs a person: ``DEAD`` (``retry`` it
after the fix, or ``abandon`` it) or ``NEEDS_RECONCILE`` (``reconcile`` or ``resolve`` it).
``ABANDONED`` rows (never to be sent) hold nothing back.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import Connection

from outbox_adapter._queries import (
    DEAD,
    NEEDS_RECONCILE,
    PENDING,
    UNSENT,
    _statements_lock,
    insert_row,
    insert_statement,
    row_shape,
)
from outbox_adapter._tables import OutboxTables

if TYPE_CHECKING:
    pass

log = logging.getLogger("outbox_adapter")

__all__ = [
    "BlockedKey",
    "blocked_keys",
    "insert_keyed_row",
    "keyed_insert",
    "take_ordering_key",
    "upsert_key",
]

_upserts: weakref.WeakKeyDictionary[OutboxTables, dict[str, Any]] = weakref.WeakKeyDictionary()
_keyed_inserts: weakref.WeakKeyDictionary[OutboxTables, dict[tuple[str, frozenset[str]], sa.Insert]] = (
    weakref.WeakKeyDictionary()
)


def upsert_key(t: OutboxTables, dialect_name: str) -> Any:
    """The key's upsert (:func:`take_ordering_key`'s statement, parameter ``b_ordering_key``), built
    once per tables and dialect."""
    with _statements_lock:
        found = _upserts.setdefault(t, {}).get(dialect_name)
    if found is not None:
        return found
    k = t.keys
    key = sa.bindparam("b_ordering_key", type_=k.c.ordering_key.type)
    upsert: Any
    if dialect_name == "mysql":
        upsert = mysql.insert(k).values(ordering_key=key, last_seq=1)
        upsert = upsert.on_duplicate_key_update(last_seq=k.c.last_seq + 1)
    else:
        dialect_insert = postgresql.insert if dialect_name == "postgresql" else sqlite.insert
        upsert = dialect_insert(k).values(ordering_key=key, last_seq=1)
        upsert = upsert.on_conflict_do_update(
            index_elements=[k.c.ordering_key], set_={"last_seq": k.c.last_seq + 1}
        )
    with _statements_lock:
        _upserts[t][dialect_name] = upsert
    return upsert


def keyed_insert(t: OutboxTables, dialect_name: str, shape: frozenset[str]) -> sa.Insert:
    """The ``INSERT`` of a row with an ordering key (:func:`insert_keyed_row`'s statement), built once
    per tables, dialect and row shape (``_queries.row_shape``)."""
    with _statements_lock:
        found = _keyed_inserts.setdefault(t, {}).get((dialect_name, shape))
    if found is not None:
        return found
    k = t.keys
    key = sa.bindparam("b_ordering_key", type_=k.c.ordering_key.type)
    seq = sa.select(k.c.last_seq).where(k.c.ordering_key == key).scalar_subquery()
    insert = insert_statement(t, dialect_name, shape).values(ordering_seq=seq)
    with _statements_lock:
        _keyed_inserts[t][(dialect_name, shape)] = insert
    return insert


def take_ordering_key(t: OutboxTables, ordering_key: str, dialect_name: str) -> tuple[Any, dict[str, Any]]:
    """The upsert that locks ``ordering_key``'s row until the caller's transaction ends and counts
    one more row for it; the caller executes it on its own connection, before :func:`insert_keyed_row`."""
    return upsert_key(t, dialect_name), {"b_ordering_key": ordering_key}


def insert_keyed_row(
    t: OutboxTables, values: dict[str, Any], dialect_name: str
) -> tuple[sa.Insert, dict[str, Any]]:
    """Like ``insert_row``, for a row with an ordering key: its ``ordering_seq`` is the key's
    ``last_seq`` as :func:`take_ordering_key` just set it (read in the same statement)."""
    _, params = insert_row(t, values, dialect_name)
    return keyed_insert(t, dialect_name, row_shape(values)), params


@dataclass(frozen=True, kw_only=True)
class BlockedKey:
    """An ordering key held back by a row that needs a person.

    Attributes:
        ordering_key: the key.
        row_id: its first unsent row, which blocks it.
        state: that row's state, ``DEAD`` or ``NEEDS_RECONCILE``.
        waiting: ``PENDING`` rows of the key behind it.
        last_error: why the row is where it is.
    """

    ordering_key: str
    row_id: int
    state: str
    waiting: int
    last_error: str | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "ordering_key": self.ordering_key,
            "row_id": self.row_id,
            "state": self.state,
            "waiting": self.waiting,
            "last_error": self.last_error,
        }


def blocked_keys(conn: Connection, t: OutboxTables, *, limit: int) -> list[BlockedKey]:
    """Keys whose first unsent row is ``DEAD`` or ``NEEDS_RECONCILE``, by that row's id, at most ``limit``."""
    o = t.outbox
    earlier, behind = o.alias("earlier"), o.alias("behind")
    waiting = (
        sa.select(sa.func.count())
        .select_from(behind)
        .where(
            behind.c.ordering_key == o.c.ordering_key,
            behind.c.state == PENDING,
            behind.c.ordering_seq > o.c.ordering_seq,
        )
        .scalar_subquery()
    )
    first = ~(
        sa.select(earlier.c.id)
        .where(
            earlier.c.ordering_key == o.c.ordering_key,
            earlier.c.state.in_(UNSENT),
            earlier.c.ordering_seq < o.c.ordering_seq,
        )
        .exists()
    )
    stmt = (
        sa.select(o.c.ordering_key, o.c.id, o.c.state, o.c.last_error, waiting.label("waiting"))
        .where(o.c.state.in_((DEAD, NEEDS_RECONCILE)), o.c.ordering_key.is_not(None), first)
        .order_by(o.c.id)
        .limit(limit)
    )
    return [
        BlockedKey(ordering_key=m["ordering_key"], row_id=m["id"], state=m["state"], waiting=int(m["waiting"]),
                   last_error=m["last_error"])
        for m in conn.execute(stmt).mappings()
    ]  # fmt: skip
