"""Orbit server: idempotent task acceptance over HTTP (FastAPI + SQLAlchemy 2).

Run it with ``orbit-server serve``; embed it with :func:`create_app`.

The names load on first use (PEP 562), so ``orbit-server --help`` and the admin commands do
not import FastAPI, and a client-only install can still run ``orbit-server`` far enough to
say which extra it needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orbit_server.api.app import create_app
    from orbit_server.settings import ServerSettings

__all__ = ["ServerSettings", "__version__", "create_app"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from orbit_server.api.app import create_app

        return create_app
    if name == "ServerSettings":
        from orbit_server.settings import ServerSettings

        return ServerSettings
    raise AttributeError(f"module 'orbit_server' has no attribute {name!r}")
