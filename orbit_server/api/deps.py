"""What the routers share: the app's state as FastAPI dependencies (``request.app.state``, set by
:func:`orbit_server.api.app.create_app`), path parameter types and the documented problem answers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import Depends, Path, Request
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
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


def _query_fields(dependant: Dependant) -> Iterator[str]:
    for field in dependant.query_params:
        yield field.alias
    for sub in dependant.dependencies:
        yield from _query_fields(sub)


#: Query parameter names per route (keyed by ``id``, the route kept alive so that the id stays its own).
_query_cache: dict[int, tuple[APIRoute, frozenset[str]]] = {}


def _query_names(route: APIRoute) -> frozenset[str]:
    """The query parameters ``route`` takes (its own and its dependencies')."""
    cached = _query_cache.get(id(route))
    if cached is None or cached[0] is not route:
        cached = _query_cache[id(route)] = (route, frozenset(_query_fields(route.dependant)))
    return cached[1]


async def _strict_query(request: Request) -> None:
    """Refuse (422 ``validation_error``) a query parameter the route does not take, and one given
    twice: a list filtered by ``?status=A&status=B`` used to keep the last, and ``?stauts=A``
    (a typo) to list everything."""
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return
    known = _query_names(route)
    problems: list[dict[str, Any]] = []
    for name in dict.fromkeys(request.query_params.keys()):
        if name not in known:
            takes = ", ".join(sorted(known)) or "none"
            problems.append({"type": "extra_forbidden", "loc": ("query", name),
                             "msg": f"no such query parameter (this route takes: {takes})"})  # fmt: skip
        elif len(request.query_params.getlist(name)) > 1:
            problems.append({"type": "too_many", "loc": ("query", name),
                             "msg": "given more than once; give it once"})  # fmt: skip
    if problems:
        raise RequestValidationError(problems)


#: A list route's dependencies: its query parameters are checked strictly (``_strict_query``).
STRICT_QUERY = [Depends(_strict_query)]
