"""The console fixes what it shows (issue 23), in a real browser (Debian's chromium through Playwright):
worker liveness, schedules and flows summary and the last hour's error types on the overview; pause and resume
of a queue; the schedules and subscriptions pages; a flow instance's signals (list, send); a step's task page
linking to its instance; a FAILED instance saying why. Every page passes axe-core (axe-playwright-python ships
it) with no serious or critical violation.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from orbit_client import OrbitClient
from orbit_server.tasks import store
from tests.conftest import DatabaseFactory
from tests.console_support import Seeder
from tests.flow_support import FlowApi, until
from tests.integration.test_console_browser import browser, shot, sign_in
from tests.servers import RunningServer, run_server

__all__ = ["browser"]  # the fixture, shared with the console's other browser tests

GRAPH: dict[str, Any] = {
    "start": "approval",
    "nodes": {
        "approval": {"type": "signal", "signal": "approve", "timeout_seconds": 3600, "next": "ship",
                     "on_timeout": "expired"},
        "ship": {"type": "task", "queue": "fulfilment", "handler": "orders.ship",
                 "params": {"by": "$.signals.approve.by"}, "next": "done"},
        "done": {"type": "end"},
        "expired": {"type": "end", "status": "CANCELLED"},
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def server(make_database: DatabaseFactory) -> Iterator[RunningServer]:
    with run_server(make_database("sqlite"), console_secret="operator-test") as running:
        running.keys = running.add_namespace("shop", ("fulfilment", "reports"))
        yield running


@pytest.fixture(scope="module")
def api(server: RunningServer) -> Iterator[FlowApi]:
    flows = FlowApi(server.base_url, "shop", {r: server.keys[r] for r in ("read", "submit", "work", "admin")})
    yield flows
    flows.close()


@pytest.fixture
def page(browser: Any, server: RunningServer, tmp_path: Path) -> Iterator[Any]:
    # 800 px wide: the overview's tables scroll inside their box instead of overflowing the page.
    context = browser.new_context(base_url=server.base_url, viewport={"width": 800, "height": 900})
    context.set_default_timeout(15_000)
    tab = context.new_page()
    tab.shots = tmp_path
    missing: list[str] = []
    tab.on(
        "response",
        lambda r: (
            missing.append(r.url) if r.status == 404 and r.request.resource_type != "document" else None
        ),
    )
    tab.missing = missing
    try:
        yield tab
    finally:
        context.close()


def accessible(page: Any, name: str) -> None:
    """axe-core on the page as it is: no serious or critical violation; also a screenshot, and the page fits."""
    from axe_playwright_python.sync_playwright import Axe

    results = Axe().run(page)
    bad = [
        f"{v['id']} ({v['impact']}): {v['help']} — {[n['target'] for n in v['nodes']][:3]}"
        for v in results.response["violations"]
        if v["impact"] in ("serious", "critical")
    ]
    assert bad == [], f"{name}: {bad}"
    width = page.evaluate("document.documentElement.scrollWidth")
    wide = page.evaluate(
        "[...document.querySelectorAll('body *')].filter(e => e.getBoundingClientRect().right > "
        "document.documentElement.clientWidth + 1 && !e.closest('.scroll, .flow-graph, pre'))"
        ".slice(0, 5).map(e => e.tagName + '.' + e.className + ' ' + (e.id || ''))"
    )
    assert width <= page.viewport_size["width"] + 1, f"{name} overflows: {width} px: {wide}"
    shot(page, name)


def _schedule(server: RunningServer, name: str) -> None:
    with OrbitClient(server.base_url, api_key=server.keys["admin"]) as client:
        client.create_schedule("shop", name, queue="reports", handler="reports.nightly", cron="30 2 * * *",
                               timezone="Europe/Berlin")  # fmt: skip
        client.create_subscription("shop", "order-results", queues=["fulfilment"])


def test_an_operators_round_through_every_page(page: Any, server: RunningServer, api: FlowApi) -> None:
    seed = Seeder(server, "shop", server.keys)
    try:
        _schedule(server, "nightly")
        failed = seed.failed("order-1001", queue="fulfilment")  # KeyError, as a worker reports it
        flow = f"approval-{uuid.uuid4().hex[:6]}"
        api.publish(flow, GRAPH)
        waiting = api.start(flow, {"order_id": 7})
        doomed = api.start(flow, {"order_id": 8})
        api.signal(doomed["id"], "approve", {"by": "ops"})
        grant = until(lambda: api.lease("fulfilment", 1), what="the ship step's task")[0]
        api.finish(
            grant, ("fail", {"type": "CarrierDown", "message": "no carrier today", "retryable": False})
        )
        api.wait_status(doomed["id"], "FAILED")
    finally:
        seed.close()

    page.goto("/ui/login")
    accessible(page, "login")
    sign_in(page, server.keys["admin"])

    # Overview: the last hour's error types, the schedules and the flows (liveness: the test below).
    live = page.locator("table.queues tbody tr", has_text="fulfilment")
    assert page.locator("table.top-errors", has_text="KeyError").count() == 1
    assert page.locator("table.top-errors", has_text="CarrierDown").count() == 1
    assert page.locator("#schedules-total").inner_text() == "1"
    assert "FAILED" in page.locator("ul.summary").inner_text()
    accessible(page, "overview")

    # Pause and resume a queue from the overview, with a reason; the API sees it.
    live.locator("input[name=reason]").fill("carrier maintenance")
    live.locator("button", has_text="Pause").click()
    page.wait_for_url("**/ui/?done=paused")
    assert "Queue paused." in page.locator(".notice").inner_text()
    queue = httpx.get(f"{server.base_url}/v1/namespaces/shop/queues/fulfilment",
                      headers={"Authorization": f"Bearer {server.keys['read']}"}).json()  # fmt: skip
    assert queue["paused"] is True
    row = page.locator("table.queues tbody tr", has_text="fulfilment")
    assert "paused" in row.inner_text()
    row.locator("input[name=reason]").fill("maintenance over")
    row.locator("button", has_text="Resume").click()
    page.wait_for_url("**/ui/?done=resumed")
    queue = httpx.get(f"{server.base_url}/v1/namespaces/shop/queues/fulfilment",
                      headers={"Authorization": f"Bearer {server.keys['read']}"}).json()  # fmt: skip
    assert queue["paused"] is False

    # Schedules: the list with the next fire, the page with occurrences, pause and resume.
    page.click("nav >> text=Schedules")
    assert "30 2 * * *" in page.locator("table.schedules").inner_text()
    accessible(page, "schedules")
    page.click("table.schedules >> text=nightly")
    assert "UTC" in page.locator("#next-fire").inner_text()
    accessible(page, "schedule")
    page.click("#schedule-control button")
    page.wait_for_url("**/ui/schedules/nightly?done=paused")
    assert "paused" in page.locator("#schedule-state").inner_text()
    page.click("#schedule-control button")
    page.wait_for_url("**/ui/schedules/nightly?done=resumed")
    assert "active" in page.locator("#schedule-state").inner_text()

    # Subscriptions: the backlog, and the deliveries not acked yet with their tasks.
    page.click("nav >> text=Subscriptions")
    assert page.locator("table.subscriptions", has_text="order-results").count() == 1
    accessible(page, "subscriptions")
    page.click("table.subscriptions >> text=order-results")
    assert page.locator(f'table.pending a[href="/ui/tasks/{failed}"]').count() == 1
    accessible(page, "subscription")

    # A flow instance's signals: send one from the form; it is listed and the instance moves on.
    page.goto(f"/ui/flow-instances/{waiting['id']}")
    accessible(page, "flow-instance")
    page.click("#signals-link")
    assert "No signal received." in page.locator("table.signals").inner_text()
    page.fill("#signal-form input[name=name]", "approve")
    page.fill("#signal-form textarea[name=payload]", '{"by": "ops@example.com", "note": "l\'été"}')
    page.click("#signal-form button")
    page.wait_for_url("**/signals?done=sent")
    signals = page.locator("table.signals").inner_text()
    assert "approve" in signals and "ops@example.com" in signals and "l'été" in signals  # no \u escapes
    accessible(page, "flow-signals")
    page.fill("#signal-form input[name=name]", "approve")
    page.fill("#signal-form textarea[name=payload]", "{not json")
    page.click("#signal-form button")
    assert "not JSON (line 1, column 2" in page.locator(".error").inner_text()
    assert page.locator("#signal-form textarea[name=payload]").input_value() == "{not json"  # kept
    instance = until(lambda: (i := api.instance(waiting["id"]))["steps"] and i, what="the ship step")

    # The step's task page links to its instance.
    page.goto(f"/ui/tasks/{instance['steps'][0]['task_id']}")
    page.click("#flow-instance-link")
    page.wait_for_url(f"**/ui/flow-instances/{waiting['id']}")

    # A FAILED instance says why and links the failing step.
    page.goto(f"/ui/flow-instances/{doomed['id']}")
    why = page.locator("#failed-why").inner_text()
    assert "ship" in why and "CarrierDown" in why and "no carrier today" in why
    page.click("#failing-step")
    page.wait_for_url(f"**/ui/tasks/{grant['task']['id']}")
    accessible(page, "task-of-a-failed-step")

    # The task list has error type, idempotency key and retry-of columns; the rest of the pages pass axe.
    page.goto("/ui/tasks")
    row = page.locator("table.tasks tbody tr", has_text="order-1001")
    assert "KeyError" in row.inner_text()
    accessible(page, "tasks")
    for path, name in (("/ui/review", "review"), ("/ui/flows", "flows"), ("/ui/api-keys", "api-keys"),
                       (f"/ui/tasks/{failed}", "task"), ("/ui/tasks/no-such-task", "error")):  # fmt: skip
        page.goto(path)
        accessible(page, name)
    assert page.missing == []  # no 404 for an asset (the favicon included)


def test_a_review_with_bad_json_keeps_the_form(page: Any, server: RunningServer) -> None:
    seed = Seeder(server, "shop", server.keys)
    try:
        task = seed.needs_review()
    finally:
        seed.close()
    sign_in(page, server.keys["admin"])
    page.goto(f"/ui/tasks/{task}")
    page.check("#review-form input[value=succeeded]")
    page.fill("#review-form input[name=reason]", "charged at the provider")
    page.fill("#review-form input[name=evidence_ref]", "PSP-1234")
    page.fill("#review-form textarea[name=result]", "{oops")
    page.click("#review-form button")
    assert "not JSON" in page.locator(".error").inner_text()
    assert page.locator("#review-form input[name=reason]").input_value() == "charged at the provider"
    assert page.locator("#review-form input[name=evidence_ref]").input_value() == "PSP-1234"
    assert page.locator("#review-form textarea[name=result]").input_value() == "{oops"
    assert page.locator("#review-form input[value=succeeded]").is_checked()
    # The radio button sits beside its label's text, not a column away.
    box = page.locator("#review-form label.choice").first.bounding_box()
    assert box is not None and box["width"] < 200
    accessible(page, "review-form-kept")


def test_overview_shows_worker_liveness_from_lease_calls(
    page: Any, server: RunningServer, api: FlowApi
) -> None:
    queue = f"idle-{uuid.uuid4().hex[:6]}"
    with server.engine.begin() as conn:
        store.create_queue(conn, "shop", queue)
    sign_in(page, server.keys["read"])
    row = page.locator("table.queues tbody tr", has_text=queue)
    assert row.locator("td").nth(-2).inner_text() == "0" and row.locator("td").nth(-1).inner_text() == "never"
    assert api.lease(queue, 1, wait=0.0) == []  # an idle worker: no task, but alive
    page.reload()
    row = page.locator("table.queues tbody tr", has_text=queue)
    assert row.locator("td").nth(-2).inner_text() == "1"  # workers seen in the last minute
    assert row.locator("td").nth(-2).get_attribute("title") == "flow-test"
    assert row.locator("td").nth(-1).inner_text().endswith("ago")


def test_an_instances_updated_time_moves_with_its_tokens(api: FlowApi) -> None:
    flow = f"moves-{uuid.uuid4().hex[:6]}"
    api.publish(flow, GRAPH)
    started = api.start(flow, {"order_id": 9})
    api.signal(started["id"], "approve", {"by": "ops"})  # the token moves on to the ship step
    moved = until(lambda: (i := api.instance(started["id"]))["steps"] and i, what="the ship step")
    assert moved["updated_at"] > started["updated_at"]
