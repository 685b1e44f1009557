"""Prometheus metrics of one app instance (DESIGN §7), on a registry of its own.

No label carries a namespace, key, task id or params: only the route template,
the method, the status code and the submission outcome.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from orbit_server.db.sampling import LEASE_EXPIRIES, SampledGauges
from orbit_server.flows.engine import ADVANCES as FLOW_ADVANCES

__all__ = ["Metrics", "method_label"]

#: The methods that keep their own label value (RFC 9110 §9); any other token a client sends is
#: counted as ``OTHER``, so made-up methods cannot grow the page without bound.
_KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE"})


def method_label(method: str) -> str:
    """The ``method`` label value of a request: the method if standard, else ``OTHER``."""
    return method if method in _KNOWN_METHODS else "OTHER"


class Metrics:
    """The server's metrics; ``registry`` is what ``GET /metrics`` exposes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.request_seconds = Histogram(
            "orbit_http_request_duration_seconds",
            "Time to answer an HTTP request, in seconds, by route template, method (OTHER for a non-standard one) and status.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.submissions = Counter(
            "orbit_submissions_total",
            "Accepted submissions: outcome=created (a new task) or replayed (same key, same request).",
            ["outcome"],
            registry=self.registry,
        )
        # --- operations (README "Operations"): lease grants, expiries and the sampled gauges ---
        self.lease_grants = Counter(
            "orbit_lease_grants",
            "Tasks leased to workers (one grant = one new attempt), by queue.",
            ["queue"],
            registry=self.registry,
        )
        #: The sampled gauges (``orbit_tasks`` etc.); the app's sampler stores into it.
        self.sampled = SampledGauges()
        self.registry.register(self.sampled)
        self.registry.register(self.sampled.failures)
        self.registry.register(LEASE_EXPIRIES)
        self.registry.register(FLOW_ADVANCES)
