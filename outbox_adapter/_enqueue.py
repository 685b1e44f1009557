"""``enqueue``: write an outbox row through the caller's connection, in the caller's transaction.

The row commits or rolls back with the business change it belongs to (DESIGN §5,
§6.1 of the reliability model): a rollback leaves nothing to send. ``enqueue`` never
begins, commits or rolls back, and never changes how the caller's engine begins
transactions. Everything is validated before the one ``INSERT`` (built once per tables, dialect and
row shape: a row's ``NULL`` optional columns are left out of it, so the database parses and stores
only what the row has; the database clock and the id come with it, no other round trip). A row with an
ordering key first upserts its key's row (``_ordering``): one more statement, and a lock
held until the caller's transaction ends.

The statements are compiled once per tables, dialect and row shape into the driver's SQL and run with
``exec_driver_sql``, their parameters converted by the very type processors SQLAlchemy would
apply: the same rows as ``Connection.execute`` writes, without its per-call statement-cache
lookup and result set-up (about 200 µs of CPU per ``enqueue`` on MariaDB + PyMySQL, a third of
what ``enqueue`` added to a one-INSERT business transaction; ``bench.compare``). A connection
with a ``schema_translate_map`` takes the ``Connection.execute`` path instead.

Inside an active
OpenTelemetry span the row also stores the trace context of an ``orbit.outbox.enqueue`` span
(README "Tracing").
"""

from __future__ import annotations

import json
import re
import sys
import uuid
import weakref
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from pydantic import ValidationError
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from orbit_client import (
    NAME_PATTERN,
    OrbitUsageError,
    SubmitOptions,
    TaskDefinition,
    TaskSubmission,
    _tracing,
    check_json_data,
    is_valid_idempotency_key,
)
from outbox_adapter import _tracing as outbox_tracing
from outbox_adapter._db import to_naive_utc, translate_db_error
from outbox_adapter._exceptions import OutboxDatabaseError, OutboxUsageError, ParamsTooLargeError
from outbox_adapter._models import OutboxEntry
from outbox_adapter._ordering import insert_keyed_row, keyed_insert, take_ordering_key, upsert_key
from outbox_adapter._queries import insert_row, insert_statement, row_parameters, row_shape
from outbox_adapter._tables import OutboxTables, RowKind

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

__all__ = ["DEFAULT_MAX_PARAMS_BYTES", "enqueue", "enqueue_async", "enqueue_flow", "enqueue_flow_async"]

#: Largest params accepted by default, in bytes of compact UTF-8 JSON (64 KiB): a quarter of the
#: server's body limit (``ORBIT_MAX_BODY_BYTES``, default 256 KiB), so that a row always fits one
#: request with its envelope and the relay's batch requests (about 192 KiB each) carry several rows
#: (README "Outbox", "One body limit"). A row is refused here, in the business transaction, rather
#: than going ``DEAD`` later on the server's ``413``; pass a reference to large data instead.
DEFAULT_MAX_PARAMS_BYTES = 64 * 1024
#: The server's default ``ORBIT_MAX_BODY_BYTES`` (the error message names both limits).
_SERVER_BODY_BYTES = 256 * 1024
_NAME_RE = re.compile(NAME_PATTERN)
#: Whether ``opentelemetry-api`` is installed: without it, ``enqueue`` never looks for a span.
_TRACING = _tracing.AVAILABLE
_DEFAULT_TABLES: OutboxTables | None = None
#: ``(queue, handler)`` pairs (exact ``str``) that ``TaskSubmission`` accepted without options: its
#: check is a function of the two strings alone. At most ``_VALID_TARGETS_MAX``, then forgotten.
_VALID_TARGETS: set[tuple[str, str]] = set()
_VALID_TARGETS_MAX = 1024


def _default_tables() -> OutboxTables:
    global _DEFAULT_TABLES
    if _DEFAULT_TABLES is None:
        _DEFAULT_TABLES = OutboxTables()
    return _DEFAULT_TABLES


