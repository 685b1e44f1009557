"""SIGKILL of a real ``orbit-server serve`` process at every named point of a flow advance (between the
statements of its transaction, and just after its commit: ``ORBIT_SERVER_FAULT=flow-pause@POINT@FILE``,
:data:`orbit_server.db.faults.FLOW_POINTS`), then recovery by a restarted process: no token lost or
duplicated, no second task for one activation, the join passes exactly once (issue 13).

One chain of processes per backend: process k recovers the crash of process k-1, then is itself
paused at point k and killed. MariaDB (the authoritative store) goes through every point; SQLite, by
default, through three of them and the crash of a start (a process start costs seconds on a loaded
machine): ``ORBIT_TEST_FLOW_CRASH_POINTS=all`` runs every point on both.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from orbit_server.db.engine import create_engine
from orbit_server.db.faults import FLOW_POINTS
from orbit_server.db.schema import flow_events, flow_history, flow_instances, flow_tokens, tasks
from tests.conftest import DatabaseFactory
from tests.flow_support import FlowApi, ok, until
from tests.server_processes import ServerProcess, prepare

QUEUE = "steps"
GRAPH = {"start": "a", "nodes": {
    "a": {"type": "task", "queue": QUEUE, "handler": "a", "next": "fork"},
    "fork": {"type": "parallel", "branches": ["b", "c"], "join": "j"},
    "b": {"type": "task", "queue": QUEUE, "handler": "b", "next": "j"},
    "c": {"type": "timer", "seconds": 0.05, "next": "j"},
    "j": {"type": "join", "next": "d"},
    "d": {"type": "task", "queue": QUEUE, "handler": "d", "next": "e"},
    "e": {"type": "end"}}}  # fmt: skip


def check_instance(url: URL, instance_id: str) -> None:
    """The invariants, read from the database."""
    engine = create_engine(url, pool_size=1)
    try:
        with engine.connect() as conn:
            status = conn.execute(
                sa.select(flow_instances.c.status).where(flow_instances.c.id == instance_id)
            ).scalar_one()
            assert status == "COMPLETED"
            per_activation = Counter(conn.execute(sa.select(tasks.c.flow_token_id, tasks.c.flow_activation).where(
                tasks.c.flow_instance_id == instance_id)).all())  # fmt: skip
            assert len(per_activation) == 3 and set(per_activation.values()) == {1}, per_activation
            tokens = Counter(conn.execute(sa.select(flow_tokens.c.state).where(flow_tokens.c.instance_id == instance_id)).scalars())  # fmt: skip
            assert tokens == {"DONE": 1, "ARRIVED": 2}, tokens  # none lost, none duplicated
            events = Counter(conn.execute(sa.select(flow_history.c.event).where(flow_history.c.instance_id == instance_id)).scalars())  # fmt: skip
            assert events["joined"] == 1 and events["timer_fired"] == 1 and events["forked"] == 2, events
            assert events["instance_completed"] == 1
            pending = conn.execute(sa.select(sa.func.count()).select_from(flow_events).where(
                flow_events.c.instance_id == instance_id, flow_events.c.consumed_at.is_(None))).scalar_one()  # fmt: skip
            assert pending == 0
    finally:
        engine.dispose()


def _finish(api: FlowApi, instance_id: str) -> None:
    def done() -> bool:
        api.work(QUEUE, ok(), wait=0.1)
        return bool(api.instance(instance_id)["status"] == "COMPLETED")

    until(done, timeout=30, what=f"instance {instance_id} to complete after the restart")


def _start(api: FlowApi, key: str, answer: list[Any]) -> None:
    try:
        answer.append(api.post("submit", "/flows/chain/instances", {"input": {}}, **{"Idempotency-Key": key}))
    except httpx.TransportError as exc:
        answer.append(exc)


@pytest.mark.parametrize(
    "backend",
    [
        "sqlite",
        pytest.param("mariadb", marks=pytest.mark.mariadb),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
def test_sigkill_at_every_point_of_an_advance_then_recovery(
    backend: str,
    make_database: DatabaseFactory,
    tmp_path: Path,
    server_processes: Callable[..., ServerProcess],
) -> None:
    url = make_database(backend)
    keys = prepare(url, "crash", (QUEUE,))
    env = {"ORBIT_FLOW_INTERVAL_SECONDS": "0.05", "ORBIT_SWEEP_INTERVAL_SECONDS": "0"}
    crashed: list[str] = []  # instances whose advance a killed process left half done
    every = backend in ("mariadb", "postgres") or os.environ.get("ORBIT_TEST_FLOW_CRASH_POINTS") == "all"
    points = list(FLOW_POINTS) if every else ["claimed", "step-inserted", "after-commit"]
    for k in range(len(points) + 2):
        point = points[k] if k < len(points) else "task-inserted"  # the last: a crash in an HTTP start
        gate = tmp_path / f"arm-{k}"
        server = server_processes(
            url, tmp_path / f"server-{k}.log", ORBIT_SERVER_FAULT=f"flow-pause@{point}@{gate}", **env
        )
        api = FlowApi(server.base_url, "crash", keys)
        try:
            if k == 0:
                api.publish("chain", GRAPH)
            for instance_id in crashed:  # recovery by this process
                _finish(api, instance_id)
                check_instance(url, instance_id)
            crashed = []
            if k == len(points) + 1:
                break
            if k < len(points):
                instance_id = api.start("chain")["id"]
                gate.touch()  # armed: the next advance reaching the point pauses there
                until(lambda: api.work(QUEUE, ok(), wait=0.1), what="task a")  # noqa: B023
                server.wait_for(f"paused-at {point}")
                crashed.append(instance_id)
            else:  # the start itself pauses after inserting its first task, then dies
                key = str(uuid.uuid4())
                gate.touch()
                answer: list[Any] = []
                thread = threading.Thread(target=_start, args=(api, key, answer))
                thread.start()
                server.wait_for(f"paused-at {point}")
            server.kill()
            if k == len(points):
                thread.join(timeout=30)
                assert answer and isinstance(answer[0], httpx.TransportError), (
                    answer
                )  # the client never heard back
                restarted = server_processes(url, tmp_path / "server-retry.log", **env)
                retry = FlowApi(restarted.base_url, "crash", keys)
                try:
                    first = retry.start("chain", key=key)  # nothing was committed: a new instance...
                    assert retry.start("chain", key=key, expect=200)["id"] == first["id"]  # ...exactly one
                    _finish(retry, first["id"])
                    check_instance(url, first["id"])
                finally:
                    retry.close()
                    restarted.stop()
        finally:
            api.close()
            if server.proc.poll() is None:
                server.stop()
