"""Alembic environment for the Orbit server schema.

Run through ``orbit-server migrate`` (which hands over a connection in
``config.attributes["connection"]``) or plain Alembic with ``-x url=...``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

VERSION_TABLE = "orbit_server_alembic_version"


def _run(connection: sa.Connection) -> None:
    context.configure(connection=connection, version_table=VERSION_TABLE, render_as_batch=True)
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
