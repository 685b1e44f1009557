"""API-key authentication and role checks, shared by every router (DESIGN §8).

The check runs on the event loop: a key seen within ``ORBIT_API_KEY_CACHE_SECONDS`` costs
no database round trip and no thread-pool hop; only a cache miss goes to the database,
in the thread pool.
"""

from __future__ import annotations

import hashlib
import time
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool

from . import errors, store

__all__ = ["Caller", "KeyCache", "authorize"]

_bearer = HTTPBearer(auto_error=False, description="An API key created with `orbit-server api-key create`.")


class KeyCache:
    """Recently seen API keys → their principal, each for ``ttl`` seconds (process clock).

    Saves a database round trip per request. Unknown keys are never cached, so a new key
    works at once; a revoked key keeps working for up to ``ttl`` seconds. ``ttl`` 0 turns
    the cache off. Keys are held by their SHA-256 only.
    """

    def __init__(self, ttl: float, max_entries: int = 10_000) -> None:
        self._ttl = ttl
        self._max = max_entries
        self._entries: dict[str, tuple[float, store.Principal]] = {}

    @staticmethod
    def _digest(key: str) -> str:
        return hashlib.sha256(key.encode("utf-8")).hexdigest()

    def get(self, key: str) -> store.Principal | None:
        return self.get_digest(self._digest(key))

    def put(self, key: str, principal: store.Principal) -> None:
        self.put_digest(self._digest(key), principal)

    def get_digest(self, digest: str) -> store.Principal | None:
        """Like :meth:`get`, given the key's SHA-256 (hex) instead (the web console's session holds only that)."""
        if self._ttl <= 0:
            return None
        entry = self._entries.get(digest)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

    def put_digest(self, digest: str, principal: store.Principal) -> None:
        if self._ttl <= 0:
            return
        if len(self._entries) >= self._max:
            self._entries.clear()
        self._entries[digest] = (time.monotonic() + self._ttl, principal)

    def forget(self, key_id: int) -> None:
        """Drop key ``key_id`` at once (revoked through this process); other processes wait out ``ttl``."""
        for digest, (_, principal) in list(self._entries.items()):
            if principal.key_id == key_id:
                self._entries.pop(digest, None)


def _lookup(engine: Engine, key: str) -> store.Principal | None:
    with engine.begin() as conn:
        return store.authenticate(conn, key)


async def _principal(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> store.Principal:
    """Resolve the bearer API key to its namespace and role; 401 when missing or unknown."""
    if credentials is None or not credentials.credentials:
        raise errors.Unauthenticated("send the API key as `Authorization: Bearer <key>`")
    cache: KeyCache = request.app.state.key_cache
    found = cache.get(credentials.credentials)
    if found is None:
        found = await run_in_threadpool(_lookup, request.app.state.engine, credentials.credentials)
        if found is not None:
            cache.put(credentials.credentials, found)
    if found is None:
        raise errors.Unauthenticated("the API key is unknown or revoked")
    return found


#: The authenticated caller of a route: ``caller: Caller``.
Caller = Annotated[store.Principal, Depends(_principal)]


def authorize(caller: store.Principal, namespace: str, action: str) -> None:
    """Raise unless ``caller`` may do ``action`` (a role of :data:`store.ROLES`) in ``namespace``.

    Raises:
        errors.NamespaceNotFound: another namespace's resources do not exist for this key
            (404, not 403, DESIGN §8).
        errors.Forbidden: the key's role does not allow ``action`` (403).
    """
    if caller.namespace != namespace:
        # Say no more than the key may know: whether the namespace exists at all is not its business.
        raise errors.NamespaceNotFound(f"namespace {namespace!r} not found for this key")
    if not caller.can(action):
        raise errors.Forbidden(forbidden_detail(caller.role, action))


def forbidden_detail(role: str, action: str) -> str:
    """The 403 message: what the key is and which key would do (README "Running the server", roles)."""
    if action == "admin":
        return f"a {role!r} key cannot do this; it needs an 'admin' key"
    return f"a {role!r} key cannot do this; it needs a {action!r} key (or an 'admin' key)"
