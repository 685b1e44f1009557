"""Operations endpoints: liveness, readiness, the published settings and ``/metrics`` (README "Operations")."""

from __future__ import annotations

import logging
from typing import Any

import sqlalchemy as sa
from fastapi import APIRouter, Request, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from orbit_client import (
    ServerInfo,
)
from orbit_server.api.auth import Caller
from orbit_server.api.deps import (
    _PROBLEMS,
    EngineDep,
    MetricsDep,
    ServerInfoDep,
    SettingsDep,
)
from orbit_server.api.metrics import metrics_refusal
from orbit_server.api.problems import _request_id, problem_response
from orbit_server.db.cluster import node_state

__all__ = ["router"]

log = logging.getLogger("orbit_server.app")

router = APIRouter()


@router.get("/healthz", tags=["operations"])
def healthz() -> dict[str, str]:
    """Liveness: the process answers."""
    return {"status": "ok"}


@router.get("/readyz", tags=["operations"], responses={503: _PROBLEMS[400]})
def readyz(engine: EngineDep, request: Request) -> Any:
    """Readiness: the database answers a query (on a Galera cluster: its node is synced in the primary component)."""
    problem: str | None = None
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
            problem = node_state(conn)
    except sa.exc.SQLAlchemyError as exc:  # a node outside the primary component also refuses the rollback
        problem = problem or "the server cannot reach its database"
        log.warning("readiness check failed: %s", type(exc).__name__)
    if problem is not None:
        log.warning("readiness check failed: %s", problem)
        response = problem_response(
            503, "database_unavailable", "Database unavailable", problem, _request_id(request)
        )
        response.headers["Retry-After"] = "1"
        return response
    return {"status": "ok"}


@router.get("/v1/settings", response_model=ServerInfo, tags=["operations"], responses=_PROBLEMS)
def published_settings(server_info: ServerInfoDep, caller: Caller) -> ServerInfo:
    """The settings clients and relays depend on, e.g. the key window (README "Retention and the key window").

    Any valid API key may read it, whatever its role.
    """
    return server_info


@router.get("/metrics", tags=["operations"], response_class=PlainTextResponse)
def prometheus_metrics(metrics: MetricsDep, settings: SettingsDep, request: Request) -> Response:
    """Prometheus metrics (text exposition format). With ``ORBIT_METRICS_TOKEN`` it needs
    ``Authorization: Bearer <token>`` (401); without, a Host that is an IP address, localhost or in
    ``ORBIT_ALLOWED_HOSTS`` (403 ``host_not_allowed``; README "Security")."""
    token = settings.metrics_token.get_secret_value() if settings.metrics_token else None
    refused = metrics_refusal(request.headers, token, settings.allowed_host_list)
    if refused is not None:
        status, code, detail = refused
        return problem_response(
            status, code, code.replace("_", " ").capitalize(), detail, _request_id(request)
        )
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
