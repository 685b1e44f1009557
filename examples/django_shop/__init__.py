"""The order service as a Django project (README "Django"): an order saved and its fulfilment enqueued in one
``transaction.atomic()``, a worker running ``django.tasks`` tasks, results applied to the order through the
ORM. ``python -m examples.django_shop.demo`` runs it on SQLite with a relay and a worker killed mid-way."""
