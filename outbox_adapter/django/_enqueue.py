"""``enqueue`` / ``enqueue_flow`` on Django's connection, in Django's transaction.

The row is the one :func:`outbox_adapter.enqueue` writes: the same validation
(:func:`~outbox_adapter._enqueue.prepare_task`), the same ``INSERT`` compiled by SQLAlchemy for the
dialect of Django's driver (:func:`~outbox_adapter._enqueue.plan_insert`) with the same parameter
conversions, only executed through ``connections[using].cursor()``. Inside
``transaction.atomic(using=...)`` it commits or rolls back with the block (a savepoint rolled back
takes it too); outside one it commits at once, like a model ``save()`` in autocommit.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from django.db import DEFAULT_DB_ALIAS, DatabaseError, IntegrityError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from orbit_client import SubmitOptions, TaskDefinition
from outbox_adapter import _tracing as outbox_tracing
from outbox_adapter._enqueue import (
    _TRACING,
    DEFAULT_MAX_PARAMS_BYTES,
    _default_tables,
    _entry,
    _inserted_id,
    plan_insert,
    prepare_flow,
    prepare_task,
)
from outbox_adapter._exceptions import OutboxDatabaseError, OutboxUsageError
from outbox_adapter._models import OutboxEntry
from outbox_adapter._tables import OutboxTables
from outbox_adapter.django._sql import translate

__all__ = ["enqueue", "enqueue_flow", "sqlalchemy_dialect"]

_DIALECTS: dict[tuple[str, str], sa.Dialect] = {}


def sqlalchemy_dialect(connection: BaseDatabaseWrapper) -> sa.Dialect:
    """The SQLAlchemy dialect of a Django connection's driver, with a ``%s``-style paramstyle
    (Django's cursors take ``%s`` on every backend; SQLAlchemy doubles a literal ``%``).

    Raises:
        OutboxUsageError: a backend other than SQLite, MySQL/MariaDB or PostgreSQL.
    """
    vendor = connection.vendor
    driver = getattr(getattr(connection, "Database", None), "__name__", "")
    found = _DIALECTS.get((vendor, driver))
    if found is not None:
        return found
    dialect: sa.Dialect
    if vendor == "sqlite":
        from sqlalchemy.dialects.sqlite.pysqlite import SQLiteDialect_pysqlite

        dialect = SQLiteDialect_pysqlite(paramstyle="format")
    elif vendor == "mysql":
        from sqlalchemy.dialects.mysql.mysqldb import MySQLDialect_mysqldb

        dialect = MySQLDialect_mysqldb()
    elif vendor == "postgresql" and driver.startswith("psycopg2"):
        from sqlalchemy.dialects.postgresql.psycopg2 import PGDialect_psycopg2

        dialect = PGDialect_psycopg2()  # type: ignore[no-untyped-call]
    elif vendor == "postgresql":
        from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg

        dialect = PGDialect_psycopg()  # type: ignore[no-untyped-call]
    else:
        raise OutboxUsageError(
            f"the Django database backend {vendor!r} is not one the outbox supports (SQLite, MySQL/MariaDB, "
            "PostgreSQL); nothing was written"
        )
    _DIALECTS[(vendor, driver)] = dialect
    return dialect


def write(using: str, values: dict[str, Any], tables: OutboxTables | None) -> OutboxEntry:
    """Insert the validated row ``values`` through Django's connection ``using``, in its transaction."""
    if using not in connections:
        raise OutboxUsageError(
            f"using={using!r} is not a database alias of settings.DATABASES "
            f"({', '.join(map(repr, connections))}); nothing was written"
        )
    connection = connections[using]
    t = tables or _default_tables()
    plan = plan_insert(t, values, sqlalchemy_dialect(connection))
    span = outbox_tracing.enqueue_span(values) if _TRACING else None
    try:
        # savepoint=False: inside the caller's block, no savepoint (the row is part of it, as a model
        # save is); outside one, a transaction of its own for the one or two statements.
        with transaction.atomic(using=using, savepoint=False), connection.cursor() as cursor:
            for rendered, params in plan:
                cursor.execute(rendered.sql, params)
            row_id = _inserted_id((cursor.fetchone()[0] if rendered.returning else cursor.lastrowid,))
    except DatabaseError as exc:
        error = _failed(exc, connection, values["idempotency_key"], t)
        if span is not None:
            outbox_tracing.enqueued(span, None, error)
        raise error from exc
    entry = _entry(row_id, values)
    if span is not None:
        outbox_tracing.enqueued(span, entry.id)
    return entry


def _failed(
    exc: DatabaseError, connection: BaseDatabaseWrapper, key: str, t: OutboxTables
) -> OutboxDatabaseError:
    """The error for a failed insert: a duplicate key says so; anything else as the SQLAlchemy path says it."""
    if isinstance(exc, IntegrityError) and "idempotency_key" in str(exc):
        return OutboxDatabaseError(
            f"cannot enqueue: the idempotency key {key!r} already exists in the outbox table {t.name!r}; this "
            "usually means the intent was already recorded (the same action enqueued twice), so there is nothing "
            "to add: skip it, or give each distinct intent its own key; the enclosing transaction.atomic() block "
            "is marked for rollback (wrap the enqueue in an atomic block of its own to go on without it)"
        )
    return translate(exc, connection, f"enqueue the row with key {key!r}")


def enqueue(
    *,
    namespace: str,
    queue: str | None = None,
    handler: str | None = None,
    params: Any,
    task: TaskDefinition[Any] | None = None,
    using: str = DEFAULT_DB_ALIAS,
    idempotency_key: str | None = None,
    ordering_key: str | None = None,
    business_ref: str | None = None,
    available_at: datetime | None = None,
    max_attempts: int | None = None,
    options: SubmitOptions | Mapping[str, Any] | None = None,
    tables: OutboxTables | None = None,
    max_params_bytes: int = DEFAULT_MAX_PARAMS_BYTES,
) -> OutboxEntry:
    """Record the intent to submit a task through Django's connection ``using``, in its transaction
    (README "Django").

    The row, its key, its limits and its errors are those of :func:`outbox_adapter.enqueue`; only
    the connection differs. Inside ``transaction.atomic(using=using)`` the row commits or rolls back
    with the block (a rolled-back savepoint takes it too); outside one it commits at once, as a model
    ``save()`` does in autocommit. No ``on_commit`` is needed.

    Args:
        using: the ``settings.DATABASES`` alias of the business database (the one the model being
            saved is written to). Default ``"default"``.
        namespace, queue, handler, params, task, idempotency_key, ordering_key, business_ref,
        available_at, max_attempts, options, tables, max_params_bytes: as for
            :func:`outbox_adapter.enqueue` (``params`` at most 64 KiB of JSON by default;
            ``available_at`` timezone-aware).

    Returns:
        The row's id and idempotency key (:class:`outbox_adapter.OutboxEntry`).

    Raises:
        ParamsTooLargeError: the params are too large; nothing was written.
        OutboxUsageError: any other invalid argument, or ``using`` is not an alias; nothing was written.
        OutboxDatabaseError: the insert failed (the key already exists, the table is missing); inside
            an atomic block, the block is then marked for rollback, as after a failed model save.
    """
    values = prepare_task(
        namespace=namespace,
        queue=queue,
        handler=handler,
        params=params,
        task=task,
        idempotency_key=idempotency_key,
        ordering_key=ordering_key,
        business_ref=business_ref,
        available_at=available_at,
        max_attempts=max_attempts,
        options=options,
        max_params_bytes=max_params_bytes,
    )
    return write(using, values, tables)


def enqueue_flow(
    *,
    namespace: str,
    flow: str,
    input: Mapping[str, Any] | None = None,
    using: str = DEFAULT_DB_ALIAS,
    idempotency_key: str | None = None,
    version: int | None = None,
    ordering_key: str | None = None,
    business_ref: str | None = None,
    available_at: datetime | None = None,
    max_attempts: int | None = None,
    tables: OutboxTables | None = None,
    max_params_bytes: int = DEFAULT_MAX_PARAMS_BYTES,
) -> OutboxEntry:
    """Record the intent to start a flow instance through Django's connection ``using``, in its
    transaction: the flow twin of :func:`enqueue`, with the arguments, result and errors of
    :func:`outbox_adapter.enqueue_flow`.
    """
    values = prepare_flow(
        namespace=namespace,
        flow=flow,
        input=input,
        version=version,
        idempotency_key=idempotency_key,
        ordering_key=ordering_key,
        business_ref=business_ref,
        available_at=available_at,
        max_attempts=max_attempts,
        max_params_bytes=max_params_bytes,
    )
    return write(using, values, tables)
