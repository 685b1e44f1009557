"""A real Django project (``tests.django_project``) for the Django integration's tests: one
database alias per business database this machine has (``default`` on SQLite, ``mariadb``,
``postgres``), a real Orbit server, outbox tables from the Alembic history on each alias.

Django is configured once per process, so the databases and the server are made once per session
(the first test of this folder that asks for them); a database server that cannot be reached leaves
its alias out (its tests skip; under ``CI=true`` they fail, as everywhere in the suite).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from orbit_client import OrbitClient, RetryPolicy
from outbox_adapter import Backoff, Relay
from tests.conftest import _scratch_database
from tests.servers import RunningServer, run_server

ALIASES = [
    pytest.param("default", id="sqlite"),
    pytest.param("mariadb", id="mariadb", marks=pytest.mark.mariadb),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


@dataclass
class Project:
    """The configured Django project: its Orbit server and namespace, and the SQLAlchemy URL of each alias."""

    orbit: RunningServer
    namespace: str
    keys: dict[str, str]
    urls: dict[str, URL] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    def engine(self, alias: str) -> sa.Engine:
        return sa.create_engine(self.urls[alias])

    @contextmanager
    def relay(self, alias: str) -> Iterator[Relay]:
        """A relay on ``alias``'s outbox with a zero backoff, closed (with its client and engine) after."""
        engine = self.engine(alias)
        with OrbitClient(
            self.orbit.base_url, api_key=self.keys["submit"], retry=RetryPolicy(max_attempts=1)
        ) as client:
            relay = Relay(client=client, engine=engine, backoff=Backoff.no_wait(), poll_interval=0.05)
            try:
                yield relay
            finally:
                relay.close()
                engine.dispose()

    def deliver(self, alias: str) -> int:
        """Run a relay over ``alias``'s outbox until nothing is due; return how many rows it delivered."""
        delivered = 0
        with self.relay(alias) as relay:
            while True:
                stats = relay.run_once()
                delivered += stats.delivered
                if not stats.claimed:
                    return delivered


def _django_entry(kind: str, url: URL) -> dict[str, Any]:
    if kind == "sqlite":
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": url.database}
    engine = "django.db.backends.mysql" if kind == "mariadb" else "django.db.backends.postgresql"
    entry = {
        "ENGINE": engine, "NAME": url.database, "USER": url.username or "", "PASSWORD": url.password or "",
        "HOST": url.host or "", "PORT": str(url.port or ""),
    }  # fmt: skip
    if kind == "mariadb":
        entry["OPTIONS"] = {"charset": "utf8mb4"}
    return entry


@pytest.fixture(scope="session")
def django_project(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Project]:
    import django
    from django.core.management import call_command

    cleanups: list[Iterator[URL]] = []
    databases: dict[str, Any] = {}
    urls: dict[str, URL] = {}
    path = tmp_path_factory.mktemp("django") / "business.db"
    databases["default"], urls["default"] = _django_entry("sqlite", sa.make_url(f"sqlite:///{path}")), None
    for alias, fixture, create, drop in (
        ("mariadb", "mysql_server", "CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci",
         "DROP DATABASE IF EXISTS `{name}`"),
        ("postgres", "postgres_server", 'CREATE DATABASE "{name}"', 'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'),
    ):  # fmt: skip
        try:
            server = request.getfixturevalue(fixture)
        except pytest.skip.Exception:
            continue  # unreachable off CI: the alias's tests skip
        gen = _scratch_database(server, create, drop)
        url = next(gen)
        cleanups.append(gen)
        databases[alias] = _django_entry(alias, url)
    orbit_path = tmp_path_factory.mktemp("orbit") / "orbit.db"
    with run_server(sa.make_url(f"sqlite:///{orbit_path}")) as orbit:
        namespace = f"dj-{uuid.uuid4().hex[:8]}"
        keys = orbit.add_namespace(namespace, ("default", "other"))
        given = {
            "databases": databases,
            "orbit_url": orbit.base_url,
            "namespace": namespace,
            "api_key": keys["work"],
        }
        env = {
            "ORBIT_TEST_DJANGO": json.dumps(given),
            "DJANGO_SETTINGS_MODULE": "tests.django_project.settings",
        }
        os.environ.update(env)
        django.setup()
        from outbox_adapter.django._settings import database_url

        project = Project(orbit, namespace, keys, env=env)
        for alias in databases:
            project.urls[alias] = database_url(alias)
            # The app's migration creates the outbox tables (the Alembic history) with the models'.
            call_command("migrate", database=alias, run_syncdb=True, verbosity=0)
        yield project
        from django.db import connections

        connections.close_all()
    for gen in cleanups:
        next(gen, None)


@pytest.fixture(params=ALIASES)
def alias(request: pytest.FixtureRequest, django_project: Project) -> str:
    """A database alias of the project (skips when this machine lacks its server)."""
    if request.param not in django_project.urls:
        pytest.skip(f"no {request.param} server reachable")
    return str(request.param)


@pytest.fixture(autouse=True)
def _nothing_due(request: pytest.FixtureRequest) -> None:
    """Each test starts with every alias's outbox delivered, so its counts are its own."""
    if "django_project" in request.fixturenames:
        project: Project = request.getfixturevalue("django_project")
        for name in project.urls:
            project.deliver(name)
