"""The web console under ``/ui`` of ``orbit-server serve`` (README, Web console).

May import the areas (``tasks``, ``results``, ``schedules``, ``retention``, ``flows``), ``db`` and the root leaf
modules; never ``api`` or ``cli``.
"""

from orbit_server.console.routes import console_router

__all__ = ["console_router"]
