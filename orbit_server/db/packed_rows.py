"""Rows packed into one column on MariaDB: ``JSON_ARRAY(<columns>)`` in a statement (:func:`packed`), read
back as the columns themselves would have given them (:func:`unpacked`).

Why: PyMySQL parses the description of each column of every result in Python, whatever the value, at about
5 µs a column here; MariaDB sends the descriptions even when no row matches. The hot statements that return
many columns pay that on every call: a ``start``'s locking read returned 23 columns, half of its client CPU
(0.23 → 0.13 ms per read packed, the statement alone in a loop), and a lease's combined read returns every
column of ``tasks``. Packed, each row is one column, and a packed subquery is one lookup instead of one per
column (``bench/results/floor-2026-12-05T1409-30f47cd.json``: a start's server CPU 4% less, MariaDB's 9%).

What MariaDB writes for each type, and how it becomes the column's own value again, by the
column's Python type: strings, integers and ``null`` as they are; a ``BOOLEAN`` as ``0``/``1`` (→ ``bool``);
a ``FLOAT`` as a number that may be integral (→ ``float``); a ``DATETIME(6)`` as ``'YYYY-MM-DD
HH:MM:SS.ffffff'`` (→ a naive ``datetime``, as PyMySQL gives it); a ``JSON`` column (``LONGTEXT`` with a
``json_valid`` check, as the schema creates it) as its document, embedded, its numbers' text untouched, so
``json.loads`` gives what SQLAlchemy's ``JSON`` type gives. Other types are not packed.

MariaDB only (:func:`packs`): MySQL's ``JSON_ARRAY`` writes a ``FLOAT`` as a double (``0.1`` would come back
``0.10000000149011612``), and its output was not verified here. A packed row longer than
``max_allowed_packet`` is ``NULL`` (MariaDB warns, and returns no error): a caller that can meet one (the
lease's read of whole task rows) reads the rows as columns instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa

__all__ = ["packed", "packs", "unpacked"]

#: How a packed value becomes the column's value, by the column's Python type (module docstring).
_FROM_JSON: dict[type, Callable[[Any], Any]] = {bool: bool, float: float, datetime: datetime.fromisoformat}


def packs(dialect: sa.Dialect) -> bool:
    """Whether statements on this database read their wide rows packed: MariaDB (module docstring)."""
    return dialect.name == "mysql" and bool(getattr(dialect, "is_mariadb", False))


def packed(columns: Sequence[sa.ColumnElement[Any]]) -> sa.ColumnElement[Any]:
    """``JSON_ARRAY(<columns>)``: the values of ``columns`` (of a table, or any typed expression) as one
    column, read back by :func:`unpacked` with the same ``columns``. MariaDB only (:func:`packs`)."""
    return sa.func.json_array(*columns, type_=sa.String)


def unpacked(value: str, columns: Sequence[sa.Column[Any]]) -> dict[str, Any]:
    """A :func:`packed` row as ``{column name: value}``, each value as the column itself gives it.

    Raises:
        ValueError: ``value`` is not a JSON array of ``len(columns)`` items.
    """
    return {
        column.name: item if item is None or (convert := _FROM_JSON.get(column.type.python_type)) is None
        else convert(item)
        for column, item in zip(columns, json.loads(value), strict=True)
    }  # fmt: skip
