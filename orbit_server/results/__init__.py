"""Result events' receivers: subscriptions and their deliveries, leased and acked (README "Result events").
The events themselves are written by the terminal transition, in :mod:`orbit_server.tasks.result_events`.

May import ``tasks``, ``db`` and the root leaf modules.
"""
