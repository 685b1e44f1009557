"""Orbit on a 3-node MariaDB Galera cluster, multi-primary: one server per node, all at once
(issue 22; README "Scaling out").

What Galera changes, each checked here against real nodes: a write on one node conflicts with a
write on another only at ``COMMIT`` (certification, reported as deadlock 1213), and is then
retried; ``SELECT ... FOR UPDATE`` locks on its own node only; a node may answer from a state a
moment behind the others (a "not found" there proves nothing); a node cut off from the primary
component refuses every statement (1047).

A lagging node is made deterministic with ``FLUSH TABLES WITH READ LOCK`` on it
(:meth:`bench.cluster.galera.GaleraNode.lagging`): its appliers stop while it still answers reads.
"""

from __future__ import annotations

import itertools
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from bench.cluster.galera import GaleraCluster
from orbit_server.tasks import store
from tests.cluster.conftest import ClusterDatabase, wait_until_a_statement_waits
from tests.servers import RunningServer, run_server

REPO = Path(__file__).resolve().parents[2]
BODY = {"queue": "default", "handler": "orders.fulfil", "params": {"order_id": 1}}


@pytest.fixture(scope="module")
def servers(galera: GaleraCluster) -> Iterator[list[RunningServer]]:
    """One Orbit server per node over one database of this module (node 0's migrates it; DDL
    on Galera is slow, total order isolation): each test uses namespaces of its own."""
    name = f"orbit_test_{uuid.uuid4().hex[:12]}"
    galera.create_database(name)
    urls = [sa.engine.make_url(url) for url in galera.urls(name)]
    with ExitStack() as stack:
        stack.callback(galera.drop_database, name)
        running = [stack.enter_context(run_server(urls[0]))]
        running += [stack.enter_context(run_server(url)) for url in urls[1:]]
        yield running


def _namespace(server: RunningServer, queues: tuple[str, ...] = ("default",)) -> tuple[str, dict[str, str]]:
    name = f"ns-{uuid.uuid4().hex[:8]}"
    return name, server.add_namespace(name, queues)


def _database(server: RunningServer) -> str:
    """The name of the database ``server`` uses."""
    return str(server.engine.url.database)


