"""Flows on the server (issue 13, DESIGN §12): durable multi-step workflows whose steps are Orbit tasks.

The wire models and the graph's validation are ``orbit_client._flow_models`` (one definition for client
and server). ``paths`` resolves the graph's paths and renders its templates against an instance's data;
no code is ever evaluated (README "Flows: graph format").

May import ``tasks``, ``db`` and the root leaf modules.
"""
