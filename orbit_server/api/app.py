"""The HTTP API (FastAPI): the app factory.

It assembles the routers (one module per resource in this folder, and the web console), the
exception handlers of :mod:`.problems`, the middleware of :mod:`.middleware` and the lifespan of
:mod:`.lifespan`, and puts what the routes share on ``app.state`` (read by :mod:`.deps`).

Endpoints raise the domain errors of :mod:`orbit_server.errors`; the handlers turn each into one
RFC 9457 problem body with a stable ``code``. Every response carries ``X-Request-Id``. Handlers are
plain ``def`` functions: FastAPI runs them in its thread pool, and each opens only short transactions.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from fastapi import FastAPI
from sqlalchemy.engine import Engine

from orbit_client import ServerInfo
from orbit_server.api import attempts, deliveries, operations, queues, schedules, tasks
from orbit_server.api.attempt_batches import attempt_batch_router
from orbit_server.api.batch import batch_router
from orbit_server.api.bodies import Utf8JsonBodies
from orbit_server.api.docs import docs_router
from orbit_server.api.fast_lane import FastLane
from orbit_server.api.flows import flows_router
from orbit_server.api.hosts import AllowedHosts
from orbit_server.api.json_bodies import JsonContentTypeMiddleware
from orbit_server.api.lifespan import lifespan
from orbit_server.api.metrics import Metrics
from orbit_server.api.middleware import RequestContextMiddleware
from orbit_server.api.openapi import _finish_openapi, operation_id
from orbit_server.api.problems import install_problem_handlers, problem_response
from orbit_server.api.wakeup import Wakeup
from orbit_server.console import console_router
from orbit_server.db.engine import create_engine
from orbit_server.settings import ServerSettings
from orbit_server.tasks.keys import KeyCache

__all__ = ["create_app"]


def create_app(settings: ServerSettings | None = None, *, engine: Engine | None = None) -> FastAPI:
    """Build the Orbit API.

    Args:
        settings: configuration; ``None`` reads it from ``ORBIT_*`` environment variables.
        engine: an engine to use (not disposed by the app); ``None`` builds one from
            ``settings.database_url`` for the app's lifetime. The schema must already
            be migrated (``orbit-server migrate``; ``serve`` does it for SQLite).
    """
    settings = settings or ServerSettings()
    the_engine = engine or create_engine(
        settings.database_url,
        pool_size=settings.db_pool_size,
        ping_idle_seconds=settings.db_ping_idle_seconds,
    )
    app = FastAPI(
        title="Orbit",
        version="0.1.0",
        summary="Idempotent task acceptance and execution",
        lifespan=lifespan,
        docs_url=None,  # served from the package, in a sandbox (orbit_server.api.docs)
        redoc_url=None,
        # Short, stable operationIds for generated clients: the route function's name (`submit_task`).
        generate_unique_id_function=operation_id,
    )
    state = app.state
    state.engine = the_engine
    state.owns_engine = engine is None
    state.settings = settings
    state.metrics = metrics = Metrics()
    state.key_cache = KeyCache(settings.api_key_cache_seconds)
    state.wakeup = wakeup = Wakeup()
    state.server_info = ServerInfo(
        submission_key_ttl_seconds=settings.submission_key_ttl_seconds,
        max_batch_items=settings.max_batch_items,
        max_body_bytes=settings.max_body_bytes,
        lease_and_start=True,
        report_and_lease=True,
        item_task_ids=True,
    )
    install_problem_handlers(app)

    app.include_router(operations.router)
    app.include_router(tasks.router)
    app.include_router(queues.router)
    app.include_router(attempts.router)
    app.include_router(attempt_batch_router(the_engine, partial(attempts.record_grants, metrics, the_engine)))
    app.include_router(deliveries.router)
    app.include_router(
        batch_router(engine=the_engine, settings=settings, metrics=metrics, on_created=wakeup.notify)
    )
    app.include_router(schedules.router)
    app.include_router(flows_router(engine_=the_engine, settings=settings, on_created=wakeup.notify))
    app.include_router(queues.control_router)
    app.include_router(
        console_router(
            engine=the_engine, settings=settings, key_cache=state.key_cache, on_created=wakeup.notify
        )
    )
    if settings.docs:
        app.include_router(docs_router(lambda: app.openapi(), app.title))
    _finish_openapi(app)
    app.add_middleware(Utf8JsonBodies)
    # Inside the request context (its request id, size limit and timeouts), before any route.
    app.add_middleware(JsonContentTypeMiddleware, problem=_scope_problem)
    if settings.fast_lane:
        # The hot worker calls' happy path, in front of the routing (orbit_server.api.fast_lane).
        app.add_middleware(FastLane, orbit=app)
    if settings.allowed_host_list:
        app.add_middleware(AllowedHosts, allowed=settings.allowed_host_list)
    app.add_middleware(
        RequestContextMiddleware,
        max_body_bytes=settings.max_body_bytes,
        metrics=metrics,
        body_timeout_seconds=settings.body_timeout_seconds,
        access_log=settings.access_log,
        redact=settings.access_log_redact,
    )
    return app


def _scope_problem(status: int, code: str, title: str, detail: str, scope: Any) -> Any:
    """A problem answer from plain ASGI, with the request id the context middleware put in the scope."""
    return problem_response(status, code, title, detail, scope.get("state", {}).get("request_id"))
