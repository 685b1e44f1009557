"""Prometheus metrics of one app instance (DESIGN §7), on a registry of its own.

No label carries a key, task id or params. The sampled gauges name namespaces, queues and
subscriptions, so ``/metrics`` is guarded (:func:`metrics_refusal`, README "Security").
"""

from __future__ import annotations

import hmac

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.datastructures import Headers

from orbit_server.api.hosts import is_address_or_localhost
from orbit_server.db.pg_notify import EVENTS as NOTIFY_EVENTS
from orbit_server.db.sampling import LEASE_EXPIRIES, SampledGauges
from orbit_server.flows.engine import ADVANCES as FLOW_ADVANCES

__all__ = ["Metrics", "method_label", "metrics_refusal"]

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
            "Tasks leased to workers (one grant = one new attempt), by namespace and queue.",
            ["namespace", "queue"],
            registry=self.registry,
        )
        #: The sampled gauges (``orbit_tasks`` etc.); the app's sampler stores into it.
        self.sampled = SampledGauges()
        self.registry.register(self.sampled)
        self.registry.register(self.sampled.failures)
        self.registry.register(LEASE_EXPIRIES)
        self.registry.register(FLOW_ADVANCES)
        self.registry.register(NOTIFY_EVENTS)


def metrics_refusal(
    headers: Headers, token: str | None, allowed_hosts: list[str]
) -> tuple[int, str, str] | None:
    """Why ``GET /metrics`` with these request ``headers`` is refused, as ``(status, code, detail)``; ``None``: served.

    With a ``token`` (``ORBIT_METRICS_TOKEN``) the request must carry ``Authorization: Bearer
    <token>`` (compared in constant time), from any Host. Without one, the Host must be an IP
    address, ``localhost`` or in ``allowed_hosts`` (``ORBIT_ALLOWED_HOSTS``, which the app's host
    check already applies): a page of another site that re-points its own name at the server
    (DNS rebinding) sends its own name as Host, so it cannot read the metrics.
    """
    if token is not None:
        sent = headers.get("authorization", "")
        scheme, _, credentials = sent.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            credentials.strip().encode(), token.encode()
        ):
            return (
                401,
                "metrics_token_required",
                "GET /metrics needs 'Authorization: Bearer <ORBIT_METRICS_TOKEN>'",
            )
        return None
    if allowed_hosts or is_address_or_localhost(headers.get("host", "")):
        return None
    return (
        403,
        "host_not_allowed",
        "/metrics answers a Host that is an IP address or localhost; set ORBIT_METRICS_TOKEN or "
        "ORBIT_ALLOWED_HOSTS to scrape it by name (README, Security)",
    )
