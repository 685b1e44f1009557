"""Alembic environment for the outbox tables in the business database.

Run through ``orbit-outbox migrate`` (which hands over a connection and the table
names in ``config.attributes``) or plain Alembic with ``-x url=... [-x table=...]``.
The version table is ``<table>_alembic_version`` (default ``orbit_outbox_alembic_version``).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context


def _table_name() -> str:
    name = context.config.attributes.get("outbox_table") or context.get_x_argument(as_dictionary=True).get(
        "table"
    )
    return str(name or "orbit_outbox")


def _run(connection: sa.Connection) -> None:
    context.configure(
        connection=connection,
        version_table=f"{_table_name()}_alembic_version",
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = context.get_x_argument(as_dictionary=True).get("url") or context.config.get_main_option(
        "sqlalchemy.url"
    )
    if not url:
        raise SystemExit("give the database URL: alembic -x url=mysql+pymysql://... upgrade head")
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        _run(conn)
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) mode is not supported; run against a database")
run_migrations_online()
