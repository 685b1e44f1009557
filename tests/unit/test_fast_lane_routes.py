"""The fast lane (:mod:`orbit_server.api.fast_lane`) serves exactly the routes FastAPI would route its
paths to: for each of its paths, the first route of the app that matches a ``POST`` to it is the lane's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from starlette.routing import Match

from orbit_server import ServerSettings, create_app
from orbit_server.api.fast_lane import FastLane, _api_routes, _lanes
from orbit_server.tasks import store

_PATHS = {
    **{f"/v1/namespaces/ns/attempts/a-1/{a}": f"/v1/namespaces/{{namespace}}/attempts/{{attempt_id}}/{a}"
       for a in ("start", "heartbeat", "complete", "fail")},
    **{f"/v1/namespaces/ns/attempts/{a}": f"/v1/namespaces/{{namespace}}/attempts/{a}"
       for a in ("start", "heartbeat", "complete", "fail")},
    "/v1/namespaces/ns/queues/q/leases": "/v1/namespaces/{namespace}/queues/{queue}/leases",
}  # fmt: skip


@pytest.mark.parametrize("path", sorted(_PATHS))
def test_the_lane_route_is_the_one_fastapi_picks(tmp_path: Path, path: str) -> None:
    app = create_app(ServerSettings(database_url=f"sqlite:///{tmp_path / 'orbit.db'}", console_secret="t"))
    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": []}
    first = next(route for route, _, _ in _api_routes(app) if route.matches(scope)[0] is Match.FULL)
    assert first.path == _PATHS[path]
    assert _lanes(app)[_PATHS[path]].route is first


@pytest.mark.parametrize(
    "extra",
    [{}, {"fastapi.telemetry": object()}, {"query_string": b"x=1"}, {"method": "PUT"}, {"root_path": "/api"}],
    ids=["plain (control)", "traced by FastAPI's telemetry", "query string", "not POST", "under a root path"],
)
def test_what_is_not_plain_goes_to_the_full_app_untouched(tmp_path: Path, extra: dict[str, object]) -> None:
    """Requests FastAPI's own telemetry traces take the full path (their spans stay FastAPI's), as do
    those with a query string, another method or a root path; the lane does not even read their body."""
    app = create_app(ServerSettings(database_url=f"sqlite:///{tmp_path / 'orbit.db'}", console_secret="t"))
    principal = store.Principal(key_id=1, namespace_id=1, namespace="ns", role="work")
    app.state.key_cache.put("k", principal)
    reached: list[tuple[object, object]] = []

    async def full_app(scope: object, receive: object, send: object) -> None:
        reached.append((scope, receive))

    read: list[int] = []

    async def receive() -> dict[str, object]:
        read.append(1)
        return {"type": "http.request", "body": b"{", "more_body": False}  # not JSON: the full app answers

    async def send(message: object) -> None:
        raise AssertionError("the lane answered")

    lane = FastLane(full_app, orbit=app)
    scope = {
        "type": "http", "method": "POST", "path": "/v1/namespaces/ns/attempts/a-1/start", "root_path": "",
        "query_string": b"", "headers": [(b"content-type", b"application/json"), (b"authorization", b"Bearer k")],
        **extra,
    }  # fmt: skip
    asyncio.run(lane(scope, receive, send))
    ((passed_scope, passed_receive),) = reached
    assert passed_scope is scope
    if extra:
        assert passed_receive is receive and not read
    else:  # the control: the lane read the body, found it is not JSON, and replays it to the full app
        assert passed_receive is not receive and read == [1]
        replayed = asyncio.run(passed_receive())  # type: ignore[operator]
        assert replayed == {"type": "http.request", "body": b"{", "more_body": False} and read == [1]
