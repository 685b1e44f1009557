"""The outbox and inbox tables on a Django database: the Alembic history of ``orbit-outbox migrate``,
run by the app's Django migration (``manage.py migrate``, and so every test database Django creates).

One schema, not a Django copy of it: the same history creates the same columns, types, indexes and
constraints, and records its revision in ``<table>_alembic_version``, so ``orbit-outbox migrate``
(and a service sharing the database without Django) keeps upgrading it.
"""

from __future__ import annotations

import sqlalchemy as sa
from django.db.backends.base.base import BaseDatabaseWrapper

from outbox_adapter._migrate import upgrade
from outbox_adapter._tables import OutboxTables
from outbox_adapter.django._settings import database_url, orbit_settings

__all__ = ["migrate_outbox"]


def migrate_outbox(connection: BaseDatabaseWrapper) -> str | None:
    """Create or upgrade the outbox tables (``settings.ORBIT["TABLE"]``, default ``orbit_outbox``) on
    Django's database ``connection``.

    A database SQLite keeps in memory (Django's default test database) exists only on Django's own
    connection, so the history runs on that connection; any other database through a connection of
    its own, from ``database_url``.

    Returns:
        The revision the database is at afterwards.

    Raises:
        OutboxDatabaseError: the database failed.
    """
    name = orbit_settings().get("TABLE")
    tables = OutboxTables(name=name) if name else OutboxTables()
    if connection.vendor == "sqlite" and connection.is_in_memory_db():  # type: ignore[attr-defined]
        connection.ensure_connection()
        raw = connection.connection
        # Django's own DB-API connection, lent for the duration: never reset, closed or disposed here.
        engine = sa.create_engine(
            "sqlite://", creator=lambda: raw, poolclass=sa.pool.StaticPool, pool_reset_on_return=None
        )
        return upgrade(engine, tables=tables)
    engine = sa.create_engine(database_url(connection.alias), poolclass=sa.pool.NullPool)
    try:
        return upgrade(engine, tables=tables)
    finally:
        engine.dispose()
