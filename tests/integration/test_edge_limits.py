"""The HTTP edge as strict as the API (issue 21), on SQLite and MariaDB through a real server: integers
past 64 bits in paths and bodies, flow templates at the depth limit, JSON bodies that are not UTF-8."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.servers import RunningServer

HUGE = ["9223372036854775808", "18446744073709551616", "99999999999999999999999999"]


@pytest.fixture(scope="module")
def ns(server: RunningServer) -> tuple[str, dict[str, str]]:
    name = f"ns-{uuid.uuid4().hex[:8]}"
    return name, server.add_namespace(name, ("default",))


@pytest.fixture(scope="module")
def http(server: RunningServer, ns: tuple[str, dict[str, str]]) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=f"{server.base_url}/v1/namespaces/{ns[0]}",
        headers={"Authorization": f"Bearer {ns[1]['admin']}"},
        timeout=30,
    ) as client:
        yield client


def _end_flow(http: httpx.Client, params: Any = None) -> str:
    flow = f"f-{uuid.uuid4().hex[:8]}"
    graph: dict[str, Any] = {"start": "e", "nodes": {"e": {"type": "end"}}}
    if params is not None:
        graph = {
            "start": "t",
            "nodes": {"t": {"type": "task", "queue": "default", "handler": "h", "params": params, "next": "e"},
                      "e": {"type": "end"}},
        }  # fmt: skip
    r = http.post(f"/flows/{flow}/versions", json={"graph": graph})
    assert r.status_code == 201, r.text
    return flow


def _subscription(http: httpx.Client) -> str:
    name = f"s-{uuid.uuid4().hex[:8]}"
    r = http.post("/subscriptions", json={"name": name})
    assert r.status_code == 201, r.text
    return name


@pytest.mark.parametrize("huge", HUGE)
def test_integers_past_64_bits_are_404_or_422_never_500(http: httpx.Client, huge: str) -> None:
    flow = _end_flow(http)
    answers = {
        "version": http.get(f"/flows/{flow}/versions/{huge}"),
        "start": http.post(
            f"/flows/{flow}/instances",
            content=f'{{"version": {huge}}}',
            headers={"Content-Type": "application/json", "Idempotency-Key": f"k-{uuid.uuid4()}"},
        ),
        "ack": http.post(
            f"/subscriptions/{_subscription(http)}/deliveries/{huge}/ack", json={"lease_token": "t"}
        ),
    }
    for what, r in answers.items():
        assert r.status_code in (404, 422), (what, r.status_code, r.text)


@pytest.mark.parametrize("depth", [26, 27, 28, 29, 30, 31])
def test_one_depth_rule_for_flow_templates_on_every_database(http: httpx.Client, depth: int) -> None:
    """The graph as stored may nest at most 30 levels, counted from its root as the database counts."""
    params: Any = {"leaf": 1}
    for _ in range(depth - 1):
        params = {"a": params}
    flow = f"f-{uuid.uuid4().hex[:8]}"
    graph = {
        "start": "t",
        "nodes": {"t": {"type": "task", "queue": "default", "handler": "h", "params": params, "next": "e"},
                  "e": {"type": "end"}},
    }  # fmt: skip
    r = http.post(f"/flows/{flow}/versions", json={"graph": graph})
    # graph > nodes > t > params: the template's own depth plus 3 levels above it.
    if depth + 3 <= 30:
        assert r.status_code == 201, r.text
        assert http.get(f"/flows/{flow}/versions/1").status_code == 200
    else:
        assert r.status_code == 422, r.text
        assert r.json()["code"] == "validation_error" and "30 levels" in r.json()["detail"], r.text
