"""A private MariaDB Galera cluster on loopback: N nodes, their own ports and datadirs, faults on demand.

    cluster = GaleraCluster(Path("/tmp/run"), size=3)
    cluster.start()                 # bootstrap node 0, the others join by SST (rsync)
    cluster.nodes[1].kill(); cluster.nodes[1].start()   # SIGKILL, rejoin by IST
    cluster.nodes[2].partition(); cluster.nodes[2].heal()  # cut off behind its proxy
    cluster.restart_all()           # whole-cluster restart from the most advanced node
    cluster.stop()

Never the shared server. Every node is one ``mariadbd`` run as the ``mysql`` user (rsync SST
drops to the datadir's owner: run as root with root-owned datadirs it fails with "Permission
denied"), with ``binlog_format=ROW``, ``innodb_autoinc_lock_mode=2`` and
``innodb_flush_log_at_trx_commit=1``; :meth:`GaleraCluster.settings` reads them back through SQL.

Group communication: node *i* listens on a loopback address of its own (127.0.0.(11+i), which
Galera also binds its outgoing connections to), and every other node reaches it through a TCP
proxy (``bench.chaos.proxy``): the address it advertises (``wsrep_node_address``) is the
proxy's. :meth:`GaleraNode.partition` lists the node's address in the proxies' control file: its
own proxy then drops every connection and refuses new ones, and the others' proxies drop the
connections coming from it, so the node is cut off in both directions while its process and its
SQL port stay up (the non-primary node of the README "Scaling out"); :meth:`GaleraNode.heal`
lets it merge back.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pymysql
import sqlalchemy as sa

from bench.chaos.mariadb import free_port

__all__ = ["EVS_SUSPECT_SECONDS", "GALERA_LIBRARY", "ClusterError", "GaleraCluster", "GaleraNode"]

GALERA_LIBRARY = "/usr/lib/galera/libgalera_smm.so"
#: The user every node runs as (and owns its datadir): rsync SST needs it.
RUN_AS = "mysql"
#: Seconds without a message after which the others suspect a node (``evs.suspect_timeout``).
EVS_SUSPECT_SECONDS = 3
#: Group-communication timeouts. The suspect timeout is short, so that a node SIGSTOPped for a few
#: seconds is suspected by both others and dropped at once (a node all others suspect is dropped
#: before ``evs.inactive_timeout``) and a test need not wait long. The inactive and install
#: timeouts keep Galera's defaults: with an install timeout of 4 s, a view change on a loaded
#: 2-core machine (load 7, a node joining by IST) once timed out on every node, each declared the
#: others inactive and no primary component was left. (Defaults: 5 s / 15 s / 7.5 s / 1 s.)
EVS = "evs.suspect_timeout=PT3S;evs.inactive_timeout=PT15S;evs.install_timeout=PT7.5S;evs.keepalive_period=PT0.5S;evs.inactive_check_period=PT0.5S"


#: Seconds with every node answering and none in a primary component after which a wait gives up.
QUORUM_LOST_SECONDS = 15.0


class ClusterError(RuntimeError):
    """The cluster did not reach the state asked for in time (the message names the node and its log)."""


class GaleraNode:
    """One node: ``mariadbd`` with the Galera provider under ``root``, SQL on 127.0.0.1:``port``."""

    def __init__(self, cluster: GaleraCluster, index: int) -> None:
        self.cluster = cluster
        self.index = index
        self.name = f"node{index}"
        self.root = cluster.root / self.name
        self.datadir = self.root / "data"
        self.tmpdir = self.root / "tmp"
        self.port = free_port()
        #: Whether it was ever synced (its port may have been handed out in URLs since).
        self.synced_once = False
        #: The loopback address of this node's group communication (in and out).
        self.gcomm_host = f"127.0.0.{11 + index}"
        self.gcomm_port = free_port()
        #: The proxy in front of :attr:`gcomm_port`: the address the other nodes use.
        self.gcomm_proxy_port = free_port()
        self.ist_port = free_port()
        self.sst_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.proxy: subprocess.Popen[bytes] | None = None
        self.kills = 0
        self.stops = 0
        for d in (self.root, self.datadir, self.tmpdir):
            d.mkdir(parents=True, exist_ok=True)

    # --- addresses ---------------------------------------------------------------------------------

    def url(self, database: str = "") -> str:
        return f"mysql+pymysql://root@127.0.0.1:{self.port}/{database}"

    @property
    def error_log(self) -> Path:
        return self.root / "mariadbd.err"

    def _argv(self, cluster_address: str, *extra: str) -> list[str]:
        provider_options = ";".join([
            f"base_port={self.gcomm_port}",
            f"gmcast.listen_addr=tcp://{self.gcomm_host}:{self.gcomm_port}",
            f"ist.recv_addr=127.0.0.1:{self.ist_port}",
            "gcache.size=128M",
            "repl.causal_read_timeout=PT10S",
            EVS,
            # No automatic recovery of the primary component from gvwstate.dat: a whole-cluster
            # restart is done by hand, from the most advanced node (restart_all), as the README says.
            "pc.recovery=FALSE",
        ])  # fmt: skip
        return [
            shutil.which("mariadbd") or "/usr/sbin/mariadbd", "--no-defaults",
            f"--datadir={self.datadir}", f"--port={self.port}", "--bind-address=127.0.0.1",
            f"--socket={self.root / 'mysqld.sock'}", f"--pid-file={self.root / 'mysqld.pid'}", f"--user={RUN_AS}",
            f"--tmpdir={self.tmpdir}", f"--log-error={self.error_log}",
            "--skip-name-resolve", "--max-connections=500", "--innodb-buffer-pool-size=128M",
            "--innodb-log-file-size=64M", "--innodb-lock-wait-timeout=20",
            "--character-set-server=utf8mb4", "--collation-server=utf8mb4_general_ci",
            # What Galera requires, and the durability baseline (DESIGN §2):
            "--binlog-format=ROW", "--innodb-autoinc-lock-mode=2", "--innodb-flush-log-at-trx-commit=1",
            "--default-storage-engine=InnoDB",
            "--wsrep-on=ON", f"--wsrep-provider={GALERA_LIBRARY}",
            f"--wsrep-cluster-name={self.cluster.name}", f"--wsrep-node-name={self.name}",
            f"--wsrep-cluster-address={cluster_address}",
            f"--wsrep-node-address=127.0.0.1:{self.gcomm_proxy_port}",
            f"--wsrep-node-incoming-address=127.0.0.1:{self.port}",
            f"--wsrep-provider-options={provider_options}",
            "--wsrep-sst-method=rsync", f"--wsrep-sst-receive-address=127.0.0.1:{self.sst_port}",
            "--wsrep-slave-threads=2", "--wsrep-certify-nonPK=ON",
            *extra,
        ]  # fmt: skip

    # --- processes ---------------------------------------------------------------------------------

    def start_proxy(self) -> None:
        if self.proxy is not None and self.proxy.poll() is None:
            return
        log = (self.root / "gcomm-proxy.log").open("ab")
        self.proxy = subprocess.Popen(
            [sys.executable, "-m", "bench.chaos.proxy", "--port", str(self.gcomm_proxy_port),
             "--target-port", str(self.gcomm_port), "--target-host", self.gcomm_host,
             "--control", str(self.cluster.partitions_file)],
            stdout=log, stderr=log, start_new_session=True, cwd=Path(__file__).resolve().parents[2],
        )  # fmt: skip
        log.close()

    def launch(self, *, bootstrap: bool = False) -> None:
        """Start ``mariadbd``; ``bootstrap`` makes it a new primary component alone (``--wsrep-new-cluster``)."""
        self.start_proxy()
        address = "gcomm://" + ",".join(
            f"127.0.0.1:{n.gcomm_proxy_port}" for n in self.cluster.nodes if n is not self
        )
        extra = ("--wsrep-new-cluster",) if bootstrap else ()
        # A node SIGKILLed and started again at once would come back with the UUID of its previous
        # incarnation, which the others may not have evicted yet ("A node with the same UUID already
        # exists in the cluster", fatal): without the saved view it takes a new one.
        (self.datadir / "gvwstate.dat").unlink(missing_ok=True)
        log = (self.root / "mariadbd.out").open("ab")
        self.proc = subprocess.Popen(
            self._argv(address, *extra), stdout=log, stderr=log, start_new_session=True
        )
        log.close()

    def start(self, timeout: float = 120.0, *, bootstrap: bool = False) -> None:
        """Start the node and wait until it is synced with a primary component (IST or SST on rejoin).

        A node SIGKILLed and started again at once is sometimes refused by the others ("A node with
        the same UUID already exists in the cluster", fatal): they still hold its previous
        incarnation at the same address. It is then started again, as Galera's message says, once
        the others have evicted that incarnation (their primary component no longer counts it:
        ``evs.inactive_timeout`` and a view change later), up to 5 times. (Retrying after fixed
        pauses of 1-3 s was refused four times in a row in a 2,000-order chaos run.)"""
        for tries in range(6):
            mark = self.error_log.stat().st_size if self.error_log.exists() else 0
            self.launch(bootstrap=bootstrap)
            try:
                self.wait_synced(timeout)
                self.synced_once = True
                return
            except ClusterError:
                with self.error_log.open("rb") as log:
                    log.seek(mark)
                    said = log.read()
                if (
                    not self.synced_once
                    and not self.running
                    and tries < 5
                    and b"Address already in use" in said
                ):
                    # Its port, free when drawn, was taken since (another test's process): no URL of
                    # this node was handed out yet, so draw another one.
                    self.port = free_port()
                    continue
                refused = b"same UUID already exists" in said
                if not refused or tries == 5 or self.running:
                    raise
                self.wait_forgotten(timeout=60.0)
                time.sleep(1.0 + tries)

    def wait_forgotten(self, timeout: float = 60.0) -> None:
        """Wait until every other running node is synced in a primary component that does not count
        this (stopped) node; return quietly after ``timeout`` (the caller's next start says more).

        Raises:
            ClusterError: every other node answers and none is in a primary component (quorum
                lost: no eviction will come; see :meth:`GaleraCluster.bootstrap_primary`).
        """
        others = [n for n in self.cluster.nodes if n is not self and n.running]
        deadline = time.monotonic() + timeout
        non_primary_since: float | None = None
        while time.monotonic() < deadline:
            states = [n.try_status() for n in others]
            if all(
                s.get("wsrep_cluster_size") == str(len(others)) and s.get("wsrep_cluster_status") == "Primary"
                for s in states
            ):
                return
            if states and all(s and s.get("wsrep_cluster_status") != "Primary" for s in states):
                non_primary_since = non_primary_since or time.monotonic()
                if time.monotonic() - non_primary_since > 10:
                    raise ClusterError(f"{self.name} cannot join: no other node is in a primary component")
            else:
                non_primary_since = None
            time.sleep(0.2)

    def wait_synced(self, timeout: float = 120.0) -> None:
        """Wait for ``wsrep_ready=ON`` and ``wsrep_local_state_comment=Synced`` on this node."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.try_status()
            if status.get("wsrep_ready") == "ON" and status.get("wsrep_local_state_comment") == "Synced":
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise ClusterError(
                    f"{self.name} exited ({self.proc.returncode}); see {self.error_log}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"{self.name} not synced within {timeout:.0f} s ({status}); see {self.error_log}"
                )
            time.sleep(0.1)

    def log_tail(self, lines: int = 25) -> str:
        """The last ``lines`` lines of the node's error log (``""`` when there is none), for an error
        message that outlives the run's temporary directory."""
        try:
            text = self.error_log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def admin_statement(self, sql: str) -> list[tuple[object, ...]]:
        """Run one ``SHOW`` or ``SET`` statement through a bare PyMySQL connection: a node outside the
        primary component refuses every other statement with 1047, and SQLAlchemy's first connect
        runs some (``SELECT``), so an engine cannot even open a connection there."""
        conn = pymysql.connect(host="127.0.0.1", port=self.port, user="root", connect_timeout=2,
                               read_timeout=10, write_timeout=10)  # fmt: skip
        try:
            with conn.cursor() as cur:
                cur.execute(sql)
                return list(cur.fetchall())
        finally:
            conn.close()

    def status(self) -> dict[str, str]:
        """``SHOW GLOBAL STATUS LIKE 'wsrep%'`` as a dict, on a non-primary node too (raises
        ``pymysql.err.MySQLError`` when the node does not answer)."""
        return {str(k): str(v) for k, v in self.admin_statement("SHOW GLOBAL STATUS LIKE 'wsrep%'")}

    def try_status(self) -> dict[str, str]:
        try:
            return self.status()
        except pymysql.err.MySQLError:
            return {}

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL ``mariadbd`` (no shutdown); :meth:`start` brings it back (InnoDB recovery, then IST)."""
        assert self.proc is not None
        self.cont()  # a stopped process must not stay stopped behind a kill
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.kills += 1

    def pause(self) -> None:
        """SIGSTOP: the node stops answering everything (the others suspect it after evs.suspect_timeout)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.stops += 1

    def cont(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def closed_for_good(self) -> bool:
        """``True`` when ``mariadbd`` runs but its group communication has closed for good
        (``wsrep_connected=OFF``): Galera logged "backend must be restarted" (seen after a SIGCONT
        that came while the others were still installing the view without it). Only a restart
        brings such a node back, as an operator would do (README "Scaling out")."""
        return self.running and self.try_status().get("wsrep_connected") == "OFF"

    def closes_within(self, seconds: float) -> bool:
        """``True`` when the node's group communication closes for good (:meth:`closed_for_good`)
        within ``seconds``; watched after a SIGCONT, where Galera decides it within a second."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.closed_for_good():
                return True
            time.sleep(0.25)
        return False

    def restart_if_closed(self, timeout: float = 180.0, grace: float = 20.0) -> bool:
        """Restart the node when its group communication stays closed for ``grace`` seconds
        (:meth:`closed_for_good`); ``True`` when it was restarted."""
        deadline = time.monotonic() + grace
        while self.closed_for_good():
            if time.monotonic() > deadline:
                self.shutdown()
                self.start(timeout)
                return True
            time.sleep(0.5)
        return False

    def partition(self) -> None:
        """Cut this node off from the others, both ways (see the module's docstring)."""
        self.cluster.set_partitioned(self, True)

    def heal(self) -> None:
        """Undo :meth:`partition`: the proxies let its connections through and the node merges back."""
        self.cluster.set_partitioned(self, False)

    @contextlib.contextmanager
    def lagging(self) -> Iterator[None]:
        """Hold this node behind the others: ``FLUSH TABLES WITH READ LOCK`` on a connection of its
        own pauses its appliers (the node desyncs, the others commit on), while reads still answer
        from what it had applied. Writes on this node wait until the block ends (``UNLOCK TABLES``)."""
        engine = sa.create_engine(self.url(), poolclass=sa.pool.NullPool)
        conn = engine.connect()
        try:
            conn.exec_driver_sql("FLUSH TABLES WITH READ LOCK")
            yield
            conn.exec_driver_sql("UNLOCK TABLES")
        finally:
            conn.close()
            engine.dispose()

    def shutdown(self, timeout: float = 60.0) -> None:
        """SIGTERM (clean shutdown: grastate.dat records the node's seqno), SIGKILL after ``timeout``."""
        if self.proc is not None and self.proc.poll() is None:
            self.cont()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def stop_proxy(self) -> None:
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.send_signal(signal.SIGTERM)
            try:
                self.proxy.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proxy.kill()
                self.proxy.wait()

    # --- recovery ----------------------------------------------------------------------------------

    def grastate(self) -> dict[str, str]:
        """``grastate.dat`` (``uuid``, ``seqno``, ``safe_to_bootstrap``); empty before the first start."""
        path = self.datadir / "grastate.dat"
        if not path.exists():
            return {}
        out = {}
        for line in path.read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and not line.startswith("#"):
                out[key.strip()] = value.strip()
        return out

    def recovered_seqno(self) -> int:
        """The last committed seqno on disk: grastate.dat after a clean shutdown, else ``--wsrep-recover``."""
        seqno = int(self.grastate().get("seqno", "-1"))
        if seqno >= 0:
            return seqno
        log = self.root / "wsrep-recover.err"
        log.unlink(missing_ok=True)
        argv = [a for a in self._argv("gcomm://") if not a.startswith("--log-error")]
        subprocess.run([*argv, f"--log-error={log}", "--wsrep-recover"], capture_output=True, timeout=120)
        found = re.findall(r"Recovered position: [0-9a-f-]+:(-?\d+)", log.read_text() if log.exists() else "")
        if not found:
            raise ClusterError(f"{self.name}: --wsrep-recover found no position; see {log}")
        return int(found[-1])

    def mark_safe_to_bootstrap(self) -> None:
        path = self.datadir / "grastate.dat"
        text = re.sub(r"safe_to_bootstrap:\s*\d", "safe_to_bootstrap: 1", path.read_text())
        path.write_text(text)
        _chown(path)


class GaleraCluster:
    """``size`` nodes under ``root`` (a directory this class owns and fills)."""

    def __init__(self, root: Path, size: int = 3, name: str | None = None) -> None:
        for tool in ("mariadb-install-db", "rsync"):
            if shutil.which(tool) is None:
                raise ClusterError(f"{tool} is not installed; a Galera cluster needs MariaDB 10.6+ and rsync")
        if not Path(GALERA_LIBRARY).exists():
            raise ClusterError(f"{GALERA_LIBRARY} is missing; install Debian's galera-4")
        try:
            pwd.getpwnam(RUN_AS)
        except KeyError as exc:
            raise ClusterError(f"no user {RUN_AS!r} to run the nodes as (install mariadb-server)") from exc
        self.root = root
        self.name = name or f"orbit-{os.getpid()}"
        self.nodes: list[GaleraNode] = []
        root.mkdir(parents=True, exist_ok=True)
        #: The proxies' control file: the gcomm addresses of the partitioned nodes.
        self.partitions_file = root / "partitioned"
        self.partitioned: set[str] = set()
        for i in range(size):
            self.nodes.append(GaleraNode(self, i))

    @property
    def size(self) -> int:
        return len(self.nodes)

    def urls(self, database: str = "") -> list[str]:
        return [n.url(database) for n in self.nodes]

    def start(self, timeout: float = 180.0) -> None:
        """Install node 0's datadir, bootstrap it, then join the others one after the other (SST by rsync
        from a synced node; their datadirs start empty) and wait for ``wsrep_cluster_size`` = N."""
        first = self.nodes[0]
        _make_traversable(self.root)
        _chown(self.root)
        done = subprocess.run(
            ["mariadb-install-db", "--no-defaults", f"--datadir={first.datadir}", f"--user={RUN_AS}",
             "--auth-root-authentication-method=normal", "--skip-test-db", f"--tmpdir={first.tmpdir}"],
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            raise ClusterError(f"mariadb-install-db failed: {done.stdout[-1500:]}{done.stderr[-1500:]}")
        _chown(self.root)
        for node in self.nodes:
            node.start_proxy()
        first.start(timeout, bootstrap=True)
        for node in self.nodes[1:]:
            node.start(timeout)
        self.wait_size(self.size, timeout)

    def set_partitioned(self, node: GaleraNode, cut: bool) -> None:
        if cut:
            self.partitioned.add(node.gcomm_host)
        else:
            self.partitioned.discard(node.gcomm_host)
        tmp = self.partitions_file.with_suffix(".tmp")
        tmp.write_text("".join(f"{host}\n" for host in sorted(self.partitioned)))
        tmp.replace(self.partitions_file)
        for other in self.nodes:
            if other.proxy is not None and other.proxy.poll() is None:
                other.proxy.send_signal(signal.SIGUSR2)

    def wait_size(self, size: int, timeout: float = 60.0, nodes: list[GaleraNode] | None = None) -> None:
        """Wait until every node of ``nodes`` (default: all running) is synced in a primary component of ``size``.

        Raises:
            ClusterError: not within ``timeout``; or, sooner, every running node has answered for
                :data:`QUORUM_LOST_SECONDS` without one in a primary component (quorum lost: only
                :meth:`bootstrap_primary` ends that).
        """
        deadline = time.monotonic() + timeout
        no_primary_since: float | None = None
        while True:
            members = nodes if nodes is not None else [n for n in self.nodes if n.running]
            states = {n.name: n.try_status() for n in members}
            if all(
                s.get("wsrep_cluster_size") == str(size) and s.get("wsrep_ready") == "ON"
                and s.get("wsrep_cluster_status") == "Primary" and s.get("wsrep_local_state_comment") == "Synced"
                for s in states.values()
            ):  # fmt: skip
                return
            everyone = [n.try_status() for n in self.nodes if n.running]
            if everyone and all(s and s.get("wsrep_cluster_status") != "Primary" for s in everyone):
                no_primary_since = no_primary_since or time.monotonic()
                if time.monotonic() - no_primary_since > QUORUM_LOST_SECONDS:
                    raise ClusterError(
                        f"no node in a primary component for {QUORUM_LOST_SECONDS:.0f} s (quorum lost); "
                        f"logs under {self.root}"
                    )
            else:
                no_primary_since = None
            if time.monotonic() > deadline:
                brief = {k: (v.get("wsrep_cluster_size"), v.get("wsrep_cluster_status"), v.get("wsrep_ready"),
                             v.get("wsrep_local_state_comment")) for k, v in states.items()}  # fmt: skip
                raise ClusterError(
                    f"cluster not at size {size} within {timeout:.0f} s: {brief}; logs under {self.root}"
                )
            time.sleep(0.1)

    def bootstrap_primary(self) -> GaleraNode | None:
        """When every running node answers but none is in a primary component (quorum lost), do
        what the README "Scaling out" tells an operator: ``pc.bootstrap=YES`` on the most advanced
        one (highest ``wsrep_last_committed``); the others join it. Returns that node, or ``None``
        when a primary component exists or a node does not answer."""
        states = {node: node.try_status() for node in self.nodes if node.running}
        if not states or any(not s or s.get("wsrep_cluster_status") == "Primary" for s in states.values()):
            return None
        failure: pymysql.err.MySQLError | None = None
        committed = {node: int(status.get("wsrep_last_committed") or -1) for node, status in states.items()}
        best = max(committed.values())
        # Only a most advanced node: bootstrapped from a node behind another, the cluster goes on
        # without the other's last writes, and that node rejoins by a full SST that drops them.
        for node in [n for n, seqno in committed.items() if seqno == best]:
            try:  # a node in the middle of a view change refuses it (1210): the caller tries again
                node.admin_statement("SET GLOBAL wsrep_provider_options='pc.bootstrap=1'")
                return node
            except pymysql.err.MySQLError as exc:
                failure = exc
        raise ClusterError(f"pc.bootstrap refused on the most advanced node(s) (seqno {best}): {failure}")

    def wait_non_primary(self, node: GaleraNode, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while node.try_status().get("wsrep_cluster_status") == "Primary":
            if time.monotonic() > deadline:
                raise ClusterError(f"{node.name} still in the primary component after {timeout:.0f} s")
            time.sleep(0.1)

    def restart_all(self, timeout: float = 180.0, *, kill: bool = False) -> GaleraNode:
        """Stop every node (SIGKILL when ``kill``), then bootstrap from the most advanced one (highest
        seqno in grastate.dat, or from ``--wsrep-recover`` after a crash) and join the others (IST).
        Returns the node it bootstrapped from."""
        for node in self.nodes:
            if kill and node.running:
                node.kill()
            else:
                node.shutdown()
        seqnos = {node.index: node.recovered_seqno() for node in self.nodes}
        first = self.nodes[max(seqnos, key=lambda i: (seqnos[i], -i))]
        first.mark_safe_to_bootstrap()
        first.start(timeout, bootstrap=True)
        for node in self.nodes:
            if node is not first:
                node.start(timeout)
        self.wait_size(self.size, timeout)
        return first

    def settings(self) -> list[dict[str, str]]:
        """The settings Orbit relies on, read back from every node through SQL."""
        names = ("binlog_format", "innodb_autoinc_lock_mode", "innodb_flush_log_at_trx_commit", "wsrep_on",
                 "wsrep_sst_method", "wsrep_sync_wait", "wsrep_cluster_name", "wsrep_provider", "version",
                 "auto_increment_increment", "auto_increment_offset", "wsrep_certify_nonPK", "tx_isolation")  # fmt: skip
        out = []
        for node in self.nodes:
            engine = sa.create_engine(node.url(), poolclass=sa.pool.NullPool)
            with engine.connect() as conn:
                row = conn.exec_driver_sql("SELECT " + ", ".join(f"@@{n}" for n in names)).one()
                status: dict[str, str] = dict(conn.exec_driver_sql(
                    "SHOW GLOBAL STATUS WHERE Variable_name IN ('wsrep_cluster_size', 'wsrep_provider_version')"
                ).all())  # fmt: skip
            engine.dispose()
            out.append({"node": node.name, **{n: str(v) for n, v in zip(names, row, strict=True)},
                        **{str(k): str(v) for k, v in status.items()}})  # fmt: skip
        return out

    def counters(self) -> dict[str, int]:
        """Certification failures and brute-force aborts summed over the running nodes."""
        total = {"wsrep_local_cert_failures": 0, "wsrep_local_bf_aborts": 0, "wsrep_last_committed": 0}
        for node in self.nodes:
            status = node.try_status()
            for key in ("wsrep_local_cert_failures", "wsrep_local_bf_aborts"):
                total[key] += int(status.get(key, 0))
            total["wsrep_last_committed"] = max(
                total["wsrep_last_committed"], int(status.get("wsrep_last_committed", 0))
            )
        return total

    def create_database(self, database: str) -> None:
        engine = sa.create_engine(self.nodes[0].url(), poolclass=sa.pool.NullPool)
        with engine.begin() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE `{database}` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
        engine.dispose()

    def drop_database(self, database: str) -> None:
        for node in self.nodes:
            if node.try_status().get("wsrep_ready") != "ON":
                continue
            engine = sa.create_engine(node.url(), poolclass=sa.pool.NullPool)
            with engine.begin() as conn:
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{database}`")
            engine.dispose()
            return

    def stop(self) -> None:
        """Stop every node (SIGTERM, then SIGKILL) and every proxy."""
        for node in self.nodes:
            node.cont()
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)
        for node in self.nodes:
            node.shutdown(30)
            node.stop_proxy()

    @contextlib.contextmanager
    def running(self) -> Iterator[GaleraCluster]:
        try:
            self.start()
            yield self
        finally:
            self.stop()


def _chown(path: Path) -> None:
    """Give ``path`` (recursively) to :data:`RUN_AS`, as mariadbd and rsync SST need."""
    entry = pwd.getpwnam(RUN_AS)
    if os.getuid() != 0:
        return  # not root: the nodes run as ourselves (``--user`` is ignored), nothing to give
    os.chown(path, entry.pw_uid, entry.pw_gid)
    if path.is_dir():
        for base, dirs, files in os.walk(path):
            for name in dirs + files:
                with contextlib.suppress(FileNotFoundError):
                    os.chown(os.path.join(base, name), entry.pw_uid, entry.pw_gid, follow_symlinks=False)


def _make_traversable(path: Path) -> None:
    """``tempfile.mkdtemp`` makes 0700 directories: let the ``mysql`` user reach ``path``."""
    for parent in [path, *path.parents]:
        if parent == Path("/"):
            break
        mode = parent.stat().st_mode
        if parent.stat().st_uid == os.getuid() and not mode & 0o001:
            parent.chmod(mode | 0o711)
