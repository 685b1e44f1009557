"""The check that keeps a SQLAlchemy ``enqueue`` out of a Django ``transaction.atomic()`` block.

``outbox_adapter.enqueue`` writes through a SQLAlchemy connection: a transaction of its own, apart
from Django's. Called inside ``transaction.atomic()``, its row commits even when the Django block
rolls back, and the relay then sends a task for business data that never existed (README
"Django"). ``outbox_adapter._enqueue`` calls :func:`refuse_inside_atomic` before every write once
Django is imported; ``outbox_adapter.django.enqueue`` is the way to enqueue in Django's transaction.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import connections

from outbox_adapter._exceptions import OutboxUsageError

__all__ = ["ALLOW_SETTING", "refuse_inside_atomic"]

#: ``settings.ORBIT[ALLOW_SETTING] = True`` lets the SQLAlchemy enqueue run inside an atomic block
#: (the SQLAlchemy engine is another database than every Django alias in that block).
ALLOW_SETTING = "ALLOW_SQLALCHEMY_ENQUEUE_IN_ATOMIC"


def orbit_settings() -> dict[str, Any]:
    """``settings.ORBIT`` (``{}`` when unset).

    Raises:
        django.core.exceptions.ImproperlyConfigured: ``ORBIT`` is not a dict.
    """
    from django.core.exceptions import ImproperlyConfigured

    value = getattr(settings, "ORBIT", None) or {}
    if not isinstance(value, dict):
        raise ImproperlyConfigured(f"settings.ORBIT must be a dict, not {type(value).__name__}")
    return value


def refuse_inside_atomic() -> None:
    """Raise when a Django connection of this thread is inside ``transaction.atomic()``.

    Raises:
        OutboxUsageError: a block is open on an alias (the message names it and the fix); nothing
            was written.
    """
    if not settings.configured:
        return
    try:
        made = connections.all(initialized_only=True)  # Django 4.1+: only the connections this thread made
    except TypeError:  # an older Django (the app needs 4.2; the check still guards a plain outbox user)
        made = connections.all()
    open_aliases = [c.alias for c in made if c.in_atomic_block]
    if not open_aliases or orbit_settings().get(ALLOW_SETTING) is True:
        return
    raise OutboxUsageError(
        "outbox_adapter.enqueue was called inside Django's transaction.atomic() "
        f"(database alias {', '.join(map(repr, open_aliases))}): it writes through a SQLAlchemy connection, "
        "whose transaction commits apart from Django's, so a rollback of the atomic block would still leave "
        "the row to be sent; use outbox_adapter.django.enqueue(..., using=ALIAS), which writes through "
        'Django\'s connection in the same transaction (README "Django"). If the SQLAlchemy engine is '
        f"another database than every Django alias in the block, set ORBIT = {{{ALLOW_SETTING!r}: True}} "
        "in the Django settings; nothing was written"
    )
