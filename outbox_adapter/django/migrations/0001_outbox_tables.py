"""The outbox and inbox tables, by the Alembic history of ``orbit-outbox migrate`` (README "Django")."""

from __future__ import annotations

from typing import Any

from django.db import migrations


def create_outbox_tables(apps: Any, schema_editor: Any) -> None:
    from outbox_adapter.django._schema import migrate_outbox

    migrate_outbox(schema_editor.connection)


class Migration(migrations.Migration):
    # The history runs on a connection of its own (the tables are Orbit's, not models of this app):
    # no Django transaction may hold the database meanwhile.
    atomic = False
    initial = True
    dependencies = []
    # Unapplying leaves the tables: they may hold rows not yet sent. Drop them by hand if you mean it.
    operations = [migrations.RunPython(create_outbox_tables, migrations.RunPython.noop, elidable=False)]
