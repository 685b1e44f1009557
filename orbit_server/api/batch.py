"""The batch acceptance route: ``POST /v1/namespaces/{ns}/tasks/batch`` (DESIGN §3).

Only authentication, the role, the body size (413, the request middleware) and a body that
is not ``{"items": [...]}`` with 1 to ``ORBIT_MAX_BATCH_ITEMS`` items fail the request as a
whole. Every item is then checked on its own, so one bad item never fails the others, and
answered with the status and problem body the single endpoint would give it.
"""

# No ``from __future__ import annotations``: FastAPI must resolve the body model defined in batch_router.

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler, GetJsonSchemaHandler, ValidationError
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, core_schema
from sqlalchemy.engine import Engine

from orbit_client import (
    NAME_PATTERN,
    BatchItem,
    BatchItemResult,
    BatchSubmitResponse,
    Problem,
    TaskSubmission,
    _tracing,
    is_valid_idempotency_key,
)
from orbit_server import errors
from orbit_server.api import tracing as server_tracing
from orbit_server.api.auth import Caller, authorize
from orbit_server.api.metrics import Metrics
from orbit_server.settings import ServerSettings
from orbit_server.tasks.acceptance_batch import Accepted, Pending, submit_batch

__all__ = ["batch_router"]

NamespaceName = Annotated[str, Path(pattern=NAME_PATTERN, description="Namespace name.")]
_PROBLEM: dict[str, Any] = {"model": Problem, "content": {"application/problem+json": {}}}


