"""The ASGI middleware in front of every route: request ids, the body size limit and timeout, the
last-resort 500, HTTP metrics and the access log.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orbit_server.api.metrics import Metrics, method_label
from orbit_server.api.problems import problem_response
from orbit_server.db.engine import nothing_committed, request_writes_tracked

#: One line per request when ``ORBIT_ACCESS_LOG`` is on (README "Running the server").
log = logging.getLogger("orbit_server.app")
access_log = logging.getLogger("orbit_server.access")
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class _BodyTooLarge(StarletteHTTPException):
    """Raised while the body streams in (an HTTPException, so FastAPI passes it through)."""

    code = "payload_too_large"


class _BodyTimeout(StarletteHTTPException):
    """The body did not arrive within ``ORBIT_BODY_TIMEOUT_SECONDS``; the connection is closed after the 408."""

    code = "request_timeout"


#: Query parameters the access log never shows (README "Running the server").
_SECRET_QUERY = re.compile(r"(?<![^&])(cursor)=[^&]*")
#: Path segments the access log never shows: idempotency keys.
_SECRET_PATH = re.compile(r"(/submissions/).+")


def _redacted_target(path: str, query: bytes) -> str:
    target = _SECRET_PATH.sub(r"\1<redacted>", path)
    if query:
        target += "?" + _SECRET_QUERY.sub(r"\1=<redacted>", query.decode("latin-1"))
    return target


class RequestContextMiddleware:
    """Request ids, the body size limit, and the last-resort 500, as plain ASGI.

    It sits outside everything else, so even a crash answers with a problem body
    and an ``X-Request-Id`` (taken from the request when well-formed, else new).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        metrics: Metrics,
        body_timeout_seconds: float = 30.0,
        access_log: bool = False,
        redact: bool = True,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.body_timeout = body_timeout_seconds
        self.access_log = access_log
        self.redact = redact

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id = headers.get("x-request-id", "")
        if not _REQUEST_ID_RE.fullmatch(request_id):
            request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False
        status = 0
        began = time.perf_counter()
        method = scope["method"]
        head = method == "HEAD"
        if head:  # answered as the GET it asks about, without the body (RFC 9110 §9.3.2)
            scope = {**scope, "method": "GET"}

        async def send_with_id(message: Message) -> None:
            nonlocal started, status
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
                route = getattr(scope.get("route"), "path", "unmatched")
                self.metrics.request_seconds.labels(route, method_label(method), str(status)).observe(
                    time.perf_counter() - began
                )
            elif head and message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        limit = self.max_body_bytes
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            response = problem_response(
                413, "payload_too_large", "Request body too large",
                f"the body has {length} bytes; the limit is {limit}", request_id,
            )  # fmt: skip
            await response(scope, receive, send_with_id)
            return
        received = 0
        body_done = False
        loop = asyncio.get_running_loop()
        body_deadline = loop.time() + self.body_timeout

        async def receive_counted() -> Message:
            nonlocal received, body_done
            if body_done:
                return await receive()
            try:
                async with asyncio.timeout_at(body_deadline):
                    message = await receive()
            except TimeoutError:
                raise _BodyTimeout(
                    408,
                    f"the body did not arrive within {self.body_timeout:g} s (ORBIT_BODY_TIMEOUT_SECONDS)",
                    headers={"Connection": "close"},
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge(413, f"the body exceeds the limit of {limit} bytes")
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        try:
            with request_writes_tracked() as writes:
                await self.app(scope, receive_counted, send_with_id)
        except Exception as exc:
            if nothing_committed(exc, writes):  # nothing was done: 503, retry (README "Scaling out")
                log.warning("database unavailable (request_id=%s): %s", request_id, getattr(exc, "orig", exc))
                if started:
                    raise
                response = problem_response(
                    503, "database_unavailable", "Database unavailable",
                    "the server's database cannot serve right now (unreachable, or a cluster node outside its "
                    "primary component); nothing was done: retry shortly", request_id,
                )  # fmt: skip
                response.headers["Retry-After"] = "1"
                await response(scope, receive, send_with_id)
                return
            log.exception("unhandled error (request_id=%s)", request_id)
            if started:
                raise
            response = problem_response(
                500, "internal_error", "Internal server error",
                f"an unexpected error occurred; quote request id {request_id} when reporting it", request_id,
            )  # fmt: skip
            await response(scope, receive, send_with_id)
        finally:
            if self.access_log and access_log.isEnabledFor(logging.INFO):  # else the line is dropped anyway
                self._log_access(scope, method, status, began, request_id)

    def _log_access(self, scope: Scope, method: str, status: int, began: float, request_id: str) -> None:
        path, query = scope.get("path", ""), scope.get("query_string", b"")
        target = (
            _redacted_target(path, query)
            if self.redact
            else path + ("?" + query.decode("latin-1") if query else "")
        )
        client = scope.get("client")
        access_log.info(
            '%s - "%s %s HTTP/%s" %d %.1fms request_id=%s',
            f"{client[0]}:{client[1]}" if client else "-",
            method,
            target,
            scope.get("http_version", "1.1"),
            status,
            (time.perf_counter() - began) * 1000,
            request_id,
        )
