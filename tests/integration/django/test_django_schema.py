"""The outbox tables come with ``manage.py migrate`` (the app's migration runs the Alembic history of
``orbit-outbox migrate``), identical to the Alembic ones on SQLite, MariaDB and PostgreSQL, and on the
in-memory SQLite database Django's test runner uses."""

from __future__ import annotations

import uuid
from typing import Any

import sqlalchemy as sa

from outbox_adapter import OutboxTables, head_revision
from outbox_adapter._migrate import current_revision
from tests.integration.django.conftest import Project


def _shape(engine: sa.Engine, tables: OutboxTables) -> dict[str, Any]:
    """Columns (type, nullability, default), primary key, indexes, unique constraints and foreign keys of
    the four tables, with each table's own name taken out of the names."""
    inspector = sa.inspect(engine)
    shape: dict[str, Any] = {}
    for role, table in (("outbox", tables.outbox), ("events", tables.events), ("inbox", tables.inbox),
                        ("keys", tables.keys)):  # fmt: skip

        def plain(name: Any, table_name: str = table.name) -> Any:
            return str(name).replace(table_name, "<t>").replace(tables.name, "<o>") if name else name

        shape[role] = {
            "columns": sorted(
                (c["name"], str(c["type"]), c["nullable"], plain(c.get("default")))
                for c in inspector.get_columns(table.name)
            ),
            "pk": inspector.get_pk_constraint(table.name)["constrained_columns"],
            "indexes": sorted(
                (plain(i["name"]), tuple(i["column_names"]), bool(i["unique"]))
                for i in inspector.get_indexes(table.name)
            ),
            "unique": sorted(
                (plain(u["name"]), tuple(u["column_names"]))
                for u in inspector.get_unique_constraints(table.name)
            ),
            "foreign_keys": sorted(
                (tuple(f["constrained_columns"]), plain(f["referred_table"]))
                for f in inspector.get_foreign_keys(table.name)
            ),
        }
    return shape


def test_manage_py_migrate_makes_the_alembic_tables(django_project: Project, alias: str) -> None:
    from outbox_adapter.django._schema import migrate_outbox

    engine = django_project.engine(alias)
    try:
        made_by_django = OutboxTables()
        assert current_revision(engine, tables=made_by_django) == head_revision()
        twin = OutboxTables(name=f"twin_{uuid.uuid4().hex[:8]}")
        from outbox_adapter import Outbox

        Outbox(engine, tables=twin).migrate()
        assert _shape(engine, made_by_django) == _shape(engine, twin)
    finally:
        engine.dispose()
    from django.db import connections

    assert migrate_outbox(connections[alias]) == head_revision()  # again: nothing to do, same revision


def test_the_in_memory_test_database_gets_the_tables_on_djangos_own_connection(
    django_project: Project,
) -> None:
    """Django's test runner keeps a SQLite test database in memory, on its own connection only."""
    from django.core.management import call_command
    from django.db import connections, transaction

    from outbox_adapter.django import enqueue

    alias = f"mem_{uuid.uuid4().hex[:6]}"
    connections.settings[alias] = {**connections.settings["default"], "NAME": ":memory:"}
    try:
        call_command("migrate", database=alias, verbosity=0)
        connection = connections[alias]
        assert {"orbit_outbox", "orbit_inbox", "orbit_outbox_events", "orbit_outbox_keys"} <= set(
            connection.introspection.table_names()
        )
        with transaction.atomic(using=alias):
            entry = enqueue(
                namespace=django_project.namespace, queue="default", handler="h", params={}, using=alias
            )
        with connection.cursor() as cursor:
            cursor.execute("SELECT state FROM orbit_outbox WHERE id = %s", [entry.id])
            assert cursor.fetchone() == ("PENDING",)
    finally:
        connections[alias].close()
        del connections[alias]
        del connections.settings[alias]
