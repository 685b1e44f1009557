"""Flows: durable multi-step workflows over Orbit tasks (README "Flows")."""
