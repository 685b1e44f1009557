"""The web console under ``/ui`` of ``orbit-server serve`` (README, Web console)."""

from orbit_server.console.routes import console_router

__all__ = ["console_router"]
