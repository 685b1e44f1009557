"""Many concurrent instances of a fork-4/join flow on MariaDB or PostgreSQL with two ``orbit-server serve`` processes, one
of them SIGKILLed and restarted under load (issue 13): every instance completes, each join passes exactly
once, each timer (claimed by either process) fires once, no token is lost or duplicated and no activation
gets a second task.

``ORBIT_TEST_FLOW_INSTANCES`` sets the count: 150 by default (to keep ``make test`` short), 1000 for the
issue's full run (``ORBIT_TEST_FLOW_INSTANCES=1000``).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from orbit_server.db.engine import create_engine
from orbit_server.db.schema import flow_events, flow_history, flow_instances, flow_tokens, tasks
from tests.conftest import DatabaseFactory
from tests.server_processes import ServerProcess, prepare

QUEUE = "steps"
BRANCHES = ["b0", "b1", "b2", "b3"]
GRAPH = {"start": "fork", "nodes": {
    "fork": {"type": "parallel", "branches": BRANCHES, "join": "j"},
    **{b: {"type": "task", "queue": QUEUE, "handler": b, "retry_safe": True, "max_attempts": 10,
           "params": {"n": "$.input.n"}, "next": "j"} for b in BRANCHES},
    "j": {"type": "join", "next": "settle"},
    "settle": {"type": "timer", "seconds": 0.05, "next": "e"},
    "e": {"type": "end"}}}  # fmt: skip


class Worker:
    """Leases, starts and completes step tasks in batches through whichever server answers."""

    def __init__(self, servers: list[ServerProcess], keys: dict[str, str]) -> None:
        self.servers = servers
        self.headers = {"Authorization": f"Bearer {keys['work']}"}
        self.client = httpx.Client(timeout=30, headers=self.headers)
        self.turn = itertools.count()

    def _post(self, path: str, body: Any) -> httpx.Response | None:
        for _ in range(len(self.servers) * 2):
            server = self.servers[next(self.turn) % len(self.servers)]
            try:
                return self.client.post(f"{server.base_url}/v1/namespaces/load{path}", json=body)
            except httpx.TransportError:
                continue  # that server is down: the other takes the call (any server may)
        return None

    def round(self) -> int:
        r = self._post(f"/queues/{QUEUE}/leases",
                       {"worker_id": "load", "max_tasks": 100, "lease_seconds": 3, "wait_seconds": 0.2})  # fmt: skip
        if r is None or r.status_code != 200 or not r.json():
            return 0
        grants = r.json()
        items = [
            {"attempt_id": g["attempt"]["id"], "lease_token": g["attempt"]["lease_token"]} for g in grants
        ]
        if self._post("/attempts/start", {"items": items}) is None:
            return 0
        done = [
            {**item, "result": {"branch": g["task"]["handler"]}}
            for item, g in zip(items, grants, strict=True)
        ]
        self._post("/attempts/complete", {"items": done})
        return len(grants)


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("mariadb", marks=pytest.mark.mariadb),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
def test_concurrent_fork_join_instances_on_two_server_processes(
    make_database: DatabaseFactory, tmp_path: Path, server_processes: Callable[..., ServerProcess], kind: str
) -> None:
    count = int(os.environ.get("ORBIT_TEST_FLOW_INSTANCES", "150"))
    url = make_database(kind)
    keys = prepare(url, "load", (QUEUE,))
    env = {
        "ORBIT_FLOW_INTERVAL_SECONDS": "0.1",
        "ORBIT_SWEEP_INTERVAL_SECONDS": "0.5",
        "ORBIT_DB_POOL_SIZE": "30",
    }
    servers = [server_processes(url, tmp_path / f"server-{n}.log", **env) for n in range(2)]
    engine = create_engine(url, pool_size=2)
    try:
        submit = {"Authorization": f"Bearer {keys['submit']}"}
        r = httpx.post(f"{servers[0].base_url}/v1/namespaces/load/flows/fan/versions", json={"graph": GRAPH},
                       headers=submit)  # fmt: skip
        assert r.status_code == 201, r.text
        began = time.monotonic()

        def start(n: int) -> str:
            with httpx.Client(timeout=30, headers=submit) as client:
                r = client.post(f"{servers[n % 2].base_url}/v1/namespaces/load/flows/fan/instances",
                                json={"input": {"n": n}}, headers={"Idempotency-Key": f"start-{n}"})  # fmt: skip
                assert r.status_code == 201, r.text
                return str(r.json()["id"])

        with ThreadPoolExecutor(8) as pool:
            instance_ids = list(pool.map(start, range(count)))
        started = time.monotonic() - began

        def completed() -> int:
            with engine.connect() as conn:
                return int(conn.execute(sa.select(sa.func.count()).select_from(flow_instances)
                                        .where(flow_instances.c.status == "COMPLETED")).scalar_one())  # fmt: skip

        stop = threading.Event()
        handled = [0]
        lock = threading.Lock()

        def work() -> None:
            worker = Worker(servers, keys)
            try:
                while not stop.is_set():
                    n = worker.round()
                    with lock:
                        handled[0] += n
            finally:
                worker.client.close()

        workers = [threading.Thread(target=work) for _ in range(4)]
        for thread in workers:
            thread.start()
        try:
            crashed = False
            # A correctness test, not a speed one: 40 s on a quiet 2-core machine, 150 s beside other tests.
            deadline = time.monotonic() + 120 + count * 1.0
            while completed() < count:
                if not crashed and handled[0] >= count * 4 // 3:  # at random under load: SIGKILL one server
                    servers[0].kill()
                    servers[0] = server_processes(url, tmp_path / "server-0-restarted.log", **env)
                    crashed = True
                assert time.monotonic() < deadline, f"{completed()} of {count} instances completed"
                time.sleep(0.2)
        finally:
            stop.set()
            for thread in workers:
                thread.join(timeout=30)
        elapsed = time.monotonic() - began
        print(f"\n{count} fork-4/join instances on two server processes: started in {started:.1f} s, "
              f"completed in {elapsed:.1f} s ({count / elapsed:.0f} instances/s, {count * 4 / elapsed:.0f} steps/s)")  # fmt: skip
        assert crashed
        with engine.connect() as conn:
            ids = set(instance_ids)
            per_activation = Counter(conn.execute(sa.select(tasks.c.flow_token_id, tasks.c.flow_activation)
                                                  .where(tasks.c.flow_instance_id.is_not(None))).all())  # fmt: skip
            assert len(per_activation) == 4 * count and set(per_activation.values()) == {1}
            tokens = Counter(conn.execute(sa.select(flow_tokens.c.instance_id, flow_tokens.c.state)).all())
            assert all(tokens[(i, "DONE")] == 1 and tokens[(i, "ARRIVED")] == 4 for i in ids)
            assert sum(tokens.values()) == 5 * count
            fired = Counter(conn.execute(sa.select(flow_history.c.instance_id).where(flow_history.c.event == "timer_fired")).scalars())  # fmt: skip
            assert fired == dict.fromkeys(ids, 1)
            joined = Counter(conn.execute(sa.select(flow_history.c.instance_id).where(flow_history.c.event == "joined")).scalars())  # fmt: skip
            assert joined == dict.fromkeys(ids, 1)
            assert conn.execute(sa.select(sa.func.count()).select_from(flow_events)
                                .where(flow_events.c.consumed_at.is_(None))).scalar_one() == 0  # fmt: skip
    finally:
        engine.dispose()
        outputs = [server.stop() for server in servers if server.proc.poll() is None]
    for output in outputs:
        assert "Traceback" not in output, output[-5000:]
