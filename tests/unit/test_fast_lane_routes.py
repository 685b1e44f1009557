"""The fast lane (:mod:`orbit_server.api.fast_lane`) serves exactly the routes FastAPI would route its
paths to: for each of its paths, the first route of the app that matches a ``POST`` to it is the lane's."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.routing import Match

from orbit_server import ServerSettings, create_app
from orbit_server.api.fast_lane import _api_routes, _lanes

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
