"""The console's operator pages: fix what the overview shows (README "Web console").

- ``POST /ui/queues/{queue}/pause|resume``: shut or open a queue's gate (``admin``, with a reason), as
  ``POST .../queues/{queue}/pause`` does;
- ``/ui/schedules``: every schedule with its trigger and next fire; ``/ui/schedules/{name}``: its facts and
  occurrences (newest first, each linked to its task); pause and resume (``admin``);
- ``/ui/subscriptions``: every subscription's backlog; ``/ui/subscriptions/{name}``: its deliveries not acked
  yet, oldest first, each linked to its task;
- ``/ui/flow-instances/{id}/signals``: the instance's signals (consumed or buffered) and a form to send one
  (``submit``), as ``POST .../flow-instances/{id}/signals``.

Every action is a ``POST`` with the session's CSRF token, runs the same audited function as the API in one
transaction, with actor ``api_key:<id>``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from orbit_client import FlowSignal
from orbit_client._problems import readable_errors
from orbit_server import errors
from orbit_server.console.flow_pages import ConsoleKit
from orbit_server.db.transact import transact
from orbit_server.flows import admin as flow_admin
from orbit_server.flows import store as flow_store
from orbit_server.schedules import schedules
from orbit_server.tasks import admin, permits
from orbit_server.tasks import overview as ops

__all__ = ["add_ops_pages"]

_OCCURRENCES = 100
_FAVICON = (
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16"><circle cx="8" cy="8" r="6" fill="none" '
    'stroke="#2754c5" stroke-width="2"/><circle cx="13" cy="4" r="2" fill="#2754c5"/></svg>'
)


def add_ops_pages(router: APIRouter, kit: ConsoleKit) -> None:
    """Add the operator pages and actions to the console's ``router``."""

    def missing(request: Request, principal: Any, session: Any, what: str) -> Response:
        return kit.render(
            request,
            "error.html",
            404,
            principal,
            session,
            message=f"No {what} in namespace {principal.namespace!r}.",
        )

    @router.get("/static/favicon.svg")
    async def favicon() -> Response:
        return Response(_FAVICON, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})

    # ----------------------------------------------------------- queues

    def queue_route(action: str) -> None:
        async def control(request: Request, queue: str) -> Response:
            checked = await kit.action(request, "admin")
            if isinstance(checked, Response):
                return checked
            principal, session, form = checked
            reason = form.get("reason", "").strip()[:2000]
            if not reason:
                return kit.render(
                    request, "error.html", 422, principal, session,
                    message="Give a reason for the pause or resume: it is kept in the queue's audit.",
                )  # fmt: skip
            try:
                await run_in_threadpool(
                    transact, kit.engine, permits.set_paused, principal.namespace_id, queue,
                    paused=action == "pause", actor=f"api_key:{principal.key_id}", reason=reason,
                )  # fmt: skip
            except errors.OrbitServerError as exc:
                return kit.render(
                    request, "error.html", exc.status, principal, session, message=exc.detail or exc.title
                )
            if action == "resume":
                kit.on_created()  # waiting lease long-polls of this process get tasks at once
            return kit.redirect(f"/ui/?done={'paused' if action == 'pause' else 'resumed'}")

        router.add_api_route(f"/queues/{{queue}}/{action}", control, methods=["POST"])

    queue_route("pause")
    queue_route("resume")

    # -------------------------------------------------------- schedules

    @router.get("/schedules")
    async def schedules_page(request: Request) -> Response:
        found = await kit.signed_in(request)
        if found is None:
            return kit.to_login(request)
        principal, session = found
        items = await kit.read_db(schedules.list_schedules, principal, limit=500)
        return kit.render(
            request, "schedules.html", 200, principal, session, page="schedules", schedules=items
        )

    async def schedule_response(
        request: Request, principal: Any, session: Any, name: str, status: int = 200, **context: Any
    ) -> Response:
        def load(conn: Any) -> tuple[Any, Any]:
            schedule = schedules.get_schedule(conn, principal, name)
            return schedule, schedules.list_occurrences(conn, principal, name, limit=_OCCURRENCES)

        try:
            schedule, occurrences = await kit.read_db(load)
        except errors.OrbitServerError as exc:
            if exc.status != 404:
                raise
            return missing(request, principal, session, f"schedule {name!r}")
        return kit.render(
            request, "schedule.html", status, principal, session, page="schedules", schedule=schedule,
            occurrences=occurrences, **context,
        )  # fmt: skip

    @router.get("/schedules/{name}")
    async def schedule_page(request: Request, name: str, done: str = "") -> Response:
        found = await kit.signed_in(request)
        if found is None:
            return kit.to_login(request)
        notice = {"paused": "Schedule paused.", "resumed": "Schedule resumed."}.get(done)
        return await schedule_response(request, *found, name, notice=notice)

    def schedule_route(action: str) -> None:
        async def control(request: Request, name: str) -> Response:
            checked = await kit.action(request, "admin")
            if isinstance(checked, Response):
                return checked
            principal, session, _form = checked
            try:
                await run_in_threadpool(
                    transact, kit.engine, schedules.set_paused, principal, name, action == "pause"
                )
            except errors.OrbitServerError as exc:
                return await schedule_response(
                    request, principal, session, name, exc.status, action_error=exc.detail or exc.title
                )
            return kit.redirect(f"/ui/schedules/{name}?done={'paused' if action == 'pause' else 'resumed'}")

        router.add_api_route(f"/schedules/{{name}}/{action}", control, methods=["POST"])

    schedule_route("pause")
    schedule_route("resume")

    # ---------------------------------------------------- subscriptions

    @router.get("/subscriptions")
    async def subscriptions_page(request: Request) -> Response:
        found = await kit.signed_in(request)
        if found is None:
            return kit.to_login(request)
        principal, session = found
        items = await kit.read_db(admin.subscription_stats, principal.namespace_id)
        return kit.render(
            request, "subscriptions.html", 200, principal, session, page="subscriptions", subscriptions=items
        )

    @router.get("/subscriptions/{name}")
    async def subscription_page(request: Request, name: str) -> Response:
        found = await kit.signed_in(request)
        if found is None:
            return kit.to_login(request)
        principal, session = found

        def load(conn: Any) -> tuple[Any, Any]:
            stats = admin.subscription_stats(conn, principal.namespace_id, name=name)
            return stats, ops.pending_deliveries(conn, principal.namespace_id, name)

        stats, pending = await kit.read_db(load)
        if not stats or pending is None:
            return missing(request, principal, session, f"subscription {name!r}")
        return kit.render(
            request, "subscription.html", 200, principal, session, page="subscriptions", sub=stats[0],
            pending=pending,
        )  # fmt: skip

    # ------------------------------------------------------ flow signals

    async def signals_response(
        request: Request, principal: Any, session: Any, instance_id: str, status: int = 200, **context: Any
    ) -> Response:
        def load(conn: Any) -> tuple[Any, Any]:
            instance = flow_store.get_instance(conn, principal, instance_id)
            return instance, ops.flow_signals_of(conn, principal.namespace_id, instance_id)

        try:
            instance, signals = await kit.read_db(load)
        except errors.OrbitServerError as exc:
            if exc.status != 404:
                raise
            return missing(request, principal, session, f"flow instance {instance_id!r}")
        return kit.render(
            request, "flow_signals.html", status, principal, session, page="flows", instance=instance,
            signals=signals, **context,
        )  # fmt: skip

    @router.get("/flow-instances/{instance_id}/signals")
    async def signals_page(request: Request, instance_id: str, done: str = "") -> Response:
        found = await kit.signed_in(request)
        if found is None:
            return kit.to_login(request)
        notice = {"sent": "Signal recorded.", "replayed": "That key was sent before: the signal stands."}.get(
            done
        )
        return await signals_response(request, *found, instance_id, notice=notice)

    @router.post("/flow-instances/{instance_id}/signals")
    async def send_signal(request: Request, instance_id: str) -> Response:
        checked = await kit.action(request, "submit")
        if isinstance(checked, Response):
            return checked
        principal, session, form = checked
        raw = form.get("payload", "").strip()
        kept = {"form_name": form.get("name", ""), "form_payload": raw, "form_key": form.get("key", "")}
        try:
            payload = json.loads(raw) if raw else None
            body = FlowSignal(name=form.get("name", "").strip(), payload=payload)
        except json.JSONDecodeError as exc:
            return await signals_response(
                request, principal, session, instance_id, 422,
                action_error=f"The payload is not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}).", **kept,
            )  # fmt: skip
        except ValidationError as exc:
            problem = "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']}" if e["loc"] else e["msg"]
                for e in readable_errors(exc.errors())
            )
            return await signals_response(
                request, principal, session, instance_id, 422, action_error=f"Not a valid signal: {problem}.",
                **kept,
            )  # fmt: skip
        key = form.get("key", "").strip() or f"console:{uuid.uuid4()}"
        try:
            _record, replayed = await run_in_threadpool(
                flow_admin.signal, kit.engine, principal, instance_id, body, key, kit.settings,
                on_created=kit.on_created,
            )  # fmt: skip
        except errors.OrbitServerError as exc:
            return await signals_response(
                request,
                principal,
                session,
                instance_id,
                exc.status,
                action_error=exc.detail or exc.title,
                **kept,
            )
        return kit.redirect(
            f"/ui/flow-instances/{instance_id}/signals?done={'replayed' if replayed else 'sent'}"
        )
