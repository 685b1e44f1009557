"""The first answer to a submission is built without reading the task back: it must be the very
bytes a replay (read from the database) answers, on SQLite and MariaDB, with PyMySQL and with
the C driver of the ``mysqlclient`` extra (DESIGN §3)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import DatabaseFactory
from tests.servers import RunningServer, run_server


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("pymysql", id="mariadb", marks=pytest.mark.mariadb),
        pytest.param("mysqldb", id="mariadb-mysqlclient", marks=pytest.mark.mariadb),
        pytest.param("psycopg", id="postgres", marks=pytest.mark.postgres),
    ],
)
def server(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[RunningServer]:
    """A real server over SQLite, MariaDB (through either driver) or PostgreSQL."""
    url = make_database({"sqlite": "sqlite", "psycopg": "postgres"}.get(request.param, "mariadb"))
    if request.param in ("pymysql", "mysqldb"):
        url = url.set(drivername=f"mysql+{request.param}")
    with run_server(url) as running:
        yield running


@pytest.fixture(scope="module")
def ns(server: RunningServer) -> tuple[str, dict[str, str]]:
    name = f"ns-{uuid.uuid4().hex[:8]}"
    return name, server.add_namespace(name, ("default",))


PARAMS: Any = {
    "order_id": 2**63 - 1,
    "sku": "BENCH-Ü-1 ✓ 𝄞",
    "price": 19.99,
    "tiny": 1e-300,
    "zero": -0.0,
    "ratio": 0.1 + 0.2,
    "nested": {"z": [], "a": [{}, None, True, False, "", [1, [2.5]]]},
    "b": 1,
    "a": 2,
}

BODIES = [
    pytest.param({"queue": "default", "handler": "h.plain", "params": PARAMS}, id="params"),
    pytest.param({"queue": "default", "handler": "h.none", "params": None}, id="no-params"),
    pytest.param({"queue": "default", "handler": "h.list", "params": ["x", 1, 2.0, {"k": "v"}]}, id="list"),
    pytest.param(
        {
            "queue": "default",
            "handler": "h.options",
            "params": {"n": 1},
            "options": {
                "max_attempts": 7,
                "retry_safe": True,
                "available_at": "2030-01-02T03:04:05.123456Z",
                "deadline": "2031-06-07T08:09:10.654321+02:00",
            },
        },
        id="options",
    ),
    pytest.param(
        {
            "queue": "default",
            "handler": "h.backoff",
            "params": {},
            "options": {"backoff_base_seconds": 0.123456789, "backoff_cap_seconds": 3.3},
        },
        id="backoff-floats",
    ),
]


@pytest.mark.parametrize("body", BODIES)
def test_the_first_answer_is_byte_identical_to_a_replay(
    server: RunningServer, ns: tuple[str, dict[str, str]], body: dict[str, Any]
) -> None:
    name, keys = ns
    headers = {"Authorization": f"Bearer {keys['submit']}", "Idempotency-Key": f"k-{uuid.uuid4()}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=30) as http:
        first = http.post(f"/v1/namespaces/{name}/tasks", json=body)
        replay = http.post(f"/v1/namespaces/{name}/tasks", json=body)
        read = http.get(f"/v1/namespaces/{name}/tasks/{first.json()['id']}")
    assert first.status_code == 201, first.text
    assert replay.status_code == 200 and replay.headers["idempotent-replayed"] == "true"
    assert first.content == replay.content
    assert first.content == read.content
