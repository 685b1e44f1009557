"""The fast lane (``ORBIT_FAST_LANE``, :mod:`orbit_server.api.fast_lane`) answers exactly what the full
FastAPI path answers: one matrix of worker calls — happy paths, replays, refusals, malformed requests —
sent to a server with the lane and to one without it, on one database, each answer compared: status,
body (ids, tokens, queue names and times replaced by placeholders, the request id dropped) and headers
(``X-Request-Id``, ``Date`` and ``Content-Length`` aside). The happy paths must really have taken the
lane, and ``/metrics`` must name the same route templates on both servers.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from orbit_server.api import fast_lane
from tests.conftest import DatabaseFactory
from tests.integration.conftest import BACKENDS
from tests.servers import RunningServer, run_server

_TIME = re.compile(r'"\d{4}-\d\d-\d\dT[0-9:.]+(Z|[+-]\d\d:\d\d)?"')


@dataclass
class Side:
    """One server of the comparison, the answers it gave and what must be replaced in them."""

    server: RunningServer
    ns: str
    keys: dict[str, str]
    other_keys: dict[str, str]
    prefix: str
    http: httpx.Client = field(init=False)
    names: dict[str, str] = field(default_factory=dict)
    answers: list[tuple[str, int, dict[str, str], Any]] = field(default_factory=list)
    queues: int = 0

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=f"{self.server.base_url}/v1/namespaces/{self.ns}", timeout=30)

    def name(self, value: str, placeholder: str) -> str:
        self.names[value] = placeholder
        return value

    def queue(self) -> str:
        self.queues += 1
        queue = self.name(
            f"{self.prefix}-q{self.queues:03d}-{uuid.uuid4().hex[:6]}", f"<queue {self.queues}>"
        )
        with self.server.engine.begin() as conn:
            from orbit_server.tasks import store

            store.create_queue(conn, self.ns, queue)
        return queue

    def submit(self, queue: str, n: int = 1, *, retry_safe: bool = False) -> None:
        items = [{"idempotency_key": uuid.uuid4().hex, "queue": queue, "handler": "h", "params": {"n": i},
                  "options": {"retry_safe": retry_safe}} for i in range(n)]  # fmt: skip
        response = self.http.post("/tasks/batch", json={"items": items}, headers=self.auth("submit"))
        assert response.status_code in (200, 201), response.text
        assert {item["status"] for item in response.json()["items"]} == {201}, response.text

    def auth(self, role: str = "work", *, other: bool = False) -> dict[str, str]:
        return {"Authorization": f"Bearer {(self.other_keys if other else self.keys)[role]}"}

    def grant(self, queue: str | None = None, *, start: bool = False) -> dict[str, Any]:
        """A fresh task of a new queue, leased: its grant (ids and token named for the comparison)."""
        queue = queue or self.queue()
        self.submit(queue, retry_safe=start)
        body = {"worker_id": "w", "max_tasks": 1, "lease_seconds": 600, "wait_seconds": 0, "start": start}
        (grant,) = self.http.post(f"/queues/{queue}/leases", json=body, headers=self.auth()).json()
        n = len(self.names)
        self.name(grant["task"]["id"], f"<task {n}>")
        self.name(grant["attempt"]["id"], f"<attempt {n}>")
        self.name(grant["attempt"]["lease_token"], f"<token {n}>")
        return dict(grant)

    def call(
        self, label: str, path: str, body: Any = None, *, content: bytes | None = None,
        headers: dict[str, str] | None = None, role: str = "work",
    ) -> httpx.Response:  # fmt: skip
        sent = {**(self.auth(role) if role else {}), **(headers or {})}
        if content is None:
            content, sent["Content-Type"] = (
                json.dumps(body).encode(),
                sent.get("Content-Type", "application/json"),
            )
        response = self.http.post(path, content=content, headers={k: v for k, v in sent.items() if v})
        self.answers.append(self.normalised(label, response))
        return response

    def replaced(self, text: str) -> str:
        for value, placeholder in sorted(self.names.items(), key=lambda item: -len(item[0])):
            text = text.replace(value, placeholder)
        return text.replace(self.server.base_url, "<server>")

    def normalised(self, label: str, response: httpx.Response) -> tuple[str, int, dict[str, str], Any]:
        text = _TIME.sub('"<time>"', self.replaced(response.text))
        body = json.loads(text) if text else None
        _drop_request_ids(body)
        assert response.headers["content-length"] == str(len(response.content))
        headers = {k: self.replaced(v) for k, v in response.headers.items()
                   if k not in ("x-request-id", "date", "content-length")}  # fmt: skip
        return label, response.status_code, headers, body


def _drop_request_ids(body: Any) -> None:
    if isinstance(body, dict):
        body.pop("request_id", None)
        for value in body.values():
            _drop_request_ids(value)
    elif isinstance(body, list):
        for value in body:
            _drop_request_ids(value)


def _matrix(side: Side) -> None:
    """Every call of the comparison, in order; each answer is kept on ``side``."""
    call = side.call
    attempts = "/attempts"
    # Warm the key cache (a key unknown to the process takes the full path, which fills it).
    call("warm-up: empty lease", f"/queues/{side.queue()}/leases", {"worker_id": "w", "wait_seconds": 0})

    g = side.grant()
    a, token = g["attempt"]["id"], g["attempt"]["lease_token"]
    call("complete before start", f"{attempts}/{a}/complete", {"lease_token": token, "result": 1})
    call("start", f"{attempts}/{a}/start", {"lease_token": token})
    call("start again (replay)", f"{attempts}/{a}/start", {"lease_token": token})
    call("start, wrong token", f"{attempts}/{a}/start", {"lease_token": "not-the-token"})
    call("heartbeat", f"{attempts}/{a}/heartbeat", {"lease_token": token, "lease_seconds": 300.0})
    call("heartbeat, default lease", f"{attempts}/{a}/heartbeat", {"lease_token": token})
    call("heartbeat, wrong token", f"{attempts}/{a}/heartbeat", {"lease_token": "x"})
    call("complete, wrong token", f"{attempts}/{a}/complete", {"lease_token": "x", "result": 1})
    call("complete", f"{attempts}/{a}/complete", {"lease_token": token, "result": {"ok": [1, 2.5, None]}})
    call("complete again (replay)", f"{attempts}/{a}/complete", {"lease_token": token, "result": {"ok": [1, 2.5, None]}})  # fmt: skip
    call("complete, other result", f"{attempts}/{a}/complete", {"lease_token": token, "result": 2})
    call("heartbeat after the end", f"{attempts}/{a}/heartbeat", {"lease_token": token})
    call("unknown attempt", f"{attempts}/00000000-0000-4000-8000-000000000000/start", {"lease_token": token})

    g = side.grant()
    a, token = g["attempt"]["id"], g["attempt"]["lease_token"]
    path = f"{attempts}/{a}/start"
    call("no key", path, {"lease_token": token}, role="", headers={"Authorization": ""})
    call("unknown key", path, {"lease_token": token}, headers={"Authorization": "Bearer nope"})
    call("basic auth", path, {"lease_token": token}, headers={"Authorization": "Basic Zm9vOmJhcg=="})
    call("key of another namespace", path, {"lease_token": token}, headers=side.auth(other=True))
    call("submit role", path, {"lease_token": token}, role="submit")
    call("read role", path, {"lease_token": token}, role="read")
    call("bad json", path, content=b'{"lease_token": ', headers={"Content-Type": "application/json"})
    call("empty body", path, content=b"", headers={"Content-Type": "application/json"})
    call("text/plain", path, content=json.dumps({"lease_token": token}).encode(), headers={"Content-Type": "text/plain"})  # fmt: skip
    call("no content type", path, content=json.dumps({"lease_token": token}).encode(), headers={"Content-Type": ""})  # fmt: skip
    call("BOM", path, content=b"\xef\xbb\xbf" + json.dumps({"lease_token": token}).encode(),
         headers={"Content-Type": "application/json"})  # fmt: skip
    call("UTF-16", path, content=json.dumps({"lease_token": token}).encode("utf-16-le"),
         headers={"Content-Type": "application/json"})  # fmt: skip
    call("not UTF-8", path, content=b'{"lease_token": "\xff"}', headers={"Content-Type": "application/json"})
    call("extra field", path, {"lease_token": token, "extra": 1})
    call("wrong type", path, {"lease_token": 5})
    call("a list", path, [token])
    call("bad namespace name", f"/../bad!ns{attempts}/{a}/start", {"lease_token": token})
    call("query string", f"{path}?x=1", {"lease_token": token})
    call("trailing slash", f"{path}/", {"lease_token": token})
    call("charset parameter", path, {"lease_token": token}, headers={"Content-Type": "application/json; charset=utf-8"})  # fmt: skip
    call("start after all that", path, {"lease_token": token})
    call("fail", f"{attempts}/{a}/fail", {"lease_token": token, "error": {"type": "E", "message": "m"}})
    call("fail again (replay)", f"{attempts}/{a}/fail", {"lease_token": token, "error": {"type": "E", "message": "m"}})  # fmt: skip
    call("fail, other error", f"{attempts}/{a}/fail", {"lease_token": token, "error": {"type": "F", "message": "n"}})  # fmt: skip
    call("fail, bad error", f"{attempts}/{a}/fail", {"lease_token": token, "error": {"type": 1}})

    # Batches, one item and several, with a refused item, and report-and-lease.
    g1, g2 = side.grant(), side.grant()
    i1 = {"attempt_id": g1["attempt"]["id"], "lease_token": g1["attempt"]["lease_token"]}
    i2 = {"attempt_id": g2["attempt"]["id"], "lease_token": g2["attempt"]["lease_token"]}
    call("batch start, one item", f"{attempts}/start", {"items": [i1]})
    call("batch start, two items", f"{attempts}/start", {"items": [i1, i2]})
    call("batch start, a wrong token", f"{attempts}/start", {"items": [{**i2, "lease_token": "x"}, i1]})
    call("batch heartbeat", f"{attempts}/heartbeat", {"items": [{**i1, "lease_seconds": 200.0}, i2]})
    call("batch start, no items", f"{attempts}/start", {"items": []})
    call("batch start, other namespace", f"{attempts}/start", {"items": [i1]}, headers=side.auth(other=True))
    call("batch start, submit role", f"{attempts}/start", {"items": [i1]}, role="submit")
    lease_queue = side.queue()
    side.submit(lease_queue, 1)
    lease = {"queue": lease_queue, "worker_id": "w", "max_tasks": 1, "lease_seconds": 600}
    response = call("batch complete with a lease", f"{attempts}/complete",
                    {"items": [{**i1, "result": "r"}], "lease": lease})  # fmt: skip
    for grant in response.json()["grants"]:
        n = len(side.names)
        side.name(grant["task"]["id"], f"<task {n}>")
        side.name(grant["attempt"]["id"], f"<attempt {n}>")
        side.name(grant["attempt"]["lease_token"], f"<token {n}>")
    # The answer above was normalised before its grant's ids were known: normalise it again.
    side.answers[-1] = side.normalised(side.answers[-1][0], response)
    call("batch complete, replay with a lease of no queue", f"{attempts}/complete",
         {"items": [{**i1, "result": "r"}], "lease": {**lease, "queue": "no-such-queue"}})  # fmt: skip
    call("batch complete, conflict", f"{attempts}/complete", {"items": [{**i1, "result": "other"}]})
    call("batch fail", f"{attempts}/fail", {"items": [{**i2, "error": {"type": "E", "message": "m"}}]})
    call("batch fail with a lease, nothing due", f"{attempts}/fail",
         {"items": [{**i2, "error": {"type": "E", "message": "m"}}], "lease": {**lease, "queue": side.queue()}})  # fmt: skip

    # Leases.
    queue = side.queue()
    side.submit(queue, 1)
    body = {"worker_id": "w", "max_tasks": 2, "lease_seconds": 600, "wait_seconds": 0}
    response = call("lease, one grant", f"/queues/{queue}/leases", body)
    for grant in response.json():
        n = len(side.names)
        side.name(grant["task"]["id"], f"<task {n}>")
        side.name(grant["attempt"]["id"], f"<attempt {n}>")
        side.name(grant["attempt"]["lease_token"], f"<token {n}>")
    side.answers[-1] = side.normalised(side.answers[-1][0], response)
    call("lease, empty", f"/queues/{queue}/leases", body)
    call("lease, empty after a short wait", f"/queues/{queue}/leases", {**body, "wait_seconds": 0.05})
    call("lease, unknown queue", "/queues/no-such-queue/leases", body)
    call("lease, bad queue name", "/queues/-bad/leases", body)
    call("lease, submit role", f"/queues/{queue}/leases", body, role="submit")
    call("lease, extra field", f"/queues/{queue}/leases", {**body, "extra": True})
    call("lease, max_tasks 0", f"/queues/{queue}/leases", {**body, "max_tasks": 0})
    call("lease, other namespace", f"/queues/{queue}/leases", body, headers=side.auth(other=True))


#: The calls that must take the fast lane when it is on (the others must not reach a route through it).
_HAPPY = {
    "warm-up: empty lease": False,  # the key is not in the cache yet
    "start": True, "start again (replay)": True, "start, wrong token": True, "heartbeat": True,
    "complete before start": True, "complete": True, "complete again (replay)": True,
    "complete, other result": True, "unknown attempt": True, "start after all that": True, "fail": True,
    "batch start, one item": True, "batch complete with a lease": True, "batch fail": True,
    "lease, one grant": True, "lease, empty": True, "lease, empty after a short wait": True,
    "lease, unknown queue": True, "charset parameter": False, "query string": False, "BOM": False,
    "no key": False, "unknown key": False, "key of another namespace": False, "submit role": False,
    "read role": False, "bad json": False, "extra field": False, "lease, extra field": False,
}  # fmt: skip


@pytest.fixture(scope="module", params=BACKENDS)
def sides(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[tuple[Side, Side]]:
    url = make_database(request.param)
    with run_server(url, fast_lane=True) as fast, run_server(url, fast_lane=False) as full:
        ns = f"fl-{uuid.uuid4().hex[:6]}"
        keys = fast.add_namespace(ns, ())
        other = fast.add_namespace(f"other-{uuid.uuid4().hex[:6]}", ())
        pair = Side(fast, ns, keys, other, "fast"), Side(full, ns, keys, other, "full")
        yield pair
        for side in pair:
            side.http.close()


def test_the_fast_lane_answers_what_the_full_path_answers(sides: tuple[Side, Side]) -> None:
    fast, full = sides
    served: list[str] = []
    parsed = fast_lane._parsed

    def spy(model: Any, body: bytes) -> Any:
        found = parsed(model, body)
        if found is not None:
            served.append(model.__name__)
        return found

    lanes: dict[str, bool] = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fast_lane, "_parsed", spy)
        original: Callable[..., httpx.Response] = fast.call

        def noting(label: str, *args: Any, **kwargs: Any) -> httpx.Response:
            before = len(served)
            response = original(label, *args, **kwargs)
            lanes[label] = len(served) > before
            return response

        fast.call = noting  # type: ignore[method-assign]
        _matrix(fast)
        fast_count = len(served)
        _matrix(full)
    assert len(served) == fast_count, "the server without the fast lane served a request through it"
    assert [a[0] for a in fast.answers] == [a[0] for a in full.answers]
    for fast_answer, full_answer in zip(fast.answers, full.answers, strict=True):
        assert fast_answer == full_answer, fast_answer[0]
    for label, taken in _HAPPY.items():
        assert lanes[label] is taken, f"{label}: {'not ' if taken else ''}served by the fast lane"
    statuses = {label: status for label, status, _, _ in fast.answers}
    assert statuses["start"] == statuses["batch complete with a lease"] == statuses["lease, one grant"] == 200
    assert statuses["start, wrong token"] == statuses["complete, other result"] == 409
    assert statuses["unknown key"] == 401 and statuses["submit role"] == 403 and statuses["bad json"] == 400


def _route_counts(server: RunningServer) -> set[str]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return {
        line
        for line in text.splitlines()
        if line.startswith("orbit_http_request_duration_seconds_count{") and "/metrics" not in line
    }


def test_metrics_name_the_same_routes(sides: tuple[Side, Side]) -> None:
    fast, full = sides
    if not fast.answers:
        _matrix(fast)
        _matrix(full)
    # Every request of the matrix counted under the same route template, method and status on both servers.
    assert _route_counts(fast.server) == _route_counts(full.server)
    assert any("/attempts/{attempt_id}/start" in line for line in _route_counts(fast.server))
