"""JSON request bodies are UTF-8 without a byte order mark (RFC 8259 §8.1), as the README says.

Python's ``json.loads`` of bytes guesses the encoding: it reads UTF-16 and UTF-32 bodies and skips
a UTF-8 BOM, so such bodies were accepted (201) although the README says bodies are UTF-8 only.
:class:`Utf8JsonBodies` refuses them before any parsing: ``400 invalid_utf8``, naming what it saw.
A JSON text starts with an ASCII character (after optional whitespace), so a NUL byte among its
first four bytes means UTF-16 or UTF-32 (RFC 4627 §3).
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["NotUtf8Body", "Utf8JsonBodies", "encoding_problem"]

_BOMS = (
    (b"\xef\xbb\xbf", "a UTF-8 byte order mark"),
    (b"\x00\x00\xfe\xff", "a UTF-32 byte order mark"),
    (b"\xff\xfe\x00\x00", "a UTF-32 byte order mark"),
    (b"\xfe\xff", "a UTF-16 byte order mark"),
    (b"\xff\xfe", "a UTF-16 byte order mark"),
)


class NotUtf8Body(HTTPException):
    """Raised while the body streams in; the app's handler answers it as a problem body."""

    code = "invalid_utf8"


def encoding_problem(start: bytes) -> str | None:
    """What makes a JSON body beginning with ``start`` (its first 4 bytes or fewer) not plain UTF-8."""
    for bom, name in _BOMS:
        if start.startswith(bom):
            return f"the body starts with {name}; JSON bodies are UTF-8 without one (RFC 8259 §8.1)"
    if b"\x00" in start:
        return "the body looks like UTF-16 or UTF-32 (a NUL byte); JSON bodies are UTF-8 (RFC 8259 §8.1)"
    return None


def _is_json(headers: Headers) -> bool:
    media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


class Utf8JsonBodies:
    """ASGI middleware: a JSON body that starts with a BOM or is UTF-16/32 raises :class:`NotUtf8Body` (400)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_json(Headers(scope=scope)):
            await self.app(scope, receive, send)
            return
        start = b""
        checked = False

        async def receive_checked() -> Message:
            nonlocal start, checked
            message = await receive()
            if not checked and message["type"] == "http.request":
                start += message.get("body", b"")[: 4 - len(start)]
                if len(start) >= 4 or not message.get("more_body", False):
                    checked = True
                    if start and (problem := encoding_problem(start)) is not None:
                        raise NotUtf8Body(400, problem)
            return message

        await self.app(scope, receive_checked, send)
