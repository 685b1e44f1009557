"""Batched attempt calls: ``POST /v1/namespaces/{ns}/attempts/start|heartbeat|complete|fail``.

DESIGN §4 "Batched attempt calls" (seed 001 §5 "续租：批量操作逐项给出结果"): a worker reports
many attempts in one request, and gets one result per item, in request order. Each item is its
own conditional transition, run by the very function the single call runs
(:func:`orbit_server.tasks.attempts.start_attempt` etc.), so it is fenced exactly alike: a stale or
forged token is ``409 lease_lost``, an unknown attempt ``404 attempt_not_found``, a ``complete``
before ``start`` ``409 invalid_transition``, and a terminal transition writes its result event
in the transaction that makes it.

One transaction per request, and one item's refusal never undoes another's. The common
refusals need no savepoint: ``attempt_not_found`` and a wrong token are found before the item
writes anything, and every other ``lease_lost`` keeps what its item wrote (the expiry of a
lapsed lease, a late report kept as evidence), exactly as the single call commits it. Any
other refusal (``invalid_transition``, ``concurrent_update``) may come after the item wrote:
then the whole transaction is rolled back and the batch runs again with one savepoint per item,
where a refused item rolls back to its savepoint and a ``concurrent_update`` runs that item
again (up to 5 times in all, as :func:`~orbit_server.db.transact.transact` does for a single
call). A deadlock or lock wait timeout runs the whole request again. Running items again is
safe because every item is idempotent for its token and body, and nothing of a rolled-back
try is left. Only authentication, the role, the body size and a malformed body (including
more than :data:`orbit_client.MAX_ATTEMPT_BATCH_ITEMS` items) fail the whole request.

*Report-and-lease* (DESIGN §4, README "Workers"): a ``complete`` or ``fail`` batch may carry a
lease request (``lease``). Its reports are committed first, in their own transaction, exactly as
without it; then :func:`~orbit_server.tasks.leases.lease_tasks` runs in a second transaction (no
long-poll), and the answer carries its grants. A grant that fails (an unknown queue, a database
error) never undoes a report: the answer is still 200 with every item's result, and the lease
part's problem in ``lease_error``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request, Response
from sqlalchemy.engine import Connection, Engine

from orbit_client import (
    NAME_PATTERN,
    AttemptBatchResponse,
    AttemptItemResult,
    AttemptState,
    BatchLease,
    CompleteBatch,
    CompleteItem,
    FailBatch,
    FailItem,
    HeartbeatBatch,
    HeartbeatItem,
    LeaseGrant,
    Problem,
    StartBatch,
    StartItem,
)
from orbit_server import errors
from orbit_server.api.auth import Caller, authorize
from orbit_server.db.transact import transact
from orbit_server.tasks import attempt_sets, leases
from orbit_server.tasks import attempts as attempt_reports

__all__ = ["Redo", "attempt_batch_router", "run_items"]

log = logging.getLogger("orbit_server.attempt_batches")

#: How many times one item is run when it meets a concurrent update (as ``transact`` does).
_ITEM_TRIES = 5
#: The fewest items a start or complete batch writes set-based (:mod:`orbit_server.tasks.attempt_sets`).
#: One item takes the single call's path, whose statements read the task, the attempt and the clock in one.
#: Two items went item by item too while the set-based path cost more (``bench.attempt_batches``:
#: ``bench/results/attempt-batches-2026-12-05T1559-904b574.json``); since its attempts are locked with
#: their tasks, its statements are built per size and a worker's items name their tasks, two items cost the
#: server less set-based (``bench/results/attempt-batches-2026-12-05T1846-b6e9072.json``, second server item by item).
_SET_BASED_FROM = 2

NamespaceName = Annotated[str, Path(pattern=NAME_PATTERN, description="Namespace name.")]
Item = Callable[[Connection], AttemptState]
#: A whole batch set-based: its states, or ``None`` (nothing written) to run it item by item.
AllAtOnce = Callable[[Connection], Sequence[AttemptState] | None]


class Redo(Exception):
    """An item was refused after it may have written: roll back, run again with savepoints."""


def run_items(
    conn: Connection, items: Sequence[Item], *, savepoints: bool = False
) -> list[AttemptState | errors.OrbitServerError]:
    """Run each ``item(conn)`` in the caller's transaction, in order (module docstring).

    Returns, per item, its :class:`AttemptState` or the domain error it was refused with.
    Without ``savepoints``, only refusals that leave nothing to undo are answered
    (:class:`errors.AttemptNotFound`, :class:`errors.LeaseLost`); with them, each item runs in
    its own savepoint: a refusal with ``keep_writes`` keeps the item's writes, any other rolls
    them back, and :class:`errors.ConcurrentUpdate` runs the item again, up to 5 times in all.

    Raises:
        Redo: without ``savepoints``, an item was refused otherwise; roll back and run the
            batch again with them.
        sqlalchemy.exc.DBAPIError: a database error, e.g. a deadlock (the caller's
            :func:`~orbit_server.db.transact.transact` rolls back and runs everything again).
    """
    out: list[AttemptState | errors.OrbitServerError] = []
    for item in items:
        if not savepoints:
            try:
                out.append(item(conn))
            except (errors.AttemptNotFound, errors.LeaseLost) as exc:
                out.append(exc)  # refused before writing, or with writes to keep (``keep_writes``)
            except errors.OrbitServerError:
                raise Redo from None
            continue
        for tries_left in range(_ITEM_TRIES - 1, -1, -1):
            savepoint = conn.begin_nested()
            try:
                state = item(conn)
            except errors.ConcurrentUpdate as exc:
                savepoint.rollback()
                if tries_left:
                    log.debug("concurrent update of a batch item; running it again")
                    continue
                out.append(exc)
            except errors.OrbitServerError as exc:
                if exc.keep_writes:
                    savepoint.commit()
                else:
                    savepoint.rollback()
                out.append(exc)
            else:
                savepoint.commit()
                out.append(state)
            break
    return out


def _set_based_or_items(
    conn: Connection, all_at_once: AllAtOnce | None, items: Sequence[Item]
) -> Sequence[AttemptState | errors.OrbitServerError]:
    """The set-based path (:mod:`orbit_server.tasks.attempt_sets`) when it takes the batch, else :func:`run_items`."""
    if all_at_once is not None and (states := all_at_once(conn)) is not None:
        return states
    return run_items(conn, items)


def _start(namespace_id: int, item: StartItem, conn: Connection) -> AttemptState:
    return attempt_reports.start_attempt(conn, namespace_id, item.attempt_id, item.lease_token)


def _heartbeat(namespace_id: int, item: HeartbeatItem, conn: Connection) -> AttemptState:
    return attempt_reports.heartbeat(
        conn, namespace_id, item.attempt_id, item.lease_token, lease_seconds=item.lease_seconds
    )


def _complete(namespace_id: int, item: CompleteItem, conn: Connection) -> AttemptState:
    return attempt_reports.complete_attempt(
        conn, namespace_id, item.attempt_id, item.lease_token, item.result
    )


def _fail(namespace_id: int, item: FailItem, conn: Connection) -> AttemptState:
    return attempt_reports.fail_attempt(conn, namespace_id, item.attempt_id, item.lease_token, item.error)


def _problem(error: errors.OrbitServerError, request_id: str | None) -> Problem:
    return Problem(
        title=error.title, status=error.status, detail=error.detail, code=error.code, request_id=request_id,
        **error.extra,
    )  # fmt: skip


def _answer(
    outcomes: Sequence[AttemptState | errors.OrbitServerError],
    request: Request,
    grants: list[LeaseGrant] | None = None,
    lease_error: errors.OrbitServerError | None = None,
) -> AttemptBatchResponse:
    request_id = getattr(request.state, "request_id", None)
    results = []
    for outcome in outcomes:
        if isinstance(outcome, AttemptState):
            results.append(AttemptItemResult(status=200, attempt=outcome))
            continue
        results.append(AttemptItemResult(status=outcome.status, error=_problem(outcome, request_id)))
    return AttemptBatchResponse(
        items=results,
        grants=grants or [],
        lease_error=_problem(lease_error, request_id) if lease_error is not None else None,
    )


def _lease_after(
    engine: Engine, namespace_id: int, lease: BatchLease
) -> tuple[list[LeaseGrant], errors.OrbitServerError | None]:
    """The lease a report batch carried, in its own transaction after the reports' (module docstring)."""
    try:
        grants = leases.lease(
            engine, namespace_id, lease.queue, worker_id=lease.worker_id,
            max_tasks=lease.max_tasks, lease_seconds=lease.lease_seconds, start=lease.start,
        )  # fmt: skip
    except errors.OrbitServerError as exc:
        return [], exc
    except Exception:  # the reports are committed: answer them, and say the grants failed
        log.exception("the lease carried by a report batch failed; its reports are committed")
        return [], errors.OrbitServerError("the lease failed after the reports were committed; lease again")
    return grants, None


