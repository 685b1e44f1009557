"""Orbit for Django (``pip install 'orbit-tasks[django]'``, ``"outbox_adapter.django"`` in
``INSTALLED_APPS``; README "Django").

- :func:`enqueue` / :func:`enqueue_flow`: the outbox row written through Django's connection, in
  ``transaction.atomic()`` with the model being saved (the same row as :func:`outbox_adapter.enqueue`).
- ``outbox_adapter.django.backend.OrbitBackend``: a ``django.tasks`` backend (Django 6, or the
  ``django-tasks`` backport on Django 4.2-5.2) that enqueues ``@task`` functions through the outbox.
- ``python manage.py orbit_worker``: runs those functions as an Orbit worker, Django set up;
  ``python manage.py orbit_consume``: result events applied through the ORM in the inbox row's
  atomic block (:class:`~outbox_adapter.django.consumer.DjangoResultConsumer`);
  ``python manage.py orbit_outbox ...``: the ``orbit-outbox`` commands on a ``DATABASES`` alias.
- ``python manage.py migrate`` creates the outbox and inbox tables (the Alembic history of
  ``orbit-outbox migrate``, run by the app's migration).

Only this subpackage imports Django; the rest of Orbit never needs it.
"""

try:
    import django as _django  # noqa: F401
except ModuleNotFoundError as _missing:  # a project without the extra: say which one
    raise ModuleNotFoundError(
        "outbox_adapter.django needs Django; install it with: pip install 'orbit-tasks[django]' "
        '(README "Django")',
        name="django",
    ) from _missing

from outbox_adapter.django._enqueue import enqueue, enqueue_flow

__all__ = ["enqueue", "enqueue_flow"]