def _retrying(http: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    """POST, sent again (as the worker SDK does) while it answers 409 ``concurrent_update``:
    retryable, nothing was done (hot rows written on three nodes meet at certification)."""
    for _ in range(10):
        answer = http.post(path, json=body)
        if answer.status_code != 409 or answer.json().get("code") != "concurrent_update":
            break
    return answer


def _limited_queue(server: RunningServer, namespace: str) -> None:
    """A queue ``limited`` of ``namespace`` with at most one live attempt per concurrency key."""
    with server.engine.begin() as conn:
        store.create_queue(conn, namespace, "limited", max_concurrency_per_key=1)


def _tasks(conn: sa.Connection, namespace: str) -> int:
    query = "SELECT COUNT(*) FROM tasks t JOIN namespaces n ON n.id = t.namespace_id WHERE n.name = :n"
    return int(conn.execute(sa.text(query), {"n": namespace}).scalar_one())


def _http(server: RunningServer, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _submit(http: httpx.Client, namespace: str, key: str, body: dict[str, Any] = BODY) -> httpx.Response:
    return http.post(f"/v1/namespaces/{namespace}/tasks", json=body, headers={"Idempotency-Key": key})


def test_the_cluster_runs_with_the_settings_orbit_needs(cluster: GaleraCluster) -> None:
    for node in cluster.settings():
        assert node["binlog_format"] == "ROW", node
        assert node["innodb_autoinc_lock_mode"] == "2", node
        assert node["innodb_flush_log_at_trx_commit"] == "1", node
        assert node["wsrep_on"] == "1" and node["wsrep_cluster_size"] == "3", node
        assert node["wsrep_sst_method"] == "rsync", node
    # Galera spaces auto-increment ids per node: ids interleave (README "Scaling out").
    offsets = {node["auto_increment_offset"] for node in cluster.settings()}
    assert offsets == {"1", "2", "3"}


def test_every_table_has_a_primary_key_and_no_code_takes_a_node_local_lock(
    servers: list[RunningServer], cluster_database: ClusterDatabase
) -> None:
    from examples.order_service.db import create_business_tables
    from outbox_adapter import Outbox

    business = sa.create_engine(cluster_database()[1])
    try:
        create_business_tables(business)
        Outbox(business).migrate()
    finally:
        business.dispose()
    schemas = [servers[0].database_url.database, business.url.database]
    with servers[2].engine.connect() as conn:
        tables = conn.execute(
            sa.text("SELECT table_schema, table_name, engine FROM information_schema.tables WHERE table_schema IN :s")
            .bindparams(sa.bindparam("s", expanding=True)),
            {"s": schemas},
        ).all()  # fmt: skip
        keyed = set(
            conn.execute(
                sa.text(
                    "SELECT table_schema, table_name FROM information_schema.table_constraints "
                    "WHERE constraint_type = 'PRIMARY KEY' AND table_schema IN :s"
                ).bindparams(sa.bindparam("s", expanding=True)),
                {"s": schemas},
            ).all()
        )
    assert len(tables) > 20
    assert [t for t in tables if (t[0], t[1]) not in keyed] == []  # Galera replicates no row without a key
    assert {t[2] for t in tables} == {"InnoDB"}
    # Locks that Galera does not replicate: GET_LOCK, LOCK TABLES (node-local, so no guarantee at all).
    sources = subprocess.run(
        ["git", "grep", "-n", "-i", "-E", r"get_lock\(|lock tables|release_lock\(", "--", "orbit_server",
         "outbox_adapter", "orbit_client", "examples", "migrations"],
        cwd=REPO, capture_output=True, text=True,
    ).stdout  # fmt: skip
    assert sources == ""


def test_the_same_keys_sent_to_three_servers_on_three_nodes_make_one_task_each(
    servers: list[RunningServer],
) -> None:
    ns, keys = _namespace(servers[0])
    keys_n = 40
    idem = [f"order-{uuid.uuid4()}" for _ in range(keys_n)]
    clients = [_http(s, keys["submit"]) for s in servers]
    try:

        def send(job: tuple[int, int]) -> tuple[str, int, str | None]:
            k, node = job
            response = _submit(clients[node], ns, idem[k], {**BODY, "params": {"order": k}})
            task_id = response.json().get("id") if response.status_code < 300 else None
            return idem[k], response.status_code, task_id

        jobs = [(k, node) for k in range(keys_n) for node in range(3)]
        with ThreadPoolExecutor(max_workers=12) as pool:
            answers = list(pool.map(send, jobs))
    finally:
        for c in clients:
            c.close()
    statuses = [status for _, status, _ in answers]
    assert sorted(set(statuses)) == [200, 201], {s: statuses.count(s) for s in set(statuses)}
    assert statuses.count(201) == keys_n  # one creation per key, every other answer a replay
    by_key: dict[str, set[str | None]] = {}
    for key, _, task_id in answers:
        by_key.setdefault(key, set()).add(task_id)
    assert all(len(ids) == 1 for ids in by_key.values())
    with servers[1].engine.connect() as conn:
        assert _tasks(conn, ns) == keys_n


def test_the_same_batches_sent_to_three_servers_on_three_nodes_make_one_task_per_key(
    servers: list[RunningServer],
) -> None:
    ns, keys = _namespace(servers[0])
    batches = [
        [{"idempotency_key": f"b-{b}-{i}-{uuid.uuid4().hex[:6]}", **BODY} for i in range(10)]
        for b in range(6)
    ]
    clients = [_http(s, keys["submit"]) for s in servers]
    try:
        # One batch per server first, alone: the three servers of this test share one process, and pydantic
        # built a model's schema lazily on two threads at once there once (a 500 "AttributeError:
        # __pydantic_core_schema__"), which is this harness's, not the cluster's. Keys of their own.
        for node, client in enumerate(clients):
            warm = [{"idempotency_key": f"warm-{node}-{uuid.uuid4().hex[:6]}", **BODY}]
            assert client.post(f"/v1/namespaces/{ns}/tasks/batch", json={"items": warm}).status_code == 200

        def send(job: tuple[int, int]) -> httpx.Response:
            b, node = job
            return clients[node].post(f"/v1/namespaces/{ns}/tasks/batch", json={"items": batches[b]})

        with ThreadPoolExecutor(max_workers=9) as pool:
            answers = list(pool.map(send, [(b, n) for b in range(len(batches)) for n in range(3)]))
    finally:
        for c in clients:
            c.close()
    assert [a.status_code for a in answers] == [200] * len(answers), [
        a.text[:300] for a in answers if a.status_code != 200
    ]
    item_statuses = [item["status"] for a in answers for item in a.json()["items"]]
    assert set(item_statuses) <= {200, 201}, item_statuses
    assert item_statuses.count(201) == 60
    with servers[2].engine.connect() as conn:
        assert _tasks(conn, ns) == 60 + len(servers)


def test_a_lagging_node_knows_an_api_key_and_a_queue_created_on_another(
    cluster: GaleraCluster, servers: list[RunningServer]
) -> None:
    """A key or queue just created on node 0, used at once on node 2 that has not applied it yet:
    never 401 or 404 (a relay would park its rows as DEAD on 404); the server waits until its
    node has caught up with the cluster (``wsrep_sync_wait``) and accepts."""
    answers: list[httpx.Response] = []
    with cluster.nodes[2].lagging():
        ns, keys = _namespace(servers[0], ("default", "late"))
        with servers[2].engine.connect() as conn:  # proof that node 2 is behind
            assert (
                conn.execute(
                    sa.text("SELECT COUNT(*) FROM namespaces WHERE name = :n"), {"n": ns}
                ).scalar_one()
                == 0
            )

        def send() -> None:
            with _http(servers[2], keys["submit"]) as http:
                answers.append(_submit(http, ns, "first", {**BODY, "queue": "late"}))

        sender = threading.Thread(target=send)
        sender.start()
        # The request's key lookup waits on node 2, behind; then the block ends.
        wait_until_a_statement_waits(cluster.nodes[2], _database(servers[2]), on="api_keys")
    sender.join(60)
    assert answers and answers[0].status_code == 201, answers[0].text if answers else None


def test_a_lagging_node_finds_a_submission_accepted_on_another(
    cluster: GaleraCluster, servers: list[RunningServer]
) -> None:
    """The reconcile lookup (``GET .../submissions/{key}``) on a node behind the one that accepted
    the key: it finds the task (after waiting for its node to catch up), never 404."""
    ns, keys = _namespace(servers[0])
    cluster.wait_size(3)
    lagging = cluster.nodes[2]
    found: list[httpx.Response] = []
    with lagging.lagging():
        with _http(servers[0], keys["submit"]) as http:
            assert _submit(http, ns, "k-1").status_code == 201

        def lookup() -> None:
            with _http(servers[2], keys["submit"]) as http:
                found.append(http.get(f"/v1/namespaces/{ns}/submissions/k-1"))

        looking = threading.Thread(target=lookup)
        looking.start()
        # The lookup waits on node 2, behind; then the block ends.
        wait_until_a_statement_waits(lagging, _database(servers[2]), on="FROM tasks")
    looking.join(60)
    assert found and found[0].status_code == 200, found[0].text if found else None


def test_a_node_cut_off_from_the_cluster_answers_503_and_fails_readiness(
    cluster: GaleraCluster, servers: list[RunningServer]
) -> None:
    ns, keys = _namespace(servers[0])
    cut = cluster.nodes[2]
    cut.partition()
    cluster.wait_non_primary(cut)
    try:
        with _http(servers[2], keys["submit"]) as http:
            ready = http.get("/readyz")
            accepted = _submit(http, ns, "while-cut")
        assert ready.status_code == 503, ready.text
        assert accepted.status_code == 503, accepted.text
        assert accepted.json()["code"] == "database_unavailable"
        assert int(accepted.headers["retry-after"]) >= 1
        with _http(servers[0], keys["submit"]) as http:  # the primary component goes on
            assert _submit(http, ns, "elsewhere").status_code == 201
    finally:
        cut.heal()
    cluster.wait_size(3)
    with _http(servers[2], keys["submit"]) as http:
        deadline = time.monotonic() + 30
        while (ready := http.get("/readyz")).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)  # the pool replaces connections the cut node refused
        assert ready.status_code == 200
        again = _submit(http, ns, "while-cut")
        assert again.status_code == 201, again.text  # nothing was recorded while it was cut off
        assert _submit(http, ns, "elsewhere").status_code == 200  # replayed from node 0's commit


def test_a_pause_on_one_node_waits_for_a_grant_in_flight_on_another(
    cluster: GaleraCluster, servers: list[RunningServer]
) -> None:
    """On one primary a pause of a limited queue locks its gate row, so it waits for a grant in
    progress: once the pause has answered, no new attempt appears. Galera's row locks are
    node-local, so a grant on node 2 does not hold back a pause on node 0: the grant must meet
    the pause at certification instead (it writes the gate row too), and run again."""
    ns, keys = _namespace(servers[0])
    _limited_queue(servers[0], ns)
    with _http(servers[0], keys["submit"]) as http:
        body = {**BODY, "queue": "limited", "options": {"concurrency_key": "c"}}
        assert _submit(http, ns, "t-1", body).status_code == 201
    cluster.wait_size(3)
    # Hold node 2's lease transaction just before its COMMIT (after its reads and writes).
    hold, held = threading.Event(), threading.Event()
    armed = [True]

    @sa.event.listens_for(servers[2].engine, "before_cursor_execute")
    def _mark(conn: sa.Connection, _c: Any, statement: str, *_a: Any) -> None:
        if statement.lstrip()[:6].upper() in ("INSERT", "UPDATE"):
            conn.info["wrote"] = True

    @sa.event.listens_for(servers[2].engine, "commit")
    def _pause(conn: sa.Connection) -> None:
        if armed[0] and conn.info.pop("wrote", False):
            armed[0] = False
            held.set()
            hold.wait(30)

    grants: list[httpx.Response] = []

    def lease() -> None:
        with _http(servers[2], keys["work"]) as http:
            grants.append(http.post(f"/v1/namespaces/{ns}/queues/limited/leases", json={"worker_id": "w2"}))

    def attempts() -> int:
        with servers[0].engine.connect() as conn:
            return int(conn.execute(sa.text(
                "SELECT COUNT(*) FROM task_attempts a JOIN tasks t ON t.id = a.task_id "
                "JOIN namespaces n ON n.id = t.namespace_id WHERE n.name = :n"), {"n": ns}).scalar_one())  # fmt: skip

    leasing = threading.Thread(target=lease)
    leasing.start()
    assert held.wait(30)
    paused: list[httpx.Response] = []
    with _http(servers[0], keys["admin"]) as admin:
        pausing = threading.Thread(
            target=lambda: paused.append(admin.post(f"/v1/namespaces/{ns}/queues/limited/pause"))
        )
        pausing.start()
        pausing.join(3)  # on one primary it waits for the grant's gate lock; on Galera it answers
        seen_when_paused = attempts() if paused else None
        hold.set()
        leasing.join(60)
        pausing.join(60)
    assert paused and paused[0].status_code == 200, paused
    assert grants and grants[0].status_code == 200, grants
    if seen_when_paused is not None:  # the pause answered first: nothing may be granted after it
        assert grants[0].json() == []
        assert attempts() == seen_when_paused == 0


def test_a_limit_of_one_per_key_holds_with_workers_on_three_nodes(
    cluster: GaleraCluster, servers: list[RunningServer]
) -> None:
    """Leases of a limited queue from three servers on three nodes at once: the gate row's lock
    is node-local, so what keeps two attempts of one key from being live together is that racing
    grants pick the same first task of the key and meet on its row at certification (one runs
    again and sees the permit). Checked from the attempts' lease intervals (database clock)."""
    ns, keys = _namespace(servers[0])
    _limited_queue(servers[0], ns)
    items = [
        {"idempotency_key": f"t-{k}-{i}", **BODY, "queue": "limited", "options": {"concurrency_key": f"c{k}"}}
        for i in range(6) for k in range(3)
    ]  # fmt: skip
    with _http(servers[1], keys["submit"]) as http:
        assert http.post(f"/v1/namespaces/{ns}/tasks/batch", json={"items": items}).status_code == 200
    cluster.wait_size(3)
    done = threading.Event()
    failures: list[str] = []

    def work(node: int) -> None:
        with _http(servers[node], keys["work"]) as http:
            while not done.is_set():
                got = _retrying(
                    http,
                    f"/v1/namespaces/{ns}/queues/limited/leases",
                    {"worker_id": f"w{node}", "max_tasks": 3},
                )
                if got.status_code != 200:
                    failures.append(got.text)
                    continue
                for grant in got.json():
                    attempt, token = grant["attempt"]["id"], grant["attempt"]["lease_token"]
                    path = f"/v1/namespaces/{ns}/attempts/{attempt}"
                    for step, body in (("start", {}), ("complete", {"result": {"ok": True}})):
                        answer = _retrying(http, f"{path}/{step}", {"lease_token": token, **body})
                        if answer.status_code != 200:
                            failures.append(f"{step}: {answer.status_code} {answer.text}")

    workers = [threading.Thread(target=work, args=(n,)) for n in range(3)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            with servers[0].engine.connect() as conn:
                succeeded = conn.execute(
                    sa.text("SELECT COUNT(*) FROM tasks t JOIN namespaces n ON n.id = t.namespace_id "
                            "WHERE n.name = :n AND t.status = 'SUCCEEDED'"), {"n": ns}
                ).scalar_one()  # fmt: skip
            if succeeded == len(items):
                break
            time.sleep(0.1)
    finally:
        done.set()
        for w in workers:
            w.join(30)
    assert failures == []
    assert succeeded == len(items)
    with servers[2].engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT t.concurrency_key, a.leased_at, a.finished_at FROM task_attempts a "
                    "JOIN tasks t ON t.id = a.task_id JOIN namespaces n ON n.id = t.namespace_id WHERE n.name = :n"),
            {"n": ns},
        ).all()  # fmt: skip
    spans: dict[str, list[tuple[Any, Any]]] = {}
    for key, start, end in rows:
        spans.setdefault(key, []).append((start, end))
    for key, intervals in spans.items():
        intervals.sort()
        for (_, earlier_end), (later_start, _) in itertools.pairwise(intervals):
            assert later_start >= earlier_end, f"two live attempts of {key}: {intervals}"


