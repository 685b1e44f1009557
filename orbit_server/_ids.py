"""Cheap checks of ids taken from a path, a body or a cursor, made before any query.

Ids, idempotency keys and names are stored in ASCII columns compared byte for byte
(``Key(...)`` in :mod:`orbit_server.db.schema`; ``ascii_bin`` on MySQL/MariaDB). A value with a
non-ASCII character cannot name a row, and MySQL/MariaDB refuse to even compare it with such
a column ("Illegal mix of collations"). So the API answers it as what it is, an id that does
not exist (404) or a cursor this server did not produce (400), the same on every database,
without asking the database.
"""

from __future__ import annotations

__all__ = ["MAX_ID_LENGTH", "can_exist"]

#: Longest id column (task, attempt, event ids are UUIDs of 36 characters; 64 leaves room).
MAX_ID_LENGTH = 64


def can_exist(value: str, max_length: int = MAX_ID_LENGTH) -> bool:
    """``True`` when ``value`` may name a row of an ASCII id column of ``max_length`` characters."""
    return 0 < len(value) <= max_length and value.isascii()
