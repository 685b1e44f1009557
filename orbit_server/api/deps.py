"""What the routers share: the app's state as FastAPI dependencies (``request.app.state``, set by
:func:`orbit_server.api.app.create_app`), path parameter types and the documented problem answers.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Path, Request
from sqlalchemy.engine import Engine

from orbit_client import (
    NAME_PATTERN,
    Problem,
    ServerInfo,
)
from orbit_server.api.metrics import Metrics
from orbit_server.api.wakeup import Wakeup
from orbit_server.settings import ServerSettings

_PROBLEMS: dict[int | str, dict[str, Any]] = {
    status: {"model": Problem, "content": {"application/problem+json": {}}}
    for status in (400, 401, 403, 404, 422)
}

NamespaceName = Annotated[str, Path(pattern=NAME_PATTERN, description="Namespace name.")]
QueueName = Annotated[str, Path(pattern=NAME_PATTERN, description="Queue name.")]
SubscriptionName = Annotated[str, Path(pattern=NAME_PATTERN, description="Subscription name.")]
_CONFLICTS: dict[int | str, dict[str, Any]] = {**_PROBLEMS, 409: _PROBLEMS[400]}


# The app's state as dependencies: ``async`` so that FastAPI calls them on the event loop, not in the thread pool.
async def _engine(request: Request) -> Engine:
    return request.app.state.engine  # type: ignore[no-any-return]


async def _settings(request: Request) -> ServerSettings:
    return request.app.state.settings  # type: ignore[no-any-return]


async def _wakeup(request: Request) -> Wakeup:
    return request.app.state.wakeup  # type: ignore[no-any-return]


async def _metrics(request: Request) -> Metrics:
    return request.app.state.metrics  # type: ignore[no-any-return]


async def _server_info(request: Request) -> ServerInfo:
    return request.app.state.server_info  # type: ignore[no-any-return]


EngineDep = Annotated[Engine, Depends(_engine)]
SettingsDep = Annotated[ServerSettings, Depends(_settings)]
WakeupDep = Annotated[Wakeup, Depends(_wakeup)]
MetricsDep = Annotated[Metrics, Depends(_metrics)]
ServerInfoDep = Annotated[ServerInfo, Depends(_server_info)]
