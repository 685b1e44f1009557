"""The Django app of Orbit's integration: ``"outbox_adapter.django"`` in ``INSTALLED_APPS``."""

from __future__ import annotations

from django.apps import AppConfig


class OrbitConfig(AppConfig):
    """Adds the ``orbit_worker`` and ``orbit_outbox`` management commands; the outbox tables come
    from ``python manage.py orbit_outbox migrate`` (README "Django")."""

    name = "outbox_adapter.django"
    label = "orbit"
    verbose_name = "Orbit"
