"""Schedules (README "Schedules"): their SQL and rules (:mod:`.schedules`), fire times and misfire policies
(:mod:`.firetimes`), the scheduler loop of a server process (:mod:`.loop`).

May import ``tasks``, ``db`` and the root leaf modules.
"""
