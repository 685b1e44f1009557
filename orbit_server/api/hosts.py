"""The ``Host`` check (``ORBIT_ALLOWED_HOSTS``): a defence against DNS rebinding.

A web page of another site that re-points its own name at the server's address sends its own
name as ``Host``; a request whose Host is an IP address or ``localhost`` did not come through
such a name. So the check lets those through always (load balancers' health checks, local
tools), and any other name only if it is listed (``*.example.com`` matches any subdomain).
"""

from __future__ import annotations

import ipaddress

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["AllowedHosts", "host_name", "is_address_or_localhost"]


def host_name(host: str) -> str:
    """The name of a ``Host`` header value, lower-cased, without its port (``[::1]:8080`` -> ``::1``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_address_or_localhost(host: str) -> bool:
    """Whether a ``Host`` header value names an IP address or ``localhost``."""
    name = host_name(host)
    if name == "localhost":
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _matches(name: str, pattern: str) -> bool:
    pattern = pattern.lower()
    if pattern.startswith("*."):
        return name.endswith(pattern[1:])
    return name == pattern


class AllowedHosts:
    """ASGI middleware: ``400`` for a request whose Host is a name not in ``allowed`` (IPs and localhost pass)."""

    def __init__(self, app: ASGIApp, allowed: list[str]) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = Headers(scope=scope).get("host", "")
            name = host_name(host)
            if not is_address_or_localhost(host) and not any(_matches(name, p) for p in self.allowed):
                state = scope.get("state") or {}
                problem = {
                    "type": "about:blank", "title": "Host not allowed", "status": 400, "code": "host_not_allowed",
                    "detail": "this server does not answer to this Host (ORBIT_ALLOWED_HOSTS, README Security)",
                    "request_id": state.get("request_id"),
                }  # fmt: skip
                response = JSONResponse(problem, 400, media_type="application/problem+json")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
