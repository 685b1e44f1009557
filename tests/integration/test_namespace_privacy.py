"""A key asking about another namespace learns nothing about it (DESIGN §8; issue 10, the first hour)."""

from __future__ import annotations

import httpx

from tests.servers import RunningServer


def test_another_namespace_is_not_found_for_this_key_whether_it_exists_or_not(server: RunningServer) -> None:
    server.add_namespace("privacy-a")
    keys = server.add_namespace("privacy-b")
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {keys['admin']}"}) as http:
        existing = http.get("/v1/namespaces/privacy-a/queues/default")
        missing = http.get("/v1/namespaces/privacy-z/queues/default")
    for response, name in ((existing, "privacy-a"), (missing, "privacy-z")):
        assert response.status_code == 404
        body = response.json()
        assert body["code"] == "namespace_not_found"
        assert body["detail"] == f"namespace {name!r} not found for this key"