def _check_params(params: Any, max_params_bytes: int, label: str) -> None:
    """JSON data the server stores unchanged, at most ``max_params_bytes``; else :class:`OutboxUsageError`."""
    try:
        # The server's own rules (orbit_client.check_json_data), so that a row the relay could never
        # deliver, or a database could not hold the same way, is refused here, on every database.
        check_json_data(params)
    except ValueError as exc:
        raise OutboxUsageError(
            f"{label} cannot be stored and sent unchanged: {exc}; nothing was written "
            '(README "HTTP API", JSON data)'
        ) from None
    try:
        encoded = json.dumps(params, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise OutboxUsageError(
            f"{label} must be JSON data (dicts, lists, str, int, float, bool, None; no NaN): {exc}; "
            "nothing was written"
        ) from None
    size = len(encoded.encode("utf-8"))
    if size > max_params_bytes:
        raise ParamsTooLargeError(
            f"{label} are {size} bytes of JSON, over enqueue's limit of {max_params_bytes} bytes "
            f"(max_params_bytes; the server's own limit is on the whole request body, ORBIT_MAX_BODY_BYTES, "
            f"{_SERVER_BODY_BYTES} bytes by default: enqueue keeps a quarter of it so a row always fits one "
            'request, README "Outbox"); store the data elsewhere and pass a reference to it; nothing was written',
            size=size,
            limit=max_params_bytes,
        )


def prepare_task(
    *,
    namespace: str,
    queue: str | None,
    handler: str | None,
    params: Any,
    task: TaskDefinition[Any] | None = None,
    idempotency_key: str | None,
    ordering_key: str | None,
    business_ref: str | None,
    available_at: datetime | None,
    max_attempts: int | None,
    options: SubmitOptions | Mapping[str, Any] | None,
    max_params_bytes: int,
) -> dict[str, Any]:
    """Validate everything and return the row's values. Raises :class:`OutboxUsageError`; writes nothing."""
    _check_namespace(namespace)
    if task is not None:
        if not isinstance(task, TaskDefinition):
            raise OutboxUsageError(
                f"task must be an orbit_client.TaskDefinition, not {task!r}; nothing was written"
            )
        if handler is not None and handler != task.handler:
            raise OutboxUsageError(
                f"handler {handler!r} is not the task definition's {task.handler!r}: pass one of them; nothing was written"
            )
        handler, queue = task.handler, queue or task.queue
        try:  # the definition's model checks the params; its options are the defaults of this row's
            params = task.dump(params)
            options = task.merged_options(options)
        except OrbitUsageError as exc:
            raise OutboxUsageError(f"{exc}; nothing was written") from None
    if queue is None or handler is None:
        raise OutboxUsageError(
            "queue and handler are required (or a task definition, task=...); nothing was written"
        )
    _check_params(params, max_params_bytes, "params")
    try:
        if options is not None and not isinstance(options, SubmitOptions):
            options = SubmitOptions.model_validate(dict(options))
        # The client's own wire model: what the server will be sent is valid before it is stored.
        # Without options it checks only the two names, so a pair it accepted is not checked again.
        if options is not None or (queue, handler) not in _VALID_TARGETS:
            TaskSubmission(queue=queue, handler=handler, params=None, options=options)
            if options is None and type(queue) is str and type(handler) is str:
                if len(_VALID_TARGETS) >= _VALID_TARGETS_MAX:
                    _VALID_TARGETS.clear()
                _VALID_TARGETS.add((queue, handler))
    except (ValidationError, TypeError) as exc:
        if isinstance(exc, ValidationError):
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}"
                for e in exc.errors(include_url=False, include_input=False)
            )
        else:
            problems = str(exc)
        raise OutboxUsageError(f"invalid submission: {problems}; nothing was written") from None
    return {
        **_common(
            namespace=namespace,
            idempotency_key=idempotency_key,
            ordering_key=ordering_key,
            business_ref=business_ref,
            available_at=available_at,
            max_attempts=max_attempts,
        ),
        "kind": RowKind.TASK.value,
        "flow": None,
        "queue": queue,
        "handler": handler,
        "params": params,
        "options": (options.model_dump(mode="json", exclude_none=True) or None)
        if options is not None
        else None,
    }


def _check_namespace(namespace: Any) -> None:
    if not isinstance(namespace, str) or not _NAME_RE.match(namespace):
        raise OutboxUsageError(
            f"namespace {namespace!r} is not a valid name (a letter or digit, then up to 63 letters, digits, "
            "'.', '_' or '-'); nothing was written"
        )


