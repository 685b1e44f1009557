"""The web console under ``/ui`` of ``orbit-server serve`` (README, Web console)."""

from .routes import console_router

__all__ = ["console_router"]
