"""The console's session: a signed, ``HttpOnly``, ``SameSite=Strict`` cookie.

It holds the SHA-256 of the API key the operator signed in with (never the key) and a
per-session CSRF token. Every request looks the digest up again (through the server's
key cache), so a revoked key loses the console within ``ORBIT_API_KEY_CACHE_SECONDS``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from dataclasses import dataclass

from itsdangerous import BadSignature, URLSafeTimedSerializer
from starlette.requests import Request
from starlette.responses import Response

__all__ = ["COOKIE", "SESSION_SECONDS", "Session", "Sessions"]

log = logging.getLogger("orbit_server.console")

COOKIE = "orbit_console"
#: A session ends this long after sign-in, in seconds (12 hours).
SESSION_SECONDS = 12 * 3600


@dataclass(frozen=True, slots=True)
class Session:
    key_hash: str
    csrf: str

    def csrf_ok(self, token: str | None) -> bool:
        """Whether a form's token is this session's (constant-time comparison)."""
        return token is not None and hmac.compare_digest(token.encode("utf-8"), self.csrf.encode("utf-8"))


class Sessions:
    """Issue and read session cookies signed with ``secret`` (``None``: a random one for this process)."""

    def __init__(self, secret: str | None) -> None:
        if not secret:
            secret = secrets.token_urlsafe(32)
            log.warning(
                "ORBIT_CONSOLE_SECRET is not set: the web console signs its sessions with a random secret, "
                "so sessions end when this process restarts and are not valid on other server processes "
                "(README, Web console)"
            )
        self._serializer = URLSafeTimedSerializer(secret, salt="orbit-console-session")

    @staticmethod
    def key_hash(key: str) -> str:
        return hashlib.sha256(key.encode("utf-8")).hexdigest()

    def issue(self, request: Request, response: Response, key: str) -> Session:
        session = Session(key_hash=self.key_hash(key), csrf=secrets.token_urlsafe(32))
        response.set_cookie(
            COOKIE,
            self._serializer.dumps([session.key_hash, session.csrf]),
            max_age=SESSION_SECONDS,
            path="/ui",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return session

    def read(self, request: Request) -> Session | None:
        raw = request.cookies.get(COOKIE)
        if not raw:
            return None
        try:
            key_hash, csrf = self._serializer.loads(raw, max_age=SESSION_SECONDS)
        except (BadSignature, ValueError, TypeError):
            return None
        if not isinstance(key_hash, str) or not isinstance(csrf, str):
            return None
        return Session(key_hash=key_hash, csrf=csrf)

    @staticmethod
    def clear(response: Response) -> None:
        response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict")
