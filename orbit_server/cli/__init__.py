"""The ``orbit-server`` command (README "Operations"): one module per command group.

:mod:`.main` holds the root group, ``serve`` and ``migrate`` and registers the groups; :mod:`.options` holds
what they share and imports no command. May import the areas (``tasks``, ``results``, ``schedules``,
``retention``, ``flows``), ``db``, the root leaf modules, and ``api`` only to build the app ``serve`` runs.
"""

from orbit_server.cli.main import main

__all__ = ["main"]
