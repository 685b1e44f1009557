"""The web console's routes (``/ui``): server-rendered pages and plain HTML forms.

A page needs a signed-in API key and shows only that key's namespace; actions (cancel,
review, retry, key creation and revocation) need the ``admin`` role, as in the API
(DESIGN §8). Every action is a ``POST`` carrying the session's CSRF token; cancel, review
and retry run the same audited functions as the API, in one transaction, with the key's
identity (``api_key:<id>``) as actor.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape
from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool

from orbit_client import CancelRequest, RetryRequest, ReviewRequest, TaskStatus
from orbit_server import errors
from orbit_server.console._forms import LoginThrottle, form_fields, json_field, validated
from orbit_server.console._session import Session, Sessions
from orbit_server.db.engine import BIGINT_MAX
from orbit_server.db.transact import transact
from orbit_server.settings import ServerSettings
from orbit_server.tasks import admin, operations, store
from orbit_server.tasks import overview as ops
from orbit_server.tasks.keys import KeyCache

__all__ = ["console_router"]

log = logging.getLogger("orbit_server.console")

_HERE = Path(__file__).parent
_CSS = (_HERE / "static" / "console.css").read_text(encoding="utf-8")
_SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}
_PAGE_SIZE = 50


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d {seconds % 86400 // 3600:02d}h"


def _when(value: datetime | None) -> str:
    if value is None:
        return "–"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)


def _compact(value: Any) -> str:
    """JSON on one line as written (no ``\\u0027`` or ``\\u00e9`` escapes: autoescaping makes it safe)."""
    return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str, separators=(", ", ": "))


def _environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(_HERE / "templates"),
        autoescape=select_autoescape(["html"]),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(age=_age, when=_when, pretty=_pretty, compact=_compact)
    env.globals["statuses"] = [status.value for status in TaskStatus]
    return env


def console_router(
    *, engine: Engine, settings: ServerSettings, key_cache: KeyCache, on_created: Callable[[], None]
) -> APIRouter:
    """The ``/ui`` routes. ``on_created`` is called after a retry made a task due (wakes lease polls)."""
    router = APIRouter(prefix="/ui", include_in_schema=False)
    env = _environment()
    sessions = Sessions(settings.console_secret, engine)
    throttle = LoginThrottle(settings.console_login_failures_per_minute)

    # ------------------------------------------------------------- plumbing

    def render(
        request: Request,
        name: str,
        status: int = 200,
        principal: store.Principal | None = None,
        session: Session | None = None,
        **context: Any,
    ) -> HTMLResponse:
        html = env.get_template(name).render(
            request=request, principal=principal, csrf=session.csrf if session else "", **context
        )
        return HTMLResponse(html, status_code=status, headers=_SECURITY_HEADERS)

    def redirect(url: str) -> RedirectResponse:
        return RedirectResponse(url, status_code=303, headers=_SECURITY_HEADERS)

    def lookup(key_hash: str) -> store.Principal | None:
        with engine.begin() as conn:
            return admin.api_key_principal(conn, key_hash)

    async def signed_in(request: Request) -> tuple[store.Principal, Session] | None:
        # Read from the database on every request, so sign-out and revocation end it at once.
        found: tuple[store.Principal, Session] | None = await run_in_threadpool(sessions.read, request)
        return found

    def to_login(request: Request) -> RedirectResponse:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        response = redirect("/ui/login?" + urlencode({"next": target}))
        sessions.clear(response)
        return response

    async def form_of(request: Request) -> dict[str, str]:
        return form_fields(await request.body())

    def same_origin(request: Request) -> bool:
        origin = request.headers.get("origin")
        if origin is None:  # SameSite=Strict already keeps the cookie off cross-site requests
            return True
        # Host only, not scheme: behind a TLS-terminating proxy the server sees http while the browser says https.
        return urlsplit(origin).netloc == request.headers.get("host", "")

    async def action(
        request: Request, role: str
    ) -> tuple[store.Principal, Session, dict[str, str]] | Response:
        """Check what every action needs: same origin, a session, the CSRF token and the role."""
        if not same_origin(request):
            return render(
                request, "error.html", 403, message="This form was sent from another site; it was refused."
            )
        found = await signed_in(request)
        if found is None:
            return render(
                request,
                "error.html",
                401,
                message="Sign in first: the session has ended or its key was revoked.",
            )
        principal, session = found
        form = await form_of(request)
        if not session.csrf_ok(form.get("csrf_token")):
            return render(
                request,
                "error.html",
                403,
                principal,
                session,
                message="The form's CSRF token is missing or wrong (an old page?); reload the page and try again.",
            )
        if not principal.can(role):
            return render(
                request,
                "error.html",
                403,
                principal,
                session,
                message=f"A {principal.role!r} key cannot do this; it needs the {role!r} role.",
            )
        return principal, session, form

    async def read_db(work: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        def run() -> Any:
            with engine.begin() as conn:
                return work(conn, *args, **kwargs)

        return await run_in_threadpool(run)

    # ----------------------------------------------------------- sign-in

    @router.get("/static/console.css")
    async def stylesheet() -> Response:
        return Response(_CSS, media_type="text/css", headers={"Cache-Control": "max-age=3600"})

    @router.get("/login")
    async def login_page(request: Request, next: str = "/ui/") -> Response:
        return render(request, "login.html", next=_safe_next(next))

    @router.post("/login")
    async def login(request: Request) -> Response:
        if not same_origin(request):
            return render(
                request, "error.html", 403, message="This form was sent from another site; it was refused."
            )
        form = await form_of(request)
        key = form.get("api_key", "").strip()
        target = _safe_next(form.get("next", "/ui/"))
        address = request.client.host if request.client else ""
        wait = throttle.retry_after(address)
        if wait > 0:
            seconds = max(1, round(wait))
            page = render(
                request,
                "login.html",
                429,
                next=target,
                error=f"Too many failed sign-ins from this address; try again in {seconds} s "
                f"(at most {throttle.limit} a minute).",
            )
            page.headers["Retry-After"] = str(seconds)
            return page
        principal = await signed_key(key) if key else None
        if principal is None:
            throttle.failed(address)
            return render(
                request, "login.html", 401, next=target, error="This API key is unknown or revoked."
            )
        response = redirect(target)
        await run_in_threadpool(sessions.issue, request, response, principal)
        log.info(
            "console sign-in by api_key:%s (%s, %s)", principal.key_id, principal.namespace, principal.role
        )
        return response

    async def signed_key(key: str) -> store.Principal | None:
        # The database, not the key cache: a key revoked a moment ago on another process opens no session.
        principal: store.Principal | None = await run_in_threadpool(lookup, sessions.key_hash(key))
        return principal

    @router.post("/logout")
    async def logout(request: Request) -> Response:
        found = await signed_in(request)
        form = await form_of(request)
        if found is not None and not found[1].csrf_ok(form.get("csrf_token")):
            return render(
                request, "error.html", 403, *found, message="The form's CSRF token is missing or wrong."
            )
        response = redirect("/ui/login")
        await run_in_threadpool(sessions.end, request, response)
        return response

    # -------------------------------------------------------------- pages

    @router.get("")
    async def root() -> Response:
        return redirect("/ui/")

    @router.get("/")
    async def overview_page(request: Request, done: str = "") -> Response:
        found = await signed_in(request)
        if found is None:
            return to_login(request)
        principal, session = found
        data = await read_db(admin.overview, principal.namespace_id)
        summary = await read_db(ops.operator_summary, principal.namespace_id)
        notice = {"paused": "Queue paused.", "resumed": "Queue resumed."}.get(done)
        return render(
            request, "overview.html", 200, principal, session, overview=data, ops=summary, page="overview",
            notice=notice,
        )  # fmt: skip

    @router.get("/tasks")
    async def tasks_page(
        request: Request,
        status: str = "",
        queue: str = "",
        handler: str = "",
        idempotency_key: str = "",
        created_since: str = "",
        cursor: str = "",
        order: str = "",
    ) -> Response:
        found = await signed_in(request)
        if found is None:
            return to_login(request)
        principal, session = found
        filters = {
            "status": status,
            "queue": queue,
            "handler": handler,
            "idempotency_key": idempotency_key,
            "created_since": created_since,
            "order": order,
        }
        error = None
        keys: dict[str, str] = {}
        page = admin.TaskListPage(items=[], next_cursor=None)
        try:
            task_filter = admin.TaskFilter(
                status=TaskStatus(status) if status else None,
                queue=queue.strip() or None,
                handler=handler.strip() or None,
                idempotency_key=idempotency_key or None,
                created_since=_parse_time(created_since),
            )
            page = await read_db(
                admin.list_tasks,
                principal.namespace_id,
                task_filter,
                limit=_PAGE_SIZE,
                cursor=cursor or None,
                order=order or "newest",
            )
            keys = await read_db(ops.idempotency_keys, principal.namespace_id, [t.id for t in page.items])
        except ValueError as exc:
            error = str(exc)
        except errors.OrbitServerError as exc:
            error = exc.detail
        next_url = None
        if page.next_cursor:
            next_url = "/ui/tasks?" + urlencode(
                {**{k: v for k, v in filters.items() if v}, "cursor": page.next_cursor}
            )
        return render(
            request,
            "tasks.html",
            400 if error else 200,
            principal,
            session,
            page="tasks",
            tasks=page.items,
            keys=keys,
            filters=filters,
            next_url=next_url,
            first_page=not cursor,
            error=error,
        )

    @router.get("/review")
    async def review_page(request: Request) -> Response:
        found = await signed_in(request)
        if found is None:
            return to_login(request)
        principal, session = found
        tasks = await read_db(admin.needs_review, principal.namespace_id)
        return render(request, "review.html", 200, principal, session, page="review", tasks=tasks)

    async def task_response(
        request: Request,
        principal: store.Principal,
        session: Session,
        task_id: str,
        status: int = 200,
        **context: Any,
    ) -> Response:
        try:
            detail = await read_db(admin.get_task_detail, principal.namespace_id, task_id)
            flow_step = await read_db(ops.flow_step_of, principal.namespace_id, task_id)
        except errors.TaskNotFound:
            return render(
                request,
                "error.html",
                404,
                principal,
                session,
                message=f"No task {task_id!r} in namespace {principal.namespace!r}.",
            )
        return render(
            request,
            "task.html",
            status,
            principal,
            session,
            page="tasks",
            detail=detail,
            task=detail.task,
            flow_step=flow_step,
            **context,
        )

    @router.get("/tasks/{task_id}")
    async def task_page(request: Request, task_id: str, done: str = "") -> Response:
        found = await signed_in(request)
        if found is None:
            return to_login(request)
        notice = {
            "cancelled": "Cancel recorded.",
            "reviewed": "Review recorded.",
            "retried": "This task is the retry you asked for.",
        }.get(done)
        return await task_response(request, *found, task_id, notice=notice)

    async def task_action(
        request: Request,
        task_id: str,
        run: Callable[[store.Principal, dict[str, str]], Any],
        done: str,
        *,
        needs_evidence: bool = False,
    ) -> Response:
        checked = await action(request, "admin")
        if isinstance(checked, Response):
            return checked
        principal, session, form = checked
        reason = form.get("reason", "").strip()
        problem = None
        if not reason:
            problem = "Give a reason: it is kept in the task's history."
        elif needs_evidence and not form.get("evidence_ref", "").strip():
            problem = (
                "Give an evidence reference (a ticket, a log link, a payment id): it is kept with the review."
            )
        if problem:
            return await task_response(
                request, principal, session, task_id, 422, action_error=problem, form=form
            )
        try:
            task = await run_in_threadpool(run, principal, form)
        except errors.OrbitServerError as exc:
            return await task_response(
                request,
                principal,
                session,
                task_id,
                exc.status,
                action_error=exc.detail or exc.title,
                form=form,
            )
        except ValueError as exc:
            return await task_response(
                request, principal, session, task_id, 422, action_error=str(exc), form=form
            )
        return redirect(f"/ui/tasks/{task.id}?done={done}")

    @router.post("/tasks/{task_id}/cancel")
    async def cancel(request: Request, task_id: str) -> Response:
        def run(principal: store.Principal, form: dict[str, str]) -> Any:
            body = validated(CancelRequest, {"reason": form["reason"].strip()})
            return transact(
                engine,
                operations.cancel_task,
                principal.namespace_id,
                task_id,
                reason=body.reason,
                actor=f"api_key:{principal.key_id}",
            )

        return await task_action(request, task_id, run, "cancelled")

    @router.post("/tasks/{task_id}/review")
    async def review(request: Request, task_id: str) -> Response:
        def run(principal: store.Principal, form: dict[str, str]) -> Any:
            outcome = form.get("outcome", "")
            if outcome not in ("succeeded", "failed"):
                raise ValueError("Choose an outcome: succeeded or failed.")
            raw = form.get("result", "").strip()
            # The API's own body model: its lengths and its JSON data rules (check_json_data).
            body = validated(
                ReviewRequest,
                {
                    "outcome": outcome,
                    "reason": form["reason"].strip(),
                    "evidence_ref": form["evidence_ref"].strip(),
                    "result": json_field(raw) if outcome == "succeeded" and raw else None,
                    "actor": form.get("on_behalf_of", "").strip() or None,
                },
            )
            return transact(
                engine,
                operations.review_task,
                principal.namespace_id,
                task_id,
                outcome=body.outcome,
                reason=body.reason,
                evidence_ref=body.evidence_ref,
                result=body.result,
                actor=f"api_key:{principal.key_id}",
                on_behalf_of=body.actor,
            )

        return await task_action(request, task_id, run, "reviewed", needs_evidence=True)

    @router.post("/tasks/{task_id}/retry")
    async def retry(request: Request, task_id: str) -> Response:
        def run(principal: store.Principal, form: dict[str, str]) -> Any:
            body = validated(RetryRequest, {"reason": form["reason"].strip()})
            task = transact(
                engine,
                operations.retry_task,
                principal.namespace_id,
                task_id,
                reason=body.reason,
                actor=f"api_key:{principal.key_id}",
            )
            on_created()
            return task

        return await task_action(request, task_id, run, "retried")

    # ------------------------------------------------------------ API keys

    async def keys_response(
        request: Request, principal: store.Principal, session: Session, status: int = 200, **context: Any
    ) -> Response:
        keys = await read_db(admin.list_api_keys, principal.namespace_id)
        return render(
            request,
            "keys.html",
            status,
            principal,
            session,
            page="keys",
            keys=keys,
            roles=store.ROLES,
            **context,
        )

    @router.get("/api-keys")
    async def keys_page(request: Request) -> Response:
        found = await signed_in(request)
        if found is None:
            return to_login(request)
        principal, session = found
        if not principal.can("admin"):
            return render(
                request,
                "error.html",
                403,
                principal,
                session,
                message="Only an admin key can see the API keys.",
            )
        return await keys_response(request, principal, session)

    @router.post("/api-keys")
    async def create_key(request: Request) -> Response:
        checked = await action(request, "admin")
        if isinstance(checked, Response):
            return checked
        principal, session, form = checked
        role = form.get("role", "")
        if role not in store.ROLES:
            return await keys_response(
                request, principal, session, 422, key_error=f"Choose a role: {', '.join(store.ROLES)}."
            )
        label = form.get("label", "").strip() or None
        if label is not None and len(label) > 255:
            return await keys_response(
                request, principal, session, 422, key_error="The label: at most 255 characters."
            )

        def create() -> str:
            with engine.begin() as conn:
                return store.create_api_key(conn, principal.namespace, role, label)

        key = await run_in_threadpool(create)
        log.info("API key (%s, label %r) created by api_key:%s in the console", role, label, principal.key_id)
        return await keys_response(request, principal, session, 201, new_key=key, new_role=role)

    @router.post("/api-keys/{key_id}/revoke")
    async def revoke_key(request: Request, key_id: int) -> Response:
        checked = await action(request, "admin")
        if isinstance(checked, Response):
            return checked
        principal, session, form = checked
        reason = form.get("reason", "").strip()
        if not reason or len(reason) > 2000:
            return await keys_response(
                request,
                principal,
                session,
                422,
                key_error="Give a reason for the revocation (at most 2000 characters).",
            )
        if not 1 <= key_id <= BIGINT_MAX:  # no such id (SQLite cannot even compare it: OverflowError)
            return await keys_response(
                request, principal, session, 404, key_error=f"No API key with id {key_id}."
            )
        actor = f"api_key:{principal.key_id} ({reason})"
        try:
            await read_db(admin.revoke_api_key, principal.namespace_id, key_id, actor=actor)
        except errors.OrbitServerError as exc:
            return await keys_response(request, principal, session, exc.status, key_error=exc.detail)
        key_cache.forget(key_id)
        if key_id == principal.key_id:
            response = redirect("/ui/login")
            sessions.clear(response)
            return response
        return redirect("/ui/api-keys")

    from orbit_server.console.flow_pages import ConsoleKit, add_flow_pages
    from orbit_server.console.ops_pages import add_ops_pages
    from orbit_server.flows.admin import engine_settings

    kit = ConsoleKit(
        engine=engine, settings=engine_settings(settings), on_created=on_created, render=render,
        redirect=redirect, signed_in=signed_in, to_login=to_login, action=action, read_db=read_db,
    )  # fmt: skip
    add_flow_pages(router, kit)
    add_ops_pages(router, kit)
    return router


def _safe_next(target: str) -> str:
    """Only a path inside the console, never another site (open redirect)."""
    if not target.startswith("/ui") or target.startswith("//") or "\\" in target:
        return "/ui/"
    return target


def _parse_time(text: str) -> datetime | None:
    """``2026-12-01T09:30`` or ``2026-12-01 09:30:00+01:00``; no zone means UTC."""
    text = text.strip()
    if not text:
        return None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"'created since' must be a date and time like 2026-12-01T09:30 (UTC), not {text!r}"
        ) from None
    try:
        return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
    except OverflowError:  # 0001-01-01T00:00+14:00 is before year 1 in UTC
        raise ValueError(f"'created since' {text!r} is out of range once converted to UTC") from None
