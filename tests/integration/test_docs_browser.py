"""/docs and /redoc in a real browser (Debian's chromium through Playwright) against a real server: they render
from the package's assets with no network beyond the server, and a script inside them cannot reach the console
of a signed-in operator (issue 21 #3: one read /ui/api-keys, took the CSRF token and minted an admin key)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import DatabaseFactory
from tests.integration.test_console_browser import browser  # noqa: F401 (the fixture)
from tests.servers import RunningServer, run_server


@pytest.fixture(scope="module")
def server(make_database: DatabaseFactory) -> Iterator[RunningServer]:
    with run_server(make_database("sqlite"), console_secret="docs-test") as running:
        running.keys = running.add_namespace("shop")
        yield running


def _signed_in_page(browser: Any, server: RunningServer) -> Any:  # noqa: F811
    context = browser.new_context()
    page = context.new_page()
    page.goto(f"{server.base_url}/ui/login")
    page.fill("input[name=api_key]", server.keys["admin"])
    page.click("button[type=submit]")
    page.wait_for_url(f"{server.base_url}/ui/")
    return page


def test_docs_render_offline_and_cannot_reach_the_console(browser: Any, server: RunningServer) -> None:  # noqa: F811
    page = _signed_in_page(browser, server)
    outside: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(server.base_url) or r.url.startswith("data:")
            or r.url.startswith("blob:") else outside.append(r.url))  # fmt: skip
    page.goto(f"{server.base_url}/docs")
    page.wait_for_selector(".opblock", timeout=20_000)
    assert page.locator(".opblock").count() > 40  # every operation of the API is listed
    assert page.evaluate("window.origin") == "null"  # the sandbox: an opaque origin
    stolen = page.evaluate(
        "fetch('/ui/api-keys', {credentials: 'include'}).then(r => r.text()).catch(e => 'refused')"
    )
    assert stolen == "refused"
    keys_before = page.context.request.get(f"{server.base_url}/ui/api-keys").text().count('id="key-')
    page.goto(f"{server.base_url}/redoc")
    page.wait_for_selector("h1", timeout=20_000)
    assert "Orbit" in page.inner_text("h1")
    page.goto(f"{server.base_url}/ui/api-keys")
    assert page.content().count('id="key-') == keys_before  # nothing was minted
    # Nothing but the server's own assets was asked for (ReDoc's hosted logo is not: the CSP blocks it first).
    assert [url for url in outside if "redoc.ly" not in url] == []
