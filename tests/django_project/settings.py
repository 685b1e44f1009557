"""The Django settings of the integration's tests: a real project, its databases and Orbit server
given by the test session in ``ORBIT_TEST_DJANGO`` (JSON: ``databases`` by alias, ``orbit_url``,
``namespace``, ``api_key``), so the test process and the ``manage.py`` processes it starts agree."""

from __future__ import annotations

import json
import os

_GIVEN = json.loads(os.environ.get("ORBIT_TEST_DJANGO", "{}"))

SECRET_KEY = "orbit-tests-only"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["django.contrib.contenttypes", "outbox_adapter.django", "tests.django_project.shop"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = _GIVEN.get("databases") or {
    "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.path.join(os.getcwd(), "orbit-django.db")}
}
_ORBIT = {
    "NAMESPACE": _GIVEN.get("namespace", "shop"),
    "ORBIT_URL": _GIVEN.get("orbit_url"),
    "API_KEY": _GIVEN.get("api_key"),
}
#: One Orbit backend per database alias: each writes its outbox rows to its own database.
TASKS = {
    alias: {
        "BACKEND": "outbox_adapter.django.backend.OrbitBackend",
        "QUEUES": ["default", "other", "nowhere"],  # "nowhere" does not exist on the server
        "OPTIONS": {**_ORBIT, "DATABASE": alias},
    }
    for alias in DATABASES
}
ORBIT = {key: value for key, value in _ORBIT.items() if value is not None}
LOGGING = {"version": 1, "disable_existing_loggers": False}
