"""``/docs`` (Swagger UI) and ``/redoc`` (ReDoc), served from installed packages, in a sandbox.

FastAPI's own pages load ``swagger-ui-dist@5`` and ``redoc@2`` from a CDN: unpinned third-party
scripts running on the console's origin (a script inside ``/docs`` in a signed-in browser could
read ``/ui/api-keys`` and mint a key), and a blank page on a host without internet. Here:

- the scripts and styles come from the ``fastapi-offline`` package (Swagger UI and ReDoc's
  standalone bundles), under ``/docs/assets/``, with our own two start-up scripts;
- the OpenAPI document is embedded in the page as a JSON data block, so the page makes no
  request of its own (``connect-src 'none'``);
- each page's ``Content-Security-Policy`` starts with ``sandbox allow-scripts allow-popups``: the
  browser runs it in a unique, opaque origin, so its scripts cannot read the console's pages or
  send its ``SameSite=Strict`` cookie, whatever a script does; no inline script runs
  (``script-src 'self'``), nothing can frame it.

"Try it out" is off (it would need the server's origin): use ``curl`` or the client (README
"HTTP API"). ``ORBIT_DOCS=false`` turns both pages off (``/openapi.json`` stays).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

__all__ = ["DOCS_CSP", "docs_router"]

_OWN = Path(__file__).parent / "docs_assets"
_ASSETS: dict[str, tuple[Any, str]] = {
    "swagger-ui-bundle.js": (files("fastapi_offline") / "static" / "swagger-ui-bundle.js", "text/javascript"),
    "swagger-ui.css": (files("fastapi_offline") / "static" / "swagger-ui.css", "text/css"),
    "redoc.standalone.js": (files("fastapi_offline") / "static" / "redoc.standalone.js", "text/javascript"),
    "favicon.png": (files("fastapi_offline") / "static" / "favicon.png", "image/png"),
    "swagger-init.js": (_OWN / "swagger-init.js", "text/javascript"),
    "redoc-init.js": (_OWN / "redoc-init.js", "text/javascript"),
}

#: The pages' policy: a sandbox (an opaque origin: no access to the console or its cookie), only
#: our own scripts, no requests, no frames. ReDoc needs inline styles and a blob: worker for search.
DOCS_CSP = (
    "sandbox allow-scripts allow-popups; default-src 'none'; script-src 'self'; "
    "style-src 'self' 'unsafe-inline'; img-src 'self' data:; font-src 'self' data:; worker-src blob:; "
    "connect-src 'none'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'"
)
_PAGE_HEADERS = {
    "Content-Security-Policy": DOCS_CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _page(title: str, head: str, body: str, spec: dict[str, Any]) -> str:
    # "<" escaped so that no text of the document can close the data block.
    data = json.dumps(spec, separators=(",", ":")).replace("<", "\\u003c")
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<title>{title}</title><link rel="icon" href="/docs/assets/favicon.png">{head}</head>'
        f'<body>{body}<script type="application/json" id="openapi">{data}</script></body></html>'
    )


def docs_router(openapi: Callable[[], dict[str, Any]], title: str) -> APIRouter:
    """The ``/docs``, ``/redoc`` and ``/docs/assets/{name}`` routes; ``openapi`` gives the document."""
    router = APIRouter(include_in_schema=False)
    cache: dict[str, bytes] = {}

    @router.get("/docs")
    def swagger_ui() -> HTMLResponse:
        html = _page(
            f"{title} API reference",
            '<link rel="stylesheet" href="/docs/assets/swagger-ui.css">'
            '<script src="/docs/assets/swagger-ui-bundle.js"></script>'
            '<script src="/docs/assets/swagger-init.js"></script>',
            '<div id="swagger-ui"></div>',
            openapi(),
        )
        return HTMLResponse(html, headers=_PAGE_HEADERS)

    @router.get("/redoc")
    def redoc() -> HTMLResponse:
        html = _page(
            f"{title} API reference",
            '<script src="/docs/assets/redoc.standalone.js"></script><script src="/docs/assets/redoc-init.js"></script>',
            '<div id="redoc"></div>',
            openapi(),
        )
        return HTMLResponse(html, headers=_PAGE_HEADERS)

    @router.get("/docs/assets/{name}")
    def asset(name: str) -> Response:
        if name not in _ASSETS:
            return Response("no such asset\n", status_code=404, media_type="text/plain")
        source, media_type = _ASSETS[name]
        if name not in cache:
            cache[name] = source.read_bytes()
        return Response(
            cache[name],
            media_type=media_type,
            headers={"Cache-Control": "public, max-age=86400", "X-Content-Type-Options": "nosniff"},
        )

    return router
