"""The HTTP API (README "HTTP API"): :func:`.app.create_app` assembles the routers (one module per resource:
``operations``, ``tasks``, ``attempts``, ``attempt_batches``, ``batch``, ``deliveries``, ``queues``, ``schedules``,
``flows``), the lifespan, middleware and problem bodies; :mod:`.deps` reads what routes share from ``app.state``.

May import the areas (``tasks``, ``results``, ``schedules``, ``retention``, ``flows``), ``db``, the root leaf
modules, ``orbit_client``'s models, and ``console`` only to mount it. Nothing below imports ``api``.
"""
