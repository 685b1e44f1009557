"""How many database commands each worker call costs the server on MariaDB and PostgreSQL (a regression is a
failure).

Counted on the server's own engine (every statement it sends, and each ``COMMIT``; not the ``BEGIN`` psycopg
sends before a PostgreSQL transaction's first statement), after a first call
has warmed the API-key cache. The figures are the floor of the current design, not a target: a change
that adds a statement to the hot path must change this test and say why. A one-item batch costs what
the single call costs (it takes the single call's path), and an empty lease writes nothing and does not
run the expiry sweep's statements when no lease of its queue has lapsed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from tests.conftest import DatabaseFactory
from tests.integration.test_execution_api import Api
from tests.servers import run_server

#: Commands (statements and COMMITs) per call on the default path, by database.
EXPECTED = {
    "mariadb": {
        "start": 4,  # lock and read task + attempt + clock; task and attempt (one UPDATE); task event; COMMIT
        "heartbeat": 3,  # lock and read; attempt; COMMIT
        # lock, read and write the result event in one INSERT ... SELECT ... FOR UPDATE RETURNING (the event only
        # on the plain path; its RETURNING takes the event's shared locks on namespace and queue and reads the
        # subscriptions); task and attempt (one UPDATE); task event; COMMIT. (MySQL 8, without INSERT ...
        # RETURNING: 5, the lock and read apart from the result event.)
        "complete": 4,
        # queue + gate + clock + "sweep due", and the claim, in one statement (a UNION); COMMIT
        "empty lease": 2,
        "lease, one grant": 5,  # that statement; the claim (UPDATE); the task event; the attempt; COMMIT
    },
    "postgres": {
        # lock and read; the attempt, the task and the task's event in one statement (data-modifying WITHs); COMMIT
        "start": 3,
        "heartbeat": 3,
        # lock and read (with the namespace's and queue's shared locks); the attempt, the task, the task event,
        # the result event and its deliveries in one statement (data-modifying WITHs; it begins after the locks
        # were granted, so it sees every subscription committed before them); COMMIT
        "complete": 3,
        # A plain queue's lease is autocommitted (no transaction: psycopg sends no BEGIN, and nothing is
        # committed by a COMMIT; each statement is its own transaction). Empty: one SELECT reads the queue,
        # its gate, the clock, whether a sweep is due and how many tasks are due (none); it writes nothing.
        # It was 3 here (the queue's SELECT, the claim's SELECT, COMMIT) plus the BEGIN psycopg sends
        # before a transaction's first statement, which this count does not see.
        "empty lease": 1,
        # that SELECT (one task due); the grant in one statement: the picked task's conditional UPDATE ...
        # RETURNING, its attempt and its event inserted from what it returned (data-modifying WITHs). It was
        # 6 (+ BEGIN): the two SELECTs, the UPDATE, the event, the attempt, COMMIT.
        "lease, one grant": 2,
    },
}


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("mariadb", marks=pytest.mark.mariadb),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
def api(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[Api]:
    quiet = {f"{loop}_interval_seconds": 0 for loop in ("sweep", "scheduler", "flow", "metrics_sample")}
    # The key stays cached for the whole module: a slow run (CI under load) outlasted the default 5 s between
    # the warming lease and the last call counted, which then counted the key's verification too.
    quiet["api_key_cache_seconds"] = 3600
    with (
        run_server(make_database(request.param), **quiet) as server,
        Api.in_new_namespace(server) as helper,
    ):  # no background loop shares the engine
        yield helper


def _commands(api: Api, call: Callable[[], httpx.Response]) -> tuple[list[str], httpx.Response]:
    seen: list[str] = []

    def statement(_conn: Any, _cursor: Any, text: str, *_args: Any) -> None:
        seen.append(" ".join(text.split())[:100])

    def commit(_conn: Any) -> None:
        seen.append("COMMIT")

    engine = api.server.engine
    sa.event.listen(engine, "before_cursor_execute", statement)
    sa.event.listen(engine, "commit", commit)
    try:
        response = call()
    finally:
        sa.event.remove(engine, "before_cursor_execute", statement)
        sa.event.remove(engine, "commit", commit)
    assert response.status_code == 200, response.text
    return seen, response


def _attempt(grant: dict[str, Any], **body: Any) -> dict[str, Any]:
    return {"attempt_id": grant["attempt"]["id"], "lease_token": grant["attempt"]["lease_token"], **body}


@pytest.mark.parametrize("batched", [False, True], ids=["single", "one-item batch"])
def test_each_worker_call_costs_its_statements_and_no_more(api: Api, batched: bool) -> None:
    queue = api.queue()
    api.submit(queue)
    api.lease(queue, 5)  # warms the key cache and the worker's liveness sighting
    api.submit(queue)
    grant = api.lease_one(queue)

    def report(action: str, **body: Any) -> Callable[[], httpx.Response]:
        if batched and action != "heartbeat":
            path, json = f"/v1/namespaces/{api.ns}/attempts/{action}", {"items": [_attempt(grant, **body)]}
        else:
            path = f"/v1/namespaces/{api.ns}/attempts/{grant['attempt']['id']}/{action}"
            json = {"lease_token": grant["attempt"]["lease_token"], **body}
        return lambda: api.http["work"].post(path, json=json)

    counted = {
        "start": _commands(api, report("start"))[0],
        "heartbeat": _commands(api, report("heartbeat"))[0],
        "complete": _commands(api, report("complete", result={"ok": True}))[0],
        "empty lease": _commands(api, lambda: api.lease_response(queue, 5))[0],
    }
    api.submit(queue)
    counted["lease, one grant"], granted = _commands(api, lambda: api.lease_response(queue, 5))
    assert len(granted.json()) == 1
    for call, commands in counted.items():
        expected = EXPECTED["postgres" if api.server.engine.dialect.name == "postgresql" else "mariadb"][call]
        assert len(commands) == expected, f"{call}: {len(commands)} commands\n" + "\n".join(commands)
    assert not [c for c in counted["empty lease"] if c.startswith(("UPDATE", "INSERT", "DELETE"))]


#: Commands per set-based batch (two items or more: ``orbit_server.api.attempt_batches._SET_BASED_FROM``), the
#: same for any size, by database, when its items do not name their tasks (``task_id``: one read fewer when they
#: do, as a worker's do).
EXPECTED_SET_BASED = {
    "mariadb": {
        # the tasks' ids; the tasks and their current attempts locked and read in one statement; the attempts;
        # the tasks; the task events; COMMIT
        "start": 6,
        # those, and for the result events: the events; the namespace's and queues' shared locks with the
        # locking read of the subscriptions (one statement); COMMIT
        "complete": 8,
    },
    "postgres": {
        "start": 6,
        # the result events' shared locks and the subscriptions' read apart: a statement sees only the rows
        # committed before it began
        "complete": 9,
    },
}


@pytest.mark.parametrize("named", [False, True], ids=["ids read", "tasks named"])
@pytest.mark.parametrize("size", [2, 8])
def test_a_set_based_batch_costs_its_statements_whatever_its_size(api: Api, size: int, named: bool) -> None:
    queue = api.queue()
    api.submit(queue)
    api.lease(queue, 5)  # warms the key cache and the worker's liveness sighting
    for n in range(size):
        api.submit(queue, params={"n": n})
    grants = api.lease(queue, size)
    assert len(grants) == size

    def batch(action: str, **body: Any) -> Callable[[], httpx.Response]:
        tasks = [{"task_id": grant["task"]["id"]} if named else {} for grant in grants]
        json = {"items": [_attempt(grant, **body, **task) for grant, task in zip(grants, tasks, strict=True)]}
        return lambda: api.http["work"].post(f"/v1/namespaces/{api.ns}/attempts/{action}", json=json)

    counted = {
        "start": _commands(api, batch("start"))[0],
        "complete": _commands(api, batch("complete", result={"ok": True}))[0],
    }
    expected = EXPECTED_SET_BASED["postgres" if api.server.engine.dialect.name == "postgresql" else "mariadb"]
    for call, commands in counted.items():
        want = expected[call] - named  # no read of the tasks' ids
        assert len(commands) == want, f"{call}: {len(commands)} commands\n" + "\n".join(commands)
