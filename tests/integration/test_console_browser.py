"""The web console in a real browser: Debian's chromium driven by Playwright, against a real server.

One browser for the module. Each page is saved as a screenshot under the test's tmp directory
(``pytest --basetemp=DIR`` keeps them somewhere known). Without chromium the tests are skipped,
except under ``CI=true``, where they fail: `.ci/run` installs it (``apt-get install chromium``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import IN_CI, DatabaseFactory
from tests.console_support import TRACEBACK, Seeder
from tests.servers import RunningServer, run_server

CHROMIUM = os.environ.get("ORBIT_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def _missing(reason: str) -> None:
    if IN_CI:
        pytest.fail(
            f"{reason} (CI=true: the browser tests must run; .ci/run installs chromium)", pytrace=False
        )
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed (pip install -e '.[dev]')")
    if not Path(CHROMIUM).exists():
        _missing(f"no chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture(scope="module")
def server(make_database: DatabaseFactory) -> Iterator[RunningServer]:
    with run_server(make_database("sqlite"), console_secret="browser-test") as running:
        running.keys = running.add_namespace("shop")
        yield running


@pytest.fixture(scope="module")
def seed(server: RunningServer) -> Iterator[Seeder]:
    seeder = Seeder(server, "shop", server.keys)
    yield seeder
    seeder.close()


@pytest.fixture
def page(browser: Any, server: RunningServer, tmp_path: Path) -> Iterator[Any]:
    context = browser.new_context(base_url=server.base_url, viewport={"width": 1280, "height": 900})
    context.set_default_timeout(10_000)
    tab = context.new_page()
    tab.shots = tmp_path  # where :func:`shot` saves
    try:
        yield tab
    finally:
        context.close()


def shot(page: Any, name: str) -> None:
    path = Path(page.shots) / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 0


def sign_in(page: Any, key: str) -> None:
    page.goto("/ui/")
    assert page.url.endswith("/ui/login?next=%2Fui%2F")
    shot(page, "sign-in")
    page.fill("input[name=api_key]", key)
    page.click("button[type=submit]")
    page.wait_for_url("**/ui/")


def test_sign_in_overview_filter_and_a_failed_tasks_traceback_then_retry(
    page: Any, server: RunningServer, seed: Seeder
) -> None:
    failed = seed.failed("order-1001")
    for _ in range(3):
        seed.submit(handler="ship")
    sign_in(page, server.keys["admin"])
    assert page.locator("header .who").inner_text().startswith("namespace shop")
    assert page.locator("table.queues tbody tr").count() >= 2
    shot(page, "overview")

    page.click("nav >> text=Tasks")
    page.fill("input[name=idempotency_key]", "order-1001")
    page.click("form.filters button[type=submit]")
    page.wait_for_url("**/ui/tasks?*idempotency_key=order-1001*")
    rows = page.locator("table.tasks tbody tr")
    assert rows.count() == 1 and "FAILED" in rows.first.inner_text()
    shot(page, "tasks-filtered")
    page.select_option("select[name=status]", "WAITING")
    page.fill("input[name=idempotency_key]", "")
    page.click("form.filters button[type=submit]")
    page.wait_for_url("**status=WAITING*")
    assert page.locator("table.tasks tbody tr").count() == 3
    assert all("ship" in text for text in page.locator("table.tasks tbody tr").all_inner_texts())

    page.goto(f"/ui/tasks/{failed}")
    assert page.locator("#task-status").inner_text() == "FAILED"
    assert "KeyError" in page.locator("#error").inner_text()
    assert page.locator("#traceback").inner_text().strip() == TRACEBACK.strip()
    assert '"customer": 41' in page.locator("#params").inner_text()
    assert "worker-7" in page.locator("table.attempts").inner_text()
    timeline = page.locator("#timeline").inner_text()
    assert "accepted" in timeline and "RUNNING → FAILED" in timeline
    shot(page, "task-failed")

    page.fill("#retry-form input[name=reason]", "order_id now sent by the shop")
    page.click("#retry-form button[type=submit]")
    page.wait_for_url(re.compile(r".*/ui/tasks/[0-9a-f-]{36}\?done=retried"))
    assert page.locator("#task-status").inner_text() == "WAITING"
    assert failed in page.locator("dl.facts").inner_text()  # the retry_of chain, backwards
    shot(page, "task-retried")
    page.goto(f"/ui/tasks/{failed}")
    assert "Retried as" in page.locator("dl.facts").inner_text()
    assert "order_id now sent by the shop" in page.locator("#timeline").inner_text()
    assert page.locator("#retry-form").count() == 0


def test_review_a_needs_review_task_from_the_inbox(page: Any, server: RunningServer, seed: Seeder) -> None:
    task_id = seed.needs_review()
    sign_in(page, server.keys["admin"])
    page.click("nav >> text=Needs review")
    page.wait_for_url("**/ui/review")
    shot(page, "needs-review")
    page.click(f"a[href='/ui/tasks/{task_id}']")
    assert page.locator("#task-status").inner_text() == "NEEDS_REVIEW"
    shot(page, "task-needs-review")
    page.check("#review-form input[value=failed]")
    page.fill("#review-form input[name=reason]", "payment provider says never charged")
    page.fill("#review-form input[name=evidence_ref]", "PSP-4711")
    page.click("#review-form button[type=submit]")
    page.wait_for_url("**?done=reviewed")
    assert page.locator("#task-status").inner_text() == "FAILED"
    last = page.locator("#timeline li").last.inner_text()
    assert (
        "reviewed" in last and "NEEDS_REVIEW → FAILED" in last and "PSP-4711" in last and "api_key:" in last
    )
    page.goto("/ui/review")
    assert task_id not in page.content()


def test_create_and_revoke_a_key(page: Any, server: RunningServer, browser: Any) -> None:
    sign_in(page, server.keys["admin"])
    page.click("nav >> text=API keys")
    page.select_option("select[name=role]", "read")
    page.fill("input[name=label]", "dashboard")
    page.click("form.filters button[type=submit]")
    new_key = page.locator("#new-key").inner_text().strip()
    assert new_key.startswith("orbit_")
    shot(page, "api-keys-created")
    row = page.locator("tr", has_text="dashboard")
    row.locator("input[name=reason]").fill("dashboard retired")
    row.locator("button").click()
    page.wait_for_url("**/ui/api-keys")
    row = page.locator("tr", has_text="dashboard")
    assert "UTC" in row.locator("td.revoked").inner_text() and row.locator("button").count() == 0
    shot(page, "api-keys-revoked")

    other = browser.new_context(base_url=server.base_url)
    try:
        tab = other.new_page()
        tab.goto("/ui/login")
        tab.fill("input[name=api_key]", new_key)
        tab.click("button[type=submit]")
        assert "unknown or revoked" in tab.locator(".error").inner_text()
    finally:
        other.close()


def test_a_read_key_sees_no_action_buttons(page: Any, server: RunningServer, seed: Seeder) -> None:
    task = seed.submit()
    sign_in(page, server.keys["read"])
    assert page.locator("nav >> text=API keys").count() == 0
    page.goto(f"/ui/tasks/{task['id']}")
    assert (
        page.locator("#cancel-form").count() == 0 and page.locator("#task-status").inner_text() == "WAITING"
    )
    shot(page, "task-read-key")
    page.click("header button:has-text('Sign out')")
    page.wait_for_url("**/ui/login")


def test_a_flow_instance_page_draws_the_graph_links_the_steps_and_pauses(
    page: Any, server: RunningServer, seed: Seeder
) -> None:
    from tests.flow_support import FlowApi, until

    graph = {
        "start": "approval",
        "nodes": {
            "approval": {"type": "signal", "signal": "approve", "next": "fanout", "timeout_seconds": 3600,
                         "on_timeout": "refund"},
            "fanout": {"type": "parallel", "branches": ["ship", "mail"], "join": "joined"},
            "ship": {"type": "task", "queue": "default", "handler": "orders.ship", "next": "joined"},
            "mail": {"type": "timer", "seconds": 3600, "next": "joined"},
            "joined": {"type": "join", "next": "done"},
            "refund": {"type": "end", "status": "FAILED"},
            "done": {"type": "end"},
        },
    }  # fmt: skip
    api = FlowApi(server.base_url, "shop", server.keys)
    try:
        api.publish("order-browser", graph)
        instance = api.start("order-browser", {"order_id": 1001}, key="order-1001-flow")
        r = api.post("submit", f"/flow-instances/{instance['id']}/signals", {"name": "approve"},
                     **{"Idempotency-Key": "approve"})  # fmt: skip
        assert r.status_code == 201, r.text
        task_id = until(lambda: api.instance(instance["id"])["steps"], what="the ship step")[0]["task_id"]
    finally:
        api.close()
    sign_in(page, server.keys["admin"])
    page.click("nav >> text=Flows")
    page.wait_for_url("**/ui/flows")
    assert "order-browser" in page.locator("#flows").inner_text()
    shot(page, "flows")
    page.click(f"a[href='/ui/flow-instances/{instance['id']}']")
    assert page.locator("#instance-status").inner_text() == "RUNNING"
    graph_box = page.locator("svg#graph")
    assert graph_box.is_visible() and graph_box.bounding_box()["width"] > 800
    states = {
        node: page.locator(f"svg#graph g[data-node={node}]").get_attribute("data-state")
        for node in ("approval", "fanout", "ship", "mail", "joined", "done")
    }
    assert states == {"approval": "passed", "fanout": "forked", "ship": "waiting", "mail": "waiting",
                      "joined": "pending", "done": "pending"}  # fmt: skip
    assert "signal_received" in page.locator("#history").inner_text()
    shot(page, "flow-instance")
    page.click("svg#graph g[data-node=ship]")  # the node is a link to its step's task
    page.wait_for_url(f"**/ui/tasks/{task_id}")
    assert page.locator("#task-status").inner_text() == "WAITING"
    page.go_back()
    page.fill("#pause-form input[name=reason]", "stock audit")
    page.click("#pause-form button[type=submit]")
    page.wait_for_url("**?done=paused")
    assert page.locator("#instance-status").inner_text() == "PAUSED"
    assert "instance_paused" in page.locator("#history").inner_text()
    shot(page, "flow-instance-paused")


@pytest.mark.parametrize("width", [800, 1024, 1280, 1600])
def test_the_queue_gate_buttons_fit_in_the_overview_at_any_width(
    browser: Any, server: RunningServer, seed: Seeder, tmp_path: Path, width: int
) -> None:
    """Issue 30: the queues table was wider than its box at every window width, and the pause/resume
    buttons (its last column) were cut off."""
    seed.queue()
    context = browser.new_context(base_url=server.base_url, viewport={"width": width, "height": 900})
    tab = context.new_page()
    tab.shots = tmp_path
    try:
        sign_in(tab, server.keys["admin"])
        box = tab.locator("main .scroll").first
        overflow = box.evaluate("e => e.scrollWidth - e.clientWidth")
        right = box.bounding_box()["x"] + box.bounding_box()["width"]
        buttons = tab.locator("form.queue-control button")
        assert buttons.count() >= 1
        edges = [b["x"] + b["width"] for b in (buttons.nth(i).bounding_box() for i in range(buttons.count()))]
        shot(tab, f"overview-{width}")
        assert max(edges) <= right, (width, max(edges), right)  # the buttons are in view, at every width
        assert width < 1280 or overflow <= 0, (width, overflow)  # from 1280 px on, the whole table fits
    finally:
        context.close()


def test_a_failed_tasks_page_says_a_plain_exception_is_not_retried(
    page: Any, server: RunningServer, seed: Seeder
) -> None:
    failed = seed.failed("order-not-retried")  # KeyError, not retryable
    sign_in(page, server.keys["read"])
    page.goto(f"/ui/tasks/{failed}")
    assert "raise RetryableError to retry" in page.locator("#not-retried").inner_text()
