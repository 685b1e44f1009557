"""``DjangoResultConsumer``: Orbit's result events applied by a Django handler through the ORM, in
the same ``transaction.atomic()`` as the event's inbox row (README "Django", "Consuming results").

The consumer's loop, leases, acks, parking and outage handling are :class:`outbox_adapter.ResultConsumer`'s;
only the business transaction differs: the inbox row (the same statements, compiled for Django's
driver) and ``handler(event)`` run in one ``transaction.atomic(using=...)`` on Django's connection,
so an order's update and its inbox entry commit together, and a redelivered event changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    IntegrityError,
    close_old_connections,
    connections,
    transaction,
)

from orbit_client import Delivery, ResultEvent
from outbox_adapter import _inbox_queries as iq
from outbox_adapter._consumer import DeliveryClient, ResultConsumer, _Conflict, _Duplicate, _HandlerFailed
from outbox_adapter._exceptions import OutboxDatabaseError
from outbox_adapter._tables import InboxOutcome, OutboxTables
from outbox_adapter.django._enqueue import sqlalchemy_dialect
from outbox_adapter.django._settings import database_url
from outbox_adapter.django._sql import execute, translate

__all__ = ["DjangoResultConsumer", "DjangoResultHandler"]

#: ``handler(event)``: applies one result event through the ORM (any model of the consumer's
#: database alias), inside the atomic block that records it in the inbox. Its return value is ignored.
DjangoResultHandler = Callable[[ResultEvent], object]

#: Django's errors that say the database (not the handler's logic) failed: the event is tried again.
_TRANSIENT = ("OperationalError", "InterfaceError")


class DjangoResultConsumer(ResultConsumer):
    """A :class:`~outbox_adapter.ResultConsumer` whose handler is ``handler(event)`` on Django's
    ORM, in the inbox row's transaction on the ``DATABASES`` alias ``using``.

    Args:
        client: an :class:`orbit_client.OrbitClient` with a ``work`` key (leases and acks deliveries).
        namespace, subscription: the Orbit namespace and its subscription.
        handler: ``handler(event)`` (:class:`orbit_client.ResultEvent`); it may raise to roll back
            (the event comes back after its lease; parked ``FAILED`` after ``max_deliveries``).
        using: the alias of the business database holding the inbox table. Default ``"default"``.
        tables: the outbox/inbox tables (``None``: the default names).
        **options: the other options of :class:`~outbox_adapter.ResultConsumer` (``batch_size``,
            ``lease_seconds``, ``max_deliveries``, ``poll_interval``, metrics, signal handlers).

    Raises:
        OutboxUsageError: an invalid name or option (as ``ResultConsumer``).
        django.core.exceptions.ImproperlyConfigured: ``using`` is not an alias.
    """

    def __init__(
        self,
        client: DeliveryClient,
        namespace: str,
        subscription: str,
        handler: DjangoResultHandler,
        *,
        using: str = DEFAULT_DB_ALIAS,
        tables: OutboxTables | None = None,
        **options: Any,
    ) -> None:
        # The base's engine (built from the alias's URL, never connected here) is not used to apply.
        super().__init__(
            database_url(using),
            client,
            namespace,
            subscription,
            handler,  # type: ignore[arg-type]
            tables=tables,
            **options,
        )
        self.using = using
        self.django_handler = handler

    def _inbox_row(self, delivery: Delivery, outcome: InboxOutcome, error: str | None = None) -> int:
        """Insert the event's inbox row through Django's connection (inside the caller's atomic block)."""
        connection = connections[self.using]
        dialect = sqlalchemy_dialect(connection)
        t = self.outbox.tables
        event = delivery.event
        with connection.cursor() as cursor:
            execute(
                cursor,
                iq.inbox_contains_statement(t, subscription=self.subscription, event_id=event.id),
                dialect,
            )
            if cursor.fetchone() is not None:
                raise _Duplicate
            stmt = iq.insert_inbox_statement(
                t, dialect.name, event_id=event.id, subscription=self.subscription, namespace=event.namespace,
                task_id=event.task_id, status=event.status.value, outcome=outcome,
                delivery_count=delivery.delivery_count, error=error,
                event=event.model_dump(mode="json") if outcome is InboxOutcome.FAILED else None,
                processed=outcome is InboxOutcome.FAILED,
            )  # fmt: skip
            returning = dialect.name == "postgresql"
            try:
                with transaction.atomic(using=self.using):  # a savepoint: a conflict leaves the block usable
                    execute(cursor, stmt.returning(t.inbox.c.id) if returning else stmt, dialect)
            except IntegrityError as exc:
                raise _Conflict(exc) from exc  # type: ignore[arg-type]
            return int(cursor.fetchone()[0] if returning else cursor.lastrowid)

    def _apply(self, delivery: Delivery) -> str:
        event = delivery.event
        what = f"apply result event {event.id}"
        connection = connections[self.using]
        close_old_connections()
        try:
            with transaction.atomic(using=self.using):
                row_id = self._inbox_row(delivery, InboxOutcome.APPLIED)
                try:
                    self.django_handler(event)
                except Exception as exc:
                    raise _HandlerFailed(exc) from exc
                with connection.cursor() as cursor:
                    dialect = sqlalchemy_dialect(connection)
                    execute(
                        cursor, iq.mark_processed_statement(self.outbox.tables, dialect.name, row_id), dialect
                    )
        except _Duplicate:
            return "duplicate"
        except _Conflict as conflict:
            return self._after_conflict(conflict, event.id, what)
        except _HandlerFailed as failed:
            if isinstance(failed.cause, DatabaseError) and type(failed.cause).__name__ in _TRANSIENT:
                raise translate(failed.cause, connection, what) from failed.cause
            raise
        except DatabaseError as exc:
            raise translate(exc, connection, what) from exc
        finally:
            close_old_connections()
        return "applied"

    def _park(self, delivery: Delivery, cause: Exception) -> str:
        error = f"handler failed on delivery {delivery.delivery_count}: {type(cause).__name__}: {cause}"
        connection = connections[self.using]
        try:
            with transaction.atomic(using=self.using):
                self._inbox_row(delivery, InboxOutcome.FAILED, error)
        except _Duplicate:
            return "duplicate"
        except _Conflict as conflict:
            return self._after_conflict(
                conflict, delivery.event.id, f"record result event {delivery.event.id}"
            )
        except DatabaseError as exc:
            raise translate(exc, connection, f"record result event {delivery.event.id} as FAILED") from exc
        return "parked"

    def _after_conflict(self, conflict: _Conflict, event_id: str, what: str) -> str:
        connection = connections[self.using]
        dialect = sqlalchemy_dialect(connection)
        try:
            with connection.cursor() as cursor:
                execute(
                    cursor,
                    iq.inbox_contains_statement(
                        self.outbox.tables, subscription=self.subscription, event_id=event_id
                    ),
                    dialect,
                )
                found = cursor.fetchone() is not None
        except DatabaseError as exc:
            raise translate(exc, connection, what) from exc
        if found:
            return "duplicate"
        cause = conflict.cause
        if isinstance(cause, DatabaseError):
            raise translate(cause, connection, what) from cause
        raise OutboxDatabaseError(f"cannot {what}: {cause}")  # pragma: no cover
