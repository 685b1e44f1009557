"""Retention (README "Retention and the key window"): inventory and purge of finished tasks, events and
deliveries, and the submission keys' window (:mod:`.purge`).

May import ``tasks``, ``db`` and the root leaf modules.
"""
