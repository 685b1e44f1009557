"""The web console's rules at the HTTP level, against a real server on SQLite and MariaDB: sessions,
CSRF, roles, namespaces, revocation, and that actions are the audited ones of the API."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import closing

import httpx
import pytest

from orbit_server.console._session import COOKIE
from tests.conftest import DatabaseFactory
from tests.console_support import TRACEBACK, Seeder, csrf_of, sign_in
from tests.integration.conftest import BACKENDS
from tests.servers import RunningServer, run_server


@pytest.fixture(scope="module", params=BACKENDS)
def server(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[RunningServer]:
    with run_server(
        make_database(request.param), api_key_cache_seconds=60, console_secret="test-secret"
    ) as running:
        running.keys = running.add_namespace("shop", queues=("default", "mail"))
        running.keys.update({f"other-{role}": key for role, key in running.add_namespace("other").items()})
        yield running


@pytest.fixture(scope="module")
def seed(server: RunningServer) -> Iterator[Seeder]:
    seeder = Seeder(server, "shop", {role: server.keys[role] for role in ("read", "submit", "work", "admin")})
    yield seeder
    seeder.close()


def test_pages_need_a_session(server: RunningServer) -> None:
    with httpx.Client(base_url=server.base_url) as anonymous:
        for path in ("/ui/", "/ui/tasks", "/ui/review", "/ui/api-keys", "/ui/tasks/x"):
            r = anonymous.get(path)
            assert r.status_code == 303 and r.headers["location"].startswith("/ui/login?next="), path
        login = anonymous.get("/ui/login")
        assert login.status_code == 200
        # It said the cookie held "a hash of the key" (issue 30): it holds a random session token.
        assert "hash of the key" not in login.text and "never the key" in login.text
        bad = anonymous.post("/ui/login", data={"api_key": "orbit_nope"})
        assert bad.status_code == 401 and "unknown or revoked" in bad.text
    with httpx.Client(base_url=server.base_url, cookies={COOKIE: "forged.value.sig"}) as forged:
        assert forged.get("/ui/").status_code == 303


def test_session_cookie_is_signed_httponly_strict_and_holds_no_key(server: RunningServer) -> None:
    with httpx.Client(base_url=server.base_url) as client:
        r = client.post("/ui/login", data={"api_key": server.keys["read"], "next": "https://evil.example/"})
        assert r.status_code == 303 and r.headers["location"] == "/ui/"  # no open redirect
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
        assert server.keys["read"] not in cookie and server.keys["read"][6:] not in cookie
        page = client.get("/ui/")
        assert page.status_code == 200 and "namespace <strong>shop</strong>" in page.text
        assert (
            page.headers["x-frame-options"] == "DENY"
            and "frame-ancestors 'none'" in page.headers["content-security-policy"]
        )
        out = client.post("/ui/logout", data={"csrf_token": csrf_of(page.text)})
        assert out.status_code == 303
        assert client.get("/ui/").status_code == 303


def test_an_action_without_the_csrf_token_is_refused(server: RunningServer, seed: Seeder) -> None:
    task = seed.submit()
    client, csrf = sign_in(server.base_url, server.keys["admin"])
    with closing(client):
        for form in ({"reason": "no token"}, {"reason": "wrong token", "csrf_token": csrf[:-2] + "xx"}):
            r = client.post(f"/ui/tasks/{task['id']}/cancel", data=form)
            assert r.status_code == 403 and "CSRF" in r.text
        r = client.post(
            f"/ui/tasks/{task['id']}/cancel",
            data={"reason": "cross-site", "csrf_token": csrf},
            headers={"Origin": "https://evil.example"},
        )
        assert r.status_code == 403
        assert seed.task(task["id"])["status"] == "WAITING"
        # Another session's token is no good either.
        other, other_csrf = sign_in(server.base_url, server.keys["admin"])
        other.close()
        assert (
            client.post(
                f"/ui/tasks/{task['id']}/cancel", data={"reason": "x", "csrf_token": other_csrf}
            ).status_code
            == 403
        )
        assert seed.task(task["id"])["status"] == "WAITING"


def test_a_read_key_sees_pages_but_cannot_act(server: RunningServer, seed: Seeder) -> None:
    task = seed.submit()
    client, csrf = sign_in(server.base_url, server.keys["read"])
    with closing(client):
        page = client.get(f"/ui/tasks/{task['id']}")
        assert page.status_code == 200 and "cancel-form" not in page.text
        r = client.post(f"/ui/tasks/{task['id']}/cancel", data={"reason": "read key", "csrf_token": csrf})
        assert r.status_code == 403 and "read&#39; key cannot do this" in r.text
        assert seed.task(task["id"])["status"] == "WAITING"
        assert client.get("/ui/api-keys").status_code == 403
        assert client.post("/ui/api-keys", data={"role": "admin", "csrf_token": csrf}).status_code == 403
        assert "API keys" not in client.get("/ui/").text.split("<main>")[0]


def test_another_namespaces_task_is_not_found(server: RunningServer, seed: Seeder) -> None:
    task = seed.submit()
    client, csrf = sign_in(server.base_url, server.keys["other-admin"])
    with closing(client):
        assert client.get(f"/ui/tasks/{task['id']}").status_code == 404
        assert (
            client.post(
                f"/ui/tasks/{task['id']}/cancel", data={"reason": "x", "csrf_token": csrf}
            ).status_code
            == 404
        )
        assert task["id"] not in client.get("/ui/tasks").text
    assert seed.task(task["id"])["status"] == "WAITING"


def test_console_actions_are_audited_with_the_keys_identity(server: RunningServer, seed: Seeder) -> None:
    failed = seed.failed("order-audit")
    client, csrf = sign_in(server.base_url, server.keys["admin"])
    with closing(client):
        page = client.get(f"/ui/tasks/{failed}")
        assert "KeyError" in page.text and "params[&#34;order_id&#34;]" in page.text  # the traceback, escaped
        assert (
            client.post(f"/ui/tasks/{failed}/retry", data={"csrf_token": csrf, "reason": " "}).status_code
            == 422
        )
        r = client.post(f"/ui/tasks/{failed}/retry", data={"csrf_token": csrf, "reason": "fixed the handler"})
        assert r.status_code == 303
        successor = re.search(r"/ui/tasks/([0-9a-f-]{36})", r.headers["location"]).group(1)  # type: ignore[union-attr]
        again = client.post(f"/ui/tasks/{failed}/retry", data={"csrf_token": csrf, "reason": "twice"})
        assert again.status_code == 409 and "already retried" in again.text
        review_id = seed.needs_review()
        missing = client.post(
            f"/ui/tasks/{review_id}/review", data={"csrf_token": csrf, "outcome": "failed", "reason": "r"}
        )
        assert missing.status_code == 422 and "evidence" in missing.text
        r = client.post(
            f"/ui/tasks/{review_id}/review",
            data={
                "csrf_token": csrf,
                "outcome": "succeeded",
                "reason": "receipt found",
                "evidence_ref": "PSP-1",
                "result": '{"charged": true}',
            },
        )
        assert r.status_code == 303
    key_id = int(re.search(r"key #(\d+)", page.text).group(1))  # type: ignore[union-attr]
    retried = seed.events(failed)[-1]
    assert (retried["event"], retried["actor"], retried["reason"]) == (
        "retried",
        f"api_key:{key_id}",
        "fixed the handler",
    )
    assert seed.task(successor)["retry_of"] == failed
    reviewed = seed.task(review_id)
    assert reviewed["status"] == "SUCCEEDED" and reviewed["result"] == {"charged": True}
    event = seed.events(review_id)[-1]
    assert event["actor"] == f"api_key:{key_id}" and event["data"]["evidence_ref"] == "PSP-1"
    assert seed.task(failed)["error"]["traceback"] == TRACEBACK


def test_a_revoked_key_loses_the_console_and_the_api(server: RunningServer, seed: Seeder) -> None:
    admin, csrf = sign_in(server.base_url, server.keys["admin"])
    with closing(admin):
        created = admin.post("/ui/api-keys", data={"csrf_token": csrf, "role": "read", "label": "temp"})
        assert created.status_code == 201
        new_key = re.search(r'<pre id="new-key">([^<]+)</pre>', created.text).group(1)  # type: ignore[union-attr]
        assert new_key not in admin.get("/ui/api-keys").text  # shown once
        victim, _ = sign_in(server.base_url, new_key)
        with closing(victim):
            api = {"Authorization": f"Bearer {new_key}"}
            assert (
                victim.get("/v1/namespaces/shop/tasks", headers=api).status_code == 200
            )  # now cached for 60 s
            key_id = re.search(r"key #(\d+)", victim.get("/ui/").text).group(1)  # type: ignore[union-attr]
            assert admin.post(f"/ui/api-keys/{key_id}/revoke", data={"csrf_token": csrf}).status_code == 422
            r = admin.post(
                f"/ui/api-keys/{key_id}/revoke", data={"csrf_token": csrf, "reason": "left the team"}
            )
            assert r.status_code == 303
            assert victim.get("/ui/").status_code == 303  # at once on this process, despite the cache
            assert victim.get("/v1/namespaces/shop/tasks", headers=api).status_code == 401
        listed = admin.get("/ui/api-keys").text
        row = listed.split(f'id="key-{key_id}"')[1].split("</tr>")[0]
        assert "UTC" in row and "Revoke" not in row


def test_tasks_pages_newest_first_through_the_cursor(server: RunningServer, seed: Seeder) -> None:
    queue = seed.queue()
    made = [seed.submit(queue, handler="page")["id"] for _ in range(55)]
    client, _ = sign_in(server.base_url, server.keys["read"])
    with closing(client):
        seen: list[str] = []
        url: str | None = f"/ui/tasks?queue={queue}"
        while url is not None:
            page = client.get(url)
            assert page.status_code == 200
            seen += re.findall(r'class="id" href="/ui/tasks/([0-9a-f-]{36})"', page.text)
            found = re.search(r'<a href="([^"]+)" rel="next">', page.text)
            url = found.group(1).replace("&amp;", "&") if found else None
        assert len(seen) == len(set(seen)) and set(seen) == set(made)  # every task once across the pages
        created = [seed.task(task_id)["created_at"] for task_id in seen]
        assert created == sorted(created, reverse=True)  # newest first (ties broken by id)
        bad = client.get("/ui/tasks?cursor=not-a-cursor")
        assert bad.status_code == 400 and "cursor" in bad.text
        assert client.get("/ui/tasks?created_since=yesterday").status_code == 400
        assert made[0] not in client.get(f"/ui/tasks?queue={queue}&created_since=2999-01-01T00:00").text


def test_the_task_page_and_lists_show_the_priority(server: RunningServer, seed: Seeder) -> None:
    queue = seed.queue()
    task = seed.submit(queue=queue, priority=-42)
    client, _csrf = sign_in(server.base_url, server.keys["read"])
    with closing(client):
        page = client.get(f"/ui/tasks/{task['id']}")
        assert re.search(r'id="task-priority">-42 · a lease grants the highest priority first', page.text)
        listed = client.get("/ui/tasks", params={"queue": queue}).text
        assert '<th title="A lease grants the highest priority first">Priority</th>' in listed
        assert '<td class="num">-42</td>' in listed
        high = seed.submit(queue=queue, priority=5)
        lined = client.get("/ui/tasks", params={"queue": queue, "status": "WAITING", "order": "lease"}).text
        assert "In lease order: the highest priority first" in lined
        order = re.findall(r'class="id" href="/ui/tasks/([0-9a-f-]{36})"', lined)
        assert order == [high["id"], task["id"]]
