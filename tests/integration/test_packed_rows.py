"""Rows read packed on MariaDB (``JSON_ARRAY``, orbit_server/db/packed_rows.py) give what the columns give, value
and Python type, at the edges of what a user can store: floats at their limits, integers past 64 bits, control and
astral characters, deep nesting, datetimes at the ends of their range, FLOAT columns, priorities at their bounds;
through the lease's read, the lean attempt read, complete's read-as-it-records and the HTTP API. And a task row
longer than ``max_allowed_packet`` packed (MariaDB gives ``NULL``) is still leased, read as columns."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa

from orbit_server.db import packed_rows
from orbit_server.db.schema import task_attempts, tasks
from orbit_server.tasks import attempt_locks, leases
from tests.conftest import DatabaseFactory
from tests.integration.test_execution_api import Api
from tests.servers import RunningServer, run_server


@pytest.fixture(scope="module")
def quiet_server(make_database: DatabaseFactory) -> Iterator[RunningServer]:
    with run_server(make_database("mariadb"), sweep_interval_seconds=0) as running:
        yield running


@pytest.fixture(scope="module")
def api(quiet_server: RunningServer) -> Iterator[Api]:
    with Api.in_new_namespace(quiet_server) as helper:
        yield helper


def typed(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (v, type(v)) for k, v in row.items()}


TASK_EDGES: list[dict[str, Any]] = [
    {"params": {"a": 1e308, "b": 5e-324, "c": -0.0, "d": 2**64 + 1, "e": -(2**70), "f": 1.0, "g": 0.1}},
    {"params": "\u0000\u0001\u001f\u007f\x80\u2028\u2029\ud7ff\ue000\uffff😀𝄞\\/\"'"},
    {"params": [[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]},
    {"cancel_reason": 'a\u0000b\\c"d\ne\tf😀\u2028', "tracestate": "k=v,x=\\y"},
    {
        "available_at": datetime(9999, 12, 31, 23, 59, 59, 999999),
        "deadline": datetime(1000, 1, 1, 0, 0, 0, 0),
    },
    {"available_at": datetime(1970, 1, 1), "deadline": datetime(2026, 1, 1, 0, 0, 0, 1)},
    {"backoff_base_seconds": 0.1, "backoff_cap_seconds": 3.4e38, "priority": -100},
    {"backoff_base_seconds": 1e-45, "backoff_cap_seconds": -0.0, "priority": 100},
    {"backoff_base_seconds": 123456789.0, "backoff_cap_seconds": 1e-3, "priority": -32768},
    {
        "concurrency_key": "k" * 255,
        "handler": 'h😀\u0000\\"\n',
        "result": 1e300,
        "error": {"x": "\ud83d\ude00"},
    },
    {"result": "€", "error": [1.5e-7, 1e21, 1e16, 123456789012345678]},
    {"params": 0, "result": False, "error": None},
    {"params": {"k": "v" * 100000}},
]


@pytest.mark.mariadb
@pytest.mark.parametrize("edges", TASK_EDGES, ids=range(len(TASK_EDGES)))
def test_lease_packed_row_equals_full_read(api: Api, edges: dict[str, Any]) -> None:
    queue = api.queue()
    task_id = api.submit(queue)["id"]
    engine = api.server.engine
    with engine.begin() as conn:
        conn.execute(tasks.update().where(tasks.c.id == task_id).values(**edges))
        ns_id = conn.scalar(sa.select(tasks.c.namespace_id).where(tasks.c.id == task_id))
    with engine.connect() as conn:
        full = dict(conn.execute(sa.select(tasks).where(tasks.c.id == task_id)).mappings().one())
        statement = sa.select(sa.func.json_array(*tasks.c, type_=sa.String)).where(tasks.c.id == task_id)
        packed = leases.unpacked(conn.execute(statement).scalar_one(), leases._TASK_ROW)
    assert typed(packed) == typed(full)
    # and through the lease statement itself, when due
    with engine.begin() as conn:
        conn.execute(
            tasks.update()
            .where(tasks.c.id == task_id)
            .values(available_at=datetime(2000, 1, 1), deadline=None)
        )
        full = dict(conn.execute(sa.select(tasks).where(tasks.c.id == task_id)).mappings().one())
        found, due = leases._find_queue_and_claim(conn, ns_id, queue, 5)
        conn.rollback()
    assert due is not None and len(due) == 1, (found, due)
    assert typed(dict(due[0])) == typed(full)


ATTEMPT_EDGES: list[dict[str, Any]] = [
    {"lease_seconds": 0.1, "worker_id": 'w😀\u0000\\"\n\u2028\x7f', "started_at": datetime(2026, 1, 1)},
    {
        "lease_seconds": 12.345,
        "lease_expires_at": datetime(9999, 12, 31, 23, 59, 59, 999999),
        "leased_at": datetime(2026, 1, 1, 0, 0, 0, 999999),
        "result": {"a": [1e308, -0.0, 2**65]},
    },
    {"lease_seconds": 33.3, "started_at": datetime(1000, 1, 1, 0, 0, 0, 1), "error": "\u0000"},
    {"lease_seconds": 1e-3, "worker_id": "x" * 255},
    {"lease_seconds": 86400.123456},
    {"lease_seconds": 3.0000001},
]


@pytest.mark.mariadb
@pytest.mark.parametrize("edges", ATTEMPT_EDGES, ids=range(len(ATTEMPT_EDGES)))
def test_lean_locked_attempt_equals_full(api: Api, edges: dict[str, Any]) -> None:
    queue = api.queue()
    api.submit(queue)
    (grant,) = api.lease(queue, 1)
    engine = api.server.engine
    with engine.begin() as conn:
        conn.execute(
            task_attempts.update().where(task_attempts.c.id == grant["attempt"]["id"]).values(**edges)
        )
    with engine.connect() as conn, conn.begin():
        ns_id = conn.scalar(sa.select(tasks.c.namespace_id).where(tasks.c.id == grant["task"]["id"]))
        for ending in (False, True):
            full = attempt_locks._locked_attempt(conn, ns_id, grant["attempt"]["id"], ending=ending)
            lean = attempt_locks._locked_attempt(
                conn, ns_id, grant["attempt"]["id"], ending=ending, lean=True
            )
            for whole, part in zip(full[:2], lean[:2], strict=True):
                assert typed(part) == {k: (whole[k], type(whole[k])) for k in part}
        conn.rollback()


def _nest(depth: int) -> Any:
    doc: Any = 1
    for _ in range(depth):
        doc = [doc]
    return doc


HTTP_PARAMS: list[Any] = [
    _nest(29),
    _nest(30),
    {"a": _nest(28)},
    int("9" * 4299),
    -int("9" * 4299),
    {"f": [1.7976931348623157e308, 5e-324, 2.2250738585072014e-308, 0.1 + 0.2, -0.0, 1e16, 1e-7, 123.0]},
    '\u0000\u0001\u001f\\"/\u2028😀𝄞\ufeff',
    "",
    [],
    {},
    None,
    True,
    0,
    -1,
    2**63,
    2**64,
    {"\u0000k😀": {"": [None, False, "x"]}},
]


@pytest.mark.mariadb
@pytest.mark.parametrize("params", HTTP_PARAMS, ids=range(len(HTTP_PARAMS)))
def test_http_grant_equals_get(api: Api, params: Any) -> None:
    queue = api.queue()
    body = {"queue": queue, "handler": "h", "params": params, "options": {}}
    r = api.http["submit"].post(
        f"/v1/namespaces/{api.ns}/tasks", json=body, headers={"Idempotency-Key": str(uuid.uuid4())}
    )
    if r.status_code != 201:
        pytest.skip(f"refused: {r.status_code} {r.text[:200]}")
    task_id = r.json()["id"]
    (grant,) = api.lease(queue, 1, lease_seconds=12.345)
    read = api.task(task_id)
    assert grant["task"] == read
    assert repr(grant["task"]) == repr(read)


RECORD_EDGES: list[dict[str, Any]] = [
    {
        "worker_id": 'w😀\u0000\\"\n\u2028\x7f',
        "leased_at": datetime(2026, 1, 1),
        "started_at": datetime(2026, 1, 1, 0, 0, 0, 999999),
    },
    {
        "worker_id": "x" * 255,
        "lease_expires_at": datetime(9999, 12, 31, 23, 59, 59, 999999),
        "leased_at": datetime(1000, 1, 1, 0, 0, 0, 1),
        "started_at": datetime(1970, 1, 1),
        "generation": 2**31 - 1,
    },
]


@pytest.mark.mariadb
@pytest.mark.parametrize("edges", RECORD_EDGES, ids=range(len(RECORD_EDGES)))
def test_lock_and_record_equals_full(api: Api, edges: dict[str, Any]) -> None:
    from orbit_client import TaskStatus
    from tests.integration.test_attempt_batches import item, ok_batch

    queue = api.queue()
    api.submit(queue)
    (grant,) = api.lease(queue, 1)
    ok_batch(api, "start", [item(grant)])
    engine = api.server.engine
    with engine.begin() as conn:
        conn.execute(
            task_attempts.update().where(task_attempts.c.id == grant["attempt"]["id"]).values(**edges)
        )
        conn.execute(
            tasks.update()
            .where(tasks.c.id == grant["task"]["id"])
            .values(cancel_requested=True, flow_activation=-5)
        )
    with engine.connect() as conn, conn.begin():
        ns_id = conn.scalar(sa.select(tasks.c.namespace_id).where(tasks.c.id == grant["task"]["id"]))
        full = attempt_locks._locked_attempt(conn, ns_id, grant["attempt"]["id"], ending=True)
        recorded = attempt_locks._lock_and_record(
            conn,
            ns_id,
            grant["attempt"]["id"],
            grant["attempt"]["lease_token"],
            to=TaskStatus.SUCCEEDED,
            values={"result": {"ok": True}},
        )
        assert recorded is not None
        for whole, part in zip(full[:2], recorded[:2], strict=True):
            assert typed(part) == {k: (whole[k], type(whole[k])) for k in part}
        conn.rollback()


@pytest.fixture(scope="module")
def big_body_api(make_database: DatabaseFactory) -> Iterator[Api]:
    """A server whose ORBIT_MAX_BODY_BYTES is raised to 17 MiB (the docs allow raising it)."""
    with (
        run_server(
            make_database("mariadb"), sweep_interval_seconds=0, max_body_bytes=17 * 1024 * 1024
        ) as running,
        Api.in_new_namespace(running) as helper,
    ):
        yield helper


@pytest.mark.mariadb
def test_lease_of_a_row_larger_than_max_allowed_packet_when_packed(big_body_api: Api) -> None:
    """Regression (found in review): a WAITING task (a retry scheduled) whose params are just under MariaDB's
    ``max_allowed_packet`` (16 MiB, the default; the body limit raised to allow it) and whose kept error pushes
    ``JSON_ARRAY(<every column>)`` over it. MariaDB then gives ``NULL`` (warning 1301) and the lease failed with a
    500 on every call, blocking the queue; now the lease reads that row as columns and grants it."""
    api = big_body_api
    queue = api.queue()
    params = {"k": "v" * (16 * 1024 * 1024 - 100 * 1024)}
    task_id = api.submit(queue, params=params, max_attempts=3)["id"]
    (grant,) = api.lease(queue, 1)
    error = {"type": "E", "message": "\u00e9" * 10_000, "retryable": True, "traceback": "\u0001" * 16 * 1024}
    r = api.http["work"].post(
        f"/v1/namespaces/{api.ns}/attempts/{grant['attempt']['id']}/fail",
        json={"lease_token": grant["attempt"]["lease_token"], "error": error},
    )
    assert r.status_code == 200, r.text[:500]
    with api.server.engine.begin() as conn:  # due now rather than after the backoff
        conn.execute(tasks.update().where(tasks.c.id == task_id).values(available_at=datetime(2000, 1, 1)))
    read = api.task(task_id)
    assert read["status"] == "WAITING" and read["params"] == params
    response = api.lease_response(queue, 1, 30, 0)
    assert response.status_code == 200, response.text[:500]
    (again,) = response.json()
    assert again["task"]["id"] == task_id and again["task"]["params"] == params


@pytest.mark.mariadb
def test_mysql_reads_the_rows_as_columns(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """MySQL (not MariaDB: its JSON_ARRAY writes a FLOAT as a double) takes the statements with plain columns:
    the same answers. Run on MariaDB with the dialect told it is MySQL."""
    queue = api.queue()
    task_id = api.submit(queue, params={"f": 1.0}, backoff_base_seconds=0.1)["id"]
    engine = api.server.engine
    monkeypatch.setattr(engine.dialect, "is_mariadb", False)
    assert not packed_rows.packs(engine.dialect)
    with engine.begin() as conn:
        ns_id = conn.scalar(sa.select(tasks.c.namespace_id).where(tasks.c.id == task_id))
        full = dict(conn.execute(sa.select(tasks).where(tasks.c.id == task_id)).mappings().one())
        found, due = leases._find_queue_and_claim(conn, ns_id, queue, 5)
        assert found is not None and due is not None and [{k: row[k] for k in full} for row in due] == [full]
        (grant,) = leases.lease_tasks(conn, ns_id, queue, worker_id="w", max_tasks=1, lease_seconds=30)
        lean = attempt_locks._locked_attempt(conn, ns_id, grant.attempt.id, lean=True)
        whole = attempt_locks._locked_attempt(conn, ns_id, grant.attempt.id)
        conn.rollback()
    assert grant.task.params == {"f": 1.0} and grant.task.backoff_base_seconds == 0.1
    for part, every in zip(lean[:2], whole[:2], strict=True):
        assert typed(part) == {key: (every[key], type(every[key])) for key in part}


def test_only_mariadb_packs() -> None:
    from sqlalchemy.dialects import mysql, postgresql, sqlite

    mariadb = mysql.dialect()
    mariadb.is_mariadb = True
    assert packed_rows.packs(mariadb)
    assert not packed_rows.packs(mysql.dialect())
    assert not packed_rows.packs(postgresql.dialect()) and not packed_rows.packs(sqlite.dialect())


@pytest.mark.mariadb
@pytest.mark.parametrize("n", range(len(TASK_EDGES)))
def test_set_based_batch_reads_packed_equal_columns(
    api: Api, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The set-based batch path's locking read of the tasks and its read of the attempts
    (``attempt_sets._lock_tasks``), packed, give what they give as columns (MySQL's path)."""
    from orbit_server.tasks import attempt_sets

    queue = api.queue()
    for _ in range(2):
        api.submit(queue)
    grants = api.lease(queue, 2)
    task_edges = {k: v for k, v in TASK_EDGES[n].items() if k not in ("params", "result", "error")}
    engine = api.server.engine
    with engine.begin() as conn:
        if task_edges:
            conn.execute(tasks.update().where(tasks.c.id == grants[0]["task"]["id"]).values(**task_edges))
        attempt_edges = ATTEMPT_EDGES[n % len(ATTEMPT_EDGES)]
        conn.execute(
            task_attempts.update()
            .where(task_attempts.c.id == grants[0]["attempt"]["id"])
            .values(**attempt_edges)
        )
        ns_id = conn.scalar(sa.select(tasks.c.namespace_id).where(tasks.c.id == grants[0]["task"]["id"]))
    ids = [g["attempt"]["id"] for g in grants]
    with engine.connect() as conn, conn.begin():
        packed = attempt_sets._lock_tasks(conn, ns_id, ids)
        monkeypatch.setattr(attempt_sets, "packs", lambda dialect: False)
        columns = attempt_sets._lock_tasks(conn, ns_id, ids)
        conn.rollback()
    assert len(packed[0]) == 2 and len(packed[1]) == 2
    by_id = {row["id"]: row for row in columns[0]}
    for row in packed[0]:
        assert typed({k: v for k, v in row.items() if k != "db_now"}) == typed(
            {k: v for k, v in by_id[row["id"]].items() if k != "db_now"}
        )
    assert {k: typed(v) for k, v in packed[1].items()} == {k: typed(v) for k, v in columns[1].items()}
