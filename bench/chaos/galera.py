"""``python -m bench.chaos --cluster galera``: the chaos run with both databases on one 3-node Galera cluster.

The business database (orders, outbox, inbox) and the Orbit database live on one private
cluster (:mod:`bench.cluster.galera`), multi-primary: Orbit server *i* uses node *i*, the relays,
workers, the consumer and the order API are spread over the nodes (each through its own node, no
proxy). Besides the process faults of the single-database run, the schedule hits the nodes:

- ``node_killed``: SIGKILL of a node's ``mariadbd``, restarted on its datadir (InnoDB recovery,
  then IST from a donor);
- ``node_paused``: SIGSTOP of a node until the others go on without it as a primary component,
  then SIGCONT (it rejoins; restarted if its group communication closes);
- ``node_partitioned``: a node cut off from the others behind its group-communication proxy
  (it turns non-primary and refuses statements with 1047; its server answers 503), then healed;
- ``cluster_restarted``: every node SIGKILLed at once, then the cluster bootstrapped from the most
  advanced node (``--wsrep-recover``) and the others joined.

A fault after which the cluster does not come back by itself (the two running nodes out of the
primary component) is recovered as the README "Scaling out" tells an operator and counted
(``operator_recoveries``). After the drain the whole cluster is stopped and started again from
its datadirs, and the checks read it (:mod:`bench.chaos.checks`).
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

import pymysql
import sqlalchemy as sa

from bench.cluster.galera import ClusterError, GaleraCluster, GaleraNode

__all__ = ["NODE_FAULTS", "ClusterDatabases", "cluster_schedule"]

log = logging.getLogger("bench.chaos.galera")

NODE_FAULTS = ["node_killed", "node_paused", "node_partitioned", "cluster_restarted"]
#: Seconds of a recovery without a primary component before the whole cluster is restarted instead.
FULL_RESTART_AFTER_SECONDS = 60.0


def cluster_schedule(
    rng: random.Random, faults: int, process_kinds: list[str], node_kinds: list[str] | None = None
) -> list[str]:
    """``faults`` kinds in a seeded order: a fifth of them (at least 6, when there are that many)
    hit the nodes, one in twenty-five of those a whole-cluster restart (at least one), the others
    drawn in turn from ``node_kinds`` (default: kill, pause, partition); the rest are spread
    evenly over ``process_kinds``."""
    kinds = node_kinds or NODE_FAULTS[:3]
    nodes = min(faults, max(6, faults // 5))
    restarts = min(nodes, max(1, nodes // 25)) if nodes >= 6 else 0
    plan = ["cluster_restarted"] * restarts
    plan += [kinds[i % len(kinds)] for i in range(nodes - restarts)]
    plan += [process_kinds[i % len(process_kinds)] for i in range(faults - len(plan))]
    rng.shuffle(plan)
    return plan


class ClusterDatabases:
    """The cluster of a chaos run, and where each process connects."""

    def __init__(self, root: Path, size: int = 3, cluster: GaleraCluster | None = None) -> None:
        #: ``False`` for a cluster given by the caller (a test session's): never stopped here.
        self.owned = cluster is None
        self.cluster = cluster or GaleraCluster(root, size, name=f"chaos-{root.name}")
        suffix = "" if self.owned else f"_{root.name[-8:].replace('-', '_')}"
        #: The names of the business and the Orbit database on the cluster.
        self.names = {"shop": f"shop{suffix}", "orbit": f"orbit{suffix}"}
        self.faults: dict[str, int] = dict.fromkeys(NODE_FAULTS, 0)
        #: Paused nodes whose group communication closed for good after SIGCONT, restarted.
        self.restarted_after_pause = 0
        #: Faults after which the cluster came back only by an operator's procedure (:meth:`_recover`).
        self.operator_recoveries = 0

    def start(self) -> None:
        if self.owned:
            self.cluster.start()
        for database in self.names.values():
            self.cluster.create_database(database)

    def url(self, database: str, i: int) -> str:
        """The URL of ``database`` (``"shop"`` or ``"orbit"``) on node ``i`` (modulo the cluster's size)."""
        return self.cluster.nodes[i % self.cluster.size].url(self.names[database])

    def direct(self, database: str) -> sa.Engine:
        """An engine for the harness's own reads: each connection goes to the first node that is in
        the primary component (``wsrep_ready=ON``); none is pooled, as a node may leave it any time."""
        nodes, name = self.cluster.nodes, self.names[database]

        def connect() -> Any:
            failure: Exception | None = None
            for node in nodes:
                try:
                    conn = pymysql.connect(host="127.0.0.1", port=node.port, user="root", database=name,
                                           connect_timeout=2, charset="utf8mb4")  # fmt: skip
                except pymysql.err.MySQLError as exc:
                    failure = exc
                    continue
                try:
                    with conn.cursor() as cur:
                        cur.execute("SHOW STATUS LIKE 'wsrep_ready'")
                        ready = cur.fetchone()
                except pymysql.err.MySQLError as exc:
                    failure, ready = exc, None
                if ready is not None and ready[1] == "ON":
                    return conn
                conn.close()
            raise failure or pymysql.err.OperationalError(1047, "no node of the cluster is ready")

        return sa.create_engine("mysql+pymysql://", creator=connect, poolclass=sa.pool.NullPool)

    def fault(self, kind: str, rng: random.Random) -> bool:
        try:
            self._fault(kind, rng)
        except ClusterError as exc:
            self._recover(exc)
        self.faults[kind] += 1
        return True

    def _recover(self, failure: ClusterError) -> None:
        """The cluster did not come back by itself after a fault: recover it as the README "Scaling
        out" tells an operator (a primary component bootstrapped on the most advanced node when
        quorum is lost, stopped nodes started, a node whose group communication closed restarted),
        and count it; raise ``failure`` when that does not bring back all nodes."""
        cluster = self.cluster
        log.warning("cluster did not recover by itself (%s); recovering as an operator would", failure)
        self.operator_recoveries += 1
        began = time.monotonic()
        deadline = began + 300
        while time.monotonic() < deadline:
            try:
                if time.monotonic() - began > FULL_RESTART_AFTER_SECONDS:
                    # The most advanced node keeps refusing pc.bootstrap: the whole-cluster procedure
                    # (clean stop, bootstrap from the highest seqno in grastate.dat) loses nothing either.
                    first = cluster.restart_all(240)
                    log.warning("cluster restarted as a whole, bootstrapped from %s", first.name)
                    return
                bootstrapped = cluster.bootstrap_primary()
                if bootstrapped is not None:
                    log.warning("no primary component left: pc.bootstrap=1 on %s", bootstrapped.name)
                for node in cluster.nodes:
                    if not node.running:
                        node.start(120)
                    else:
                        node.restart_if_closed(grace=5.0)
                cluster.wait_size(cluster.size, 60)
                return
            except ClusterError as exc:
                log.warning("recovery not done yet: %s", str(exc).splitlines()[0])
                time.sleep(2.0)
        raise failure

    def _fault(self, kind: str, rng: random.Random) -> None:
        cluster = self.cluster
        node: GaleraNode = rng.choice(cluster.nodes)
        if kind == "node_killed":
            node.kill()
            time.sleep(rng.uniform(0.2, 1.5))
            node.start(180)
        elif kind == "node_paused":
            # SIGSTOP until the others have dropped the node and go on as a primary component of
            # two (past the suspect and inactive timeouts, and their view change), then SIGCONT: it
            # merges back. A SIGCONT in the middle of that view change once closed the node's group
            # communication for good and left the other two non-primary (no quorum), a state only
            # an operator's bootstrap ends: a fixed pause of 4-5.5 s does not fault a node, it
            # races Galera's own timers.
            others = [n for n in cluster.nodes if n is not node]
            node.pause()
            try:
                cluster.wait_size(len(others), 60, nodes=others)
                time.sleep(rng.uniform(0.5, 2.0))
            finally:
                node.cont()
            if node.closes_within(10.0):
                node.shutdown()
                node.start(180)
                self.restarted_after_pause += 1
        elif kind == "node_partitioned":
            node.partition()
            try:
                cluster.wait_non_primary(node, 30)
                time.sleep(rng.uniform(0.5, 2.0))
            finally:
                node.heal()
        elif kind == "cluster_restarted":
            cluster.restart_all(240, kill=True)
        else:  # pragma: no cover - the schedule only holds the kinds above
            raise ValueError(kind)
        cluster.wait_size(cluster.size, 240)

    def settings(self) -> dict[str, Any]:
        return {node["node"]: node for node in self.cluster.settings()}

    def counters(self) -> dict[str, int]:
        return self.cluster.counters()

    def restart_for_checks(self) -> None:
        """Stop every node cleanly and start the cluster again from its datadirs."""
        self.cluster.restart_all(240)

    def stop(self) -> None:
        if self.owned:
            self.cluster.stop()

    def drop(self) -> None:
        """Drop the run's databases (a cluster given by the caller lives on)."""
        if not self.owned:
            for database in self.names.values():
                self.cluster.drop_database(database)