class _AnyItem:
    """An item as received: any JSON value, checked one by one later; documented as a BatchItem."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.any_schema()

    @classmethod
    def __get_pydantic_json_schema__(
        cls, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return handler(BatchItem.__pydantic_core_schema__)


def _problem(exc: errors.OrbitServerError, request_id: str | None) -> Problem:
    return Problem(
        title=exc.title,
        status=exc.status,
        detail=exc.detail,
        code=exc.code,
        request_id=request_id,
        **exc.extra,
    )


#: Fields of a batch item that are not part of the submission (nor of its digest).
_NOT_SUBMISSION = frozenset({"idempotency_key", "traceparent", "tracestate"})


def _check_item(index: int, raw: Any) -> Pending | errors.OrbitServerError | list[dict[str, Any]]:
    """An item as the single endpoint would check it: the key first (400), then the body (422).

    Returns the valid item, the key's error, or the validation errors (``loc``, ``msg``,
    ``type``; never the input, which may hold params).
    """
    if isinstance(raw, dict):
        key = raw.get("idempotency_key")
        if key is None or key == "":
            return errors.ItemIdempotencyKeyMissing("give every item a unique idempotency_key")
        if not isinstance(key, str) or not is_valid_idempotency_key(key):
            return errors.ItemIdempotencyKeyInvalid(
                "an idempotency_key is 1 to 255 printable ASCII characters"
            )
        fields = {name: value for name, value in raw.items() if name not in _NOT_SUBMISSION}
        traceparent, tracestate = (
            _tracing.clean(raw["traceparent"], raw.get("tracestate"))
            if "traceparent" in raw
            else (None, None)
        )
        try:
            return Pending.of(key, TaskSubmission.model_validate(fields), traceparent, tracestate)
        except ValidationError as exc:
            found = [
                (e["loc"], e["msg"], e["type"])
                for e in exc.errors(include_url=False, include_input=False, include_context=False)
            ]
    else:
        found = [((), "Input should be an object (a BatchItem)", "model_type")]
    return [{"loc": ["body", "items", index, *loc], "msg": msg, "type": kind} for loc, msg, kind in found]


def _invalid(problems: list[dict[str, Any]], request_id: str | None) -> Problem:
    detail = "; ".join(f"{'.'.join(map(str, p['loc']))}: {p['msg']}" for p in problems)
    return Problem(
        title="The request is not valid",
        status=422,
        detail=detail,
        code="validation_error",
        request_id=request_id,
        errors=problems,
    )


def batch_router(
    *,
    engine: Engine,
    settings: ServerSettings,
    metrics: Metrics,
    on_created: Callable[[], None],
) -> APIRouter:
    """The router of ``POST /v1/namespaces/{ns}/tasks/batch``.

    Args:
        engine: the server database.
        settings: ``max_batch_items``, ``default_max_attempts`` and ``submission_key_ttl_seconds``
            are read.
        metrics: submissions are counted in ``orbit_submissions_total`` (created/replayed).
        on_created: called (from a worker thread) when a batch created at least one task, to
            wake long-polling lease calls.
    """
    router = APIRouter(tags=["tasks"])
    max_items = settings.max_batch_items
    key_ttl = timedelta(seconds=settings.submission_key_ttl_seconds)

    class BatchSubmission(BaseModel):
        """``{"items": [BatchItem, ...]}``: 1 to ``ORBIT_MAX_BATCH_ITEMS`` items, each checked on its own."""

        model_config = ConfigDict(extra="forbid")

        items: list[_AnyItem] = Field(min_length=1, max_length=max_items)

    @router.post(
        "/v1/namespaces/{namespace}/tasks/batch",
        response_model=BatchSubmitResponse,
        responses={status: _PROBLEM for status in (400, 401, 403, 404, 413, 422)},
    )
    def submit_tasks(
        namespace: NamespaceName, body: BatchSubmission, caller: Caller, request: Request
    ) -> BatchSubmitResponse:
        """Accept up to ``ORBIT_MAX_BATCH_ITEMS`` submissions, each with its own idempotency key.

        200 with ``{"items": [...]}``: one result per item, in request order, each with the
        status the single endpoint would answer for it alone: ``201`` + ``task`` (created),
        ``200`` + ``task`` + ``replayed: true`` (same key, same request), or an error status
        with its problem body as ``error``: 400 ``idempotency_key_missing`` /
        ``idempotency_key_invalid``, 404 ``queue_not_found``, 409 ``request_in_progress``
        (retry that item with the same key), 422 ``idempotency_key_reused`` /
        ``validation_error``. Two items with one key are handled one after the other. All
        items are written in one transaction. Requires the ``submit`` role.
        """
        authorize(caller, namespace, "submit")
        started_ns = time.time_ns() if _tracing.AVAILABLE else 0
        request_id: str | None = getattr(request.state, "request_id", None)
        results: list[BatchItemResult | None] = []
        valid: list[Pending] = []
        positions: list[int] = []  # where each valid item is in ``results``
        for index, raw in enumerate(body.items):
            checked = _check_item(index, raw)
            if isinstance(checked, Pending):
                valid.append(checked)
                positions.append(index)
                results.append(None)
            elif isinstance(checked, errors.OrbitServerError):
                results.append(BatchItemResult(status=checked.status, error=_problem(checked, request_id)))
            else:
                results.append(BatchItemResult(status=422, error=_invalid(checked, request_id)))
        answers = iter(
            submit_batch(
                engine,
                caller,
                valid,
                default_max_attempts=settings.default_max_attempts,
                key_ttl=key_ttl,
            )
        )
        created = replayed = 0
        for position, result in enumerate(results):
            if result is not None:
                continue
            answer = next(answers)
            if isinstance(answer, Accepted):
                if answer.outcome == "created":
                    created += 1
                    results[position] = BatchItemResult(status=201, task=answer.task)
                else:
                    replayed += 1
                    results[position] = BatchItemResult(status=200, task=answer.task, replayed=True)
            else:
                results[position] = BatchItemResult(status=answer.status, error=_problem(answer, request_id))
        if _tracing.AVAILABLE and any(item.traceparent is not None for item in valid):
            server_tracing.batch_accepted(
                started_ns,
                [
                    (result.task, result.status, item.traceparent, item.tracestate)
                    for item, position in zip(valid, positions, strict=True)
                    if item.traceparent is not None and (result := results[position]) is not None
                ],
            )
        if created:
            metrics.submissions.labels("created").inc(created)
            on_created()
        if replayed:
            metrics.submissions.labels("replayed").inc(replayed)
        return BatchSubmitResponse(items=[r for r in results if r is not None])

    return router
