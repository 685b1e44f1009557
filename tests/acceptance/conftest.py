"""Fixtures of the acceptance tests (real processes)."""

from tests.server_processes import server_processes

__all__ = ["server_processes"]