def _common(
    *,
    namespace: str,
    idempotency_key: str | None,
    ordering_key: str | None,
    business_ref: str | None,
    available_at: datetime | None,
    max_attempts: int | None,
) -> dict[str, Any]:
    """The values every row has, validated (task and flow rows alike)."""
    if idempotency_key is None:
        idempotency_key = str(uuid.uuid4())
    elif not isinstance(idempotency_key, str) or not is_valid_idempotency_key(idempotency_key):
        raise OutboxUsageError(
            "idempotency_key must be 1-255 printable ASCII characters without leading or trailing spaces "
            "(README, section HTTP API); nothing was written"
        )
    for label, value in (("ordering_key", ordering_key), ("business_ref", business_ref)):
        if value is not None and (not isinstance(value, str) or not 1 <= len(value) <= 255):
            raise OutboxUsageError(
                f"{label} must be a string of 1-255 characters or None; nothing was written"
            )
    if max_attempts is not None and (
        isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or not 1 <= max_attempts <= 1000
    ):
        raise OutboxUsageError(
            f"max_attempts must be 1-1000 or None, not {max_attempts!r}; nothing was written"
        )
    return {
        "idempotency_key": idempotency_key,
        "namespace": namespace,
        "ordering_key": ordering_key,
        "business_ref": business_ref,
        "max_attempts": max_attempts,
        "available_at": to_naive_utc(available_at) if available_at is not None else None,
    }


def prepare_flow(
    *,
    namespace: str,
    flow: str,
    input: Any,
    version: int | None,
    idempotency_key: str | None,
    ordering_key: str | None,
    business_ref: str | None,
    available_at: datetime | None,
    max_attempts: int | None,
    max_params_bytes: int,
) -> dict[str, Any]:
    """Validate a flow start and return the row's values. Raises :class:`OutboxUsageError`; writes nothing."""
    _check_namespace(namespace)
    if not isinstance(flow, str) or not _NAME_RE.match(flow):
        raise OutboxUsageError(
            f"flow {flow!r} is not a valid flow name (a letter or digit, then up to 63 letters, digits, "
            "'.', '_' or '-'); nothing was written"
        )
    if input is None:
        input = {}
    if not isinstance(input, Mapping):
        raise OutboxUsageError(
            f"input must be a JSON object (a dict), not {type(input).__name__}; nothing was written "
            '(README "Flows: running them")'
        )
    input = dict(input)
    _check_params(input, max_params_bytes, "input")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 1):
        raise OutboxUsageError(
            f"version must be a published version number (1 or more) or None, not {version!r}; "
            "nothing was written"
        )
    return {
        **_common(
            namespace=namespace,
            idempotency_key=idempotency_key,
            ordering_key=ordering_key,
            business_ref=business_ref,
            available_at=available_at,
            max_attempts=max_attempts,
        ),
        "kind": RowKind.FLOW.value,
        "flow": flow,
        "queue": "",
        "handler": "",
        "params": input,
        "options": {"version": version} if version is not None else None,
    }


def _insert_failed(exc: sa.exc.SQLAlchemyError, key: str, t: OutboxTables) -> OutboxDatabaseError:
    """The error for a failed ``INSERT``: a duplicate key says so; anything else as ``translate_db_error``."""
    if isinstance(exc, sa.exc.IntegrityError) and "idempotency_key" in str(exc.orig):
        return OutboxDatabaseError(
            f"cannot enqueue: the idempotency key {key!r} already exists in the outbox table {t.name!r}; this "
            "usually means the intent was already recorded (the same action enqueued twice), so there is nothing "
            "to add: skip it, or give each distinct intent its own key; roll back the transaction (on PostgreSQL "
            "it is unusable now)"
        )
    return translate_db_error(exc, f"enqueue the row with key {key!r}")


def _inserted_id(key: Any) -> int:
    if key is None or key[0] is None:  # pragma: no cover - every supported driver reports it
        raise OutboxDatabaseError("the database did not report the id of the inserted outbox row")
    return int(key[0])


def _entry(row_id: int, values: Mapping[str, Any]) -> OutboxEntry:
    return OutboxEntry(
        id=int(row_id),
        idempotency_key=values["idempotency_key"],
        namespace=values["namespace"],
        queue=values["queue"],
        handler=values["handler"],
        ordering_key=values["ordering_key"],
        business_ref=values["business_ref"],
        kind=values["kind"],
        flow=values["flow"],
    )


