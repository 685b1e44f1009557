"""JSON request bodies, refused early and clearly (README "HTTP API", bad input):

- a body sent to an API route (``/v1/...``) without ``Content-Type: application/json`` (or another ``+json``
  type) is answered ``415 unsupported_media_type`` naming the header, before any route runs (``curl -d``
  sends ``application/x-www-form-urlencoded`` unless told otherwise; the old answer was a puzzling
  ``422 "body: Input should be a valid dictionary"``);
- a body that is not JSON at all is ``400 invalid_json`` with the parser's reason and the line and column
  where it stopped (not ``422 "body.24: JSON decode error"``, which reads like a field path).
"""

from __future__ import annotations

import email.message
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["JsonContentTypeMiddleware", "invalid_json", "is_json_media_type"]

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def is_json_media_type(value: str | None) -> bool:
    """``application/json`` or ``application/<anything>+json``, parameters (``charset``) allowed."""
    if not value:
        return False
    message = email.message.Message()
    message["content-type"] = value
    if message.get_content_maintype() != "application":
        return False
    subtype = message.get_content_subtype()
    return subtype == "json" or subtype.endswith("+json")


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"content-length":
            return value.strip() not in (b"", b"0")
        if name == b"transfer-encoding":
            return True
    return False


class JsonContentTypeMiddleware:
    """Answers ``415 unsupported_media_type`` to a request under ``prefix`` that carries a body that is not
    declared as JSON. ``problem(status, code, title, detail, scope)`` builds the response (the app's one
    problem body, with its request id)."""

    def __init__(self, app: ASGIApp, *, problem: Any, prefix: str = "/v1/") -> None:
        self.app = app
        self.problem = problem
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] in _BODY_METHODS
            and scope["path"].startswith(self.prefix)
            and _has_body(scope["headers"])
        ):
            declared = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"content-type"), None)
            if not is_json_media_type(declared):
                said = f"Content-Type {declared!r}" if declared else "no Content-Type"
                response = self.problem(
                    415,
                    "unsupported_media_type",
                    "Unsupported media type",
                    f"the body must be JSON sent with the header 'Content-Type: application/json' (this request "
                    f"has {said}; curl -d needs -H 'Content-Type: application/json')",
                    scope,
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def invalid_json(errors: list[dict[str, Any]], body: Any) -> str | None:
    """The ``400 invalid_json`` detail for FastAPI's JSON decode error (``type`` ``json_invalid``, ``loc``
    ``("body", position)``, the document as ``body``), or ``None`` for any other validation error."""
    found = next((e for e in errors if e.get("type") == "json_invalid"), None)
    if found is None:
        return None
    loc = found.get("loc", ())
    position = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else 0
    reason = str((found.get("ctx") or {}).get("error") or "not JSON")
    document = body if isinstance(body, str) else ""
    line = document.count("\n", 0, position) + 1
    column = position - document.rfind("\n", 0, position)
    return f"the body is not JSON: {reason} at line {line}, column {column} (character {position + 1})"
