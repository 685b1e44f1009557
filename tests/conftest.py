"""Shared fixtures: real databases, each test module getting its own.

Servers are found in this order: an explicit URL (``ORBIT_TEST_MYSQL_URL``,
``ORBIT_TEST_POSTGRES_URL``); else a container through testcontainers when it is
installed and a Docker engine answers (users' laptops); else the local servers at
127.0.0.1 (these machines and CI). A test that
needs a server it cannot reach is skipped on a laptop and **fails** under
``CI=true``. Every database is created with a unique name and dropped after.
"""

from __future__ import annotations

import atexit
import gc
import os
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

from tests.xdist_groups import group_of, make_scheduler

MYSQL_DEFAULT = "mysql+pymysql://root@127.0.0.1:3306/test"
POSTGRES_DEFAULT = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
#: ``make test-quick`` sets ``sqlite``: the database servers are not asked for at all (a test that needs one
#: skips, CI or not); unset, every database is tested.
ONLY_SQLITE = os.environ.get("ORBIT_TEST_DATABASES", "").strip().lower() == "sqlite"


def _unreachable(what: str, url: URL, exc: Exception) -> None:
    message = f"{what} at {url.render_as_string()} is unreachable: {exc}"
    if IN_CI:
        pytest.fail(f"{message} (CI=true: database tests must run)", pytrace=False)
    pytest.skip(message)


def _docker_answers() -> bool:
    """Whether a Docker engine answers; the client (and its socket) is closed either way."""
    if not os.environ.get("DOCKER_HOST") and not Path("/var/run/docker.sock").exists():
        return False  # no engine to ask: do not even build a client
    try:
        import docker  # type: ignore[import-not-found]
    except ImportError:
        return False
    with warnings.catch_warnings():
        # A client that fails to connect leaves its socket for the garbage collector: collect it here,
        # so that its ResourceWarning (an error under filterwarnings=error) cannot surface in a test.
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            client = docker.from_env()
        except Exception:
            gc.collect()
            return False
        try:
            client.ping()
            return True
        except Exception:
            return False
        finally:
            client.close()
            gc.collect()


def _container_url(kind: str) -> URL | None:
    """Start a MySQL 8 / PostgreSQL container when testcontainers is installed and Docker answers."""
    if not _docker_answers():
        return None
    try:
        if kind == "mysql":
            from testcontainers.community.mysql import MySqlContainer  # type: ignore[import-not-found]

            container = MySqlContainer("mysql:8.0", dialect="pymysql")
        else:
            from testcontainers.community.postgres import PostgresContainer  # type: ignore[import-not-found]

            container = PostgresContainer("postgres:16", driver="psycopg")
        container.start()
    except Exception:
        return None
    atexit.register(container.stop)
    return make_url(container.get_connection_url())


def _server_url(env: str, default: str, what: str) -> URL:
    if ONLY_SQLITE:
        pytest.skip(f"ORBIT_TEST_DATABASES=sqlite (make test-quick): {what} not tested")
    explicit = os.environ.get(env)
    kind = "mysql" if "MYSQL" in env else "postgres"
    url = make_url(explicit) if explicit else (_container_url(kind) or make_url(default))
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except Exception as exc:
        _unreachable(what, url, exc)
    finally:
        engine.dispose()
    return url


@pytest.fixture(scope="session")
def mysql_server() -> URL:
    """URL of the MariaDB/MySQL server the tests may create databases on."""
    return _server_url("ORBIT_TEST_MYSQL_URL", MYSQL_DEFAULT, "MariaDB/MySQL")


@pytest.fixture(scope="session")
def postgres_server() -> URL:
    """URL of the PostgreSQL server the tests may create databases on."""
    return _server_url("ORBIT_TEST_POSTGRES_URL", POSTGRES_DEFAULT, "PostgreSQL")


def _scratch_database(server: URL, create: str, drop: str) -> Iterator[URL]:
    name = f"orbit_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(create.format(name=name)))
    try:
        yield server.set(database=name)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(drop.format(name=name)))
        admin.dispose()


DatabaseFactory = Callable[[str], URL]


@pytest.fixture(scope="module")
def make_database(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DatabaseFactory]:
    """``make_database(kind)`` → URL of a new empty database of ``kind``
    (``sqlite``, ``mariadb`` or ``postgres``), dropped when the module ends."""
    cleanups: list[Iterator[URL]] = []

    def make(kind: str) -> URL:
        if kind == "sqlite":
            path = tmp_path_factory.mktemp("db") / f"{uuid.uuid4().hex[:8]}.db"
            return make_url(f"sqlite:///{path}")
        if kind == "mariadb":
            gen = _scratch_database(
                request.getfixturevalue("mysql_server"),
                "CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci",
                "DROP DATABASE IF EXISTS `{name}`",
            )
        elif kind == "postgres":
            gen = _scratch_database(
                request.getfixturevalue("postgres_server"),
                'CREATE DATABASE "{name}"',
                'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)',
            )
        else:
            raise ValueError(kind)
        cleanups.append(gen)
        return next(gen)

    yield make
    for gen in cleanups:
        next(gen, None)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its xdist group (:func:`tests.xdist_groups.group_of`): a test module, every
    cluster test, every Django test, or the heavy acceptance modules. Under ``make test`` the scheduler of
    :mod:`tests.xdist_groups` runs each group whole on one worker; without xdist the mark is inert."""
    root = Path(__file__).parent
    for item in items:
        module = Path(str(item.fspath)).relative_to(root).as_posix()
        item.add_marker(pytest.mark.xdist_group(group_of(module)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` groups by :func:`tests.xdist_groups.group_of` (pytest 9.2 broke xdist's own
    grouping), the long groups first; any other ``--dist`` is xdist's."""
    return make_scheduler(config, log)