class _Rendered:
    """One statement compiled for one dialect: the driver's SQL, its parameters in order, and the
    bind processors SQLAlchemy would apply to them (module docstring)."""

    __slots__ = ("defaults", "names", "positional", "processors", "returning", "sql")

    def __init__(self, stmt: Any, dialect: sa.Dialect, *, row: bool) -> None:
        # PostgreSQL reports a new row's id through RETURNING (``lastrowid`` is not the id there).
        self.returning = row and dialect.name == "postgresql"
        compiled = (stmt.returning(stmt.table.c.id) if self.returning else stmt).compile(dialect=dialect)
        self.sql = compiled.string
        self.positional = bool(compiled.positional)
        binds = {name: bind for bind, name in compiled.bind_names.items()}
        self.names = list(compiled.positiontup or ()) if self.positional else list(binds)
        #: The statement's own values (``state``, ``attempts``, ...); the caller gives the ``b_*`` ones.
        self.defaults = {name: bind.value for name, bind in binds.items()}
        self.processors: dict[str, Any] = {}
        for name in self.names:
            processor = binds[name].type.dialect_impl(dialect).bind_processor(dialect)
            if processor is not None:
                self.processors[name] = processor

    def parameters(self, values: Mapping[str, Any]) -> tuple[Any, ...] | dict[str, Any]:
        processors, defaults = self.processors, self.defaults
        out = {}
        for name in self.names:
            value = values[name] if name in values else defaults[name]
            processor = processors.get(name)
            out[name] = processor(value) if processor is not None else value
        return tuple(out[name] for name in self.names) if self.positional else out


_RENDERED: weakref.WeakKeyDictionary[OutboxTables, dict[tuple[str, frozenset[str], type, str], _Rendered]] = (
    weakref.WeakKeyDictionary()
)


def _rendered(
    t: OutboxTables, which: str, shape: frozenset[str], dialect: sa.Dialect, build: Callable[[], Any]
) -> _Rendered:
    """The statement ``build()`` returns (``which``: ``"row"``, ``"key"`` or ``"keyed_row"`` of ``t``, for
    rows of ``shape``) compiled for ``dialect``: built and compiled once, then found by this key."""
    key = (which, shape, type(dialect), dialect.paramstyle)
    by_tables = _RENDERED.get(t)
    if by_tables is None:
        by_tables = _RENDERED.setdefault(t, {})
    found = by_tables.get(key)
    if found is None:
        found = by_tables[key] = _Rendered(build(), dialect, row=which != "key")
    return found


def _plan(
    connection: Connection, t: OutboxTables, values: dict[str, Any]
) -> list[tuple[_Rendered, Any]] | None:
    """The statements (rendered, parameters) inserting the row through ``connection`` (the sync one
    of an ``AsyncConnection``); ``None``: use ``Connection.execute``."""
    if connection.get_execution_options().get("schema_translate_map"):
        return None
    return plan_insert(t, values, connection.dialect)


_NO_SHAPE: frozenset[str] = frozenset()


def plan_insert(t: OutboxTables, values: dict[str, Any], dialect: sa.Dialect) -> list[tuple[_Rendered, Any]]:
    """The statements inserting the validated row ``values`` (from :func:`prepare_task` or
    :func:`prepare_flow`) into ``t``, compiled for ``dialect``: ``(rendered, parameters)`` pairs in
    order, to run on a DB-API cursor of that dialect's driver (``rendered.sql``; after the last one,
    the id is ``cursor.fetchone()[0]`` when ``rendered.returning``, else ``cursor.lastrowid``).

    The one definition of an outbox row's ``INSERT``: :func:`enqueue` runs it through a SQLAlchemy
    connection, ``outbox_adapter.django.enqueue`` through a Django connection's cursor. The row's
    ``NULL`` optional columns are left out of it (``_queries.row_shape``)."""
    shape = row_shape(values)
    params = row_parameters(values, shape)
    name = dialect.name
    if values["ordering_key"] is None:
        row = _rendered(t, "row", shape, dialect, lambda: insert_statement(t, name, shape))
        return [(row, row.parameters(params))]
    key = _rendered(t, "key", _NO_SHAPE, dialect, lambda: upsert_key(t, name))
    row = _rendered(t, "keyed_row", shape, dialect, lambda: keyed_insert(t, name, shape))
    return [(key, key.parameters({"b_ordering_key": values["ordering_key"]})), (row, row.parameters(params))]


