"""The documentation site in a real browser (issue 29): built with mkdocs, served from a local directory
with no network, and looked at in Debian's chromium (Playwright): the home page, a tutorial, the HTTP API
reference, a how-to guide and the CLI reference render with the site's navigation and search, load nothing
from another host, and axe-core finds no serious or critical accessibility issue. Screenshots go to the
test's tmp directory (``pytest --basetemp=DIR`` keeps them somewhere known). Without chromium the tests
skip, except under ``CI=true``. (The OpenAPI operations page passed too, once its tab labels wrapped, but
axe takes two minutes on its 50 operations; it is left out of the run.)
"""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.docs_pages import REPO
from tests.integration.test_console_browser import browser as browser

PAGES = {
    "home": "",
    "tutorial": "tutorials/first-hour/",
    "http-api": "reference/http-api/",
    "how-to": "how-to/run-relays/",
    "cli": "reference/cli/",
}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    built = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(built)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(built))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.RequestHandlerClass.log_message = lambda *args: None  # type: ignore[method-assign]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("name", list(PAGES))
def test_a_page_renders_offline_and_axe_finds_no_serious_issue(
    browser: Any,
    site: str,
    name: str,
    tmp_path: Path,
) -> None:
    from axe_playwright_python.sync_playwright import Axe

    context = browser.new_context(viewport={"width": 1280, "height": 900})
    elsewhere: list[str] = []
    context.route(
        "**/*",
        lambda route: (
            route.continue_()
            if route.request.url.startswith(site)
            else (elsewhere.append(route.request.url), route.abort())
        ),
    )
    page = context.new_page()
    try:
        page.goto(site + PAGES[name])
        page.wait_for_load_state("networkidle")
        assert page.locator("nav.md-nav--primary").count() == 1, "no navigation"
        assert page.locator("input.md-search__input").count() == 1, "no search"
        assert page.locator("article h1").count() >= 1
        page.screenshot(path=str(tmp_path / f"{name}.png"), full_page=True)
        bad = [
            f"{v['id']} ({v['impact']}): {v['help']} — {[n['target'] for n in v['nodes']][:3]}"
            for v in Axe().run(page).response["violations"]
            if v["impact"] in ("serious", "critical")
        ]
        assert bad == [], f"{name}: {bad}"
        assert elsewhere == [], f"{name} asked another host for {elsewhere}"
    finally:
        context.close()
