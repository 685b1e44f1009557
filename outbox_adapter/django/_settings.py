"""What the integration reads from Django's settings: a SQLAlchemy URL for a ``DATABASES`` alias,
and ``settings.ORBIT``."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from django.core.exceptions import ImproperlyConfigured
from django.db import connections

from outbox_adapter.django._guard import orbit_settings

__all__ = ["database_url", "orbit_settings"]


def database_url(using: str) -> sa.URL:
    """The SQLAlchemy URL of ``settings.DATABASES[using]`` (same server, database, user and driver as
    Django's), for the relay, reconcile and the other ``orbit-outbox`` commands.

    Raises:
        ImproperlyConfigured: ``using`` is not an alias, or its backend is not SQLite, MySQL/MariaDB or
            PostgreSQL.
    """
    if using not in connections:
        raise ImproperlyConfigured(
            f"{using!r} is not a database alias of settings.DATABASES ({', '.join(map(repr, connections))})"
        )
    connection = connections[using]
    db: dict[str, Any] = connection.settings_dict
    vendor = connection.vendor
    if vendor == "sqlite":
        return sa.URL.create("sqlite", database=str(db["NAME"]))
    if vendor == "mysql":
        driver = "mysql+mysqldb"
    elif vendor == "postgresql":
        name = getattr(getattr(connection, "Database", None), "__name__", "")
        driver = "postgresql+psycopg2" if name.startswith("psycopg2") else "postgresql+psycopg"
    else:
        raise ImproperlyConfigured(
            f"DATABASES[{using!r}] uses the {vendor!r} backend; the outbox supports SQLite, MySQL/MariaDB and "
            "PostgreSQL"
        )
    return sa.URL.create(
        driver,
        username=db.get("USER") or None,
        password=db.get("PASSWORD") or None,
        host=db.get("HOST") or None,
        port=int(db["PORT"]) if db.get("PORT") else None,
        database=str(db["NAME"]),
    )
