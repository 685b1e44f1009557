"""Migrating on a Galera node that is a moment behind the node that migrated first (README "Scaling
out"): every server runs ``orbit-server migrate`` (or ``serve``'s migration) on its own node, and a
business service may run ``orbit-outbox migrate`` from several instances. Before the fix the
lagging node read "no version table, no tables" from what it had applied, created the first table
again and failed with 1050 "Table ... already exists" (seen when the cluster tests' servers started
right after a chaos run had left a node behind; here, with node 2 held behind, the stray CREATE is
refused with 1047 "Aborting TOI"). Now the migration's reads wait until the node has caught up
(``wsrep_sync_wait``), and it finds the schema at its newest revision."""

from __future__ import annotations

import threading
from collections.abc import Callable

import sqlalchemy as sa

from bench.cluster.galera import GaleraCluster
from orbit_server.db import migrate
from outbox_adapter import _migrate as outbox_migrate
from tests.cluster.conftest import ClusterDatabase, wait_until_a_statement_waits


def _upgrade_behind(
    cluster: GaleraCluster, cluster_database: ClusterDatabase, upgrade: Callable[[sa.Engine], object]
) -> sa.Engine:
    urls = cluster_database()
    first, lagging = sa.create_engine(urls[0]), sa.create_engine(urls[2])
    errors: list[BaseException] = []

    def second() -> None:
        try:
            upgrade(lagging)
        except BaseException as exc:  # reported below
            errors.append(exc)

    with cluster.nodes[2].lagging():
        upgrade(first)
        thread = threading.Thread(target=second)
        thread.start()
        # The second migration's first read waits on node 2, behind; then the block ends.
        wait_until_a_statement_waits(cluster.nodes[2], str(urls[2].database), on="alembic_version")
    thread.join(120)
    first.dispose()
    assert not thread.is_alive() and errors == [], errors
    return lagging


def test_the_server_schema_migrated_on_a_lagging_node_after_another(
    cluster: GaleraCluster, cluster_database: ClusterDatabase
) -> None:
    lagging = _upgrade_behind(cluster, cluster_database, migrate.upgrade)
    assert migrate.current_revision(lagging) == migrate.head_revision()
    lagging.dispose()


def test_the_outbox_tables_migrated_on_a_lagging_node_after_another(
    cluster: GaleraCluster, cluster_database: ClusterDatabase
) -> None:
    lagging = _upgrade_behind(cluster, cluster_database, outbox_migrate.upgrade)
    assert outbox_migrate.current_revision(lagging) == outbox_migrate.head_revision()
    lagging.dispose()
