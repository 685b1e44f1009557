"""Every console form and filter with the API's bad-input corpus, on SQLite and MariaDB (issue 21).

The console must answer what the API answers: a 4xx naming the rule, never a 500, and never a
stored value that the database cannot give back (a lone surrogate made the namespace's task
listing answer 500 for good). Sessions end at sign-out and at revocation, on the server.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from contextlib import closing

import httpx
import pytest

from orbit_server.tasks import admin, store
from tests.conftest import DatabaseFactory
from tests.console_support import Seeder, sign_in
from tests.integration import test_console_http
from tests.integration.conftest import BACKENDS
from tests.servers import RunningServer, run_server

#: JSON texts that the API refuses in a body (400 or 422), with the words the refusal names.
BAD_JSON = {
    "nan": ("NaN", "NaN"),
    "infinity": ("Infinity", "infinite"),
    "minus-infinity": ('{"a": -Infinity}', "infinite"),
    "1e400": ("1e400", "infinite"),
    "lone-surrogate": ('"\\ud800"', "surrogate"),
    "lone-surrogate-key": ('{"\\udfff": 1}', "surrogate"),
    "31-levels": ("[" * 31 + "]" * 31, "30 levels"),
    "5000-levels": ("[" * 5000 + "]" * 5000, "30 levels"),
    "4301-digits": ("7" * 4301, "4300 digits"),
    "not-json": ('{"a": ', "not JSON"),
}
#: JSON texts at the limits, which the API stores and gives back unchanged.
#: The fixture: tasks made over HTTP in namespace "shop".
seed = test_console_http.seed
GOOD_JSON = ["[" * 30 + "]" * 30, "1" + "0" * 400, '{"name": "Zoë ✓"}', "-0.0", "18446744073709551616"]
HUGE = ["9223372036854775808", "18446744073709551616", "99999999999999999999999999"]


@pytest.fixture(scope="module", params=BACKENDS)
def server(request: pytest.FixtureRequest, make_database: DatabaseFactory) -> Iterator[RunningServer]:
    with run_server(
        make_database(request.param), api_key_cache_seconds=60, console_secret="test-secret"
    ) as running:
        running.keys = running.add_namespace("shop", queues=("default",))
        yield running


@pytest.fixture(scope="module")
def console(server: RunningServer) -> Iterator[tuple[httpx.Client, str]]:
    client, csrf = sign_in(server.base_url, server.keys["admin"])
    with closing(client):
        yield client, csrf


def _review(outcome: str = "succeeded", **fields: str) -> dict[str, str]:
    return {"outcome": outcome, "reason": "receipt found", "evidence_ref": "PSP-1", **fields}


def _everything_still_reads(server: RunningServer, seed: Seeder, client: httpx.Client, task_id: str) -> None:
    """The task, the namespace's listing and the console's pages all answer (a stored bad value broke them)."""
    seed.task(task_id)
    listing = seed.http["read"].get("/v1/namespaces/shop/tasks")
    assert listing.status_code == 200, listing.text
    for page in (f"/ui/tasks/{task_id}", "/ui/tasks", "/ui/review", "/ui/"):
        assert client.get(page).status_code == 200, page


@pytest.mark.parametrize("case", list(BAD_JSON))
def test_a_review_result_the_api_refuses_is_refused_and_nothing_is_stored(
    server: RunningServer, seed: Seeder, console: tuple[httpx.Client, str], case: str
) -> None:
    text, words = BAD_JSON[case]
    client, csrf = console
    task_id = seed.needs_review()
    api = seed.http["admin"].post(
        f"/v1/namespaces/shop/tasks/{task_id}/review",
        content=json.dumps(_review()).removesuffix("}") + f', "result": {text}}}',
        headers={"Content-Type": "application/json"},
    )
    assert api.status_code in (400, 422), api.text  # the API's answer, which the console must match
    r = client.post(f"/ui/tasks/{task_id}/review", data={"csrf_token": csrf, **_review(result=text)})
    assert r.status_code == 422, r.text[:500]
    assert words in r.text
    assert seed.task(task_id)["status"] == "NEEDS_REVIEW"
    _everything_still_reads(server, seed, client, task_id)


@pytest.mark.parametrize("text", GOOD_JSON)
def test_a_review_result_at_the_limits_is_stored_as_sent(
    server: RunningServer, seed: Seeder, console: tuple[httpx.Client, str], text: str
) -> None:
    client, csrf = console
    task_id = seed.needs_review()
    r = client.post(f"/ui/tasks/{task_id}/review", data={"csrf_token": csrf, **_review(result=text)})
    assert r.status_code == 303, r.text[:500]
    read = seed.http["read"].get(f"/v1/namespaces/shop/tasks/{task_id}")
    assert read.json()["status"] == "SUCCEEDED" and read.json()["result"] == json.loads(text)
    _everything_still_reads(server, seed, client, task_id)


#: The API's length limits (CancelRequest, ReviewRequest, RetryRequest, FlowControl).
TOO_LONG = {
    "reason": ("x" * 2001, "2000 characters"),
    "big-reason": ("x" * 200_000, "2000 characters"),
    "evidence_ref": ("e" * 1001, "1000 characters"),
    "on_behalf_of": ("o" * 256, "255 characters"),
}


@pytest.mark.parametrize("field", list(TOO_LONG))
def test_review_fields_past_the_apis_lengths_are_422(
    seed: Seeder, console: tuple[httpx.Client, str], field: str
) -> None:
    value, words = TOO_LONG[field]
    client, csrf = console
    task_id = seed.needs_review()
    name = "reason" if field == "big-reason" else field
    r = client.post(f"/ui/tasks/{task_id}/review", data={"csrf_token": csrf, **_review(**{name: value})})
    assert r.status_code == 422 and words in r.text, r.text[:300]
    assert seed.task(task_id)["status"] == "NEEDS_REVIEW"
    assert seed.events(task_id)[-1]["event"] != "reviewed"


@pytest.mark.parametrize("reason", ["x" * 2001, "x" * 200_000])
def test_cancel_and_retry_reasons_past_2000_characters_are_422(
    seed: Seeder, console: tuple[httpx.Client, str], reason: str
) -> None:
    client, csrf = console
    waiting = seed.submit()
    r = client.post(f"/ui/tasks/{waiting['id']}/cancel", data={"csrf_token": csrf, "reason": reason})
    assert r.status_code == 422 and "2000 characters" in r.text
    assert seed.task(waiting["id"])["status"] == "WAITING"
    failed = seed.failed(f"long-{len(reason)}")
    r = client.post(f"/ui/tasks/{failed}/retry", data={"csrf_token": csrf, "reason": reason})
    assert r.status_code == 422 and "2000 characters" in r.text
    assert seed.task(failed)["status"] == "FAILED"
    # At the limit it is kept whole.
    r = client.post(f"/ui/tasks/{waiting['id']}/cancel", data={"csrf_token": csrf, "reason": "y" * 2000})
    assert r.status_code == 303
    assert seed.events(waiting["id"])[-1]["reason"] == "y" * 2000


def test_key_forms_keep_the_limits(server: RunningServer, console: tuple[httpx.Client, str]) -> None:
    client, csrf = console
    r = client.post("/ui/api-keys", data={"csrf_token": csrf, "role": "read", "label": "l" * 256})
    assert r.status_code == 422 and "255 characters" in r.text
    r = client.post("/ui/api-keys", data={"csrf_token": csrf, "role": "superuser"})
    assert r.status_code == 422
    key_id = re.search(r'id="key-(\d+)"', client.get("/ui/api-keys").text).group(1)  # type: ignore[union-attr]
    r = client.post(f"/ui/api-keys/{key_id}/revoke", data={"csrf_token": csrf, "reason": "r" * 2001})
    assert r.status_code == 422 and "2000 characters" in r.text
    for huge in HUGE:
        r = client.post(f"/ui/api-keys/{huge}/revoke", data={"csrf_token": csrf, "reason": "gone"})
        assert r.status_code == 404, (huge, r.status_code)
    for bad in ("-1", "0", "x", "1.5", "%C3%A9"):
        r = client.post(f"/ui/api-keys/{bad}/revoke", data={"csrf_token": csrf, "reason": "gone"})
        assert r.status_code in (404, 422), (bad, r.status_code)


@pytest.mark.parametrize(
    "query",
    [
        {"created_since": "0001-01-01T00:00:00+14:00"},
        {"created_since": "9999-12-31T23:59:59-14:00"},
        {"created_since": "2026-13-01"},
        {"created_since": "x" * 5000},
        {"status": "BOGUS"},
        {"cursor": "not-a-cursor"},
        {"cursor": "é"},
    ],
    ids=lambda q: next(iter(q)),
)
def test_bad_task_filters_are_400(console: tuple[httpx.Client, str], query: dict[str, str]) -> None:
    client, _ = console
    r = client.get("/ui/tasks", params=query)
    assert r.status_code == 400, (query, r.status_code)


@pytest.mark.parametrize(
    "query",
    [
        {"idempotency_key": "é"},
        {"idempotency_key": "\u2028"},
        {"idempotency_key": "k" * 300},
        {"queue": "é"},
        {"queue": "q" * 300},
        {"handler": "é"},
        {"handler": "h" * 300},
    ],
    ids=lambda q: f"{next(iter(q))}-{len(next(iter(q.values())))}",
)
def test_filters_no_task_can_match_find_nothing(
    seed: Seeder, console: tuple[httpx.Client, str], query: dict[str, str]
) -> None:
    seed.submit()
    client, _ = console
    r = client.get("/ui/tasks", params=query)
    assert r.status_code == 200 and "/ui/tasks/" not in r.text.split("<tbody")[-1], query


@pytest.mark.parametrize("task_id", ["%C3%A9", "x" * 300, *HUGE])
def test_a_task_id_that_cannot_exist_is_404(console: tuple[httpx.Client, str], task_id: str) -> None:
    client, csrf = console
    assert client.get(f"/ui/tasks/{task_id}").status_code == 404
    for action, form in (("cancel", {"reason": "r"}), ("retry", {"reason": "r"}),
                         ("review", _review("failed"))):  # fmt: skip
        r = client.post(f"/ui/tasks/{task_id}/{action}", data={"csrf_token": csrf, **form})
        assert r.status_code == 404, (action, r.status_code)
    assert client.get(f"/ui/flow-instances/{task_id}").status_code == 404


def test_a_huge_sign_in_key_is_just_unknown(server: RunningServer) -> None:
    with httpx.Client(base_url=server.base_url) as client:
        for key in ("k" * 100_000, "é" * 100, "\x00"):
            r = client.post("/ui/login", data={"api_key": key})
            assert r.status_code == 401, r.status_code


# ---------------------------------------------------------------------------- sessions end


def _signed_in_cookie(server: RunningServer, key: str) -> tuple[dict[str, str], str]:
    client, csrf = sign_in(server.base_url, key)
    with closing(client):
        return dict(client.cookies), csrf


def test_a_cookie_saved_before_sign_out_is_worth_nothing_after(server: RunningServer, seed: Seeder) -> None:
    task = seed.submit()
    saved, csrf = _signed_in_cookie(server, server.keys["admin"])
    with httpx.Client(base_url=server.base_url, cookies=saved) as browser:
        assert browser.get("/ui/").status_code == 200
        assert browser.post("/ui/logout", data={"csrf_token": csrf}).status_code == 303
    with httpx.Client(base_url=server.base_url, cookies=saved) as replay:
        assert replay.get("/ui/").status_code == 303
        r = replay.post(f"/ui/tasks/{task['id']}/cancel", data={"csrf_token": csrf, "reason": "replayed"})
        assert r.status_code == 401
    assert seed.task(task["id"])["status"] == "WAITING"


def test_revoking_a_key_ends_its_sessions_at_once(server: RunningServer, seed: Seeder) -> None:
    with server.engine.begin() as conn:
        key = store.create_api_key(conn, "shop", "admin", "short-lived")
    saved, csrf = _signed_in_cookie(server, key)
    with httpx.Client(base_url=server.base_url, cookies=saved) as browser:
        assert browser.get("/ui/").status_code == 200  # the key is in the server's cache for 60 s now
        key_id = int(re.search(r"key #(\d+)", browser.get("/ui/").text).group(1))  # type: ignore[union-attr]
        with server.engine.begin() as conn:  # as `orbit-server key revoke` does
            admin.revoke_api_key(conn, None, key_id, actor="test")
        assert browser.get("/ui/").status_code == 303
        task = seed.submit()
        r = browser.post(f"/ui/tasks/{task['id']}/cancel", data={"csrf_token": csrf, "reason": "revoked"})
        assert r.status_code == 401
    assert seed.task(task["id"])["status"] == "WAITING"


def test_sessions_are_separate_and_sign_out_ends_only_its_own(server: RunningServer) -> None:
    first, first_csrf = sign_in(server.base_url, server.keys["read"])
    second, _ = sign_in(server.base_url, server.keys["read"])
    with closing(first), closing(second):
        assert first.post("/ui/logout", data={"csrf_token": first_csrf}).status_code == 303
        assert first.get("/ui/").status_code == 303
        assert second.get("/ui/").status_code == 200


# ------------------------------------------------------------------------ sign-in limit


def test_failed_sign_ins_are_limited_per_address(make_database: DatabaseFactory) -> None:
    with run_server(make_database("sqlite"), console_login_failures_per_minute=3) as running:
        keys = running.add_namespace("shop")
        with httpx.Client(base_url=running.base_url) as client:
            for _ in range(3):
                assert client.post("/ui/login", data={"api_key": "orbit_wrong"}).status_code == 401
            r = client.post("/ui/login", data={"api_key": "orbit_wrong"})
            assert r.status_code == 429 and "Too many failed sign-ins" in r.text
            assert 1 <= int(r.headers["retry-after"]) <= 60
            # While limited, even the right key waits: the limit is on the address, not the guess.
            assert client.post("/ui/login", data={"api_key": keys["read"]}).status_code == 429


def test_flow_control_reasons_keep_the_apis_limit(
    server: RunningServer, console: tuple[httpx.Client, str]
) -> None:
    """Pause, resume and cancel of a flow instance: a reason past 2,000 characters is 422, not cut to 2,000."""
    api = httpx.Client(
        base_url=f"{server.base_url}/v1/namespaces/shop",
        headers={"Authorization": f"Bearer {server.keys['admin']}"},
        timeout=30,
    )
    with api:
        flow = f"f-{uuid.uuid4().hex[:8]}"
        graph = {"start": "w", "nodes": {"w": {"type": "timer", "seconds": 3600, "next": "e"},
                                         "e": {"type": "end"}}}  # fmt: skip
        assert api.post(f"/flows/{flow}/versions", json={"graph": graph}).status_code == 201
        started = api.post(
            f"/flows/{flow}/instances", json={}, headers={"Idempotency-Key": str(uuid.uuid4())}
        )
        assert started.status_code in (200, 201), started.text
        instance = started.json()["id"]
        client, csrf = console
        for action in ("pause", "resume", "cancel"):
            r = client.post(
                f"/ui/flow-instances/{instance}/{action}", data={"csrf_token": csrf, "reason": "x" * 2001}
            )
            assert r.status_code == 422 and "2000 characters" in r.text, (action, r.status_code)
        assert api.get(f"/flow-instances/{instance}").json()["status"] == "RUNNING"
