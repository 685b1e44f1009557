"""Every error the outbox adapter raises.

One root, :class:`OutboxError`, and three families kept apart (STYLE habit 2)::

    OutboxError
    ├── OutboxUsageError (also ValueError)   misuse caught before anything is written
    │   └── ParamsTooLargeError              params over the size limit, refused at enqueue
    ├── OutboxDatabaseError                  the business database failed or is unreachable
    │   └── OutboxSchemaError                the outbox tables are missing: run `orbit-outbox migrate`
    └── OutboxRowError                       an operator command named a row it cannot act on
        ├── RowNotFoundError                 no row with that id
        └── InvalidStateError                the row's state does not allow the operation

Errors about one row carry ``row_id`` and, when known, its ``state``. SQLAlchemy
exceptions never leave the package: an :class:`OutboxDatabaseError` keeps the
original as ``__cause__``. Errors from the Orbit server are ``orbit_client``
errors and are not wrapped (the relay and ``reconcile`` record them on the row).
"""

from __future__ import annotations

__all__ = [
    "InvalidStateError",
    "OutboxDatabaseError",
    "OutboxError",
    "OutboxRowError",
    "OutboxSchemaError",
    "OutboxUsageError",
    "ParamsTooLargeError",
    "RowNotFoundError",
]


class OutboxError(Exception):
    """Root of every error raised by ``outbox_adapter``.

    Attributes:
        message: what happened and what to do about it (also ``str(error)``).
        row_id: the outbox row concerned, or ``None`` when the error is not about one row.
        state: that row's state when the error was raised (``"PENDING"``, ``"DEAD"``, ...),
            or ``None`` if unknown or not about one row.
    """

    def __init__(self, message: str, *, row_id: int | None = None, state: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.row_id = row_id
        self.state = state

    def __str__(self) -> str:
        return self.message


class OutboxUsageError(OutboxError, ValueError):
    """The adapter was called wrongly (a malformed key, name or option). Nothing was written."""


class ParamsTooLargeError(OutboxUsageError):
    """The params of an ``enqueue`` serialise to more bytes than allowed. Nothing was written.

    Attributes:
        size: the params' size as compact UTF-8 JSON, in bytes.
        limit: the limit in bytes (``max_params_bytes``).
    """

    def __init__(self, message: str, *, size: int, limit: int) -> None:
        super().__init__(message)
        self.size = size
        self.limit = limit


class OutboxDatabaseError(OutboxError):
    """The business database failed or could not be reached; ``__cause__`` is the SQLAlchemy error.

    Attributes:
        retryable: ``True`` when the failure looks transient (connection lost or
            refused, deadlock, lock wait timeout), so the same call may succeed later.
    """

    def __init__(
        self, message: str, *, retryable: bool = False, row_id: int | None = None, state: str | None = None
    ) -> None:
        super().__init__(message, row_id=row_id, state=state)
        self.retryable = retryable


class OutboxSchemaError(OutboxDatabaseError):
    """The outbox tables do not exist (or are out of date) in this database.

    Fix: ``orbit-outbox migrate --database-url URL``, or add :class:`OutboxTables`
    to the application's own Alembic metadata.
    """


class OutboxRowError(OutboxError):
    """An operator command (``retry``, ``show``, ...) named a row it cannot act on."""


class RowNotFoundError(OutboxRowError):
    """No outbox row has that id (it may have been purged)."""


class InvalidStateError(OutboxRowError):
    """The row's state does not allow the operation, e.g. ``retry`` of a row that is not ``DEAD``."""
