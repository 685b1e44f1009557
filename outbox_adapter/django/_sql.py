"""Running the outbox's SQLAlchemy statements through a Django connection's cursor, and reading
Django's database errors with the outbox's own rules."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from django.db import DatabaseError
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper

from outbox_adapter._db import translate_db_error
from outbox_adapter._exceptions import OutboxDatabaseError

__all__ = ["execute", "translate"]


def execute(cursor: CursorWrapper, stmt: sa.ClauseElement, dialect: sa.Dialect) -> None:
    """Run ``stmt`` on ``cursor``: compiled for ``dialect`` (``sqlalchemy_dialect`` of the cursor's
    connection), its values converted by the bind processors SQLAlchemy would apply."""
    compiled: Any = stmt.compile(dialect=dialect)  # a SQLCompiler: bind_names, positiontup
    values = compiled.construct_params()
    converted: dict[str, Any] = {}
    for bind, name in compiled.bind_names.items():
        processor = bind.type.dialect_impl(dialect).bind_processor(dialect)
        value = values[name]
        converted[name] = processor(value) if processor is not None else value
    if compiled.positional:
        cursor.execute(compiled.string, tuple(converted[name] for name in compiled.positiontup or ()))
    else:
        cursor.execute(compiled.string, converted)


def translate(exc: DatabaseError, connection: BaseDatabaseWrapper, what: str) -> OutboxDatabaseError:
    """Django's error ``exc`` as the :class:`OutboxDatabaseError` the SQLAlchemy path raises for the
    same driver error (``retryable`` when transient; :class:`OutboxSchemaError` for a missing table)."""
    driver_error = exc.__cause__
    base = getattr(getattr(connection, "Database", None), "Error", None)
    if isinstance(driver_error, Exception) and isinstance(base, type):
        wrapped = sa.exc.DBAPIError.instance(None, None, driver_error, base)
        if isinstance(wrapped, sa.exc.SQLAlchemyError):
            return translate_db_error(wrapped, what)
    return OutboxDatabaseError(f"cannot {what}: {type(exc).__name__}: {exc}")