def test_one_ordering_key_enqueued_on_three_nodes_at_once_is_numbered_in_commit_order(
    cluster: GaleraCluster, cluster_database: ClusterDatabase
) -> None:
    """Rows of one ordering key written on three nodes at once: ids interleave across nodes (each
    node hands out its own auto-increment offset) and say nothing about commit order; the key's
    row (``last_seq + 1``) is written by every enqueue, so two racing enqueues on two nodes meet
    at certification, the loser's transaction fails at COMMIT (1213) and its retry takes the next
    number: ``ordering_seq`` is 1..N, no gaps, no repeats."""
    from outbox_adapter import Outbox, OutboxDatabaseError, OutboxTables, enqueue

    urls = cluster_database()
    Outbox(sa.create_engine(urls[0]), tables=OutboxTables()).migrate()
    engines = [sa.create_engine(url, isolation_level="READ COMMITTED") for url in urls]
    conflicts = [0]
    per_node = 15

    def write(node: int) -> None:
        for i in range(per_node):
            while True:
                try:
                    with engines[node].begin() as conn:
                        enqueue(conn, namespace="shop", queue="default", handler="h", params={"n": node, "i": i},
                                idempotency_key=f"k-{node}-{i}", ordering_key="customer-1")  # fmt: skip
                    break
                except (sa.exc.OperationalError, OutboxDatabaseError) as exc:
                    # at COMMIT (certification), or at the upsert (a brute-force abort by an applier)
                    cause = exc if isinstance(exc, sa.exc.OperationalError) else exc.__cause__
                    assert isinstance(cause, sa.exc.OperationalError) and cause.orig.args[0] == 1213, exc
                    conflicts[0] += 1

    threads = [threading.Thread(target=write, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    cluster.wait_size(3)
    with engines[1].connect() as conn:
        rows = conn.execute(sa.text("SELECT id, ordering_seq, idempotency_key FROM orbit_outbox")).all()
    for engine in engines:
        engine.dispose()
    seqs = sorted(r.ordering_seq for r in rows)
    assert seqs == list(range(1, 3 * per_node + 1))
    # Each writer's own rows are numbered in the order it committed them.
    for node in range(3):
        mine = sorted(
            (r for r in rows if r.idempotency_key.startswith(f"k-{node}-")), key=lambda r: r.ordering_seq
        )
        assert [r.idempotency_key for r in mine] == [f"k-{node}-{i}" for i in range(per_node)]
    by_id = [r.ordering_seq for r in sorted(rows, key=lambda r: r.id)]
    print(f"conflicts retried: {conflicts[0]}; ids out of commit order: {by_id != sorted(by_id)}")
