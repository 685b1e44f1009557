"""The console's flow pages (``/ui/flows``, ``/ui/flow-instances/{id}``): README "Web console".

- ``/ui/flows``: the namespace's flows (newest version) and its instances, newest first, filtered
  by flow, status and idempotency key, 50 a page (cursor links);
- ``/ui/flow-instances/{id}``: the instance's facts, its version's graph drawn as inline SVG with
  each node's state (:mod:`.flowgraph`) and a link to each step's task page, its tokens, steps and
  history (oldest first, 200 a page); pause, resume and cancel forms for an ``admin`` key.

Actions are ``POST`` forms with the session's CSRF token and a reason; they run the same audited
function as the API, in one transaction, with actor ``api_key:<id>``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import Response
from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool

from orbit_client import FlowControl, FlowInstanceStatus
from orbit_server import errors
from orbit_server.console import flowgraph
from orbit_server.console._session import Session
from orbit_server.flows import admin as flow_admin
from orbit_server.flows import engine as flow_engine
from orbit_server.flows import store as flow_store
from orbit_server.tasks import store

__all__ = ["ConsoleKit", "add_flow_pages"]

_PAGE_SIZE = 50
_HISTORY_PAGE = 200


@dataclass(frozen=True)
class ConsoleKit:
    """What the flow pages use of :func:`~orbit_server.console.routes.console_router`'s plumbing."""

    engine: Engine
    settings: flow_engine.EngineSettings
    on_created: Callable[[], None]
    render: Callable[..., Response]
    redirect: Callable[[str], Response]
    signed_in: Callable[[Request], Awaitable[tuple[store.Principal, Session] | None]]
    to_login: Callable[[Request], Response]
    action: Callable[[Request, str], Awaitable[tuple[store.Principal, Session, dict[str, str]] | Response]]
    read_db: Callable[..., Awaitable[Any]]


def add_flow_pages(router: APIRouter, kit: ConsoleKit) -> None:
    """Add the flow pages to the console's ``router``."""

    @router.get("/flows")
    async def flows_page(
        request: Request, flow: str = "", status: str = "", idempotency_key: str = "", cursor: str = ""
    ) -> Response:
        found = await kit.signed_in(request)
        if found is None:
            return kit.to_login(request)
        principal, session = found
        filters = {"flow": flow.strip(), "status": status, "idempotency_key": idempotency_key}
        error = None
        flows: list[Any] = []
        items: list[Any] = []
        next_cursor = None
        try:
            wanted = FlowInstanceStatus(status) if status else None
            flows = await kit.read_db(flow_store.list_flows, principal)
            page = await kit.read_db(
                flow_store.list_instances, principal, flow=filters["flow"] or None, status=wanted,
                idempotency_key=idempotency_key or None, limit=_PAGE_SIZE, cursor=cursor or None,
            )  # fmt: skip
            items, next_cursor = page.items, page.next_cursor
        except ValueError:
            error = f"Unknown status {status!r}: choose one of the list."
        except errors.OrbitServerError as exc:
            error = exc.detail or exc.title
        next_url = None
        if next_cursor:
            next_url = "/ui/flows?" + urlencode(
                {**{k: v for k, v in filters.items() if v}, "cursor": next_cursor}
            )
        return kit.render(
            request, "flows.html", 400 if error else 200, principal, session, page="flows", flows=flows,
            instances=items, filters=filters, next_url=next_url, first_page=not cursor, error=error,
            flow_statuses=[s.value for s in FlowInstanceStatus],
        )  # fmt: skip

    async def instance_response(
        request: Request,
        principal: store.Principal,
        session: Session,
        instance_id: str,
        status: int = 200,
        history_cursor: str | None = None,
        **context: Any,
    ) -> Response:
        def load(conn: Any) -> tuple[Any, Any, Any, set[str]]:
            instance = flow_store.get_instance(conn, principal, instance_id)
            version = flow_store.get_version(conn, principal, instance.flow, instance.version)
            history = flow_store.history(
                conn, principal, instance_id, cursor=history_cursor, limit=_HISTORY_PAGE
            )
            return instance, version, history, flow_admin.visited_nodes(conn, instance_id)

        try:
            instance, version, history, visited = await kit.read_db(load)
        except errors.InvalidCursor:
            return kit.render(
                request, "error.html", 400, principal, session,
                message="That history link is not one this console made; open the instance again.",
            )  # fmt: skip
        except errors.OrbitServerError as exc:
            if exc.status != 404:
                raise
            return kit.render(
                request, "error.html", 404, principal, session,
                message=f"No flow instance {instance_id!r} in namespace {principal.namespace!r}.",
            )  # fmt: skip
        graph = flowgraph.instance_graph(version.graph, instance, visited)
        return kit.render(
            request, "flow_instance.html", status, principal, session, page="flows", instance=instance,
            version=version, graph=graph, node_width=flowgraph.NODE_WIDTH, node_height=flowgraph.NODE_HEIGHT,
            history=history.items, history_next=history.next_cursor, **context,
        )  # fmt: skip

    @router.get("/flow-instances/{instance_id}")
    async def instance_page(
        request: Request, instance_id: str, done: str = "", history_cursor: str = ""
    ) -> Response:
        found = await kit.signed_in(request)
        if found is None:
            return kit.to_login(request)
        notice = {
            "paused": "Pause recorded.",
            "resumed": "Resume recorded.",
            "cancelled": "Cancel recorded.",
        }.get(done)
        return await instance_response(request, *found, instance_id, history_cursor=history_cursor or None,
                                       notice=notice)  # fmt: skip

    def control_route(action: str, done: str) -> None:
        async def control(request: Request, instance_id: str) -> Response:
            checked = await kit.action(request, "admin")
            if isinstance(checked, Response):
                return checked
            principal, session, form = checked
            reason = form.get("reason", "").strip()
            if not reason:
                return await instance_response(
                    request, principal, session, instance_id, 422,
                    action_error="Give a reason: it is kept in the instance's history.",
                )  # fmt: skip
            body = FlowControl(reason=reason[:2000])  # audited as api_key:<id>, as through the API
            try:
                await run_in_threadpool(
                    flow_admin.control_instance, kit.engine, principal, instance_id, action, body, kit.settings,
                    on_created=kit.on_created,
                )  # fmt: skip
            except errors.OrbitServerError as exc:
                return await instance_response(
                    request, principal, session, instance_id, exc.status, action_error=exc.detail or exc.title
                )
            return kit.redirect(f"/ui/flow-instances/{instance_id}?done={done}")

        router.add_api_route(f"/flow-instances/{{instance_id}}/{action}", control, methods=["POST"])

    control_route("pause", "paused")
    control_route("resume", "resumed")
    control_route("cancel", "cancelled")
