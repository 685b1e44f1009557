"""A private 3-node MariaDB Galera cluster, started once per test session (``bench.cluster``).

Starting one costs ~25 s on a quiet 2-core machine, so every cluster test shares it. A test that
kills, pauses or partitions a node leaves it however it likes: :func:`cluster` brings every node
back (restart, SIGCONT, heal) and waits for ``wsrep_cluster_size`` = 3 before the next test.
Each test gets databases of its own on the cluster (:func:`cluster_database`).

Without Galera (no ``galera-4``, no ``mysql`` user, no rsync) the tests are skipped, except under
``CI=true``, where they fail.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pymysql
import pytest
from sqlalchemy.engine import URL, make_url

from bench.cluster.galera import ClusterError, GaleraCluster, GaleraNode
from tests.conftest import IN_CI

#: Database URLs of one database on the cluster, one per node (node 0 first).
ClusterDatabase = Callable[[], list[URL]]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "galera: needs a private MariaDB Galera cluster (galera-4, rsync); part of `make test`"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.galera)


@pytest.fixture(scope="session")
def galera() -> Iterator[GaleraCluster]:
    """The session's cluster (3 nodes), torn down when the session ends."""
    root = Path(tempfile.mkdtemp(prefix="orbit-galera-"))
    try:
        cluster = GaleraCluster(root, 3)
    except ClusterError as exc:
        shutil.rmtree(root, ignore_errors=True)
        if IN_CI:
            pytest.fail(
                f"cannot build a Galera cluster: {exc} (CI=true: cluster tests must run)", pytrace=False
            )
        pytest.skip(f"cannot build a Galera cluster: {exc}")
    try:
        cluster.start()
    except Exception:
        cluster.stop()
        raise
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def cluster(galera: GaleraCluster) -> GaleraCluster:
    """The session's cluster with every node running, connected and synced."""
    for node in galera.nodes:
        node.cont()
        if node.gcomm_host in galera.partitioned:
            node.heal()
    for node in galera.nodes:
        if not node.running:
            node.start()
        else:
            node.restart_if_closed(grace=5.0)
    galera.wait_size(galera.size, timeout=120)
    return galera


@pytest.fixture
def cluster_database(cluster: GaleraCluster) -> Iterator[ClusterDatabase]:
    """``cluster_database()`` → a new empty database on the cluster, as one URL per node."""
    names: list[str] = []

    def make() -> list[URL]:
        name = f"orbit_test_{uuid.uuid4().hex[:12]}"
        cluster.create_database(name)
        names.append(name)
        return [make_url(url) for url in cluster.urls(name)]

    yield make
    for name in names:
        cluster.drop_database(name)


#: How long a statement must have run on a lagging node to count as waiting for it to catch up, in ms.
_WAITING_MS = 300


def wait_until_a_statement_waits(
    node: GaleraNode, database: str, *, on: str = "", timeout: float = 60.0
) -> tuple[str, str]:
    """Block until a statement of another session on ``database`` (naming ``on`` in its text, when
    given) has run on ``node`` for 0.3 s or more, and return its ``(state, text)``.

    Called while ``node`` is held behind (:meth:`GaleraNode.lagging`): such a statement is a read
    waiting for the node to catch up (``wsrep_sync_wait``), which proves that the request under test
    reached the node while it lagged, where a fixed sleep only hoped so. A write waiting for the
    block's read lock does not count. Fails the test after ``timeout`` seconds.
    """
    query = (
        "SELECT STATE, INFO FROM information_schema.PROCESSLIST WHERE DB = %s AND COMMAND = 'Query' "
        "AND ID <> CONNECTION_ID() AND TIME_MS >= %s AND INFO LIKE %s "
        "AND COALESCE(STATE, '') NOT LIKE '%%read lock%%' AND COALESCE(STATE, '') NOT LIKE '%%backup lock%%'"
    )
    deadline = time.monotonic() + timeout
    conn = pymysql.connect(host="127.0.0.1", port=node.port, user="root", connect_timeout=5, read_timeout=10)
    try:
        while True:
            with conn.cursor() as cur:
                cur.execute(query, (database, _WAITING_MS, f"%{on}%"))
                rows = cur.fetchall()
            if rows:
                return str(rows[0][0]), str(rows[0][1])
            if time.monotonic() > deadline:
                pytest.fail(f"no statement on {database!r} waited on node {node.index} within {timeout:g} s")
            time.sleep(0.05)
    finally:
        conn.close()
