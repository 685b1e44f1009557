"""The console's session: a row on the server, named by a signed, ``HttpOnly``, ``SameSite=Strict`` cookie.

Signing in stores a row in ``console_sessions`` (the SHA-256 of a random 256-bit token, the
API key's id, its expiry, by the database clock) and sets a cookie holding the token and a
per-session CSRF token, signed with ``ORBIT_CONSOLE_SECRET``. Every request reads the row
again, joined with its key: signing out deletes the row, revoking the key deletes its rows
(and a revoked key's rows match no more), and a row past ``expires_at`` matches no more. So a
cookie saved before sign-out or revocation is worth nothing after it, on every server process.
The cookie never holds the API key.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from dataclasses import dataclass
from datetime import timedelta

import sqlalchemy as sa
from itsdangerous import BadSignature, URLSafeTimedSerializer
from sqlalchemy.engine import Engine
from starlette.requests import Request
from starlette.responses import Response

from orbit_server.db.engine import db_now
from orbit_server.db.schema import api_keys, console_sessions, namespaces
from orbit_server.tasks import store

__all__ = ["COOKIE", "SESSION_SECONDS", "Session", "Sessions"]

log = logging.getLogger("orbit_server.console")

COOKIE = "orbit_console"
#: A session ends this long after sign-in, in seconds (12 hours).
SESSION_SECONDS = 12 * 3600


@dataclass(frozen=True, slots=True)
class Session:
    token_hash: str
    csrf: str

    def csrf_ok(self, token: str | None) -> bool:
        """Whether a form's token is this session's (constant-time comparison)."""
        return token is not None and hmac.compare_digest(token.encode("utf-8"), self.csrf.encode("utf-8"))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class Sessions:
    """Issue, read and end console sessions stored through ``engine``, their cookies signed with
    ``secret`` (``None``: a random one for this process). The methods do blocking database I/O:
    call them from a thread (``run_in_threadpool``)."""

    def __init__(self, secret: str | None, engine: Engine) -> None:
        if not secret:
            secret = secrets.token_urlsafe(32)
            log.warning(
                "ORBIT_CONSOLE_SECRET is not set: the web console signs its sessions with a random secret, "
                "so sessions end when this process restarts and are not valid on other server processes "
                "(README, Web console)"
            )
        self._serializer = URLSafeTimedSerializer(secret, salt="orbit-console-session")
        self._engine = engine

    @staticmethod
    def key_hash(key: str) -> str:
        return _digest(key)

    def issue(self, request: Request, response: Response, principal: store.Principal) -> Session:
        """Store a new session of ``principal``'s key and set its cookie on ``response``."""
        token = secrets.token_urlsafe(32)
        session = Session(token_hash=_digest(token), csrf=secrets.token_urlsafe(32))
        with self._engine.begin() as conn:
            now = db_now(conn)
            conn.execute(console_sessions.delete().where(console_sessions.c.expires_at <= now))
            conn.execute(
                console_sessions.insert().values(
                    token_hash=session.token_hash,
                    api_key_id=principal.key_id,
                    created_at=now,
                    expires_at=now + timedelta(seconds=SESSION_SECONDS),
                )
            )
        response.set_cookie(
            COOKIE,
            self._serializer.dumps([token, session.csrf]),
            max_age=SESSION_SECONDS,
            path="/ui",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return session

    def _cookie(self, request: Request) -> Session | None:
        raw = request.cookies.get(COOKIE)
        if not raw:
            return None
        try:
            token, csrf = self._serializer.loads(raw, max_age=SESSION_SECONDS)
        except (BadSignature, ValueError, TypeError):
            return None
        if not isinstance(token, str) or not isinstance(csrf, str):
            return None
        return Session(token_hash=_digest(token), csrf=csrf)

    def read(self, request: Request) -> tuple[store.Principal, Session] | None:
        """The signed-in key and the session of ``request``'s cookie; ``None`` if there is none, or it
        was ended (sign-out, revocation) or expired."""
        session = self._cookie(request)
        if session is None:
            return None
        with self._engine.begin() as conn:
            now = db_now(conn)
            row = conn.execute(
                sa.select(api_keys.c.id, api_keys.c.role, namespaces.c.id.label("ns_id"), namespaces.c.name)
                .select_from(
                    console_sessions.join(api_keys, api_keys.c.id == console_sessions.c.api_key_id).join(
                        namespaces, namespaces.c.id == api_keys.c.namespace_id
                    )
                )
                .where(
                    console_sessions.c.token_hash == session.token_hash,
                    console_sessions.c.expires_at > now,
                    api_keys.c.revoked_at.is_(None),
                )
            ).first()
        if row is None:
            return None
        principal = store.Principal(key_id=row.id, namespace_id=row.ns_id, namespace=row.name, role=row.role)
        return principal, session

    def end(self, request: Request, response: Response) -> None:
        """Delete ``request``'s session, if any, and clear its cookie on ``response`` (sign-out)."""
        session = self._cookie(request)
        if session is not None:
            with self._engine.begin() as conn:
                conn.execute(
                    console_sessions.delete().where(console_sessions.c.token_hash == session.token_hash)
                )
        self.clear(response)

    @staticmethod
    def clear(response: Response) -> None:
        response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict")
