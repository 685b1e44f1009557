"""The HTTP edge as strict as the API (issue 21), on SQLite and MariaDB through a real server: integers
past 64 bits in paths and bodies, flow templates at the depth limit, JSON bodies that are not UTF-8."""

from __future__ import annotations

import base64
import json
import re
import uuid
from typing import Any

import httpx
import pytest

from tests.conftest import DatabaseFactory
from tests.integration import test_bad_input
from tests.servers import RunningServer, run_server

#: The fixtures: a namespace, and an admin client of it.
ns, http = test_bad_input.ns, test_bad_input.http
HUGE = ["9223372036854775808", "18446744073709551616", "99999999999999999999999999"]


def _task_graph(params: Any) -> dict[str, Any]:
    return {
        "start": "t",
        "nodes": {"t": {"type": "task", "queue": "default", "handler": "h", "params": params, "next": "e"},
                  "e": {"type": "end"}},
    }  # fmt: skip


def _end_flow(http: httpx.Client, params: Any = None) -> str:
    flow = f"f-{uuid.uuid4().hex[:8]}"
    graph = {"start": "e", "nodes": {"e": {"type": "end"}}} if params is None else _task_graph(params)
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


@pytest.mark.parametrize("after", [2**63, 2**64, -1, True, 1.5])
def test_a_history_cursor_past_64_bits_is_400(http: httpx.Client, after: Any) -> None:
    flow = _end_flow(http)
    started = http.post(f"/flows/{flow}/instances", json={}, headers={"Idempotency-Key": f"k-{uuid.uuid4()}"})
    assert started.status_code == 201, started.text
    cursor = base64.urlsafe_b64encode(json.dumps([after]).encode()).decode().rstrip("=")
    r = http.get(f"/flow-instances/{started.json()['id']}/history", params={"cursor": cursor})
    assert r.status_code == 400 and r.json()["code"] == "invalid_cursor", r.text


@pytest.mark.parametrize(
    "created", ["0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00", "2026-01-01T00:00:00+05:00", "x", 5]
)
def test_a_task_cursor_with_an_odd_time_is_answered_never_500(http: httpx.Client, created: Any) -> None:
    cursor = base64.urlsafe_b64encode(json.dumps([created, str(uuid.uuid4())]).encode()).decode().rstrip("=")
    r = http.get("/tasks", params={"cursor": cursor})
    assert r.status_code in (200, 400), r.text


@pytest.mark.parametrize("depth", [26, 27, 28, 29, 30, 31])
def test_one_depth_rule_for_flow_templates_on_every_database(http: httpx.Client, depth: int) -> None:
    """The graph as stored may nest at most 30 levels, counted from its root as the database counts."""
    params: Any = {"leaf": 1}
    for _ in range(depth - 1):
        params = {"a": params}
    flow = f"f-{uuid.uuid4().hex[:8]}"
    r = http.post(f"/flows/{flow}/versions", json={"graph": _task_graph(params)})
    # graph > nodes > t > params: the template's own depth plus 3 levels above it.
    if depth + 3 <= 30:
        assert r.status_code == 201, r.text
        assert http.get(f"/flows/{flow}/versions/1").status_code == 200
    else:
        assert r.status_code == 422, r.text
        assert r.json()["code"] == "validation_error" and "30 levels" in r.json()["detail"], r.text


@pytest.mark.parametrize(
    "body",
    [
        b"\xef\xbb\xbf" + b'{"queue":"default","handler":"h"}',
        '{"queue":"default","handler":"h"}'.encode("utf-16"),
        '{"queue":"default","handler":"h"}'.encode("utf-16-le"),
        '{"queue":"default","handler":"h"}'.encode("utf-32"),
    ],
    ids=["utf-8-bom", "utf-16-bom", "utf-16-le", "utf-32"],
)
def test_json_bodies_that_are_not_plain_utf_8_are_400(http: httpx.Client, body: bytes) -> None:
    r = http.post(
        "/tasks",
        content=body,
        headers={"Content-Type": "application/json", "Idempotency-Key": f"k-{uuid.uuid4()}"},
    )
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "invalid_utf8", r.text


# --------------------------------------------------------------------------------- API docs


def test_the_docs_load_nothing_from_another_site_and_run_in_a_sandbox(server: RunningServer) -> None:
    for page in ("/docs", "/redoc"):
        r = httpx.get(f"{server.base_url}{page}")
        assert r.status_code == 200
        csp = r.headers["content-security-policy"]
        assert csp.startswith("sandbox allow-scripts") and "allow-same-origin" not in csp
        assert "script-src 'self'" in csp and "connect-src 'none'" in csp
        assert "cdn." not in r.text and "https://" not in r.text.split('<script type="application/json"')[0]
        assert '"openapi":' in r.text  # the document is embedded, the page fetches nothing
        for asset in re.findall(r'(?:src|href)="(/docs/assets/[^"]+)"', r.text):
            served = httpx.get(f"{server.base_url}{asset}")
            assert served.status_code == 200 and len(served.content) > 100, asset
    assert httpx.get(f"{server.base_url}/docs/assets/../../settings.py").status_code == 404
    assert httpx.get(f"{server.base_url}/docs/assets/nothing.js").status_code == 404


def test_docs_can_be_turned_off(make_database: DatabaseFactory) -> None:
    with run_server(make_database("sqlite"), docs=False) as running:
        assert httpx.get(f"{running.base_url}/docs").status_code == 404
        assert httpx.get(f"{running.base_url}/redoc").status_code == 404
        assert httpx.get(f"{running.base_url}/openapi.json").status_code == 200


# ----------------------------------------------------------------------------------- /metrics


def test_metrics_without_a_token_answer_only_an_address_or_localhost(server: RunningServer) -> None:
    url = f"{server.base_url}/metrics"
    assert httpx.get(url).status_code == 200  # Host: 127.0.0.1:port
    assert httpx.get(url, headers={"Host": "localhost:8080"}).status_code == 200
    assert httpx.get(url, headers={"Host": "[::1]:8080"}).status_code == 200
    rebound = httpx.get(url, headers={"Host": "attacker.example"})
    assert rebound.status_code == 403 and rebound.json()["code"] == "host_not_allowed"
    assert "orbit_tasks" not in rebound.text


def test_a_metrics_token_is_required_once_set(make_database: DatabaseFactory) -> None:
    with run_server(make_database("sqlite"), metrics_token="s3cret-token") as running:
        url = f"{running.base_url}/metrics"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret-token"}):
            r = httpx.get(url, headers=headers)
            assert r.status_code == 401 and r.json()["code"] == "metrics_token_required", headers
        ok = httpx.get(url, headers={"Authorization": "Bearer s3cret-token", "Host": "orbit.internal"})
        assert ok.status_code == 200 and "orbit_http_request_duration_seconds" in ok.text


def test_allowed_hosts_are_checked_on_every_request(make_database: DatabaseFactory) -> None:
    with run_server(make_database("sqlite"), allowed_hosts="orbit.example.com, *.orbit.internal") as running:
        for host, status in (("orbit.example.com", 200), ("a.orbit.internal", 200), ("evil.example", 400)):
            assert httpx.get(f"{running.base_url}/healthz", headers={"Host": host}).status_code == status, (
                host
            )
            assert httpx.get(f"{running.base_url}/metrics", headers={"Host": host}).status_code == status, (
                host
            )
