"""Settings of the Django shop: SQLite in ``DJANGO_SHOP_DIR`` (default ``.demo/django_shop``), Orbit
from ``ORBIT_URL``, ``ORBIT_API_KEY`` (a work key) and ``ORBIT_NAMESPACE``."""

from __future__ import annotations

import os
from pathlib import Path

WORK_DIR = Path(os.environ.get("DJANGO_SHOP_DIR", ".demo/django_shop")).resolve()
NAMESPACE = os.environ.get("ORBIT_NAMESPACE", "shop")

SECRET_KEY = "django-shop-demo-only"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["django.contrib.contenttypes", "outbox_adapter.django", "examples.django_shop.orders"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(WORK_DIR / "shop.db"),
        # Several processes write one SQLite file: wait for the lock rather than fail at once.
        "OPTIONS": {"timeout": 30},
    }
}
ORBIT = {
    "NAMESPACE": NAMESPACE,
    "ORBIT_URL": os.environ.get("ORBIT_URL"),
    "API_KEY": os.environ.get("ORBIT_API_KEY"),
}
TASKS = {
    "default": {
        "BACKEND": "outbox_adapter.django.backend.OrbitBackend",
        "QUEUES": ["fulfilment"],
        "OPTIONS": {
            "NAMESPACE": NAMESPACE,
            "ORBIT_URL": os.environ.get("ORBIT_URL"),
            "API_KEY": os.environ.get("ORBIT_API_KEY"),
            # Every step of fulfil is journaled, so an attempt whose worker died may run again.
            "SUBMIT_OPTIONS": {"retry_safe": True, "max_attempts": 5},
        },
    }
}
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["stderr"], "level": "WARNING"},
}