def _row_id(rendered: _Rendered, result: sa.CursorResult[Any]) -> int:
    return _inserted_id((result.scalar_one() if rendered.returning else result.lastrowid,))


def _refuse_inside_django_atomic() -> None:
    """Refuse a SQLAlchemy enqueue while a Django ``transaction.atomic()`` block is open in this
    thread (README "Django"): the row would commit apart from the Django transaction, so its rollback
    would leave the row to be sent. Only looked at once Django is imported (``outbox_adapter.django``
    holds the check; nothing here imports Django)."""
    if "django.db" in sys.modules:
        from outbox_adapter.django._guard import refuse_inside_atomic

        refuse_inside_atomic()


def _write(conn: Connection | Session, values: dict[str, Any], tables: OutboxTables | None) -> OutboxEntry:
    """Insert the validated row through ``conn`` (one statement; two with an ordering key)."""
    _refuse_inside_django_atomic()
    t = tables or _default_tables()
    span = outbox_tracing.enqueue_span(values) if _TRACING else None
    try:
        connection = conn.connection() if isinstance(conn, Session) else conn
        plan = _plan(connection, t, values)
        if plan is not None:
            for rendered, params in plan:
                result = connection.exec_driver_sql(rendered.sql, params)
            row_id = _row_id(rendered, result)
        else:
            dialect = connection.dialect.name
            if values["ordering_key"] is None:
                result = connection.execute(*insert_row(t, values, dialect))
            else:  # lock the key until the caller's transaction ends: its rows in commit order
                connection.execute(*take_ordering_key(t, values["ordering_key"], dialect))
                result = connection.execute(*insert_keyed_row(t, values, dialect))
            row_id = _inserted_id(result.inserted_primary_key)
    except sa.exc.SQLAlchemyError as exc:
        error = _insert_failed(exc, values["idempotency_key"], t)
        if span is not None:
            outbox_tracing.enqueued(span, None, error)
        raise error from exc
    entry = _entry(row_id, values)
    if span is not None:
        outbox_tracing.enqueued(span, entry.id)
    return entry


async def _write_async(
    conn: AsyncConnection | AsyncSession, values: dict[str, Any], tables: OutboxTables | None
) -> OutboxEntry:
    """The asyncio twin of :func:`_write`."""
    from sqlalchemy.ext.asyncio import AsyncSession

    _refuse_inside_django_atomic()
    t = tables or _default_tables()
    span = outbox_tracing.enqueue_span(values) if _TRACING else None
    try:
        connection = await conn.connection() if isinstance(conn, AsyncSession) else conn
        sync = connection.sync_connection
        plan = _plan(sync, t, values) if sync is not None else None
        if plan is not None:
            for rendered, params in plan:
                result = await connection.exec_driver_sql(rendered.sql, params)
            row_id = _row_id(rendered, result)
        else:
            dialect = connection.dialect.name
            if values["ordering_key"] is None:
                result = await connection.execute(*insert_row(t, values, dialect))
            else:  # lock the key until the caller's transaction ends: its rows in commit order
                await connection.execute(*take_ordering_key(t, values["ordering_key"], dialect))
                result = await connection.execute(*insert_keyed_row(t, values, dialect))
            row_id = _inserted_id(result.inserted_primary_key)
    except sa.exc.SQLAlchemyError as exc:
        error = _insert_failed(exc, values["idempotency_key"], t)
        if span is not None:
            outbox_tracing.enqueued(span, None, error)
        raise error from exc
    entry = _entry(row_id, values)
    if span is not None:
        outbox_tracing.enqueued(span, entry.id)
    return entry


