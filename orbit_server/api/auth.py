"""API-key authentication and role checks, shared by every router (DESIGN §8).

The check runs on the event loop: a key seen within ``ORBIT_API_KEY_CACHE_SECONDS`` costs
no database round trip and no thread-pool hop; only a cache miss goes to the database,
in the thread pool.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool

from orbit_server import errors
from orbit_server.db.cluster import causal_reads, is_galera
from orbit_server.tasks import store
from orbit_server.tasks.keys import KeyCache

__all__ = ["Caller", "authorize"]

_bearer = HTTPBearer(auto_error=False, description="An API key created with `orbit-server api-key create`.")


def _lookup(engine: Engine, key: str) -> store.Principal | None:
    with engine.begin() as conn:
        found = store.authenticate(conn, key)
        again = found is None and is_galera(conn)
    if again:  # a key created on another node a moment ago: 401 only once this node has caught up
        with engine.begin() as conn, causal_reads(conn):
            found = store.authenticate(conn, key)
    return found


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