#: Told of every lease a report batch carried, after it ran: ``(namespace, namespace_id, lease, grants,
#: started_ns)``, ``started_ns`` the lease's start (``time.time_ns()``, for its trace spans).
Granted = Callable[[str, int, BatchLease, list[LeaseGrant], int], None]


def attempt_batch_router(engine: Engine, granted: Granted | None = None) -> APIRouter:
    """The four batched attempt routes, on ``engine`` (included by :func:`orbit_server.create_app`);
    ``granted`` is told of each lease a report batch carried (its grants may be none), for the
    lease metrics and the worker's liveness sighting, as a standalone lease call records them."""
    router = APIRouter(tags=["execution"])
    path = "/v1/namespaces/{namespace}/attempts"
    problems: dict[int | str, dict[str, Any]] = {
        status: {"model": Problem, "content": {"application/problem+json": {}}}
        for status in (401, 403, 404, 413, 422)
    }

    def run(
        request: Request, items: list[Item], all_at_once: AllAtOnce | None = None, *,
        lease: BatchLease | None = None, namespace: str = "", namespace_id: int = 0,
    ) -> Response:  # fmt: skip
        if len(items) < _SET_BASED_FROM:
            all_at_once = None
        try:
            outcomes = transact(engine, _set_based_or_items, all_at_once, items)
        except Redo:
            outcomes = transact(engine, run_items, items, savepoints=True)
        if lease is None:
            # Serialised here, once: FastAPI would validate the answer against response_model again
            # first (the model stays declared). Without a lease request, the answer is as it always was.
            body = _answer(outcomes, request).model_dump_json(exclude={"grants", "lease_error"})
            return Response(body, media_type="application/json")
        started_ns = time.time_ns()
        grants, lease_error = _lease_after(engine, namespace_id, lease)
        if granted is not None and lease_error is None:
            try:
                granted(namespace, namespace_id, lease, grants, started_ns)
            except Exception:  # metrics and liveness are advisory: the grants are made, answer them
                log.exception("recording the grants of a report batch's lease failed")
        answer = _answer(outcomes, request, grants, lease_error)
        return Response(answer.model_dump_json(exclude_none=False), media_type="application/json")

    @router.post(f"{path}/start", response_model=AttemptBatchResponse, responses=problems)
    def start_attempts(
        namespace: NamespaceName, body: StartBatch, caller: Caller, request: Request
    ) -> Response:
        """Confirm the start of many attempts (``LEASED → RUNNING``); one result per item, in order.

        Each item is exactly ``POST .../attempts/{attempt_id}/start``: its result has the status
        that call would answer (200, 404 ``attempt_not_found``, 409 ``lease_lost``) and its
        ``attempt`` state or ``error`` problem. Requires ``work``.
        """
        authorize(caller, namespace, "work")
        ns = caller.namespace_id
        items: list[Item] = [partial(_start, ns, item) for item in body.items]
        return run(request, items, partial(attempt_sets.start_all, namespace_id=ns, items=body.items))

    @router.post(f"{path}/heartbeat", response_model=AttemptBatchResponse, responses=problems)
    def heartbeats(
        namespace: NamespaceName, body: HeartbeatBatch, caller: Caller, request: Request
    ) -> Response:
        """Renew many leases; one result per item, in order (each as ``.../{attempt_id}/heartbeat``).

        An item's ``attempt.cancel_requested`` tells its handler to stop. Requires ``work``.
        """
        authorize(caller, namespace, "work")
        ns = caller.namespace_id
        return run(request, [partial(_heartbeat, ns, item) for item in body.items])

    @router.post(f"{path}/complete", response_model=AttemptBatchResponse, responses=problems)
    def complete_attempts(
        namespace: NamespaceName, body: CompleteBatch, caller: Caller, request: Request
    ) -> Response:
        """Save many results; one result per item, in order (each as ``.../{attempt_id}/complete``).

        Each success writes its task's result event in this request's transaction. A refused
        item with the right token keeps its result on the attempt as evidence
        (``error.evidence_recorded``). With ``lease`` (report-and-lease), the answer also carries
        the grants made after the reports were committed, or ``lease_error``. Requires ``work``.
        """
        authorize(caller, namespace, "work")
        ns = caller.namespace_id
        items: list[Item] = [partial(_complete, ns, item) for item in body.items]
        all_at_once = partial(attempt_sets.complete_all, namespace_id=ns, items=body.items)
        return run(request, items, all_at_once, lease=body.lease, namespace=namespace, namespace_id=ns)

    @router.post(f"{path}/fail", response_model=AttemptBatchResponse, responses=problems)
    def fail_attempts(
        namespace: NamespaceName, body: FailBatch, caller: Caller, request: Request
    ) -> Response:
        """Report many failures; one result per item, in order (each as ``.../{attempt_id}/fail``).

        With ``lease``, grants after the reports, as for ``complete``. Requires ``work``.
        """
        authorize(caller, namespace, "work")
        ns = caller.namespace_id
        items: list[Item] = [partial(_fail, ns, item) for item in body.items]
        return run(request, items, lease=body.lease, namespace=namespace, namespace_id=ns)

    return router