def enqueue(
    conn: Connection | Session,
    *,
    namespace: str,
    queue: str | None = None,
    handler: str | None = None,
    params: Any,
    task: TaskDefinition[Any] | None = None,
    idempotency_key: str | None = None,
    ordering_key: str | None = None,
    business_ref: str | None = None,
    available_at: datetime | None = None,
    max_attempts: int | None = None,
    options: SubmitOptions | Mapping[str, Any] | None = None,
    tables: OutboxTables | None = None,
    max_params_bytes: int = DEFAULT_MAX_PARAMS_BYTES,
) -> OutboxEntry:
    """Record the intent to submit a task, in the caller's transaction (README "Outbox").

    Writes one ``PENDING`` row through ``conn`` and nothing else; never commits. Commit
    the business change and the row together; a rollback leaves nothing to send. A relay
    then submits the task with the row's idempotency key, at most once per key.

    Inside an active OpenTelemetry span (``opentelemetry-api`` installed, the ``otel``
    extra), the row stores the W3C trace context of an ``orbit.outbox.enqueue`` span under
    it, and the task continues that trace (README "Tracing"); outside one, none.

    Args:
        conn: a SQLAlchemy ``Connection`` or ORM ``Session`` of the business database.
        namespace: the Orbit namespace.
        queue: the queue's name; it must exist on the server when the relay sends
            (otherwise the row ends ``DEAD``). With ``task``, ``None`` means the definition's queue.
        handler: the handler name workers dispatch on, e.g. ``"orders.fulfil"``; with ``task``,
            leave it out (``None``).
        task: a typed task definition (:class:`orbit_client.TaskDefinition`, README "Typed tasks"):
            its handler and queue, its options under ``options``, and ``params`` (a model instance or
            a mapping) validated against its model and stored as the model's JSON; wrong params
            raise :class:`OutboxUsageError` naming each field, nothing written.
        params: JSON data for the task, at most ``max_params_bytes``, within the server's limits
            (:func:`orbit_client.check_json_data`: finite numbers, integers of at most 4300 digits,
            valid Unicode, at most 30 levels of nesting), checked here the same way on every database.
        idempotency_key: 1-255 printable ASCII characters; ``None`` means a new UUID4. Fixed
            for the row's life: every send, retry and reconcile uses it. A business key
            (e.g. ``f"order-{order.uuid}-fulfil"``) makes a second ``enqueue`` for the same
            intent fail on the unique index instead of sending twice. The server remembers
            keys per namespace, across every database that sends to it: a key must never
            repeat for the namespace's lifetime, so build it from a UUID, not from an
            autoincrement id that a new or restored database hands out again.
        ordering_key: rows with the same key are sent one at a time in the order their
            transactions committed: a row waits while an earlier one is ``PENDING``, ``DEAD``
            or ``NEEDS_RECONCILE`` (an ``ABANDONED`` row holds nothing back). The key's row in
            the keys table stays locked until this transaction ends, so a concurrent enqueue
            of the same key waits for it (README "Ordering keys"); take several keys in one
            transaction in a fixed order. ``None``: no ordering, no lock, no extra statement.
        business_ref: free text linking the row to the business record, e.g. ``"order:42"``.
        available_at: earliest send time, timezone-aware; ``None`` means now (database clock).
        max_attempts: budget of sends whose outcome may be unknown, 1-1000; ``None`` means
            the relay's default (5).
        options: the task's :class:`orbit_client.SubmitOptions` (or a mapping of its fields).
        tables: the outbox tables; ``None`` means ``OutboxTables()`` (``orbit_outbox``).
        max_params_bytes: largest params accepted, in bytes of compact UTF-8 JSON.
            Default 64 KiB.

    Returns:
        The row's id (assigned inside the caller's transaction) and idempotency key.

    Raises:
        ParamsTooLargeError: the params are too large; nothing was written.
        OutboxUsageError: any other invalid argument, e.g. params the server cannot hold (the message
            names the limit), or a call inside a Django ``transaction.atomic()`` block, whose rollback
            this row would outlive (use ``outbox_adapter.django.enqueue``, README "Django"); nothing
            was written.
        OutboxDatabaseError: the insert failed, e.g. the key already exists in the outbox (the
            message says so; ``sqlalchemy.exc.IntegrityError`` is its ``__cause__``) or the table is missing
            (:class:`OutboxSchemaError`). The caller's transaction is then unusable on
            PostgreSQL: roll it back.
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
    return _write(conn, values, tables)


async def enqueue_async(
    conn: AsyncConnection | AsyncSession,
    *,
    namespace: str,
    queue: str | None = None,
    handler: str | None = None,
    params: Any,
    task: TaskDefinition[Any] | None = None,
    idempotency_key: str | None = None,
    ordering_key: str | None = None,
    business_ref: str | None = None,
    available_at: datetime | None = None,
    max_attempts: int | None = None,
    options: SubmitOptions | Mapping[str, Any] | None = None,
    tables: OutboxTables | None = None,
    max_params_bytes: int = DEFAULT_MAX_PARAMS_BYTES,
) -> OutboxEntry:
    """The asyncio twin of :func:`enqueue`, for an ``AsyncConnection`` or ``AsyncSession``.

    Same arguments, result and errors; it awaits the one ``INSERT`` and never commits.
    Needs ``sqlalchemy[asyncio]`` and an async driver (``aiomysql``, ``psycopg``, ``aiosqlite``).
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
    return await _write_async(conn, values, tables)


