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
)
from orbit_server.api.problems import _request_id, problem_response

__all__ = ["router"]

log = logging.getLogger("orbit_server.app")

router = APIRouter()


@router.get("/healthz", tags=["operations"])
def healthz() -> dict[str, str]:
    """Liveness: the process answers."""
    return {"status": "ok"}


@router.get("/readyz", tags=["operations"], responses={503: _PROBLEMS[400]})
def readyz(engine: EngineDep, request: Request) -> Any:
    """Readiness: the database answers a query."""
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except sa.exc.SQLAlchemyError as exc:
        log.warning("readiness check failed: %s", type(exc).__name__)
        return problem_response(503, "database_unavailable", "Database unavailable",
                                "the server cannot reach its database", _request_id(request))  # fmt: skip
    return {"status": "ok"}


@router.get("/v1/settings", response_model=ServerInfo, tags=["operations"], responses=_PROBLEMS)
def published_settings(server_info: ServerInfoDep, caller: Caller) -> ServerInfo:
    """The settings clients and relays depend on, e.g. the key window (README "Retention and the key window").

    Any valid API key may read it, whatever its role.
    """
    return server_info


@router.get("/metrics", tags=["operations"], response_class=PlainTextResponse)
def prometheus_metrics(
    metrics: MetricsDep,
) -> Response:
    """Prometheus metrics (text exposition format); no API key, like /healthz: expose it internally."""
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
