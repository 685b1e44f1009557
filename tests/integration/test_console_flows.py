"""The console's flow pages at the HTTP level, against a real server on SQLite and MariaDB: the list, the
instance page (graph with node states, links to step tasks, history), and the audited control forms."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from contextlib import closing
from typing import Any

import httpx
import pytest

from tests.conftest import DatabaseFactory
from tests.console_support import sign_in
from tests.flow_support import FlowApi, until
from tests.integration.conftest import BACKENDS
from tests.servers import RunningServer, run_server

GRAPH: dict[str, Any] = {
    "start": "approval",
    "nodes": {
        "approval": {"type": "signal", "signal": "approve", "timeout_seconds": 3600, "next": "fanout",
                     "on_timeout": "expired"},
        "fanout": {"type": "parallel", "branches": ["ship", "mail"], "join": "joined"},
        "ship": {"type": "task", "queue": "fulfilment", "handler": "orders.ship", "next": "joined"},
        "mail": {"type": "timer", "seconds": 3600, "next": "joined"},
        "joined": {"type": "join", "next": "done"},
        "done": {"type": "end"},
        "expired": {"type": "end", "status": "CANCELLED"},
    },
}  # fmt: skip


@pytest.fixture(scope="module", params=BACKENDS)
def server(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[RunningServer]:
    with run_server(make_database(request.param), console_secret="flow-secret") as running:
        running.keys = running.add_namespace("shop", ("fulfilment",))
        running.keys.update({f"other-{role}": key for role, key in running.add_namespace("other").items()})
        yield running


@pytest.fixture(scope="module")
def api(server: RunningServer) -> Iterator[FlowApi]:
    flows = FlowApi(server.base_url, "shop", {r: server.keys[r] for r in ("read", "submit", "work", "admin")})
    yield flows
    flows.close()


def forked(api: FlowApi) -> tuple[str, dict[str, Any]]:
    """An instance past its signal, forked: the ship branch waits for its task, the mail branch on a timer."""
    flow = f"order-{uuid.uuid4().hex[:6]}"
    api.publish(flow, GRAPH)
    instance = api.start(flow, {"order_id": 7})
    r = api.post("submit", f"/flow-instances/{instance['id']}/signals", {"name": "approve"},
                 **{"Idempotency-Key": "approve"})  # fmt: skip
    assert r.status_code == 201, r.text
    return flow, until(lambda: (i := api.instance(instance["id"]))["steps"] and i, what="the ship step")


def node_states(html: str) -> dict[str, str]:
    return dict(re.findall(r'<g class="node [^"]*" data-node="([a-z_0-9]+)" data-state="([a-z]+)"', html))


def test_flow_pages_need_a_session(server: RunningServer) -> None:
    with httpx.Client(base_url=server.base_url) as anonymous:
        for path in ("/ui/flows", f"/ui/flow-instances/{uuid.uuid4()}"):
            r = anonymous.get(path)
            assert r.status_code == 303 and r.headers["location"].startswith("/ui/login?next="), path


def test_list_and_instance_page_show_the_graph_with_node_states(server: RunningServer, api: FlowApi) -> None:
    flow, instance = forked(api)
    [step] = instance["steps"]
    client, _ = sign_in(server.base_url, server.keys["read"])
    with closing(client):
        listing = client.get("/ui/flows", params={"flow": flow})
        assert listing.status_code == 200 and 'href="/ui/flows"' in listing.text  # the nav link
        assert f'href="/ui/flow-instances/{instance["id"]}"' in listing.text
        assert "ship <small>(task)</small>" in listing.text
        assert client.get("/ui/flows", params={"flow": flow, "status": "COMPLETED"}).text.count(
            "/ui/flow-instances/"
        ) == 0  # fmt: skip
        assert client.get("/ui/flows", params={"status": "BOGUS"}).status_code == 400

        page = client.get(f"/ui/flow-instances/{instance['id']}")
        assert page.status_code == 200
        html = page.text
        assert node_states(html) == {
            "approval": "passed", "fanout": "forked", "ship": "waiting", "mail": "waiting", "joined": "pending",
            "done": "pending", "expired": "pending",
        }  # fmt: skip
        link = rf'<a href="/ui/tasks/{step["task_id"]}">\s*<g class="node n-waiting" data-node="ship"'
        assert re.search(link, html), "the ship node links to its step's task"
        assert html.count(f'href="/ui/tasks/{step["task_id"]}"') >= 3  # graph, node table, steps (and tokens)
        history = html[html.index('id="history"') :]
        assert "instance_started" in history and "signal_received" in history
        assert 'id="pause-form"' not in html  # a read key gets no forms
        assert client.get(f"/ui/tasks/{step['task_id']}").status_code == 200
        bad = client.get(f"/ui/flow-instances/{instance['id']}", params={"history_cursor": "not-a-cursor"})
        assert bad.status_code == 400 and "history link" in bad.text


def test_pause_resume_and_cancel_are_audited_forms(server: RunningServer, api: FlowApi) -> None:
    _, instance = forked(api)
    url = f"/ui/flow-instances/{instance['id']}"
    client, csrf = sign_in(server.base_url, server.keys["admin"])
    with closing(client):
        page = client.get(url).text
        assert 'id="pause-form"' in page and 'id="cancel-form"' in page and 'id="resume-form"' not in page
        assert client.post(f"{url}/pause", data={"reason": "audit"}).status_code == 403  # no CSRF token
        refused = client.post(f"{url}/pause", data={"csrf_token": csrf, "reason": " "})
        assert refused.status_code == 422 and "Give a reason" in refused.text
        done = client.post(f"{url}/pause", data={"csrf_token": csrf, "reason": "stock audit"})
        assert done.status_code == 303 and done.headers["location"] == f"{url}?done=paused"
        page = client.get(done.headers["location"]).text
        assert (
            'id="instance-status">PAUSED<' in page
            and 'id="resume-form"' in page
            and "Pause recorded." in page
        )
        assert api.instance(instance["id"])["paused"] is True
        key_id = re.search(r"key #(\d+)", page)
        assert key_id and f"by api_key:{key_id.group(1)}" in page[page.index('id="history"') :]

        assert client.post(f"{url}/resume", data={"csrf_token": csrf, "reason": "done"}).status_code == 303
        assert api.instance(instance["id"])["status"] == "RUNNING"
        assert (
            client.post(f"{url}/cancel", data={"csrf_token": csrf, "reason": "customer left"}).status_code
            == 303
        )
        page = client.get(url).text
        assert 'id="instance-status">CANCELLED<' in page and 'id="cancel-form"' not in page
        again = client.post(f"{url}/cancel", data={"csrf_token": csrf, "reason": "twice"})
        assert again.status_code == 409 and "cannot be cancelled" in again.text

    submit, csrf = sign_in(server.base_url, server.keys["submit"])
    with closing(submit):
        r = submit.post(f"{url}/pause", data={"csrf_token": csrf, "reason": "x"})
        assert r.status_code == 403 and "admin" in r.text


def test_another_namespace_sees_no_instance(server: RunningServer, api: FlowApi) -> None:
    _, instance = forked(api)
    client, csrf = sign_in(server.base_url, server.keys["other-admin"])
    with closing(client):
        r = client.get(f"/ui/flow-instances/{instance['id']}")
        assert r.status_code == 404 and "No flow instance" in r.text
        r = client.post(
            f"/ui/flow-instances/{instance['id']}/cancel", data={"csrf_token": csrf, "reason": "x"}
        )
        assert r.status_code == 404
        assert instance["id"] not in client.get("/ui/flows").text
    assert api.instance(instance["id"])["status"] == "RUNNING"