def enqueue_flow(
    conn: Connection | Session,
    *,
    namespace: str,
    flow: str,
    input: Mapping[str, Any] | None = None,
    idempotency_key: str | None = None,
    version: int | None = None,
    ordering_key: str | None = None,
    business_ref: str | None = None,
    available_at: datetime | None = None,
    max_attempts: int | None = None,
    tables: OutboxTables | None = None,
    max_params_bytes: int = DEFAULT_MAX_PARAMS_BYTES,
) -> OutboxEntry:
    """Record the intent to start a flow instance, in the caller's transaction (README "Starting
    flows from the outbox").

    The flow twin of :func:`enqueue`: one ``PENDING`` row of kind ``"flow"`` written through
    ``conn``, never committed here. A relay then sends ``POST /v1/namespaces/{ns}/flows/{flow}/instances``
    with the row's idempotency key (one request per row; flow starts are not batched), so the
    instance is started at most once per key; an unknown outcome is settled by the same key
    (``GET .../flow-instances?idempotency_key=K``), exactly as a task row's is.

    Args:
        conn: a SQLAlchemy ``Connection`` or ORM ``Session`` of the business database.
        namespace: the Orbit namespace.
        flow: the flow's name; a version of it must be published when the relay sends (an
            unknown flow or version ends the row ``DEAD``, with the command that fixes it).
        input: the instance's input, a JSON object (``None``: ``{}``), at most
            ``max_params_bytes`` of compact UTF-8 JSON, checked as :func:`enqueue` checks params.
        idempotency_key: as for :func:`enqueue`: fixed for the row's life, never repeated for the
            namespace's lifetime (build it from a business UUID); ``None`` means a new UUID4. The
            server remembers a flow start's key as long as the instance exists.
        version: start this published version; ``None`` means the newest version when the relay
            sends.
        ordering_key, business_ref, available_at, max_attempts, tables, max_params_bytes: as for
            :func:`enqueue`. Task and flow rows of one ordering key are sent in commit order together.

    Returns:
        The row's id and idempotency key (``kind == "flow"``, ``flow`` set).

    Raises:
        ParamsTooLargeError: the input is too large; nothing was written.
        OutboxUsageError: any other invalid argument (a bad flow name, an input that is not a JSON
            object, a version below 1), or a call inside a Django ``transaction.atomic()`` block (as
            for :func:`enqueue`); nothing was written.
        OutboxDatabaseError: as for :func:`enqueue` (a duplicate key, a missing table, or a table not
            yet migrated to ``outbox_0005``: run ``orbit-outbox migrate``).
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
    return _write(conn, values, tables)


async def enqueue_flow_async(
    conn: AsyncConnection | AsyncSession,
    *,
    namespace: str,
    flow: str,
    input: Mapping[str, Any] | None = None,
    idempotency_key: str | None = None,
    version: int | None = None,
    ordering_key: str | None = None,
    business_ref: str | None = None,
    available_at: datetime | None = None,
    max_attempts: int | None = None,
    tables: OutboxTables | None = None,
    max_params_bytes: int = DEFAULT_MAX_PARAMS_BYTES,
) -> OutboxEntry:
    """The asyncio twin of :func:`enqueue_flow`: same arguments, result and errors; never commits."""
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
    return await _write_async(conn, values, tables)
