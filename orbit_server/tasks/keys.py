"""The process-wide cache of recently seen API keys, shared by the API's auth dependency and the web console.

Imports only :mod:`orbit_server.tasks.store` (the principal a key resolves to).
"""

from __future__ import annotations

import hashlib
import time

from orbit_server.tasks import store

__all__ = ["KeyCache"]


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
